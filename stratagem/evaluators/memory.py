"""Analytic per-GPU memory: four blocks (weights, gradients, optimizer, activations) + transients + overhead.

Every function works on `PlanColumns` (numpy arrays), so one code path serves `evaluate` (one plan) and
`evaluate_many` (screening millions). All sizes are bytes unless a name says otherwise.

Sources:
  [ZeRO]  Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
          sec. 3.1 (2 + 2 + K bytes/param) and sec. 5 (stage 1/2/3 divide optimizer / + grads / + params by Nd).
  [MLM]   Megatron-LM megatron/training/theoretical_memory_usage.py: 18 bytes/param, or 6 + 12/d with the
          distributed optimizer (bf16 params 2 + fp32 main grads 4 unsharded; fp32 master 4 + Adam 8 sharded).
  [DS]    DeepSpeed memory estimators (deepspeed.runtime.zero.stage_1_and_2 / stage3
          estimate_zero{2,3}_model_states_mem_needs): ZeRO-2 = 4P + 16P/d, ZeRO-3 = 18P/d + 4 * largest layer.
  [Korthikanti] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
          (arXiv 2205.05198), sec. 4 and Table 2: per-layer activations sbh(34 + 5as/h), TP/SP division,
          selective/full recompute, sec. 4.2.3 in-flight micro-batches (1F1B: p; interleaved x(1 + (p-1)/(pv))).
  [NT]    huggingface/nanotron (src/nanotron): optim/gradient_accumulator.py FP32GradientAccumulator (fp32 grad
          buffers for every parameter, fp32 master copies of this rank's ZeRO-1 shard only), helpers.py
          (ZeroDistributedOptimizer around the accumulator; DDP bf16 grad buckets when dp > 1),
          models/base.py build_model (pipeline blocks assigned by cumulative compute cost), models/llama.py
          (MHA packs q/k/v into one [3, b, s, a, d] copy that q's view keeps alive), parallel/tensor_parallel
          (tp_recompute_allgather: column linears save the sharded input, one reused all-gather buffer).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators import memory_engine as eng
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.experts import expert_data_parallel
from stratagem.evaluators.memory_activations import layer_bytes, layer_elements
from stratagem.evaluators.memory_copies import fp8_weight_cache_bytes, optimizer_step_bytes
from stratagem.evaluators.memory_pipeline import cost_split_layers, pipeline_layers, stage_layers
from stratagem.evaluators.stages import stage_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import OPTIMIZER, STACKS, StateTerm, stack_record
from stratagem.units import GIB

__all__ = [
    "GIB",
    "DEEPSPEED_ZERO3_LAYER_BYTES",
    "StateTerm",
    "STACK_STATES",
    "FP32_STATES",
    "ZERO_PAPER_STATES",
    "optimizer_state_bytes",
    "training_optimizer_bytes",
    "model_state_bytes",
    "korthikanti_layer_bytes",
    "op_layer_elements",
    "recomputed_layers",
    "stage_layers",
    "cost_split_layers",
    "pipeline_layers",
    "rank_memory_columns",
    "memory_columns",
]

Array = NDArray[np.float64]
# [DS] estimate_zero3_model_states_mem_needs: 4 bytes x the largest layer's parameters stay gathered on the GPU.
DEEPSPEED_ZERO3_LAYER_BYTES = 4.0


# ---- model states ----------------------------------------------------------------------------------------
# The per-stack conventions live in the stack records (spaces/stacks.py); these names stay for callers.
STACK_STATES: dict[str, tuple[StateTerm, ...]] = {name: r.states for name, r in STACKS.items()}
FP32_STATES: tuple[StateTerm, ...] = STACKS["megatron"].fp32_states
TORCH_FP32_STATES: tuple[StateTerm, ...] = STACKS["torch"].fp32_states
# [ZeRO] sec. 3.1 as published: fp16 params 2 + fp16 grads 2 + K = 12 (fp32 params, momentum, variance).
ZERO_PAPER_STATES: tuple[StateTerm, ...] = (
    StateTerm("weights", 2, 3),
    StateTerm("gradients", 2, 2),
    StateTerm("optimizer", 12, 1),
)


def optimizer_state_bytes(optimizer: str, hidden: int, ffn: int) -> float:
    """Optimizer state bytes per parameter (fp32 states unless stated).

    adamw: momentum + variance = 8 [ZeRO sec. 3.1]; sgd: momentum = 4; adafactor (Shazeer & Stern 2018,
    sec. 3, no momentum): row + column second-moment factors, 4(r + c)/(rc) ~ 4(1/h + 1/f) per parameter of
    an h x f matrix; adamw8bit (Dettmers et al. 2022): two 8-bit states + one fp32 absmax per 2048-block.
    """
    return {
        "adamw": 8.0,
        "sgd": 4.0,
        "adafactor": 4.0 * (1.0 / hidden + 1.0 / ffn),
        "adamw8bit": 2.0 + 2 * 4.0 / 2048,
    }[optimizer]


def training_optimizer_bytes(scn: Scenario) -> float:
    """Optimizer state bytes per parameter for the scenario: `optimizer_state_bytes`, halved for 16-bit states
    (training.optimizer_state_dtype bf16: Megatron --exp-avg-dtype/--exp-avg-sq-dtype bf16); adamw8bit's states are
    already 8-bit."""
    m, tr = scn.model, scn.training
    opt = optimizer_state_bytes(tr.optimizer, m.hidden_size, m.ffn_hidden_size)
    if tr.optimizer_state_dtype == "bf16" and tr.optimizer != "adamw8bit":
        opt /= 2.0
    return opt


def model_state_bytes(
    terms: tuple[StateTerm, ...], params: Array | float, zero_stage: Array | float, shard: Array | float,
    opt_bytes: float, offload: Array | float = 0.0, dp: Array | float = 2.0, grad_bytes: float | None = None,
    host_shards: Array | float = 0.0,
) -> dict[str, Array]:
    """Bytes per block for `params` parameters: each term's bytes, divided by `shard` once its stage is on.

    [ZeRO] sec. 5: stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters.
    Offload moves the optimizer block to host memory (ZeRO-Offload, Ren et al. 2021). `dp` (data-parallel
    degree) only decides whether terms that need data parallelism exist. `grad_bytes` (training.grad_dtype)
    replaces the width of the terms marked `grad` (None: the stack's default width). `host_shards` (0/1) also
    moves the sharded weights and gradients to the host (FSDP2's CPUOffloadPolicy: torch/distributed/fsdp/
    _fully_shard/_fsdp_api.py keeps the sharded parameters and their gradients on CPU).
    """
    z = np.asarray(zero_stage, dtype=np.float64)
    out: dict[str, Array] = {b: np.zeros_like(z) for b in ("weights", "gradients", "optimizer")}
    for t in terms:
        per = opt_bytes if t.bytes_per_param == OPTIMIZER else t.bytes_per_param
        if t.grad and grad_bytes is not None:
            per = grad_bytes
        exists = (z <= t.exists_until) & (z >= t.exists_from) & ((np.asarray(dp) > 1) | (not t.needs_dp))
        divisor = np.where(z >= t.sharded_from, shard, 1.0)
        value = np.where(exists, per * np.asarray(params) / divisor, 0.0)
        if t.block == "optimizer":
            value = value * (1.0 - np.asarray(offload))
        elif t.sharded_from <= 3:  # a sharded weight / gradient buffer
            value = np.where(z >= t.sharded_from, value * (1.0 - np.asarray(host_shards)), value)
        out[t.block] = out[t.block] + value
    return out


# ---- activations -------------------------------------------------------------------------------------------
def korthikanti_layer_bytes(
    s: float, b: float, h: float, a: float, t: float = 1, sp: bool = False, recompute: str = "none",
) -> float:
    """Per-layer activation bytes of Korthikanti et al. 2022's GPT layer (fp16, dropout, unfused attention).

    Table 2: no parallelism sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h);
    selective drops the 5as/h attention terms; full recompute keeps the layer input, 2sbh (/t with SP).
    Kept as the published reference that `_layer_elements` re-derives for SwiGLU/RMSNorm/fused attention.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn_scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + attn_scores)
    return s * b * h * (10 + 24 / t + attn_scores / t)


def _layer_elements(scn: Scenario, pc: PlanColumns, s: Array, b: Array) -> tuple[Array, Array, Array]:
    """Saved elements per layer per micro-batch: (no recompute, selective or module recompute, full), re-derived
    for this model tensor by tensor in evaluators/memory_activations.py (`saved_tensors`): Llama-style layer with
    fused (flash/SDPA) attention, no dropout; MoE routed copies with the expert size; nanotron's packed MHA QKV
    [NT]; Megatron's fused SwiGLU; full recompute keeps only the layer input [Korthikanti Table 2]."""
    return layer_elements(scn, pc, s, b)


def op_layer_elements(scn: Scenario, pc: PlanColumns, s: Array, b: Array) -> Array:
    """Saved elements per layer per micro-batch under torchtitan's op-level selective recompute (what the
    harness's policy saves: stratagem.launch.harness.parallelize `op_sac_context`, after torchtitan
    torchtitan/distributed/activation_checkpoint.py `_save_list`: every mm output but every second one, the
    attention output, reduce-scatter outputs).

    The layer's matmuls run wq, wk, wv, wo, then w1, w3, w2 (SwiGLU) or fc1, fc2 (GELU); the odd ones are
    kept: wq sb*qd/t, wv sb*kvd/t, w1 (fc1) sbf/t and, SwiGLU only, w2's row-parallel partial sum, full sbh on
    every TP rank; the attention output sb*qd/t; with SP the two reduce-scatter outputs 2sbh/t; plus the
    layer input kept as under full recompute (sbh, / t with SP). MoE: the MLP terms for top_k routed copies
    (the router's own matmul, which shifts the parity, is not modelled).
    """
    m = scn.model
    t, sp = pc.tp, pc.sequence_parallel
    sbh = s * b * m.hidden_size
    ffn = float(m.moe.expert_ffn_hidden_size if m.moe else m.ffn_hidden_size)
    copies = float(m.moe.top_k if m.moe else 1)
    attention = s * b * (2 * m.q_size + m.kv_size) / t
    mlp = copies * (s * b * ffn / t + (sbh if m.mlp == "swiglu" else 0.0))
    scattered = np.where(sp > 0, 2 * sbh / t, 0.0)
    return sbh / np.where(sp > 0, t, 1.0) + attention + mlp + scattered


def recomputed_layers(pc: PlanColumns, layers: Array) -> Array:
    """Layers of a stage that recompute: all, or `recompute_layers` per model chunk (partial recompute:
    Megatron's --recompute-method block --recompute-num-layers N; the harness's `recomputed_layers`)."""
    chunk = layers / pc.virtual_stages
    partial = np.minimum(pc.recompute_layers, chunk) * pc.virtual_stages
    return np.where(pc.recompute_layers > 0, partial, layers)


def _in_flight(pc: PlanColumns, m: Array, last: bool) -> Array:
    """Micro-batches whose activations a stage holds at its peak [Korthikanti sec. 4.2.3].

    No PP: 1. GPipe: all m. 1F1B / ZB-H1 (Qi et al. 2023: same peak as 1F1B): stage 0 holds min(p, m), the
    last stage 1. Interleaved: stage 0 holds p(1 + (p-1)/(pv)) micro-batches' worth of its layers.
    """
    p, v, sched = pc.pp, pc.virtual_stages, pc.pp_schedule
    if last:
        steady = np.where(sched == 2, np.minimum(m, 1 + (p - 1) / v), 1.0)
    else:
        steady = np.where(sched == 2, np.minimum(m, p + (p - 1) / v), np.minimum(p, m))
    held = np.where(sched == 0, m, steady)
    return np.where(p > 1, held, 1.0)


# ---- the whole rank ----------------------------------------------------------------------------------------
def _router_params(m: ModelSpec) -> float:
    """Parameters of one MoE layer's router: the gate [E, h] and its bias (0 for a dense model)."""
    if m.moe is None:
        return 0.0
    return float(m.hidden_size * m.moe.num_experts + (m.moe.num_experts if m.moe.router_bias else 0))


def _first_moe_layer(m: ModelSpec) -> int:
    """Index of the first MoE layer (every MoE layer has the same routed parameters)."""
    return next(i for i in range(m.num_layers) if m.is_moe_layer(i))


def _stage_params(scn: Scenario, pc: PlanColumns, layers: Array, last: bool) -> tuple[Array, Array, Array, Array]:
    """(dense params, expert params, largest FSDP unit, one layer's linear weights) held by one rank of the
    first or last stage."""
    m = scn.model
    t, p, ep = pc.tp, pc.pp, pc.ep
    norms = 2 * m.norm_params()  # replicated across TP
    # per-layer means over the layers this stage really holds (evaluators/stages.py: DeepSeek's dense layers sit
    # on the first stage); routed experts split over ep x etp (evaluators/experts.py, Megatron MoE folding)
    st = stage_columns(m, pc)
    n_st = np.maximum(st.last_layers if last else st.first_layers, 1.0)
    # the router [E, h] (+ bias) is whole on every TP rank (torchtitan apply_moe_ep_tp: router NoParallel;
    # Megatron TopKRouter is not TP-split): per-layer mean of the routers of this stage's MoE layers
    routed = st.last_expert if last else st.first_expert
    router = _router_params(m)
    routers = 0.0 if m.moe is None else routed / max(1.0, float(m.layer_params(_first_moe_layer(m))[1])) * router
    layer_dense = (((st.last_dense if last else st.first_dense) - routers) / n_st - norms) / t + norms + routers / n_st
    layer_expert = (st.last_expert if last else st.first_expert) / n_st / (ep * pc.etp)
    emb = m.embedding_params() / t
    head = (m.head_params() - m.norm_params()) / t + m.norm_params()  # the final norm is replicated by TP
    tied_copy = m.vocab_size * m.hidden_size / t if m.tied_embeddings else 0.0
    if last:  # last stage: layers + final norm + output projection (a tied copy when pp > 1)
        extra = head + np.where(p > 1, tied_copy, emb)
    else:  # first stage: embedding (+ the head when there is one stage)
        extra = emb + np.where(p > 1, 0.0, head)
    dense = layers * layer_dense + extra
    expert = layers * layer_expert
    largest = np.maximum((m.dense_layer_params() - norms) / t + norms,
                         (m.moe_layer_dense_params() - norms - router) / t + norms + router
                         + m.layer_params(m.num_layers - 1)[1] / (ep * pc.etp))
    unit = np.maximum(largest, np.maximum(emb, head + tied_copy))
    return dense, expert, unit, layer_dense - norms + layer_expert


def _moe_share(scn: Scenario, pc: PlanColumns, last: bool) -> Array:
    """Share of the stage's layers that are MoE layers (evaluators/stages.py: DeepSeek's first_dense_layers sit on
    the first stage): routed parameters on the stage / one MoE layer's, over its layers (1 for a dense model's
    bookkeeping: its layers use the dense MLP anyway)."""
    m = scn.model
    if m.moe is None:
        return np.ones(len(pc))
    st = stage_columns(m, pc)
    n_st = np.maximum(st.last_layers if last else st.first_layers, 1.0)
    per_layer = max(1.0, float(m.layer_params(_first_moe_layer(m))[1]))
    return np.minimum(1.0, (st.last_expert if last else st.first_expert) / per_layer / n_st)


def memory_columns(scn: Scenario, pc: PlanColumns, cal: Calibration) -> dict[str, Array]:
    """Bytes per block for the worst rank of every plan, plus `peak`, `hbm` and `worst_stage`."""
    first = rank_memory_columns(scn, pc, cal, "first")
    last = rank_memory_columns(scn, pc, cal, "last")
    use_last = last["peak"] > first["peak"]
    out = {k: np.where(use_last, last[k], first[k]) for k in first}
    out["worst_stage"] = np.where(use_last, pc.pp - 1, 0.0)
    out["hbm"] = np.full(len(pc), scn.cluster.gpu.hbm_gib * GIB)
    return out


def rank_memory_columns(
    scn: Scenario, pc: PlanColumns, cal: Calibration, stage: Literal["first", "last"],
) -> dict[str, Array]:
    """Bytes per block (weights, gradients, optimizer, activations, transient, overhead) and `peak` for one
    rank of the first or the last pipeline stage (the same rank when pp = 1)."""
    m, tr = scn.model, scn.training
    last = stage == "last"
    fp32 = pc.precision == 0
    first_layers, last_layers = pipeline_layers(scn, pc)
    layers = last_layers if last else first_layers
    dense, expert, unit, layer_lin = _stage_params(scn, pc, layers, last)
    shard = pc.dp * pc.cp / pc.dp_replicate  # ZeRO/FSDP shard group (torchtitan: dp_shard x cp)
    expert_shard = np.maximum(1.0, expert_data_parallel(pc) / pc.dp_replicate)  # edp = tp*dp*cp / (ep*etp)
    opt = training_optimizer_bytes(scn)

    masters = eng.fp32_masters(scn)  # torch's DDP / FSDP2: the engine terms of evaluators/memory_engine.py
    host: Array | float = ((pc.optimizer_offload > 0) & eng.uses_fsdp(pc)).astype(np.float64) if masters else 0.0

    def states(terms: tuple[StateTerm, ...], grad_bytes: float | None) -> dict[str, Array]:
        d = model_state_bytes(terms, dense, pc.zero_stage, shard, opt, pc.optimizer_offload, pc.dp, grad_bytes,
                              host)
        e = model_state_bytes(terms, expert, pc.zero_stage, expert_shard, opt, pc.optimizer_offload, pc.dp,
                              grad_bytes, host)
        return {k: d[k] + e[k] for k in d}

    rec = stack_record(tr.stack)
    m_steps = tr.global_batch_size / (pc.dp * pc.micro_batch_size)
    redone = recomputed_layers(pc, layers)  # partial recompute: the other layers keep everything
    copies = tuple(t for t in rec.states if t.block == "weights" and t.sharded_from > 3)  # held compute copies
    mixed = states(tuple(t for t in rec.states if not (masters and t in copies)), tr.grad_bytes)
    full32 = states(rec.fp32_states, None)
    blocks = {k: np.where(fp32, full32[k], mixed[k]) for k in mixed}
    if masters:
        # bf16 compute copies kept for backward: FSDP2 zero 2 keeps the unsharded units (reshard_after_forward=
        # False), autocast the casts backward saved (memory_engine.autocast_copy_params); zero 3 gathers per unit
        has_head = last | (pc.pp == 1)  # the output projection (the tied copy with pp > 1) is cast, not the embedding
        head_w = np.where(has_head, m.vocab_size * m.hidden_size / pc.tp, 0.0)
        cast = eng.autocast_copy_params(scn, pc, layers, redone, layer_lin, 0.0)
        # autocast's cache holds every cast until each micro-batch's forward leaves its autocast region
        # (torch/amp/autocast_mode.py __exit__: clear_autocast_cache): each in-flight micro-batch keeps its own saved
        # layer casts, and the one in forward all the stage's casts at its end (the head's: the last chunk's one).
        # Only leaf weights are cached (aten/src/ATen/autocast_mode.cpp cached_cast: is_leaf): DDP with TP holds
        # local shards and makes DTensor views of them per forward (harness hold_tp_params_local), never cached
        cached = (pc.tp == 1) | (pc.dp == 1)  # one chunk's forward is one autocast region (harness model.forward)
        every = np.where(cached, eng.autocast_copy_params(scn, pc, layers, 0.0 * redone, layer_lin, 0.0), 0.0)
        every = every / pc.virtual_stages
        held_casts = cast * (_in_flight(pc, m_steps, last) - 1) + np.maximum(cast, every) + head_w
        copy = np.where(eng.uses_autocast(scn, pc), held_casts,
                        np.where(eng.uses_fsdp(pc) & (pc.zero_stage == 2), dense + expert, 0.0))
        blocks["weights"] = blocks["weights"] + np.where(fp32, 0.0, 2.0 * copy)
        # DDP + gradient accumulation: the accumulated .grad tensors beside the buckets (param dtype, fp32)
        blocks["gradients"] = blocks["gradients"] + np.where(eng.ddp_accumulates(pc, m_steps),
                                                             4.0 * (dense + expert), 0.0)
        # without data parallelism the TP embedding's gradient stays the whole [V, h] Partial DTensor that its
        # backward makes (no row-sharded strategy: tensor/_ops/_embedding_ops.py embedding_dense_backward_strategy)
        whole_emb = (pc.dp == 1) & (pc.tp > 1) & ((not last) | (pc.pp == 1))
        blocks["gradients"] = blocks["gradients"] + np.where(
            whole_emb, (1.0 - 1.0 / pc.tp) * m.vocab_size * m.hidden_size * 4.0, 0.0)
        # ZeroRedundancyOptimizer: whole parameters, greedily: the fullest rank's share, not 1/shard
        frac = eng.zero1_worst_fraction(scn, pc, layers, not last, last)
        z1 = (pc.zero_stage == 1) & (pc.dp > 1)
        blocks["optimizer"] = np.where(z1, opt * (dense + expert) * frac * (1.0 - pc.optimizer_offload),
                                       blocks["optimizer"])
    # ZeRO-3 with PP on a stack that keeps parameters gathered (torchtitan parallelize_llama: reshard_after_forward
    # = not pp_enabled): the stage's unsharded parameters (compute dtype) stay through the step, and with gradient
    # sync on the last micro-batch only, FSDP2 accumulates unsharded gradients in the reduce dtype between
    # micro-batches (torch/distributed/fsdp/_fully_shard/_fsdp_param.py to_accumulated_grad_if_needed).
    if not rec.reshard_after_forward_with_pp:
        kept = (pc.zero_stage == 3) & (pc.pp > 1) & (pc.dp * pc.cp > 1)
        held = dense + expert
        blocks["weights"] = blocks["weights"] + np.where(kept, held * np.where(fp32, 4.0, 2.0), 0.0)
        reduce_b = np.where(fp32, 4.0, tr.grad_reduce_bytes)
        accumulated = np.where(kept & (m_steps > 1), held * reduce_b, 0.0)
        if masters:
            # torch pipelining runs every backward without gradient sync (stage.py backward_maybe_with_nosync:
            # set_requires_gradient_sync(False)) and reduce-scatters once after the last (perform_reduce_grad):
            # FSDP2 (zero 2 or 3) holds the stage's unsharded gradients in the reduce dtype until then, and the
            # sharded ones only after them (_fsdp_param_group.py post_backward): one or the other
            synced_late = eng.uses_fsdp(pc) & (pc.pp > 1)
            accumulated = np.where(synced_late, held * reduce_b, 0.0)
            blocks["gradients"] = np.maximum(blocks["gradients"], accumulated)
        else:
            blocks["gradients"] = blocks["gradients"] + accumulated

    # Activations: elements per layer x layers of this stage x in-flight micro-batches x bytes per element.
    act_bytes = np.where(fp32, 4.0, 2.0)
    s = tr.seq_len / pc.cp
    b = pc.micro_batch_size
    # bytes per layer: fp8 plans on Transformer Engine keep linear inputs in fp8 (memory_activations.layer_bytes);
    # an MoE model's stage mixes MoE layers and dense-MLP layers (DeepSeek's first three): the stage's mean layer
    share = _moe_share(scn, pc, last)
    moe_layer = layer_bytes(scn, pc, s, b, act_bytes)
    dense_layer = layer_bytes(scn, pc, s, b, act_bytes, dense_mlp=True) if m.moe is not None else moe_layer
    none, selective, full = (share * a + (1.0 - share) * d for a, d in zip(moe_layer, dense_layer, strict=True))
    per_layer = np.select([pc.recompute_is("none"), pc.recompute_is("selective"), pc.recompute_is("op")],
                          [none, selective, op_layer_elements(scn, pc, s, b) * act_bytes], full)
    in_flight = _in_flight(pc, m_steps, last)
    per_mb = per_layer * redone + none * (layers - redone)
    sp_div = np.where(pc.sequence_parallel > 0, pc.tp, 1.0)
    sbh = s * b * m.hidden_size
    # The last stage (or the only one) also holds the final norm input and LM-head input (sbh each) and
    # the logits at the loss (vocab-parallel: / t).
    head_acts = 2 * sbh / sp_div * act_bytes
    logits = s * b * m.vocab_size / pc.tp * cal.logits_bytes
    p2p = np.where(pc.pp > 1, 2 * 2 * sbh / sp_div * act_bytes, 0.0)
    logits_el = s * b * m.vocab_size / pc.tp
    if masters:
        per_mb = per_mb + eng.engine_layer_bytes(scn, pc, s, b, layers, redone)
        ac = eng.uses_autocast(scn, pc)
        gathered = np.where(pc.sequence_parallel > 0, sbh, sbh / sp_div)  # LM-head input (SP all-gathers it)
        head_acts = sbh / sp_div * np.where(ac, 4.0, act_bytes) + gathered * act_bytes
        # harness parallelize.uses_loss_parallel: vocabulary-parallel logits only without PP (pipelining's stages
        # return plain tensors); under GPipe the last stage keeps every micro-batch's logits (stage output) and
        # fp32 log-softmax output until its backward (torch/distributed/pipelining/stage.py fwd_cache)
        v_split = np.where(pc.pp == 1, pc.tp, 1.0)
        logits_el = s * b * m.vocab_size / v_split
        gpipe_m = np.where((pc.pp > 1) & (pc.pp_schedule == 0), m_steps, 1.0)  # 1F1B: each loss's backward next
        logits = logits_el * (cal.logits_bytes + (gpipe_m - 1) * (act_bytes + 4.0))
        # [PIPE] receive buffers: the stage input [b, s(/t), h] in the residual dtype (fp32 unless FSDP2's bf16)
        io_bytes = np.where(eng.uses_fsdp(pc) & ~fp32, 2.0, 4.0)
        per_rank = eng.pipeline_recv_buffers(pc, m_steps, not last, last) * sbh / sp_div * io_bytes
        # a non-last stage also keeps each in-flight micro-batch's output until its backward (fwd_cache)
        per_rank = per_rank + np.where((pc.pp > 1) & (not last), in_flight * sbh / sp_div * io_bytes, 0.0)
        p2p = np.zeros_like(p2p)
    activations = per_mb * in_flight + np.where(last | (pc.pp == 1), head_acts + logits, 0.0)
    if masters:
        activations = activations + per_rank
        # The gradients made in backward (all but DDP's buckets) appear as the first backward frees its micro-batch:
        # with one micro-batch, GPipe (every forward before the first backward) or 1F1B's first stage with m = pp (no
        # forward after its first backward: torch/distributed/pipelining/schedules.py Schedule1F1B warmup), they
        # coexist with m - 1 micro-batches' activations only: peak m A + max(0, G - A) (else A + G)
        buckets = np.where((pc.dp > 1) & (pc.zero_stage <= 1), 4.0 * (dense + expert), 0.0)
        dynamic = np.maximum(blocks["gradients"] - buckets, 0.0)
        filled = (pc.pp_schedule == 1) & (m_steps <= pc.pp) & (not last)
        overlap = (((pc.pp_schedule == 0) | filled) & (pc.pp > 1)) | (m_steps <= 1)
        blocks["gradients"] = blocks["gradients"] - np.where(overlap, np.minimum(dynamic, per_mb), 0.0)
        # interleaved 1F1B whose warmup, (v - 1) p + 2 (p - 1 - rank) forwards (schedules.py
        # ScheduleInterleaved1F1B), covers all v m of them: backwards then run chunk by chunk in rounds of p, the
        # last chunk's first; its gradients (G/v) appear as A/v is freed, all of them once p A/v is
        v, p = pc.virtual_stages, pc.pp
        warm = (v - 1) * p + 2 * (p - 1 - np.where(last, p - 1, 0.0))
        filled_v = (pc.pp_schedule == 2) & (p > 1) & (warm >= v * m_steps)
        extra = np.maximum(0.0, np.maximum(dynamic / v - per_mb / v, dynamic - p * per_mb / v))
        blocks["gradients"] = blocks["gradients"] - np.where(filled_v, dynamic - extra, 0.0)

    # Transients: backward working set = one layer's activations re-materialised (full recompute) or the
    # gradient of one layer's largest activations; FSDP gathers (current + prefetched unit, compute dtype)
    # and one unit's unsharded gradients for reduce-scatter [FSDP2 design, torch docs]; DeepSpeed ZeRO-3
    # holds 4 B x largest layer [DS]; with sequence parallelism one reused buffer holds the all-gathered
    # layer input, s b h (Megatron's global memory buffer, nanotron's MemoryBuffer [NT]).
    compute_bytes = np.where(fp32, 4.0, 2.0)
    rematerialised = pc.recompute_is("full") | pc.recompute_is("op")  # the whole layer is re-run in backward
    working = np.where(rematerialised, none, per_layer)
    gather = np.where(pc.zero_stage == 3, 2 * unit * compute_bytes, 0.0)
    if not rec.reshard_after_forward_with_pp:  # units kept gathered through the step (weights block above)
        gather = np.where((pc.pp > 1) & (pc.dp * pc.cp > 1), 0.0, gather)
    if masters and not last:
        # DTensor has no row-sharded strategy for the embedding's backward (torch/distributed/tensor/_ops/
        # _embedding_ops.py embedding_dense_backward_strategy): under TP it makes the whole [V, h] gradient (param
        # dtype) before reduce-scattering it; with pp > 1 other micro-batches' activations are still held then
        emb_grad = m.vocab_size * m.hidden_size * np.where(eng.uses_fsdp(pc) & ~fp32, 2.0, 4.0)
        working = np.where((pc.tp > 1) & (pc.pp > 1), np.maximum(working, emb_grad), working)
    # the unsharded unit's gradient is in the parameter dtype: fp32 params without a master copy, else bf16
    grad_bytes = np.where(fp32, 4.0, 2.0 if rec.master_weights else 4.0)
    scatter = np.where(pc.zero_stage >= 2, unit * grad_bytes, 0.0)
    if rec.zero3_gather == "largest_layer":
        gather = np.where(pc.zero_stage == 3, DEEPSPEED_ZERO3_LAYER_BYTES * unit, 0.0)
        scatter = np.zeros_like(gather)
    sp_gather = np.where(pc.sequence_parallel > 0, s * b * m.hidden_size * act_bytes, 0.0)
    transient = working + gather + scatter + p2p + sp_gather
    if masters:  # the loss's buffers are freed once the LM head's backward is done, before the layers' backward
        loss_peak = np.where(last | (pc.pp == 1), logits_el * cal.logits_bytes, 0.0)
        transient = np.maximum(transient - loss_peak, 0.0)

    # engine copies: the fp8 weight copies Transformer Engine caches across micro-batches (memory_copies.py)
    blocks["weights"] = blocks["weights"] + fp8_weight_cache_bytes(scn, pc, layers * layer_lin)
    # the optimizer step runs once activations are freed: its transient (foreach AdamW's exp_avg_sq_sqrt) peaks
    # over the states alone; the moments are the optimizer block less the master copies
    master = sum(t.bytes_per_param for t in rec.states if t.master)
    moments = np.where(fp32, blocks["optimizer"], blocks["optimizer"] * opt / (opt + master))
    largest = m.vocab_size * m.hidden_size / pc.tp / np.where(pc.zero_stage >= 3, shard, 1.0)
    step = optimizer_step_bytes(scn, pc, moments, largest)
    transient = np.maximum(transient, step - activations)
    allocated = blocks["weights"] + blocks["gradients"] + blocks["optimizer"] + activations + transient
    overhead = cal.fragmentation * allocated + cal.context_gib * GIB
    return {
        "weights": blocks["weights"],
        "gradients": blocks["gradients"],
        "optimizer": blocks["optimizer"],
        "activations": activations,
        "transient": transient,
        "overhead": overhead,
        "peak": allocated + overhead,
    }
