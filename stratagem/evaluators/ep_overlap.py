"""EP all-to-all overlap as the engines run it: Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm),
one layer's forward of a micro-batch with its backward of another, bounded by the step's stream/event graph, the
steady-state micro-batches the schedule pairs and the SMs DeepEP's kernels hold; DualPipe's pairing for comparison.
The exchanges and the expert GEMMs themselves are evaluators.experts'. Vectorised over `PlanColumns`.

Sources:
  [MCore-1F1B] megatron/core/models/common/model_chunk_schedule_plan.py TransformerLayerSchedulePlan.run
          (--overlap-moe-expert-parallel-comm): one layer's forward of micro-batch A runs with its backward of
          micro-batch B, split into nodes on a compute and a communication stream; each node waits for the event the
          previous node of its own micro-batch recorded (pipeline_parallel/utils.py ScheduleNode
          stream_acquire_context: event.wait, then event.record), so only nodes of different micro-batches overlap.
          Issue order: combine_bwd(B) | pre_dispatch_fwd(A); mlp_bwd(B); dispatch_fwd(A); mlp_bwd_dw(B) (delayed
          expert wgrad, no event); dispatch_bwd(B); mlp_fwd(A); combine_fwd(A); pre_dispatch_bwd(B); then
          pre_dispatch_bwd_dw(B) (delayed attention wgrad). pipeline_parallel/schedules.py get_pp_rank_microbatches:
          the combined steps exist only in the steady state; warm-up (interleaved: 2 (p - rank - 1) + (v - 1) x
          microbatch_group_size_per_vp_stage (default p), + 1 with this overlap) forwards and the same number of
          cool-down backwards run alone; combined_1f1b.py combined_1f1b_schedule_for_no_pipelining: with pp = 1 the
          first forward and the last backward run alone; transformer_config.py: pp > 1 needs virtual stages.
  [DeepEP-SM] DeepEP's dispatch / combine kernels occupy a fixed number of SMs for their whole run
          (deep_ep/buffer.py Buffer.num_sms, 20 by default; Megatron moe_flex_dispatcher_num_sms, "historical
          default 20"): a compute kernel running beside them gets the other SMs only.
  [MCore-host] The host issues a combined step's nodes in the order above from one thread, and the forward
          dispatch blocks it: megatron/core/transformer/moe/fused_a2a.py FusedDispatch.forward ("the CPU will wait
          for GPU's signal to arrive": DeepEP's dispatch returns the received token counts as a host list), the
          all-to-all dispatcher's _maybe_dtoh_and_synchronize likewise. The wait ends when B's combine backward
          (issued before it on the in-order communication stream) and A's pre-dispatch node are done; only then can
          the host issue the rest of the step. So a combined step lasts at least the host time of one layer's
          forward and backward plus that wait: the overlap moves the host work onto the critical path that the
          exposed exchanges used to cover. Megatron's DeepSeek-V3 GB200 guide (docs/discussions/deepseek-v3-gb200-
          optimization, Megatron-LM 1d9edcf8c7, sec. 3.2) names this cost ("divides the forward and backward into
          multiple stages ... synchronization between different stages, which aggravates the CPU overhead"); its
          size is the layer's host time (evaluators.host.layer_host_s).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.comm import all_gather_s, group_link
from stratagem.evaluators.experts import (
    dispatch_bytes_per_token,
    exchange_s,
    load_imbalance,
    moe_layer_fraction,
    moe_tokens_per_rank,
    routed_matmul_per_layer,
    routed_time_factor,
)
from stratagem.evaluators.host import pre_dispatch_host_share
from stratagem.evaluators.rate_tables import LAYER_GEMMS, gemm_size
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = [
    "exchange_pieces",
    "expert_forward_s",
    "a2a_overlap_paired",
    "a2a_overlap_refused",
    "dualpipe_paired",
    "a2a_overlap_layer_s",
    "host_bound_layer_s",
    "ep_overlap_exposed",
    "ep_overlap_host_wait",
]

Array = NDArray[np.float64]


def exchange_pieces(scn: Scenario, pc: PlanColumns, cal: Calibration) -> tuple[Array, Array, Array, Array]:
    """(dispatch forward, combine forward, dispatch backward, combine backward) seconds of one MoE layer per
    micro-batch: dispatch_s split into its four exchanges, each with its share of the expert-TP gathers."""
    moe = scn.model.moe
    if moe is None:
        zero = np.zeros(len(pc))
        return zero, zero, zero, zero
    dispatch, combine = dispatch_bytes_per_token(scn, pc)
    copies = moe_tokens_per_rank(scn, pc) * moe.top_k * load_imbalance(scn, pc)
    gather = all_gather_s(group_link(scn.cluster, cal, pc.etp, 1.0), pc.etp * copies * combine)
    other = exchange_s(scn, pc, cal, combine) + gather
    return exchange_s(scn, pc, cal, dispatch) + gather, other, other, other


def expert_forward_s(scn: Scenario, pc: PlanColumns, cal: Calibration, mm_rate: Array) -> Array:
    """Forward seconds of one layer's routed-expert GEMMs per micro-batch, averaged over layers: the routed FLOPs
    (tokens x top_k through one expert's weights, / tp) at the layer's matmul rate `mm_rate` times the routed time
    factor (imbalance, expert GEMM size), as evaluators.step_terms.step_context times them."""
    m = scn.model
    if m.moe is None:
        return np.zeros(len(pc))
    tokens = pc.micro_batch_size * scn.training.seq_len / pc.cp
    dense_mm = 2.0 * tokens * m.mean_matmul_params_per_layer() / pc.tp
    size = gemm_size(cal.rate_tables, "dense", dense_mm, LAYER_GEMMS, cal.matmul_efficiency,
                     cal.half_efficiency_gflop * 1e9)
    routed = 2.0 * tokens * routed_matmul_per_layer(scn) / pc.tp
    return routed * routed_time_factor(scn, pc, cal, size) / mm_rate


def a2a_overlap_paired(pc: PlanColumns, micro: Array) -> Array:
    """Share of a rank's layer passes that run as combined forward + backward steps [MCore-1F1B]: pp = 1 pairs all
    but the first forward and the last backward, (m - 1) / m; interleaved pipelines all but the warm-up forwards
    (and as many cool-down backwards) of the rank with the most, rank 0: w = 2 (p - 1) + (v - 1) p + 1 of m v;
    none for the plans Megatron refuses this overlap (transformer_config.py __post_init__: pp > 1 without virtual
    stages, full recompute, "moe" in the recomputed modules: `a2a_overlap_refused`)."""
    v = pc.virtual_stages
    total = micro * v
    warmup = np.where(pc.pp > 1, 2.0 * (pc.pp - 1.0) + (v - 1.0) * pc.pp + 1.0, 1.0)
    paired = np.maximum(0.0, total - np.minimum(total, warmup)) / np.maximum(total, 1.0)
    return np.where(a2a_overlap_refused(pc), 0.0, paired)


def a2a_overlap_refused(pc: PlanColumns) -> NDArray[np.bool_]:
    """The plans for which Megatron refuses --overlap-moe-expert-parallel-comm (transformer_config.py
    __post_init__): pp > 1 without virtual stages, full recompute, "moe" in the recomputed modules."""
    refused: NDArray[np.bool_] = (((pc.pp > 1) & (pc.virtual_stages <= 1)) | pc.recompute_is("full")
                                  | pc.recomputes_module("moe"))
    return refused


def dualpipe_paired(pp: Array, micro: Array) -> Array:
    """Share of a rank's chunk passes DualPipe runs as overlapped forward + backward pairs (DeepSeek-V3 report sec.
    3.2.1; deepseek-ai/DualPipe dualpipe.py DualPipe.step: steps 4 (nF0B1F1B0, 2 (m/2 - p + r + 1) pairs, the
    middle ranks' first one not overlapped) and 5 (nB1F1B0, p/2 - r - 1 pairs), r the rank's index in its half): on
    rank 0, m - 3p/2 + 1 of its m forwards (m >= 2p, m even). DualPipe runs in DeepSeek's own HAI-LLM and the
    DualPipe reference (its overlapped_forward_backward supplied by the model); no stack record here runs it, so the
    DeepSeek-V3 layout stands in by Megatron's interleaved schedule with 2 chunks and --overlap-moe-expert-parallel-
    comm (a2a_overlap_paired, whose pair graph follows the same split: attention, dispatch, MLP, combine, backward
    split into input and weight gradients). For that run (p 16, m 120): 97 / 120 = 0.808 here, 193 / 240 = 0.804
    for the stand-in."""
    paired = np.maximum(0.0, micro - 1.5 * pp + 1.0) / np.maximum(micro, 1.0)
    return np.where(pp > 1, paired, 0.0)


def a2a_overlap_layer_s(comm: tuple[Array, ...], comp: tuple[Array, ...],
                        sm_share: float) -> Array:
    """Seconds of one combined layer step, forward of A with backward of B [MCore-1F1B], from the stream/event
    graph of TransformerLayerSchedulePlan.run.

    comm = (dispatch_fwd Df, combine_fwd Cf, dispatch_bwd Db, combine_bwd Cb); comp = (pre-dispatch forward a:
    attention, norms, router; expert forward Mf; expert input-gradient Mb; expert weight-gradient Mw; pre-dispatch
    input-gradient Ab; its delayed weight-gradient Aw). From the step's start s: Mb and Df start at
    s = max(a, Cb); Db at s + max(Df, Mb) (B's event after Mb); Mf at s + max(Mb + Mw, Df) (compute stream, A's
    event after Df); Cf and Ab both at X = the later of Db's and Mf's ends; the next layer's Cb waits for Cf and
    Ab, its a for Cf and Aw. Period: max(max(Df, Mb) + Db, max(Mb + Mw, Df) + Mf) + max(max(Cf, Ab + Aw) + a,
    max(Cf, Ab) + Cb). Compute running beside a communication kernel that holds `sm_share` of the SMs [DeepEP-SM]
    runs on the rest: its overlapped part takes 1 / (1 - share) as long."""
    df, cf, db, cb = comm
    a, mf, mb, mw, ab, aw = comp
    k = sm_share / (1.0 - sm_share)

    def slowed(x: Array, beside: Array, group: Array) -> Array:
        # x's share of a compute group running beside one communication node, slowed while they overlap
        return x * (1.0 + k * np.minimum(group, beside) / np.maximum(group, 1e-30))

    a2 = slowed(a, cb, a)
    mb2, mw2 = slowed(mb, df, mb + mw), slowed(mw, df, mb + mw)
    mf2 = slowed(mf, db, mf)
    ab2, aw2 = slowed(ab, cf, ab + aw), slowed(aw, cf, ab + aw)
    first = np.maximum(np.maximum(df, mb2) + db, np.maximum(mb2 + mw2, df) + mf2)
    second = np.maximum(np.maximum(cf, ab2 + aw2) + a2, np.maximum(cf, ab2) + cb)
    out: Array = first + second
    return out


def host_bound_layer_s(host: Array, pre_share: float, a: Array, cb: Array) -> Array:
    """Host-side length of one combined step [MCore-host]: the layer's forward + backward host time `host`, plus
    the wait at the forward dispatch beyond the host's own pre-dispatch work (pre_share of `host`): the dispatch
    returns once A's pre-dispatch node `a` and B's combine backward `cb` (the stream's earlier exchange) are done."""
    out: Array = host + np.maximum(0.0, np.maximum(a, cb) - pre_share * host)
    return out


def _combined_nodes(scn: Scenario, pc: PlanColumns, cal: Calibration, total: Array, mm_rate: Array,
                    fwd_layer: Array, attn_fwd: Array, layer_compute: Array) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """(comm, comp) nodes of one combined step as a2a_overlap_layer_s takes them (see ep_overlap_exposed)."""
    frac = moe_layer_fraction(scn)
    pieces = exchange_pieces(scn, pc, cal)
    scale = total / np.maximum(frac * sum(pieces), 1e-30)
    comm = tuple(frac * x * scale for x in pieces)
    e = expert_forward_s(scn, pc, cal, mm_rate)
    a = np.maximum(0.0, fwd_layer - e)
    rest = np.maximum(0.0, layer_compute - fwd_layer - 2.0 * e)
    aw = np.minimum(rest, np.maximum(0.0, a - attn_fwd))
    return comm, (a, e, e, e, rest - aw, aw)


def ep_overlap_exposed(scn: Scenario, pc: PlanColumns, cal: Calibration, total: Array, micro: Array,
                       mm_rate: Array, fwd_layer: Array, attn_fwd: Array, layer_compute: Array,
                       sm_share: float) -> Array:
    """Exposed seconds of one layer's expert exchanges per micro-batch with Megatron's EP overlap, averaged over
    the rank's layer passes: the combined steps (a2a_overlap_paired of them) expose what their stream graph adds
    to the layer's compute (a2a_overlap_layer_s - compute), the unpaired warm-up / cool-down passes all of
    `total` (their exchanges, forward + backward, as the caller counts them).

    The layer's compute splits as the engine's nodes do: expert forward Mf = expert_forward_s, its input and
    weight gradients one forward each (Mb, Mw); the rest of the forward `fwd_layer` is the pre-dispatch node a;
    the rest of `layer_compute` (recompute included) is the pre-dispatch backward, of which the delayed weight
    gradient Aw is one pass of a's GEMMs (a less the core attention `attn_fwd`). The four exchanges are
    exchange_pieces, scaled to sum to `total`. Calibration.overlap scales what a combined step hides (1: the graph's
    bound; 0: nothing, as on gloo). The step's host side is ep_overlap_host_wait's (the caller's launch floor)."""
    if scn.model.moe is None:
        return total
    comm, comp = _combined_nodes(scn, pc, cal, total, mm_rate, fwd_layer, attn_fwd, layer_compute)
    step = a2a_overlap_layer_s(comm, comp, sm_share)
    exposed_pair = np.minimum(total, np.maximum(0.0, step - sum(comp)))
    # Calibration.overlap: the share of the hideable time the calibration credits (1 on GPUs, 0 on gloo/CPU)
    exposed_pair = cal.overlap * exposed_pair + (1.0 - cal.overlap) * total
    paired = a2a_overlap_paired(pc, micro)
    return paired * exposed_pair + (1.0 - paired) * total


def ep_overlap_host_wait(scn: Scenario, pc: PlanColumns, cal: Calibration, total: Array, micro: Array,
                         mm_rate: Array, fwd_layer: Array, attn_fwd: Array, layer_compute: Array,
                         host: Array) -> Array:
    """Host seconds per layer and micro-batch, averaged over the rank's layer passes, that the combined steps add to
    the layer's host time `host` (forward + backward): the wait at the forward dispatch [MCore-host]
    (host_bound_layer_s - host) on the paired passes, with the nodes of ep_overlap_exposed. A combined step lasts at
    least host + this: the overlap moves the host work onto the critical path, so on a host-bound layer it gains
    nothing and may lose this wait (Megatron's GB200 guide: "the overall benefit is negative")."""
    if scn.model.moe is None:
        return np.zeros(len(pc))
    comm, comp = _combined_nodes(scn, pc, cal, total, mm_rate, fwd_layer, attn_fwd, layer_compute)
    wait = host_bound_layer_s(host, pre_dispatch_host_share(scn, cal), comp[0], comm[3]) - host
    out: Array = a2a_overlap_paired(pc, micro) * cal.overlap * wait
    return out
