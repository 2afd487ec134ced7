"""Analytic step time: a short composition of per-mechanism terms (evaluators.step_terms: compute, recompute, TP,
EP, CP, PP; here: DP and the optimizer), the pipeline bubble from the schedule tables (evaluators.schedules) and
the per-step overhead. Stack variants come from the stack record and the training settings, not from branches.

Vectorised over `PlanColumns`; every column is seconds per optimizer step on the slowest pipeline rank.

Sources:
  [PaLM]   Chowdhery et al. 2022, app. B: model FLOPs per token 6N + 12 L H Q T (attention, non-causal).
  [Narayanan] Narayanan et al. 2021 (Megatron-LM at scale, SC21), sec. 5.1 / app.: 72 B s L h^2 (1 + s/(6h)
           + V/(12 h L)) FLOPs per iteration for GPT (4h MLP), the same count as [PaLM] for that shape.
  [ZeRO]   Rajbhandari et al. 2019, sec. 7: DDP and ZeRO-1/2 move 2 Psi per step, ZeRO-3 3 Psi (1.5x).
  [FSDP2]  torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: one all-gather per unit forward (the next
           unit's prefetched behind the current one's compute), again backward when resharded, one reduce-scatter
           per unit backward behind the next unit's backward; the first gather and the last reduce-scatter wait.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration, default_calibration
from stratagem.evaluators.comm import Link, all_gather_s, all_reduce_s, group_link, reduce_scatter_s
from stratagem.evaluators.experts import expert_dp_link
from stratagem.evaluators.memory import training_optimizer_bytes
from stratagem.evaluators.schedules import critical_hops, idle_slots, phases, rank_actions
from stratagem.evaluators.speed import (
    speed_terms,
)
from stratagem.evaluators.stages import stage_columns
from stratagem.evaluators.step_parts import COMM_TERMS, STEP_PARTS, TIME_TERMS
from stratagem.evaluators.step_terms import (
    StepContext,
    cp_layer_s,
    ep_layer_s,
    layer_floor_s,
    matmul_params_per_layer,
    pp_step_s,
    recompute_mb,
    step_context,
    tp_layer_s,
)
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import expert_data_parallel, shard_group
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = [
    "time_factors",
    "speed_rows",
    "pipeline_row",
    "model_flops_per_token",
    "megatron_flops_per_token",
    "bubble_fraction",
    "schedule_idle_slots",
    "rank_params",
    "dp_terms",
    "optimizer_s",
    "time_columns",
]

Array = NDArray[np.float64]

# Device <-> host copy bandwidth per GPU for optimizer offload: PCIe Gen4 x16 achieves ~25 GB/s one way.
PCIE_BYTES_S = 25e9
# Host memory bandwidth per GPU for the CPU optimizer step (ZeRO-Offload): ~200 GB/s per 2-socket node / 8.
HOST_MEM_BYTES_S = 25e9


# What each engine's TP overlap hides, for `explain` (evaluators.step_terms._te_pipelined / _symm_mem_exposed).
TP_OVERLAP_HOW = {
    "transformer_engine": "TE userbuffers: every TP collective cut into tp chunks under its GEMM, the first chunk "
                          "exposed",
    "eager": "async TP: inductor's micro_pipeline_tp fuses the forward's 2 all-gathers and 2 reduce-scatters "
             "(again when recomputed) and the backward's 2 all-gathers with their matmuls; the backward's 2 "
             "reduce-scatters (of a sum of input gradients) stay NCCL; exposed per fused op: the local shard's copy, "
             "barriers, the reduce-scatter's sum, copies beyond their GEMM chunk, the chunked GEMM's efficiency",
}


def speed_rows(scn: Scenario, plan: Plan, cal: Calibration | None = None) -> list[tuple[str, str, str]]:
    """(factor, value, source) rows for `explain`: every factor that scales compute for this plan, then the TP
    and EP traffic exposed vs hidden (seconds per step)."""
    cal = cal or default_calibration(scn.cluster.gpu.name)
    rows = [(t.name, f"x{t.value:.3g}" if t.name != "fp8_casts" else f"{t.value:g} B", t.source)
            for t in speed_terms(scn, plan.precision, cal) if t.name != "tp_overlap"]
    cols = time_columns(scn, PlanColumns.from_plans([plan]), cal)
    overlap = next(t for t in speed_terms(scn) if t.name == "tp_overlap")
    exposed, hidden = float(cols["tp_comm_s"][0]), float(cols["tp_hidden_s"][0])
    share = hidden / (exposed + hidden) if exposed + hidden > 0 else 0.0
    rows.append(("TP comm exposed / hidden", f"{exposed:.3g} s / {hidden:.3g} s", overlap.source))
    if scn.training.tp_overlap:
        rows.append(("TP share hidden", f"{share:.0%}", TP_OVERLAP_HOW[scn.training.record.kernels]))
    if plan.pp > 1:
        rows.append(pipeline_row(scn, plan, cols))
    if scn.model.moe is not None and plan.zero_stage == 3:
        edp = expert_data_parallel(plan)
        how = scn.training.record.expert_zero3
        rows.append(("expert shards (ZeRO-3)", f"edp {edp}",
                     f"{how}: each unit's experts gathered and their gradients reduce-scattered every micro-batch "
                     "(once per step with torchtitan's PP), hidden per unit behind its compute (timing.dp_terms)"))
    if scn.model.moe is not None:
        tr = scn.training
        rows.append(("EP comm exposed / hidden", f"{cols['ep_comm_s'][0]:.3g} s / {cols['ep_hidden_s'][0]:.3g} s",
                     f"dispatcher {tr.dispatcher} ({tr.record.cite('moe_dispatchers') or tr.record.name}); "
                     f"overlap with another micro-batch {'on' if tr.ep_overlap else 'off'}"))
    return rows


def pipeline_row(scn: Scenario, plan: Plan, cols: dict[str, Array]) -> tuple[str, str, str]:
    """The schedule's (warm-up, steady, cool-down) of the first and last rank from the engine's action list, its idle
    slots and the P2P sends on the critical path (evaluators.schedules)."""
    p, v, s = plan.pp, plan.virtual_stages, plan.pp_schedule
    m = int(round(float(cols["micro_batches"][0])))
    first, last = (phases(rank_actions(s, p, v, m, r)) for r in (0, p - 1))
    pc = PlanColumns.from_plans([plan])
    detail = (f"{s}, p {p}, v {v}, m {m}: warm-up/steady/cool-down chunk steps rank 0 {first[0]}/{first[1]}/"
              f"{first[2]}, rank {p - 1} {last[0]}/{last[1]}/{last[2]}; "
              f"{float(critical_hops(pc, np.array([float(m)]))[0]):.0f} P2P sends on the critical path "
              "(torch.distributed.pipelining action lists, evaluators.schedules)")
    return "pipeline", f"idle {float(idle_slots(pc, float(m))[0]):.3g} slots", detail


# ---- FLOPs --------------------------------------------------------------------------------------------------
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
    """Bubble time over ideal time: the schedule table's idle slots (evaluators.schedules) over m micro-batches:
    (p-1)/m for gpipe (0) and 1f1b (1), (p-1)/(v m) interleaved (2), (p-1)/(3 v m) zero-bubble (3)."""
    n = len(np.atleast_1d(pp))
    ones = np.ones(n)
    pc = PlanColumns(dp=ones, tp=ones, pp=np.asarray(pp, dtype=np.float64) * ones, cp=ones, ep=ones,
                     dp_replicate=ones, zero_stage=0 * ones, sequence_parallel=0 * ones, micro_batch_size=ones,
                     precision=ones, activation_checkpointing=0 * ones,
                     pp_schedule=np.asarray(schedule, dtype=np.float64) * ones,
                     virtual_stages=np.asarray(virtual, dtype=np.float64) * ones, optimizer_offload=0 * ones)
    return idle_slots(pc) / micro_batches


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


# ---- data parallel and optimizer ----------------------------------------------------------------------------
def _unit_collectives(ctx: StepContext, link: Link, params: Array) -> tuple[Array, Array]:
    """(all-gather, reduce-scatter) seconds of one FSDP unit's collectives [FSDP2]: units = layers + 1 (the root
    holds embedding / head); NCCL runs all-gather / reduce-scatter as rings (comm.all_gather_s)."""
    tr, units = ctx.scn.training, ctx.layers + 1.0
    grad_bytes = np.where(ctx.pc.fp32, 4.0, tr.grad_reduce_bytes)
    return all_gather_s(link, params * ctx.act_bytes / units), reduce_scatter_s(link, params * grad_bytes / units)


def _per_unit(ctx: StepContext, unit: tuple[Array, Array], reshard: Array, unit_fwd: Array,
              unit_bwd: Array) -> tuple[Array, Array]:
    """(traffic, exposed) seconds of FSDP's per-unit collectives (`_unit_collectives`) for one micro-batch [FSDP2].
    The next unit's gather hides only behind the current unit's forward; in backward each unit's re-gather and the
    previous unit's reduce-scatter hide behind its backward; the first gather and the last reduce-scatter are
    exposed."""
    units, cal = ctx.layers + 1.0, ctx.cal
    ag, rs = unit
    ag_bwd = np.where(reshard, ag, 0.0)
    fwd = ag + (units - 1.0) * np.maximum(0.0, ag - cal.overlap * unit_fwd)
    bwd = ag_bwd + (units - 1.0) * np.maximum(0.0, ag_bwd + rs - cal.overlap * unit_bwd) + rs
    return units * (ag + ag_bwd + rs), fwd + bwd


def dp_terms(ctx: StepContext, rec_mb: Array, idle_mb: Array) -> tuple[Array, Array]:
    """(traffic, exposed) seconds per step of the data-parallel traffic over the dp x cp ranks that hold the same
    weights (HSDP: shard inside dp/replicate) and, for experts, over edp (experts.expert_dp_link).

    DDP / ZeRO-1: once per step (all-reduce; reduce-scatter + all-gather) [ZeRO], hidden behind one micro-batch's
    compute. ZeRO-2: a bulk reduce-scatter per micro-batch (and on torch, FSDP2 with reshard_after_forward=False,
    the gather kept through backward). ZeRO-3: FSDP's per-unit collectives every micro-batch (_per_unit). Under
    torch's pipeline schedules FSDP2 (ZeRO-2 and -3: torchtitan parallelize_llama sets reshard_after_forward = not
    pp_enabled) gathers each unit once per step and reduce-scatters once: PipelineStage.backward_maybe_with_nosync
    turns gradient sync and reshard-after-backward off for every micro-batch, and perform_reduce_grad runs FSDP's
    post-backward once after the last (torch/distributed/pipelining/stage.py): StackRecord.reshard_after_forward_with_pp.
    """
    scn, pc, cal = ctx.scn, ctx.pc, ctx.cal
    cl, tr, rec = scn.cluster, scn.training, scn.training.record
    t, z = pc.tp, pc.zero_stage
    grad_bytes = np.where(pc.fp32, 4.0, tr.grad_reduce_bytes)
    dense, expert = rank_params(scn, pc)
    shard_n = shard_group(pc)
    shard_link = group_link(cl, cal, shard_n, t)
    rep_link = group_link(cl, cal, pc.dp_replicate, t * shard_n)
    fsdp_zero2_keeps = not rec.master_weights
    once_per_step = (pc.pp > 1) & (z >= 2) & (not rec.reshard_after_forward_with_pp)
    compute_only = ctx.compute_mb + rec_mb + idle_mb  # the GPU's wall time of a micro-batch (launch waits too)
    # a unit's wall time: its compute plus its share of launch waits (the GPU idles, the links do not)
    idle_layer = idle_mb / ctx.layers
    fwd_share = ctx.fwd_layer / ctx.fwd_bwd_layer
    unit_fwd = ctx.fwd_layer + idle_layer * fwd_share
    unit_bwd = ctx.fwd_bwd_layer - ctx.fwd_layer + rec_mb / ctx.layers + idle_layer * (1.0 - fwd_share)

    def sync(link: Link, params: Array) -> tuple[Array, Array, Array]:
        g, w = params * grad_bytes, params * ctx.act_bytes
        rs, ag = reduce_scatter_s(link, g), all_gather_s(link, w)
        per_step = np.select([z == 0, z == 1], [all_reduce_s(link, g), rs + ag],
                             np.where((z == 2) & (not fsdp_zero2_keeps), ag, 0.0))
        z2_traffic = rs + np.where(fsdp_zero2_keeps, ag, 0.0)
        z2_exposed = np.maximum(0.0, z2_traffic - cal.overlap * compute_only)
        unit = _unit_collectives(ctx, link, params)
        unit_traffic, unit_exposed = _per_unit(ctx, unit, z == 3, unit_fwd, unit_bwd)
        kept_traffic, kept_exposed = _per_unit(ctx, unit, np.zeros(len(pc), dtype=bool), unit_fwd, unit_bwd)
        per_mb = np.select([z == 2, z == 3], [z2_traffic, unit_traffic], 0.0)
        exposed_mb = np.select([z == 2, z == 3], [z2_exposed, unit_exposed], 0.0)
        per_step = np.where(once_per_step, kept_traffic, per_step)
        per_mb = np.where(once_per_step, 0.0, per_mb)
        exposed = np.where(once_per_step, kept_exposed, exposed_mb)
        some = params > 0  # no collective for a group with nothing to send (dense models' experts)
        return np.where(some, per_step, 0.0), np.where(some, per_mb, 0.0), np.where(some, exposed, 0.0)

    dense_step, dense_mb, dense_exposed = sync(shard_link, dense)
    expert_step, expert_mb, expert_exposed = sync(expert_dp_link(scn, cal, pc), expert)
    replicas = all_reduce_s(rep_link, dense * grad_bytes / np.where(z >= 1, shard_n, 1.0))
    step_only = dense_step + expert_step + replicas - np.where(once_per_step, dense_step + expert_step, 0.0)
    exposed = (np.maximum(0.0, step_only - cal.overlap * compute_only)
               + np.where(once_per_step, dense_exposed + expert_exposed,
                          (dense_exposed + expert_exposed) * ctx.micro))
    traffic = dense_step + expert_step + replicas + (dense_mb + expert_mb) * ctx.micro
    return traffic, exposed


def optimizer_s(ctx: StepContext) -> Array:
    """Optimizer step: read gradient, read + write master weights and states, write the compute copy, over HBM;
    offloaded: gradients down and weights up over PCIe, the update over host memory."""
    scn, pc = ctx.scn, ctx.pc
    tr, gpu = scn.training, scn.cluster.gpu
    z = pc.zero_stage
    dense, expert = rank_params(scn, pc)
    shard_n = shard_group(pc)
    updated = (dense / np.where(z >= 1, shard_n, 1.0)
               + expert / np.where(z >= 1, np.maximum(1.0, expert_data_parallel(pc)), 1.0))
    grad_bytes = np.where(pc.fp32, 4.0, tr.grad_reduce_bytes)
    master = np.where(pc.fp32 | (not tr.record.master_weights), 0.0, 4.0)
    opt = training_optimizer_bytes(scn)
    # with a separate master copy the low-precision weights are only written; else fp32 weights read and written
    touched = grad_bytes + 2.0 * (master + opt) + np.where(master > 0, ctx.act_bytes, 2.0 * 4.0)
    on_device = updated * touched / (gpu.hbm_tbps * 1e12)
    offloaded = updated * (grad_bytes + ctx.act_bytes) / PCIE_BYTES_S + updated * touched / HOST_MEM_BYTES_S
    return np.where(pc.offload, offloaded, on_device)


def schedule_idle_slots(ctx: StepContext, rec_mb: Array) -> Array:
    """Idle micro-batch slots of the schedule (evaluators.schedules.idle_slots) at this plan's micro-batches and
    per-stage durations: forward F, weight-gradient GEMMs W (one per forward GEMM: the forward matmul time), input
    gradient I = the rest of the backward with the recomputed forward (zero-bubble's split: torch
    stage_backward_input / stage_backward_weight)."""
    f = ctx.layers * ctx.fwd_layer
    w = ctx.layers * ctx.layer_mm / ctx.mm_rate
    i = np.maximum(ctx.compute_mb + rec_mb - f - w, 0.0)
    return idle_slots(ctx.pc, ctx.micro, f, i, w)


# ---- the step ----------------------------------------------------------------------------------------------
def time_factors(cal: Calibration) -> dict[str, float]:
    """Each TIME_TERMS term's multiplier at the posterior mean of the calibration's time multipliers (1 where none);
    ValueError on a name that is not a time term."""
    out = dict.fromkeys(TIME_TERMS, 1.0)
    if cal.time_multipliers is None:
        return out
    unknown = [n for n in cal.time_multipliers.names if n not in out]
    if unknown:
        raise ValueError(f"time_multipliers.names: {unknown} are not step-time terms {list(TIME_TERMS)}")
    return out | cal.time_multipliers.factors()


def time_columns(scn: Scenario, pc: PlanColumns, cal: Calibration) -> dict[str, Array]:
    """Seconds per optimizer step by part (step_parts.STEP_PARTS: the terms, their hidden companions, the sums) for
    every plan, plus `micro_batches` and `model_flops` (model FLOPs per token). step_s = compute + recompute +
    exposed_comm + bubble + optimizer + overhead; exposed_comm = the exposed TP + EP + CP + PP + DP. Each term is
    multiplied by its multiplier from the calibration (time_factors; hidden traffic with its term's) before the
    sums."""
    ctx = step_context(scn, pc, cal)
    micro, layers = ctx.micro, ctx.layers
    rec_mb = recompute_mb(ctx)
    layer_compute = ctx.fwd_bwd_layer + rec_mb / layers
    tp_exposed, tp_total = tp_layer_s(ctx)
    ep_exposed, ep_total = ep_layer_s(ctx, layer_compute)
    cp_layer = cp_layer_s(ctx)
    # a layer takes at least the host time to launch its kernels (step_terms.layer_floor_s); the GPU idles for the
    # difference
    floor = layer_floor_s(ctx, layer_compute)
    idle_mb = layers * np.maximum(0.0, floor - (layer_compute + tp_exposed + ep_exposed + cp_layer))
    dp_traffic, dp_exposed = dp_terms(ctx, rec_mb, idle_mb)
    slot = ctx.compute_mb + rec_mb + layers * (tp_exposed + ep_exposed + cp_layer) + idle_mb
    bubble = schedule_idle_slots(ctx, rec_mb) * slot
    compute, recompute = micro * ctx.compute_mb, micro * rec_mb
    tp_s, ep_s = micro * layers * tp_exposed, micro * layers * ep_exposed
    cp_s, pp_s = micro * layers * cp_layer, pp_step_s(ctx)
    overhead = cal.step_overhead_s + micro * idle_mb
    opt = optimizer_s(ctx)
    tp_hidden, ep_hidden = micro * layers * (tp_total - tp_exposed), micro * layers * (ep_total - ep_exposed)
    parts = {"compute_s": compute, "recompute_s": recompute, "tp_comm_s": tp_s, "ep_comm_s": ep_s, "cp_comm_s": cp_s,
             "pp_comm_s": pp_s, "dp_comm_s": dp_exposed, "bubble_s": bubble, "optimizer_s": opt,
             "overhead_s": overhead, "tp_hidden_s": tp_hidden, "ep_hidden_s": ep_hidden, "dp_hidden_s": dp_traffic}
    if cal.time_multipliers is not None:  # None: the formulas exactly (not even a multiplication by 1)
        f = time_factors(cal)
        for p in STEP_PARTS:
            if p.term:
                parts[p.name] = parts[p.name] * f[p.name]
            if p.hidden:  # a term's multiplier scales its hidden traffic too
                parts[p.hidden] = parts[p.hidden] * f[p.name]
    # dp_hidden_s: the traffic less what the step waits for (both scaled by the DP multiplier first)
    parts["dp_hidden_s"] = parts["dp_hidden_s"] - parts["dp_comm_s"]
    exposed = sum((parts[k] for k in COMM_TERMS), np.zeros(len(pc)))
    step = (parts["compute_s"] + parts["recompute_s"] + exposed + parts["bubble_s"] + parts["optimizer_s"]
            + parts["overhead_s"])
    return parts | {"exposed_comm_s": exposed, "step_s": step, "micro_batches": micro,
                    "model_flops": np.full(len(pc), model_flops_per_token(scn.model, scn.training.seq_len))}
