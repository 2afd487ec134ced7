"""The per-mechanism terms of the step time, each a vectorised function of a `StepContext` (the plan columns with
what every term shares: tokens per rank, layers of the slowest rank, compute rates). evaluators.timing composes
them; each term follows its engine and names it.

Sources:
  [MLM-TP] Shoeybi et al. 2019, sec. 3: 2 all-reduces forward + 2 backward per layer; Korthikanti et al. 2022
           sec. 4.2.2: with sequence parallelism all-gather + reduce-scatter, same volume.
  [TE-UB]  TransformerEngine transformer_engine/pytorch/module/base.py initialize_ub / cpp userbuffers
           (split_pipelined AG+GEMM, GEMM+RS; ring-exchange): the GEMM and its collective are cut into tp chunks
           and chunk i's transfer runs under chunk i-1's GEMM; Megatron --tp-comm-overlap (needs sequence
           parallelism). [AsyncTP] torch/distributed/_symmetric_memory/__init__.py fused_all_gather_matmul /
           fused_matmul_reduce_scatter: the same micro-pipeline over tp shards (torchtitan async TP, compiled).
  [FA2]    Dao 2023, sec. 4.1: causal attention does half the work; backward = 2.5x forward.
  [NT-P2P] huggingface/nanotron nouamane/bench2 src/nanotron/parallel/pipeline_parallel/p2p.py: two metadata
           tensors per transfer, each awaited by `while not work.is_completed(): time.sleep(0.1)`.
  [A2A-ov] megatron/core/pipeline_parallel/combined_1f1b.py (--overlap-moe-expert-parallel-comm): the forward of
           one micro-batch runs with the backward of another, each one's dispatch / combine under the other's
           compute; the first forward and last backward of each rank (its warm-up / cool-down) have no partner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.comm import Link, all_gather_s, all_reduce_s, group_link, p2p_s, reduce_scatter_s
from stratagem.evaluators.ep_overlap import ep_overlap_exposed, ep_overlap_host_wait
from stratagem.evaluators.experts import (
    dispatch_s,
    moe_layer_fraction,
    permute_s,
    routed_matmul_per_layer,
    routed_time_factor,
)
from stratagem.evaluators.host import layer_host_s
from stratagem.evaluators.memory import recomputed_layers
from stratagem.evaluators.rate_tables import LAYER_GEMMS, gemm_size
from stratagem.evaluators.schedules import critical_hops, p2p_hidden
from stratagem.evaluators.speed import (
    compute_factors,
    fp8_cast_bytes,
    fp8_gemm_size,
    fp8_linear_speedup,
    fp8_routed_experts,
)
from stratagem.evaluators.stages import StageColumns, slowest_rank_s, stage_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import micro_batches, sp_divisor
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.scenario import Scenario

__all__ = [
    "StepContext",
    "step_context",
    "matmul_params_per_layer",
    "fp8_cast_elements",
    "fp8_routed_cast_elements",
    "recompute_per_layer",
    "module_recompute_per_layer",
    "forward_repeats",
    "tp_layer_s",
    "tp_traffic_s",
    "mlp_tp_share",
    "fp8_gather_width",
    "tp_gemm_shares",
    "ep_layer_s",
    "layer_floor_s",
    "comm_sm_share",
    "GPU_SMS",
    "DEEPEP_SMS",
    "cp_layer_s",
    "pp_step_s",
    "pipeline_poll_s",
]

Array = NDArray[np.float64]


def matmul_params_per_layer(m: ModelSpec) -> float:
    """Weights one token multiplies through in one layer: attention Q,K,V,O + the active MLP (top_k experts
    and the router for MoE), averaged over layers (ModelSpec.layer_matmul_params)."""
    return m.mean_matmul_params_per_layer()


@dataclass(frozen=True)
class StepContext:
    """What the terms share, per plan (one micro-batch on the slowest rank unless said)."""

    scn: Scenario
    pc: PlanColumns
    cal: Calibration
    act_bytes: Array
    """Bytes of one activation element (fp32 4, else 2)."""
    micro: Array
    """Micro-batches per step per pipeline."""
    tokens: Array
    """Tokens of one micro-batch on one rank (s / cp x b)."""
    st: StageColumns
    layers: Array
    """Layers of the most loaded rank."""
    mm_rate: Array
    """Achieved matmul FLOP/s (fp8 GEMM speed-up included)."""
    layer_mm: Array
    """Forward matmul FLOPs of one layer per rank, timed at mm_rate (routed experts' imbalance and GEMM size in)."""
    fwd_layer: Array
    """Forward seconds of one layer."""
    attn_fwd: Array
    """Forward seconds of one layer's core attention (flash kernel)."""
    fwd_bwd_layer: Array
    """Forward + backward seconds of one layer (backward 2x matmul, 2.5x attention [FA2]), fp8 casts and the
    MoE permute included."""
    compute_mb: Array
    """Forward + backward seconds of the slowest rank (its layers, the head on the last)."""
    activation: Array
    """Bytes of one layer's b s h activation on a rank."""


def fp8_cast_elements(m: ModelSpec, tokens: Array, tp: Array) -> Array:
    """Elements one layer's fp8 linears cast per micro-batch on a rank, forward + backward [torchao-f8 in
    evaluators.speed]: each converted nn.Linear casts its input twice (forward GEMM, weight-gradient GEMM), its
    output gradient twice (input- and weight-gradient GEMMs) and its weight twice (forward, input gradient).
    Converted: Q, K, V, O and the dense or shared-expert MLP (routed experts are grouped GEMMs torchao's Float8Linear
    does not convert)."""
    h, q, kv = float(m.hidden_size), float(m.q_size), float(m.kv_size)
    moe = m.moe
    share = m.num_moe_layers() / m.num_layers if moe is not None else 0.0
    f_shared = float(moe.shared_experts * moe.shared_ffn) if moe is not None else 0.0
    f = (1.0 - share) * float(m.ffn_hidden_size) + share * f_shared
    mlp_in = 2.0 * h + f if f > 0 else 0.0
    mlp_out = 2.0 * f + h if f > 0 else 0.0
    per_token = 3.0 * h + q + mlp_in + (q + 2.0 * kv + h) + mlp_out
    weights = h * (q + 2.0 * kv) + q * h + 3.0 * h * f
    return (2.0 * tokens * per_token + 2.0 * weights) / tp


def fp8_routed_cast_elements(scn: Scenario, pc: PlanColumns, tokens: Array) -> Array:
    """Elements the routed experts' fp8 GEMMs cast per micro-batch on a rank, forward + backward, averaged over
    layers, where the stack runs them in fp8 (speed.fp8_routed_experts), counted as fp8_cast_elements counts an MLP:
    each token's top_k copies through one expert's fc1 / fc2 (inputs and output gradients twice each) and the rank's
    local experts' weights twice (over ep x etp)."""
    m = scn.model
    moe = m.moe
    if moe is None or not fp8_routed_experts(scn):
        return np.zeros(len(pc))
    h, f = float(m.hidden_size), float(moe.expert_ffn_hidden_size)
    share = m.num_moe_layers() / m.num_layers
    per_copy = (2.0 * h + f) + (2.0 * f + h)
    weights = moe.num_experts * 3.0 * h * f / (pc.ep * pc.etp)
    return share * (2.0 * tokens * moe.top_k * per_copy / pc.tp + 2.0 * weights)


def step_context(scn: Scenario, pc: PlanColumns, cal: Calibration) -> StepContext:
    """The shared columns of `scn` x `pc` (compute of one micro-batch on the most loaded rank)."""
    m, tr, gpu = scn.model, scn.training, scn.cluster.gpu
    t, p, c = pc.tp, pc.pp, pc.cp
    act_bytes = np.where(pc.fp32, 4.0, 2.0)
    micro = micro_batches(pc, tr.global_batch_size)
    tokens = pc.micro_batch_size * tr.seq_len / c
    peak_bf16 = gpu.peak_tflops("bf16") * 1e12
    peak = np.where(pc.fp32, gpu.peak_tflops("fp32") * 1e12, peak_bf16)
    layer_mm = 2.0 * tokens * matmul_params_per_layer(m) / t
    layer_attn = tokens * m.attention_flops_per_token(tr.seq_len) / t  # causal flash forward [FA2]
    head_mm = 2.0 * tokens * m.vocab_size * m.hidden_size / t
    # small per-GPU matmuls run less efficiently: F / (F + half), or the measured GEMM table (evaluators.rate_tables)
    size = gemm_size(cal.rate_tables, "dense", layer_mm, LAYER_GEMMS, cal.matmul_efficiency,
                     cal.half_efficiency_gflop * 1e9)
    f = compute_factors(scn, cal)  # kernel path (vs the calibrated one) x clock: printed by `explain`
    # fp8: the converted linears at the fp8 peak, their fixed part as long as at bf16 (evaluators.speed [fp8-gemm])
    size_fp8 = fp8_gemm_size(scn, cal, layer_mm / 1e9)
    bf16_rate = peak * cal.matmul_efficiency * f["kernels"] * f["clock"] * size
    mm_rate = np.where(pc.fp8, peak_bf16 * fp8_linear_speedup(scn) * cal.matmul_efficiency * f["kernels"]
                       * f["clock"] * size_fp8, bf16_rate)
    attn_rate = peak * cal.attention_efficiency * f["kernels"] * f["clock"] * size
    routed_mm = 2.0 * tokens * routed_matmul_per_layer(scn) / t  # routed experts (evaluators/experts.py)
    routed_factor = routed_time_factor(scn, pc, cal, size)
    # routed experts the stack leaves in bf16 in fp8 plans (speed.fp8_routed_experts): timed at the bf16 rate
    bf16_experts = pc.fp8 & (not fp8_routed_experts(scn))
    routed_factor = np.where(bf16_experts, routed_factor * mm_rate / bf16_rate, routed_factor)
    layer_mm = layer_mm + routed_mm * (routed_factor - 1.0)
    # fp8 casts over HBM: fused or eager, with the recipe's scales (speed.fp8_cast_bytes)
    cast_elements = fp8_cast_elements(m, tokens, t) + fp8_routed_cast_elements(scn, pc, tokens)
    casts = np.where(pc.fp8, cast_elements * fp8_cast_bytes(scn) / (gpu.hbm_tbps * 1e12), 0.0)
    # token permute / unpermute around the experts, HBM-bound (experts.permute_s), on MoE layers
    permute = moe_layer_fraction(scn) * permute_s(scn, pc)
    st = stage_columns(m, pc)  # evaluators/stages.py: the slowest rank decides (the last one also runs the head)
    layers = np.maximum(np.maximum(st.first_layers, st.middle_layers), st.last_layers)
    fwd_layer = layer_mm / mm_rate + layer_attn / attn_rate
    fwd_bwd_layer = 3.0 * layer_mm / mm_rate + 3.5 * layer_attn / attn_rate + casts + permute
    compute_mb = slowest_rank_s(st, p, fwd_bwd_layer, 3.0 * head_mm / mm_rate)
    return StepContext(scn=scn, pc=pc, cal=cal, act_bytes=act_bytes, micro=micro, tokens=tokens, st=st,
                       layers=layers, mm_rate=mm_rate, layer_mm=layer_mm, fwd_layer=fwd_layer,
                       attn_fwd=layer_attn / attn_rate,
                       fwd_bwd_layer=fwd_bwd_layer, compute_mb=compute_mb,
                       activation=tokens * m.hidden_size * act_bytes)


def recompute_per_layer(ctx: StepContext) -> Array:
    """Recompute seconds of one layer per micro-batch: full = one more forward; selective (memory.py's
    definition: the MLP activation recomputed from the saved gate/up projections) = elementwise work over HBM
    (read + write the dropped tensors: SwiGLU silu(g) and silu(g)*u, GELU gelu(x)); op (torchtitan's op-level
    policy, memory.py `op_layer_elements`) = every second matmul (wk, wo, w3 / fc2) + the selective work."""
    m, pc, gpu = ctx.scn.model, ctx.pc, ctx.scn.cluster.gpu
    t = pc.tp
    ffn = float(m.moe.expert_ffn_hidden_size * m.moe.top_k if m.moe else m.ffn_hidden_size)
    dropped = 4.0 if m.mlp == "swiglu" else 2.0
    selective = dropped * ctx.tokens * ffn / t * ctx.act_bytes / (gpu.hbm_tbps * 1e12)
    op_mm = 2.0 * ctx.tokens * (m.hidden_size * m.kv_size + m.q_size * m.hidden_size + m.hidden_size * ffn) / t
    selective = np.where(pc.by_module, module_recompute_per_layer(ctx), selective)
    return np.select([pc.recompute_is("full"), pc.recompute_is("selective"), pc.recompute_is("op")],
                     [ctx.fwd_layer, selective, op_mm / ctx.mm_rate + selective], 0.0)


def module_recompute_per_layer(ctx: StepContext) -> Array:
    """Seconds one layer spends re-running the modules of Megatron's --recompute-modules (transformer_config.py
    recompute_modules; transformer_layer.py / moe_layer.py / multi_latent_attention.py wrap each in
    CheckpointWithoutOutput), per micro-batch, averaged over dense and MoE layers:
      core_attn       the flash-attention forward;
      layernorm       the two norms: read the input, write the output (HBM, sequence-parallel shard);
      moe_act         the routed experts' SwiGLU / GELU: read gate (+ up), write the activation (HBM);
      mla_up_proj     MLA's up-projections, q_lora -> heads x (nope + rope), kv_lora -> heads x (nope + v) (GEMMs);
      mlp             the dense layers' MLP forward (GEMMs); moe: the routed experts' forward (GEMMs);
      shared_experts  the shared experts' forward (GEMMs)."""
    m, pc, gpu = ctx.scn.model, ctx.pc, ctx.scn.cluster.gpu
    t, tok, hbm = pc.tp, ctx.tokens, gpu.hbm_tbps * 1e12
    moe = m.moe
    share = m.num_moe_layers() / m.num_layers if moe is not None else 0.0
    mats = 3.0 if m.mlp == "swiglu" else 2.0
    h = float(m.hidden_size)
    cost = {
        "core_attn": ctx.attn_fwd,
        "layernorm": 2.0 * 2.0 * tok * h / t * ctx.act_bytes / hbm,
        "mlp": (1.0 - share) * 2.0 * tok * mats * h * m.ffn_hidden_size / t / ctx.mm_rate,
    }
    if moe is not None:
        f_e = float(moe.expert_ffn_hidden_size)
        cost["moe_act"] = share * tok * moe.top_k * f_e * mats / t * ctx.act_bytes / hbm
        cost["moe"] = share * 2.0 * tok * moe.top_k * mats * h * f_e / t / ctx.mm_rate
        cost["shared_experts"] = share * 2.0 * tok * mats * h * moe.shared_experts * moe.shared_ffn / t / ctx.mm_rate
    if m.mla is not None:
        a, ml = float(m.num_attention_heads), m.mla
        up = (ml.q_lora_rank or 0) * a * (ml.qk_nope_head_dim + ml.qk_rope_head_dim) + ml.kv_lora_rank * a * (
            ml.qk_nope_head_dim + ml.v_head_dim)
        cost["mla_up_proj"] = 2.0 * tok * up / t / ctx.mm_rate
    out = np.zeros(len(pc))
    for name, seconds in cost.items():
        out = out + np.where(pc.recomputes_module(name), seconds, 0.0)  # type: ignore[arg-type]
    return out


def recompute_mb(ctx: StepContext) -> Array:
    """Recompute seconds per micro-batch on the slowest rank (partial recompute: recompute_layers per chunk)."""
    return recomputed_layers(ctx.pc, ctx.layers) * recompute_per_layer(ctx)


def forward_repeats(ctx: StepContext) -> Array:
    """Share of the slowest rank's layers whose forward runs twice (full recompute re-runs the forward with its
    collectives: Megatron CheckpointFunction / torch.utils.checkpoint re-execute the module, all-gathers,
    reduce-scatters and all-to-alls included)."""
    full = ctx.pc.recompute_is("full")
    return np.where(full, recomputed_layers(ctx.pc, ctx.layers) / ctx.layers, 0.0)


def tp_layer_s(ctx: StepContext) -> tuple[Array, Array]:
    """(exposed, total) seconds of one layer's TP collectives per micro-batch: 4 all-reduces of the b s h
    activation [MLM-TP] (with sequence parallelism 4 all-gathers + 4 reduce-scatters), 2 more on layers whose
    forward is recomputed (forward_repeats). Hidden only where the stack overlaps them (training.tp_overlap, with
    sequence parallelism), as its engine does: Transformer Engine's userbuffers (`_te_pipelined`) or torch's
    micro-pipelined symmetric-memory ops (`_symm_mem_exposed`), chosen by the stack record's kernels."""
    scn, pc, cal = ctx.scn, ctx.pc, ctx.cal
    link = group_link(scn.cluster, cal, pc.tp, 1.0)
    total = tp_traffic_s(ctx, link)
    if not scn.training.tp_overlap:
        return total, total
    # TE userbuffers and symmetric memory move the chunks with direct NVLink copies (CUDA IPC / copy engines),
    # not NCCL kernels: each ring step pays the link latency, not NCCL's per-step software cost
    direct = group_link(scn.cluster, cal.model_copy(update={"collective_step_us": 0.0}), pc.tp, 1.0)
    inside = direct.n <= direct.per_node
    engine = _te_pipelined if scn.training.record.kernels == "transformer_engine" else _symm_mem_exposed
    exposed = np.where(inside, engine(ctx, direct, link), total)
    return np.where(pc.sequence_parallel > 0, np.minimum(exposed, total), total), total


def fp8_gather_width(ctx: StepContext, backward: bool = False) -> Array:
    """Bytes per element of the all-gathers relative to the activation: fp8 plans gather the linears' fp8
    inputs, 1 byte of 2: forward on Transformer Engine (_Linear.forward casts before gather_along_first_dim) and
    torchao's float8 TP (torchtitan, tensorwise: Float8ColwiseParallel / PrepareFloat8ModuleInput cast before
    redistribute), and backward on torchao, whose Float8RowwiseParallel casts the output gradient
    (_NoopFwToFloat8BwDynamic) before its all-gather; else 1."""
    tr = ctx.scn.training
    torchao = tr.record.kernels != "transformer_engine" and tr.fp8_recipe_used == "tensorwise"
    cast_first = torchao or (tr.record.kernels == "transformer_engine" and not backward)
    return np.where(ctx.pc.fp8 & cast_first, 0.5, 1.0)


def mlp_tp_share(scn: Scenario) -> float:
    """Share of layers whose MLP side runs TP collectives (the attention side always does): every dense layer, and
    the MoE layers unless the stack sends their routed tokens through the dispatcher alone and they have no shared
    experts (StackRecord.moe_tp_collectives)."""
    moe = scn.model.moe
    if moe is None or moe.shared_experts > 0 or scn.training.record.moe_tp_collectives == "whole_block":
        return 1.0
    return 1.0 - moe_layer_fraction(scn)


def tp_traffic_s(ctx: StepContext, link: Link) -> Array:
    """Seconds of one layer's TP collectives per micro-batch over `link`, averaged over layers: with sequence
    parallelism forward 2 all-gathers + 2 reduce-scatters (one of each around attention, one around the MLP),
    backward 2 + 2, a recomputed forward's again [MLM-TP], all-gathers at fp8_gather_width; without it 2
    all-reduces forward and 2 backward [MLM-TP], each as NCCL runs it (comm.all_reduce_s: NVLS inside an NVSwitch
    node). The MLP's half where its layer runs them (mlp_tp_share)."""
    s = ctx.activation
    forward = 2.0 * all_gather_s(link, s * fp8_gather_width(ctx)) + 2.0 * reduce_scatter_s(link, s)
    backward = 2.0 * all_gather_s(link, s * fp8_gather_width(ctx, backward=True)) + 2.0 * reduce_scatter_s(link, s)
    sp = forward * (1.0 + forward_repeats(ctx)) + backward
    ar = 2.0 * all_reduce_s(link, s) * (2.0 + forward_repeats(ctx))
    out: Array = np.where(ctx.pc.sequence_parallel > 0, sp, ar) * (1.0 + mlp_tp_share(ctx.scn)) / 2.0
    return out


def _te_pipelined(ctx: StepContext, direct: Link, nccl: Link) -> Array:
    """[TE-UB] every TP collective pipelined with the GEMM it feeds or follows (forward and input-gradient GEMMs:
    2x the forward matmuls) in tp chunks: max(comm, gemm) + min(comm, gemm) / tp, of which the GEMM is the rest."""
    comm = tp_traffic_s(ctx, direct)
    gemm = 2.0 * ctx.layer_mm / ctx.mm_rate
    return np.maximum(0.0, comm - gemm) + np.minimum(comm, gemm) / ctx.pc.tp


def tp_gemm_shares(m: ModelSpec) -> tuple[float, float, float, float]:
    """Shares of a layer's forward matmul FLOPs of the GEMMs next to its 4 TP collectives: (all-gather -> QKV,
    out-projection -> reduce-scatter, all-gather -> MLP up (gate + up), MLP down -> reduce-scatter)."""
    h, q, kv, f = float(m.hidden_size), float(m.q_size), float(m.kv_size), float(m.ffn_hidden_size)
    up = (2.0 if m.mlp == "swiglu" else 1.0) * h * f
    parts = (h * (q + 2.0 * kv), q * h, up, f * h)
    return tuple(x / sum(parts) for x in parts)  # type: ignore[return-value]


def _symm_mem_exposed(ctx: StepContext, direct: Link, nccl: Link) -> Array:
    """[AsyncTP] torchtitan async TP: inductor's micro_pipeline_tp_pass fuses an all-gather into the matmuls that
    consume it (fused_all_gather_matmul) and a reduce-scatter into the matmul that produces it
    (fused_matmul_reduce_scatter; _find_producer_matmul accepts mm / _scaled_mm / reshape-mm-reshape only). In a
    Llama block that matches the forward's 2 all-gathers and 2 reduce-scatters (again in a recomputed forward) and
    the backward's 2 all-gathers (of the gradients entering the out- and down-projections' input-gradient GEMMs);
    the backward's 2 reduce-scatters take the sum of the q/k/v (gate/up) input gradients, an add, and stay NCCL.
    A fused op moves tp - 1 shards by copy-engine copies under the other shards' GEMMs (two streams,
    _pipelined_multi_all_gather_and_consume / _pipelined_produce_and_all2all) and leaves exposed: per step the copy
    beyond its GEMM chunk; the barriers (2 per all-gather, 2 per step of a reduce-scatter); the all-gather's copy of
    the local shard into the symmetric buffer before the first GEMM; the reduce-scatter's sum of the tp received
    chunks (HBM); and the GEMM cut into tp row chunks runs at the smaller GEMM's efficiency (calibration's
    half_efficiency_gflop)."""
    pc, cal, hbm = ctx.pc, ctx.cal, ctx.scn.cluster.gpu.hbm_tbps * 1e12
    t, s = pc.tp, ctx.activation
    step = s / t / direct.bandwidth  # one shard's copy (its latency is the barriers')
    chunk_gflop = ctx.layer_mm / t / 1e9
    whole = ctx.layer_mm / 1e9
    slower = (whole + cal.half_efficiency_gflop) / whole * chunk_gflop / (chunk_gflop + cal.half_efficiency_gflop)
    ag_fwd, rs_fwd, ag_up, rs_down = tp_gemm_shares(ctx.scn.model)
    gemm = ctx.layer_mm / ctx.mm_rate

    width = fp8_gather_width(ctx)

    def fused(share: float, gather: bool, w: Array | float = 1.0) -> Array:
        g = share * gemm
        fixed = np.where(gather, 2.0 * direct.alpha + 2.0 * w * s / t / hbm,
                         2.0 * (t - 1) * direct.alpha + (s + s / t) / hbm)
        return fixed + (t - 1) * np.maximum(0.0, w * step - g / t) + g * (1.0 / slower - 1.0)

    forward = fused(ag_fwd, True, width) + fused(rs_fwd, False) + fused(ag_up, True, width) + fused(rs_down, False)
    back = fp8_gather_width(ctx, backward=True)
    backward = fused(rs_fwd, True, back) + fused(rs_down, True, back) + 2.0 * reduce_scatter_s(nccl, s)
    return forward * (1.0 + forward_repeats(ctx)) + backward


def ep_layer_s(ctx: StepContext, layer_compute: Array) -> tuple[Array, Array]:
    """(exposed, total) seconds of one layer's expert token exchanges per micro-batch (experts.dispatch_s, averaged
    over layers by the MoE share; a recomputed forward dispatches and combines again). With the stack's EP overlap
    (training.ep_comm_overlap) [A2A-ov] experts.ep_overlap_exposed: the combined 1F1B steps' stream graph per layer
    (TransformerLayerSchedulePlan.run), the steady-state share Megatron pairs, DeepEP's SMs."""
    scn, pc = ctx.scn, ctx.pc
    total = moe_layer_fraction(scn) * dispatch_s(scn, pc, ctx.cal) * (1.0 + 0.5 * forward_repeats(ctx))
    if not scn.training.ep_overlap:
        return total, total
    exposed = ep_overlap_exposed(scn, pc, ctx.cal, total, ctx.micro, ctx.mm_rate, ctx.fwd_layer, ctx.attn_fwd,
                                 layer_compute, comm_sm_share(scn))
    return exposed, total


def layer_floor_s(ctx: StepContext, layer_compute: Array) -> Array:
    """Seconds a layer takes at least per micro-batch, whatever its GPU work: the host time to launch it
    (host.layer_host_s; a third more with full recompute, which re-issues the forward), plus, with the EP overlap,
    the host's wait at the combined steps' forward dispatch (ep_overlap.ep_overlap_host_wait)."""
    scn, pc = ctx.scn, ctx.pc
    host = layer_host_s(scn, pc, ctx.cal)
    floor = host * (1.0 + pc.recompute_is("full") / 3.0)
    if not scn.training.ep_overlap or scn.model.moe is None:
        return floor
    total = moe_layer_fraction(scn) * dispatch_s(scn, pc, ctx.cal) * (1.0 + 0.5 * forward_repeats(ctx))
    return floor + ep_overlap_host_wait(scn, pc, ctx.cal, total, ctx.micro, ctx.mm_rate, ctx.fwd_layer,
                                        ctx.attn_fwd, layer_compute, host)


# Streaming multiprocessors per GPU (NVIDIA datasheets / whitepapers: A100 108, H100 / H200 / H800 SXM 132,
# B200 148); DeepEP's dispatch / combine kernels take DEEPEP_SMS of them (deep_ep/buffer.py Buffer.num_sms = 20;
# Megatron transformer_config.py moe_deepep_num_sms, "historical default 20").
GPU_SMS: dict[str, int] = {"a100-40g": 108, "a100-80g": 108, "h100-sxm-80g": 132, "h100-96g": 132, "h200": 132,
                           "h800": 132, "b200": 148}
DEEPEP_SMS = 20


def comm_sm_share(scn: Scenario) -> float:
    """Share of the GPU's SMs the EP communication kernels hold while they overlap compute: DeepEP's SMs over the
    GPU's (0 for NCCL all-to-all, whose channel count varies, and for GPUs whose SM count is not listed)."""
    sms = GPU_SMS.get(scn.cluster.gpu.name)
    return DEEPEP_SMS / sms if scn.training.dispatcher == "deepep" and sms else 0.0


def cp_layer_s(ctx: StepContext) -> Array:
    """Context parallel per layer per micro-batch: K and V of the local chunk gathered forward, again backward, and
    their gradients reduce-scattered: 3 ring passes of cp x local KV, one more where the forward is recomputed."""
    scn, pc = ctx.scn, ctx.pc
    link = group_link(scn.cluster, ctx.cal, pc.cp, pc.tp)
    kv_local = ctx.tokens * scn.model.kv_per_token() * ctx.act_bytes
    return (3.0 + forward_repeats(ctx)) * all_gather_s(link, pc.cp * kv_local)


def pipeline_poll_s(pp: Array, tp: Array, virtual: Array, quantum: float) -> Array:
    """Host time per micro-batch a pipeline rank spends polling P2P metadata messages [NT-P2P] (0 if quantum = 0).

    Each activation or gradient send and receive is preceded by 2 metadata messages, each awaited in a poll loop
    that checks once, then sleeps `quantum` between checks. Per micro-batch and model chunk a first or last stage
    sends once and receives once: 4 messages; a middle stage (p > 2) 8. A message costs at least one quantum on the
    side that posts it last, and the side that posted first notices completion at its next check, a uniform phase
    within the quantum; the t tensor-parallel ranks of a stage wait for the latest of t phases, E[max of t
    uniforms] = t / (t + 1) quantum. Per micro-batch: messages x quantum x (1 + t / (t + 1)).
    """
    messages = np.where(pp > 2, 8.0, 4.0) * virtual
    return np.where(pp > 1, messages * quantum * (1.0 + tp / (tp + 1.0)), 0.0)


def pp_step_s(ctx: StepContext) -> Array:
    """Exposed pipeline P2P seconds per step: the boundary sends on the critical path of the schedule's action
    lists (evaluators.schedules.critical_hops: 2 (p v - 1) interleaved, 2 (p - 2) + 2 (p - 1) m / p for 1F1B's
    lock-step), each one stage output forward or one gradient backward (with sequence parallelism sharded over tp);
    hidden behind a micro-batch's compute where the stack and the schedule overlap P2P
    (evaluators.schedules.p2p_hidden); plus host polling per micro-batch [NT-P2P]."""
    scn, pc, cal = ctx.scn, ctx.pc, ctx.cal
    link = group_link(scn.cluster, cal, pc.pp, pc.tp * pc.cp * pc.dp)
    boundary = ctx.activation / sp_divisor(pc)
    send = p2p_s(link, boundary, pc.pp > 1)
    hidden = p2p_hidden(pc, scn.training.record.p2p_overlap)
    send = np.where(hidden, np.maximum(0.0, send - cal.overlap * ctx.compute_mb), send)
    polls = ctx.micro * pipeline_poll_s(pc.pp, pc.tp, pc.virtual_stages, cal.p2p_poll_s)
    return critical_hops(pc, ctx.micro) * send + polls
