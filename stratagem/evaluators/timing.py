"""Analytic step time: compute, recompute, communication by kind, pipeline bubble, optimizer, overhead.

Vectorised over `PlanColumns`; every column is seconds per optimizer step on the slowest pipeline rank.

Sources:
  [PaLM]   Chowdhery et al. 2022, app. B: model FLOPs per token 6N + 12 L H Q T (attention, non-causal).
  [Narayanan] Narayanan et al. 2021 (Megatron-LM at scale, SC21), sec. 5.1 / app.: 72 B s L h^2 (1 + s/(6h)
           + V/(12 h L)) FLOPs per iteration for GPT (4h MLP), the same count as [PaLM] for that shape;
           sec. 2.2: pipeline bubble (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved.
  [MLM-TP] Shoeybi et al. 2019, sec. 3: 2 all-reduces forward + 2 backward per layer (f/g operators);
           Korthikanti et al. 2022 sec. 4.2.2: with sequence parallelism all-gather + reduce-scatter, same volume.
  [FA2]    Dao 2023, FlashAttention-2, sec. 4.1: causal attention does half the work; backward = 2.5x forward.
  [ZeRO]   Rajbhandari et al. 2019, sec. 7: DDP and ZeRO-1/2 move 2 Psi per step, ZeRO-3 3 Psi (1.5x).
  [ZB]     Qi et al. 2023, Zero Bubble Pipeline Parallelism, sec. 3: ZB-H1 bubble ~ 1/3 of 1F1B's.
  [NT-P2P] huggingface/nanotron, branch nouamane/bench2 from 67c5ebb6 (the code of the Ultra-Scale Playbook sweep),
           src/nanotron/parallel/pipeline_parallel/p2p.py: P2P.send_tensors / recv_tensors (used by state.py
           SendActivation, RecvActivation, SendGrad, RecvGrad for every micro-batch) first exchange two metadata
           tensors, each awaited by `while not work.is_completed(): time.sleep(0.1)`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration, default_calibration
from stratagem.evaluators.comm import (
    Link,
    all_gather_s,
    all_reduce_s,
    group_link,
    p2p_s,
    reduce_scatter_s,
)
from stratagem.evaluators.experts import (
    dispatch_s,
    expert_data_parallel,
    expert_dp_link,
    moe_layer_fraction,
    routed_matmul_per_layer,
    routed_time_factor,
)
from stratagem.evaluators.memory import recomputed_layers, training_optimizer_bytes
from stratagem.evaluators.stages import slowest_rank_s, stage_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.hardware import ClusterSpec
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = [
    "TIME_KEYS",
    "FP8_LINEAR_SPEEDUP",
    "SpeedTerm",
    "clock_factor",
    "fp8_linear_speedup",
    "compute_factors",
    "speed_terms",
    "speed_rows",
    "matmul_params_per_layer",
    "model_flops_per_token",
    "megatron_flops_per_token",
    "bubble_fraction",
    "pipeline_poll_s",
    "rank_params",
    "time_columns",
]

Array = NDArray[np.float64]

TIME_KEYS: tuple[str, ...] = (
    "compute_s", "recompute_s", "tp_comm_s", "dp_comm_s", "pp_comm_s", "cp_comm_s", "bubble_s",
    "optimizer_s", "overhead_s", "exposed_comm_s", "step_s",
)
# Device <-> host copy bandwidth per GPU for optimizer offload: PCIe Gen4 x16 achieves ~25 GB/s one way.
PCIE_BYTES_S = 25e9
# Host memory bandwidth per GPU for the CPU optimizer step (ZeRO-Offload): ~200 GB/s per 2-socket node / 8.
HOST_MEM_BYTES_S = 25e9


# ---- explicit speed factors ---------------------------------------------------------------------------------
# Linear-layer (GEMM + its scaling casts) speed-up of fp8 over bf16 per recipe, when the casts are fused (torch.compile
# for torchao, Transformer Engine's own kernels); eager torchao casts cancel the gain (torchtitan float8 docs:
# "--compile.enable: required - fuses float8 scaling/casting kernels"), so unfused = 1.0. Derived from end-to-end
# ratios on Llama-3-8B, 8 x H100, seq 8192, compiled (the linears are ~0.6 of that step in this model):
#   tensorwise  torchtitan commit 7a04053 log: 5,760 -> 7,186 tok/s (1.25x e2e) -> 1.5x on the linears;
#               bench/reference tt-8b-8gpu-FSDP+compile -> +float8: 6,667 -> 8,532 (1.28x e2e) agrees.
#   rowwise     same log: 5,760 -> 6,424 (1.12x e2e) -> 1.2x on the linears (per-row scales, slower GEMM).
#   blockwise   DeepSeek-V3-style 1x128 / 128x128 scales (Transformer Engine Float8BlockScaling): between rowwise
#               and tensorwise, 1.3x.
#   mxfp8       torchao MXFP8 on B200 (torchao README, Sept 2025: 1.28x e2e) -> 1.5x on the linears.
# Every value stays below the datasheet fp8/bf16 ratio (2.0 on Hopper/Blackwell), which bounds it again at use.
FP8_LINEAR_SPEEDUP: dict[str, float] = {"tensorwise": 1.5, "rowwise": 1.2, "blockwise": 1.3, "mxfp8": 1.5}


class SpeedTerm(NamedTuple):
    """One factor that scales compute (or a TP traffic split), with where it comes from."""

    name: str
    value: float
    source: str


def clock_factor(cluster: ClusterSpec) -> float:
    """Sustained clock under a power cap, relative to the datasheet clock: (cap / TDP)^(1/3), at most 1.

    CMOS dynamic power P = a C V^2 f with the supply voltage scaled with the clock under DVFS (V ~ f), so P ~ f^3
    (Weste & Harris, CMOS VLSI Design, 4th ed., sec. 5.1); 1 when no cap is set or the TDP is not known.
    """
    tdp = cluster.gpu.tdp_w
    if tdp is None or cluster.power_cap_w <= 0:
        return 1.0
    return float(min(1.0, (cluster.power_cap_w / tdp) ** (1.0 / 3.0)))


def fp8_linear_speedup(scn: Scenario) -> float:
    """fp8 / bf16 speed of the linear layers for the scenario's recipe, stack and compile setting (FP8_LINEAR_SPEEDUP),
    bounded by the GPU's datasheet fp8 / bf16 ratio; 1 where the GPU has no fp8."""
    gpu, tr = scn.cluster.gpu, scn.training
    if gpu.peak_tflops_fp8 is None:
        return 1.0
    fused = tr.compile_on or tr.record.kernels == "transformer_engine"
    value = FP8_LINEAR_SPEEDUP[tr.fp8_recipe_used] if fused else 1.0
    return float(min(value, gpu.peak_tflops_fp8 / gpu.peak_tflops_bf16))


def compute_factors(scn: Scenario) -> dict[str, float]:
    """The factors that multiply every compute rate (matmul and attention): the stack's kernels, torch.compile,
    and the sustained clock under the cluster's power cap."""
    tr = scn.training
    rec = tr.record
    return {
        "kernels": rec.kernel_efficiency,
        "compile": rec.compile_gain if tr.compile_on else 1.0,
        "clock": clock_factor(scn.cluster),
    }


def speed_terms(scn: Scenario, precision: str = "bf16") -> list[SpeedTerm]:
    """Every factor that scales compute for this scenario (and fp8's linear speed-up for fp8 plans), with its
    source, for `explain`."""
    tr, cl = scn.training, scn.cluster
    rec = tr.record
    f = compute_factors(scn)
    cap = f"{cl.power_cap_w:g} W cap" if cl.power_cap_w > 0 else "no cap"
    terms = [
        SpeedTerm("kernels", f["kernels"], f"{rec.name}: {rec.kernels} ({rec.cite('kernel_efficiency')})"),
        SpeedTerm("compile", f["compile"],
                  f"torch.compile {'on' if tr.compile_on else 'off'}"
                  f"{'' if tr.compile is not None else ' (stack default)'}: x{rec.compile_gain:g} when on "
                  f"({rec.cite('compile_gain') or 'kernels already fused'})"),
        SpeedTerm("clock", f["clock"], f"{cl.gpu.name} TDP {cl.gpu.tdp_w or 'n/a'} W, {cap}: (cap/TDP)^(1/3)"),
    ]
    if precision == "fp8":
        terms.append(SpeedTerm("fp8_linears", fp8_linear_speedup(scn),
                               f"recipe {tr.fp8_recipe_used}, linear layers only (FP8_LINEAR_SPEEDUP), <= datasheet "
                               "fp8/bf16"))
    terms.append(SpeedTerm("tp_overlap", 1.0 if tr.tp_overlap else 0.0,
                           f"TP collectives {'overlapped with their GEMMs' if tr.tp_overlap else 'exposed'} "
                           f"({rec.cite('tp_comm_overlap_default')})"))
    return terms


def speed_rows(scn: Scenario, plan: Plan, cal: Calibration | None = None) -> list[tuple[str, str, str]]:
    """(factor, value, source) rows for `explain`: every factor that scales compute for this plan, then the TP
    traffic exposed vs hidden behind the GEMMs (seconds per step)."""
    rows = [(t.name, f"x{t.value:.3g}", t.source) for t in speed_terms(scn, plan.precision) if t.name != "tp_overlap"]
    cols = time_columns(scn, PlanColumns.from_plans([plan]), cal or default_calibration(scn.cluster.gpu.name))
    overlap = next(t for t in speed_terms(scn) if t.name == "tp_overlap")
    rows.append(("TP comm exposed / hidden", f"{cols['tp_comm_s'][0]:.3g} s / {cols['tp_hidden_s'][0]:.3g} s",
                 overlap.source))
    return rows


# ---- FLOPs --------------------------------------------------------------------------------------------------
def matmul_params_per_layer(m: ModelSpec) -> float:
    """Weights one token multiplies through in one layer: attention Q,K,V,O + the active MLP (top_k experts
    and the router for MoE), averaged over layers (MLA projections, shared experts and dense layers as the
    model has them: ModelSpec.layer_matmul_params). Norms and biases do no matmul work."""
    return m.mean_matmul_params_per_layer()


def model_flops_per_token(m: ModelSpec, seq_len: int) -> float:
    """Model FLOPs per token, forward + backward, no recompute [PaLM app. B]: 6 N_mm + 12 L s q, where N_mm
    counts the matmul weights a token passes (layers + LM head) and q = heads x head_dim; the attention term as
    the variant has it (3 x forward score + value FLOPs, non-causal as PaLM counts them; windowed layers see
    their window; MLA's q/k and v head widths: ModelSpec.attention_flops_per_token). Used for MFU."""
    n_mm = m.num_layers * matmul_params_per_layer(m) + m.vocab_size * m.hidden_size
    return 6.0 * n_mm + 3.0 * m.num_layers * m.attention_flops_per_token(seq_len, causal=False)


def megatron_flops_per_token(num_layers: int, hidden: int, seq_len: int, vocab: int) -> float:
    """[Narayanan] 72 B s L h^2 (1 + s/(6h) + V/(12 h L)) per iteration, divided by the B s tokens."""
    return 72.0 * num_layers * hidden**2 * (1 + seq_len / (6 * hidden) + vocab / (12 * hidden * num_layers))


def bubble_fraction(pp: Array, micro_batches: Array, schedule: Array, virtual: Array) -> Array:
    """Bubble time over ideal time [Narayanan sec. 2.2, ZB sec. 3]: (p-1)/m for gpipe (0) and 1f1b (1),
    (p-1)/(v m) interleaved (2), (p-1)/(3 m) zero-bubble ZB-H1 (3)."""
    per = np.select([schedule == 2, schedule == 3], [1.0 / virtual, 1.0 / 3.0], 1.0)
    return np.where(pp > 1, (pp - 1) * per / micro_batches, 0.0)


def pipeline_poll_s(pp: Array, tp: Array, virtual: Array, quantum: float) -> Array:
    """Host time per micro-batch a pipeline rank spends polling P2P metadata messages [NT-P2P] (0 if quantum = 0).

    Each activation or gradient send and receive is preceded by 2 metadata messages, each awaited in a poll loop
    that checks once, then sleeps `quantum` between checks. Per micro-batch and model chunk a first or last stage
    sends once and receives once (activation forward, gradient backward): 4 messages; a middle stage (p > 2)
    receives and sends in both directions: 8. A message costs at least one quantum on the side that posts it last
    (its GPU stream is still busy at the first check, so the check fails), and the side that posted first notices
    completion at its next check, a uniform phase within the quantum; the t tensor-parallel ranks of a stage each
    poll their own peer and are then synchronised by the next TP collective, so the stage waits for the latest of
    t phases, E[max of t uniforms] = t / (t + 1) quantum. Per micro-batch: messages x quantum x (1 + t / (t + 1)).
    """
    messages = np.where(pp > 2, 8.0, 4.0) * virtual
    return np.where(pp > 1, messages * quantum * (1.0 + tp / (tp + 1.0)), 0.0)


# ---- parameters per rank -------------------------------------------------------------------------------------
def rank_params(scn: Scenario, pc: PlanColumns) -> tuple[Array, Array]:
    """(dense, expert) parameters held by one rank of the most loaded pipeline stage, before ZeRO sharding:
    stage layers / tp (experts also / ep), plus the embedding or LM head (both when pp = 1)."""
    m = scn.model
    st = stage_columns(m, pc)  # evaluators/stages.py: the plan's split; the most loaded rank
    layers = np.maximum(np.maximum(st.first_layers, st.middle_layers), st.last_layers)
    ends = m.embedding_params() + m.head_params() + (m.vocab_size * m.hidden_size if m.tied_embeddings else 0)
    one_end = max(m.embedding_params(), m.head_params() + (m.vocab_size * m.hidden_size if m.tied_embeddings
                                                          else 0))
    extra = np.where(pc.pp > 1, float(one_end), float(ends))
    dense = (layers * m.layer_dense_params() + extra) / pc.tp
    expert = layers * m.layer_expert_params() / (pc.ep * pc.etp)  # routed experts over ep x etp (experts.py)
    return dense, expert


# ---- the step ----------------------------------------------------------------------------------------------
def time_columns(scn: Scenario, pc: PlanColumns, cal: Calibration) -> dict[str, Array]:
    """Seconds per optimizer step by part (TIME_KEYS) for every plan, plus `micro_batches` and `model_flops`
    (model FLOPs per token). step_s = compute + recompute + exposed_comm + bubble + optimizer + overhead."""
    m, tr, cl, gpu = scn.model, scn.training, scn.cluster, scn.cluster.gpu
    rec = stack_record(tr.stack)
    t, p, c, d, v = pc.tp, pc.pp, pc.cp, pc.dp, pc.virtual_stages
    fp32, fp8 = pc.precision == 0, pc.precision == 2
    act_bytes = np.where(fp32, 4.0, 2.0)
    micro = tr.global_batch_size / (d * pc.micro_batch_size)
    tokens = pc.micro_batch_size * tr.seq_len / c  # tokens of one micro-batch on one rank

    # Compute of one micro-batch on the most loaded rank (forward + backward).
    peak_bf16 = gpu.peak_tflops("bf16") * 1e12
    peak = np.where(fp32, gpu.peak_tflops("fp32") * 1e12, peak_bf16)
    peak_mm = np.where(fp8, peak_bf16 * fp8_linear_speedup(scn), peak)  # fp8: the linear layers only
    layer_mm = 2.0 * tokens * matmul_params_per_layer(m) / t  # forward FLOPs of one layer's matmuls per rank
    # causal flash forward, 2 s q per token for full attention [FA2]; windows and MLA as the model has them
    layer_attn = tokens * m.attention_flops_per_token(tr.seq_len) / t
    head_mm = 2.0 * tokens * m.vocab_size * m.hidden_size / t
    size = layer_mm / (layer_mm + cal.half_efficiency_gflop * 1e9)  # small per-GPU matmuls run less efficiently
    factors = compute_factors(scn)  # kernels x compile x clock: explicit, printed by `explain`
    stack = factors["kernels"] * factors["compile"] * factors["clock"]
    mm_rate = peak_mm * cal.matmul_efficiency * stack * size
    attn_rate = peak * cal.attention_efficiency * stack * size
    # routed experts (evaluators/experts.py): the busiest expert rank's load and the small per-expert GEMMs
    routed_mm = 2.0 * tokens * routed_matmul_per_layer(scn) / t
    layer_mm = layer_mm + routed_mm * (routed_time_factor(scn, pc, cal, size) - 1.0)
    st = stage_columns(m, pc)  # evaluators/stages.py: the slowest rank decides (the last one also runs the head)
    layers = np.maximum(np.maximum(st.first_layers, st.middle_layers), st.last_layers)
    fwd_layer = layer_mm / mm_rate + layer_attn / attn_rate
    fwd_bwd_layer = 3.0 * layer_mm / mm_rate + 3.5 * layer_attn / attn_rate  # backward: 2x matmul, 2.5x attention
    compute_mb = slowest_rank_s(st, p, fwd_bwd_layer, 3.0 * head_mm / mm_rate)

    # Recompute: full = one more forward of every layer; selective (memory.py's definition: the MLP activation
    # is recomputed from the saved gate/up projections) = elementwise work, bound by HBM: read + write the
    # dropped tensors (SwiGLU: silu(g) and silu(g)*u; GELU: gelu(x)).
    ffn = float(m.moe.expert_ffn_hidden_size * m.moe.top_k if m.moe else m.ffn_hidden_size)
    dropped = 4.0 if m.mlp == "swiglu" else 2.0
    selective = dropped * tokens * ffn / t * act_bytes / (gpu.hbm_tbps * 1e12)
    # op (torchtitan's op-level policy; memory.py `op_layer_elements`): every second matmul is re-run (wk, wo,
    # w3 / fc2: 2 tokens (h kvd + qd h + h f) / t FLOPs) and the MLP's elementwise work as selective; the
    # attention output is kept, so attention is not re-run.
    op_mm = 2.0 * tokens * (m.hidden_size * m.kv_size + m.q_size * m.hidden_size + m.hidden_size * ffn) / t
    per_layer = np.select([pc.recompute_is("full"), pc.recompute_is("selective"), pc.recompute_is("op")],
                          [fwd_layer, selective, op_mm / mm_rate + selective], 0.0)
    recompute_mb = recomputed_layers(pc, layers) * per_layer  # partial recompute: recompute_layers per chunk

    # Tensor parallel: 4 all-reduces of the b s h activation per layer per micro-batch [MLM-TP]; MoE adds 4
    # all-to-alls (dispatch + combine, forward + backward) of the top_k routed copies over the ep group.
    tp_link = group_link(cl, cal, t, 1.0)
    activation = tokens * m.hidden_size * act_bytes
    tp_layer = 4.0 * all_reduce_s(tp_link, activation)
    ep_layer = np.zeros(len(pc))
    if m.moe is not None:  # dispatch/combine over ep, all-gather over etp, per MoE layer (experts.py)
        # the token exchange sits between the router and the experts: TP comm overlap does not hide it
        # (Megatron's separate EP all-to-all overlap, --overlap-moe-expert-parallel-comm, is not modelled)
        ep_layer = moe_layer_fraction(scn) * dispatch_s(scn, pc, cal, m.hidden_size * act_bytes)

    # Context parallel: per layer, K and V of the local chunk gathered forward, again backward, and their
    # gradients reduce-scattered: 3 ring passes of c x local KV.
    cp_link = group_link(cl, cal, c, t)
    kv_local = tokens * m.kv_per_token() * act_bytes
    cp_layer = 3.0 * all_gather_s(cp_link, c * kv_local)

    # Megatron overlaps TP collectives with the GEMMs they feed (--tp-comm-overlap) and P2P with compute;
    # the other stacks run them in line. Hidden traffic is bounded by the compute it hides behind.
    hides = tr.tp_overlap
    layer_compute = fwd_bwd_layer + recompute_mb / layers
    tp_exposed = (np.maximum(0.0, tp_layer - cal.overlap * layer_compute) if hides else tp_layer) + ep_layer

    # A layer takes at least the host time to launch its kernels (layer_floor_ms; a third more with full
    # recompute); the GPU idles for the difference.
    floor = cal.layer_floor_ms * 1e-3 * (1.0 + (pc.activation_checkpointing == 2) / 3.0)
    idle_layer = np.maximum(0.0, floor - (layer_compute + tp_exposed + cp_layer))
    tp_mb, cp_mb, idle_mb = layers * tp_exposed, layers * cp_layer, layers * idle_layer

    # Pipeline: per micro-batch each model chunk sends its output forward and receives a gradient backward;
    # with sequence parallelism the boundary tensor is sharded over tp.
    pp_link = group_link(cl, cal, p, t * c * d)
    boundary = activation / np.where(pc.sequence_parallel > 0, t, 1.0)
    pp_mb = 2.0 * v * p2p_s(pp_link, boundary, p > 1)
    if rec.p2p_overlap:
        pp_mb = np.maximum(0.0, pp_mb - cal.overlap * compute_mb)
    pp_mb = pp_mb + pipeline_poll_s(p, t, v, cal.p2p_poll_s)

    # Data parallel over the dp x cp ranks that hold the same weights (HSDP: shard inside dp/replicate).
    dense, expert = rank_params(scn, pc)
    grad_bytes = np.where(fp32, 4.0, tr.grad_reduce_bytes)  # training.grad_reduce_dtype, else the stack's default
    param_bytes = act_bytes
    shard_n = d * c / pc.dp_replicate
    shard_link = group_link(cl, cal, shard_n, t)
    rep_link = group_link(cl, cal, pc.dp_replicate, t * shard_n)
    expert_link = expert_dp_link(scn, cal, pc)  # edp = tp*dp*cp / (ep*etp) ranks, ep*etp apart
    z = pc.zero_stage
    # torch's zero 2 is FSDP2 with reshard_after_forward=False: parameters gathered per micro-batch and kept
    # through its backward (others: ZeRO-2 all-gathers updated parameters once per step)
    fsdp_zero2_keeps = not rec.master_weights
    # torchtitan with PP (parallelize_llama: reshard_after_forward = not pp_enabled; the pipeline schedule syncs
    # gradients on the last micro-batch only): ZeRO-3 gathers each unit once per step and reduce-scatters once.
    once_per_step = (p > 1) & (z == 3) & (not rec.reshard_after_forward_with_pp)
    # FSDP units (FSDP2 fully_shard per transformer block + the root for embedding/head; DeepSpeed ZeRO-3 fetches
    # per submodule likewise): one all-gather per unit forward, again backward when resharded, one reduce-scatter
    # per unit backward. NCCL runs all-gather / reduce-scatter as rings (its tree algorithm is all-reduce only:
    # NCCL docs, NCCL_ALGO), so each collective pays (n-1) ring steps of latency (comm.all_gather_s). Only the next
    # unit's prefetch hides behind the current unit's compute; the first gather and the last reduce-scatter are
    # exposed.
    units = layers + 1.0
    unit_fwd = fwd_layer  # forward compute per unit per micro-batch
    unit_bwd = fwd_bwd_layer - fwd_layer + recompute_mb / layers  # backward (+ its recompute) per unit

    def per_unit(link_: Link, params: Array, reshard: Array) -> tuple[Array, Array]:
        """(traffic seconds, exposed seconds) of FSDP's per-unit collectives for one micro-batch."""
        ag = all_gather_s(link_, params * param_bytes / units)
        rs = reduce_scatter_s(link_, params * grad_bytes / units)
        ag_bwd = np.where(reshard, ag, 0.0)
        traffic = units * (ag + ag_bwd + rs)
        # the first gather waits; the other units' gathers are prefetched behind the previous unit's compute;
        # in backward each unit's gather (when resharded) and the previous unit's reduce-scatter hide behind it,
        # and the last reduce-scatter waits
        fwd = ag + (units - 1.0) * np.maximum(0.0, ag - cal.overlap * unit_fwd)
        bwd = ag_bwd + (units - 1.0) * np.maximum(0.0, ag_bwd + rs - cal.overlap * unit_bwd) + rs
        return traffic, fwd + bwd

    def sync(link_: Link, params: Array) -> tuple[Array, Array, Array]:
        """(once-per-step seconds, per-micro-batch traffic seconds, per-micro-batch exposed seconds) of this
        group's gradient/parameter traffic."""
        g, w = params * grad_bytes, params * param_bytes
        rs, ag = reduce_scatter_s(link_, g), all_gather_s(link_, w)
        per_step = np.select([z == 0, z == 1], [all_reduce_s(link_, g), rs + ag],
                             np.where((z == 2) & fsdp_zero2_keeps, 0.0, np.where(z == 2, ag, 0.0)))
        # ZeRO-2 per micro-batch: one bulk reduce-scatter of the gradients (bucketed, overlapped with backward)
        # and, on torch, FSDP2's gather kept through backward; ZeRO-3: the per-unit collectives above
        z2_traffic = rs + np.where(fsdp_zero2_keeps, ag, 0.0)
        z2_exposed = np.maximum(0.0, z2_traffic - cal.overlap * (compute_mb + recompute_mb))
        unit_traffic, unit_exposed = per_unit(link_, params, z == 3)
        kept_traffic, kept_exposed = per_unit(link_, params, np.zeros_like(z, dtype=bool))
        per_mb = np.select([z == 2, z == 3], [z2_traffic, unit_traffic], 0.0)
        exposed_mb = np.select([z == 2, z == 3], [z2_exposed, unit_exposed], 0.0)
        # torch ZeRO-3 with PP: once per step, parameters kept (no backward re-gather)
        per_step = np.where(once_per_step, kept_traffic, per_step)
        per_mb = np.where(once_per_step, 0.0, per_mb)
        some = params > 0  # no collective at all for a group with nothing to send (dense models' experts)
        exposed = np.where(once_per_step, kept_exposed, exposed_mb)
        return np.where(some, per_step, 0.0), np.where(some, per_mb, 0.0), np.where(some, exposed, 0.0)

    dense_step, dense_mb, dense_exposed = sync(shard_link, dense)
    expert_step, expert_mb, expert_exposed = sync(expert_link, expert)
    replicas = np.where(z >= 1, all_reduce_s(rep_link, dense * grad_bytes / shard_n),
                        all_reduce_s(rep_link, dense * grad_bytes))
    dp_step = dense_step + expert_step + replicas
    dp_mb = (dense_mb + expert_mb) * micro
    compute_only = compute_mb + recompute_mb
    # once-per-step traffic (DDP/ZeRO-1 gradients, ZeRO-2 parameters, torch ZeRO-3 with PP) hides behind one
    # micro-batch's compute; per-micro-batch traffic as computed per unit (exposed_* above), every micro-batch
    step_only = dp_step - np.where(once_per_step, dense_step + expert_step, 0.0)
    exposed_dp = (np.maximum(0.0, step_only - cal.overlap * compute_only)
                  + np.where(once_per_step, dense_exposed + expert_exposed, 0.0)
                  + np.where(once_per_step, 0.0, (dense_exposed + expert_exposed) * micro))

    # Optimizer: read gradient, read + write master weights and states, write the compute copy, over HBM;
    # offloaded: gradients down and weights up over PCIe, the update over host memory.
    updated = dense / np.where(z >= 1, shard_n, 1.0) + expert / np.where(z >= 1, np.maximum(1.0, expert_data_parallel(pc)), 1.0)
    opt = training_optimizer_bytes(scn)
    master = np.where(fp32 | (not rec.master_weights), 0.0, 4.0)
    # with a separate master copy the low-precision weights are only written; otherwise the fp32 weights are
    # read and written
    touched = grad_bytes + 2.0 * (master + opt) + np.where(master > 0, param_bytes, 2.0 * 4.0)
    on_device = updated * touched / (gpu.hbm_tbps * 1e12)
    offloaded = updated * (grad_bytes + param_bytes) / PCIE_BYTES_S + updated * touched / HOST_MEM_BYTES_S
    optimizer = np.where(pc.optimizer_offload > 0, offloaded, on_device)

    slot = compute_only + tp_mb + cp_mb + pp_mb + idle_mb
    bubble = bubble_fraction(p, micro, pc.pp_schedule, v) * micro * slot
    tp_s, cp_s, pp_s = micro * tp_mb, micro * cp_mb, micro * pp_mb
    exposed = tp_s + cp_s + pp_s + exposed_dp
    overhead = cal.step_overhead_s + micro * idle_mb
    compute, recompute = micro * compute_mb, micro * recompute_mb
    step = compute + recompute + exposed + bubble + optimizer + overhead
    return {
        "compute_s": compute, "recompute_s": recompute, "tp_comm_s": tp_s, "dp_comm_s": dp_step + dp_mb,
        "pp_comm_s": pp_s, "cp_comm_s": cp_s, "bubble_s": bubble, "optimizer_s": optimizer,
        "overhead_s": overhead, "exposed_comm_s": exposed, "step_s": step, "micro_batches": micro,
        "model_flops": np.full(len(pc), model_flops_per_token(m, tr.seq_len)),
        "tp_hidden_s": micro * layers * (tp_layer + ep_layer - tp_exposed),  # TP traffic overlapped with GEMMs (not in step)
    }
