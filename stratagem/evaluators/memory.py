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

from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators import memory_engine as eng
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.memory_activations import layer_bytes, layer_elements
from stratagem.evaluators.memory_copies import fp8_weight_cache_bytes, optimizer_step_bytes
from stratagem.evaluators.memory_pipeline import in_flight, pipeline_layers
from stratagem.evaluators.memory_rank import Rank
from stratagem.evaluators.stages import stage_columns, trained_scenario
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import expert_shard_group, kept_gathered_with_pp, micro_batches, shard_group
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import OPTIMIZER, STACKS, StateTerm, stack_record
from stratagem.units import GIB

__all__ = [
    "overhead_bytes",
    "DEEPSPEED_ZERO3_LAYER_BYTES",
    "STACK_STATES",
    "ZERO_PAPER_STATES",
    "optimizer_state_bytes",
    "training_optimizer_bytes",
    "model_state_bytes",
    "korthikanti_layer_bytes",
    "op_layer_elements",
    "recomputed_layers",
    "rank_memory_columns",
    "memory_columns",
]

Array = NDArray[np.float64]
Mask = NDArray[np.bool_]
# [DS] estimate_zero3_model_states_mem_needs: 4 bytes x the largest layer's parameters stay gathered on the GPU.
DEEPSPEED_ZERO3_LAYER_BYTES = 4.0


# ---- model states ----------------------------------------------------------------------------------------
# The per-stack conventions live in the stack records (spaces/stacks.py); these names stay for callers.
STACK_STATES: dict[str, tuple[StateTerm, ...]] = {name: r.states for name, r in STACKS.items()}
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
    # a copy of the embedding on the last stage when pp > 1: tied to the head, or for the multi-token-prediction
    # modules there (megatron/core/models/gpt/gpt_model.py: the embedding is built when pre_process or mtp_process)
    tied_copy = m.vocab_size * m.hidden_size / t if m.tied_embeddings or m.mtp_layers else 0.0
    if last:  # last stage: layers (+ MTP modules) + final norm + output projection (+ that embedding copy)
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
    rank of the first or the last pipeline stage (the same rank when pp = 1): the model states of the stack
    record, the engine's own copies, the activations, the transients, the optimizer step, each a term below; each
    block times its multiplier when the calibration carries memory multipliers (peak: their sum)."""
    r = _rank(trained_scenario(scn), pc, cal, stage == "last")
    engine = ENGINES[r.rec.master_weights]
    states = _states(r, engine)
    blocks = _kept_gathered(r, engine, engine.copies(r, states))
    # the engine's compute copies (autocast's casts, FSDP2's unsharded units, kept through the step under PP) are
    # freed after backward (torch pipelining's perform_reduce_grad reshards them before the optimizer step)
    copies = blocks["weights"] - states["weights"]
    per_mb, none, per_layer = _layer_activations(r, engine)
    held_head, held_io, p2p, loss_freed = engine.stage_io(r)
    activations = per_mb * r.in_flight + held_head + held_io
    blocks["gradients"] = engine.freed_gradients(r, blocks["gradients"], per_mb)
    transient = np.maximum(_backward_transient(r, engine, none, per_layer) + p2p - loss_freed, 0.0)
    # the optimizer step peaks over the states at rest: no activations, no compute copies
    transient = np.maximum(transient, _optimizer_step(r, blocks) - activations - copies)
    allocated = blocks["weights"] + blocks["gradients"] + blocks["optimizer"] + activations + transient
    overhead = overhead_bytes(allocated, cal)
    out = {**blocks, "activations": activations, "transient": transient, "overhead": overhead,
           "peak": allocated + overhead}
    if cal.memory_multipliers is None:  # the formulas exactly
        return out
    # each block times its multiplier (the overhead block's from the allocated bytes before); peak = their sum
    f = cal.memory_multipliers.factors()
    out = {k: v * f.get(k, 1.0) for k, v in out.items()}
    out["peak"] = sum((out[b] for b in BLOCKS), np.zeros(len(pc)))
    return out


def overhead_bytes(allocated: Array, cal: Calibration) -> Array:
    """The overhead block: the allocator's fragmentation of the allocated bytes (the other blocks' sum, in BLOCKS
    order) plus the per-rank CUDA/NCCL context (Calibration.fragmentation, context_gib)."""
    out: Array = cal.fragmentation * allocated + cal.context_gib * GIB
    return out


# ---- the terms of one rank -----------------------------------------------------------------------------------
def _rank(scn: Scenario, pc: PlanColumns, cal: Calibration, last: bool) -> Rank:
    """The quantities the terms share (memory_rank.Rank)."""
    tr = scn.training
    first_layers, last_layers = pipeline_layers(scn, pc)
    layers = last_layers if last else first_layers
    dense, expert, unit, layer_linear = _stage_params(scn, pc, layers, last)
    microbatches = micro_batches(pc, tr.global_batch_size)
    return Rank(
        scn=scn, pc=pc, cal=cal, rec=stack_record(tr.stack), last=last, fp32=pc.fp32, layers=layers,
        redone=recomputed_layers(pc, layers),  # partial recompute: the other layers keep everything
        dense=dense, expert=expert, unit=unit, layer_linear=layer_linear,
        shard=shard_group(pc),  # ZeRO/FSDP shard group (torchtitan: dp_shard x cp)
        expert_shard=expert_shard_group(pc),
        opt_bytes=training_optimizer_bytes(scn), microbatches=microbatches,
        in_flight=in_flight(pc, microbatches, last), act_bytes=np.where(pc.fp32, 4.0, 2.0),
        s=tr.seq_len / pc.cp + np.zeros(len(pc)), b=pc.micro_batch_size,
    )


def _states(r: Rank, engine: EngineTerms) -> dict[str, Array]:
    """Weights, gradients and optimizer states from the stack record's terms (fp32 or mixed precision), dense
    parameters sharded over the dense shard group and experts over theirs [ZeRO, MLM, DS, NT]. An engine that
    makes its own compute copies (torch) leaves out the record's copy terms (StateTerm sharded_from > 3)."""
    pc, tr = r.pc, r.scn.training
    host = engine.host_shards(r)

    def states(terms: tuple[StateTerm, ...], grad_bytes: float | None) -> dict[str, Array]:
        d = model_state_bytes(terms, r.dense, pc.zero_stage, r.shard, r.opt_bytes, pc.optimizer_offload, pc.dp,
                              grad_bytes, host)
        e = model_state_bytes(terms, r.expert, pc.zero_stage, r.expert_shard, r.opt_bytes, pc.optimizer_offload,
                              pc.dp, grad_bytes, host)
        return {k: d[k] + e[k] for k in d}

    terms = r.rec.states_for(tr.optimizer_state_dtype)
    copies = tuple(t for t in terms if t.block == "weights" and t.sharded_from > 3)  # held compute copies
    mixed = states(tuple(t for t in terms if not (engine.own_copies and t in copies)), tr.grad_bytes)
    full32 = states(r.rec.fp32_states, None)
    blocks = {k: np.where(r.fp32, full32[k], mixed[k]) for k in mixed}
    # engine copies: the fp8 weight copies Transformer Engine caches across micro-batches (memory_copies.py)
    blocks["weights"] = blocks["weights"] + fp8_weight_cache_bytes(r.scn, pc, r.layers * r.layer_linear)
    return blocks


def _kept_gathered(r: Rank, engine: EngineTerms, blocks: dict[str, Array]) -> dict[str, Array]:
    """ZeRO-2/3 with PP on a stack that keeps parameters gathered (torchtitan parallelize_llama: reshard_after_forward
    = not pp_enabled): the stage's unsharded parameters (compute dtype) stay through the step (ZeRO-2's states
    already hold that copy), and with gradient sync on the last micro-batch only (torch/distributed/pipelining/
    stage.py backward_maybe_with_nosync, perform_reduce_grad), FSDP2 accumulates unsharded gradients in the
    reduce dtype between micro-batches (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    to_accumulated_grad_if_needed): one job for both stages."""
    if r.rec.reshard_after_forward_with_pp:
        return blocks
    pc = r.pc
    kept = kept_gathered_with_pp(pc, r.rec)
    held = r.dense + r.expert
    reduce_b = np.where(r.fp32, 4.0, r.scn.training.grad_reduce_bytes)
    out = dict(blocks)
    gathered = kept & (pc.zero_stage == 3)  # ZeRO-2's record terms hold the gathered copy already
    out["weights"] = out["weights"] + np.where(gathered, held * np.where(r.fp32, 4.0, 2.0), 0.0)
    out["gradients"] = engine.unsharded_grads(r, out["gradients"], held * reduce_b, kept & (r.microbatches > 1))
    return out


def _layer_activations(r: Rank, engine: EngineTerms) -> tuple[Array, Array, Array]:
    """(bytes one micro-batch leaves on the rank's layers, one layer's bytes without recompute, one layer's bytes
    under the plan's recompute). Elements per layer from the saved-tensor inventory (memory_activations.py): fp8
    plans on Transformer Engine keep linear inputs in fp8; an MoE model's stage mixes MoE and dense-MLP layers
    (DeepSeek's first three): the stage's mean layer. Partial recompute: the other layers keep everything."""
    scn, pc = r.scn, r.pc
    share = _moe_share(scn, pc, r.last)
    moe_layer = layer_bytes(scn, pc, r.s, r.b, r.act_bytes)
    dense_layer = layer_bytes(scn, pc, r.s, r.b, r.act_bytes, dense_mlp=True) if scn.model.moe else moe_layer
    none, selective, full = (share * a + (1.0 - share) * d for a, d in zip(moe_layer, dense_layer, strict=True))
    per_layer = np.select([pc.recompute_is("none"), pc.recompute_is("selective"), pc.recompute_is("op")],
                          [none, selective, op_layer_elements(scn, pc, r.s, r.b) * r.act_bytes], full)
    per_mb = per_layer * r.redone + none * (r.layers - r.redone) + engine.layer_extra(r)
    return per_mb, none, per_layer


def _backward_transient(r: Rank, engine: EngineTerms, none: Array, per_layer: Array) -> Array:
    """Backward working set = one layer's activations re-materialised (full / op recompute) or the gradient of one
    layer's largest activations; FSDP gathers (current + prefetched unit, compute dtype) and one unit's unsharded
    gradients for reduce-scatter [FSDP2 design, torch docs]; DeepSpeed ZeRO-3 holds 4 B x largest layer [DS]; with
    sequence parallelism one reused buffer holds the all-gathered layer input, s b h (Megatron's global memory
    buffer, nanotron's MemoryBuffer [NT])."""
    pc, rec = r.pc, r.rec
    compute_bytes = np.where(r.fp32, 4.0, 2.0)
    rematerialised = pc.recompute_is("full") | pc.recompute_is("op")  # the whole layer is re-run in backward
    working = engine.working(r, np.where(rematerialised, none, per_layer))
    gather = np.where(pc.zero_stage == 3, 2 * r.unit * compute_bytes, 0.0)
    if not rec.reshard_after_forward_with_pp:  # units kept gathered through the step (_kept_gathered)
        gather = np.where((pc.pp > 1) & (pc.dp * pc.cp > 1), 0.0, gather)
    # the unsharded unit's gradient is in the parameter dtype: fp32 params without a master copy, else bf16
    grad_bytes = np.where(r.fp32, 4.0, 2.0 if rec.master_weights else 4.0)
    scatter = np.where(pc.zero_stage >= 2, r.unit * grad_bytes, 0.0)
    if rec.zero3_gather == "largest_layer":
        gather = np.where(pc.zero_stage == 3, DEEPSPEED_ZERO3_LAYER_BYTES * r.unit, 0.0)
        scatter = np.zeros_like(gather)
    sp_gather = np.where(pc.sequence_parallel > 0, r.sbh * r.act_bytes, 0.0)
    return working + gather + scatter + sp_gather


def _optimizer_step(r: Rank, blocks: dict[str, Array]) -> Array:
    """The optimizer step's own allocations (memory_copies.optimizer_step_bytes: foreach AdamW's exp_avg_sq_sqrt,
    the for-loop's temporaries, nothing when fused), once activations and compute copies are freed; the moments
    are the optimizer block less the master copies. Traced with foreach (llama3-8b dp2 z0 full-ac): rest 29.92 GiB
    = half of the 59.83 GiB Adam states, peak 149.58 GiB = fp32 weights + gradients + states + that transient."""
    m, pc = r.scn.model, r.pc
    master = sum(t.bytes_per_param for t in r.rec.states_for(r.scn.training.optimizer_state_dtype) if t.master)
    moments = np.where(r.fp32, blocks["optimizer"], blocks["optimizer"] * r.opt_bytes / (r.opt_bytes + master))
    largest = m.vocab_size * m.hidden_size / pc.tp / np.where(pc.zero_stage >= 3, r.shard, 1.0)
    return optimizer_step_bytes(r.scn, pc, moments, largest)


# ---- engines ---------------------------------------------------------------------------------------------------
class EngineTerms(NamedTuple):
    """How an engine's own allocations enter a rank's memory, chosen by the stack record (`ENGINES`)."""

    own_copies: bool
    """The engine makes its own compute copies (the record's copy terms are left out of the states)."""
    host_shards: Callable[[Rank], Array | float]
    """1 where the sharded weights and gradients live on the host."""
    copies: Callable[[Rank, dict[str, Array]], dict[str, Array]]
    """The blocks with the engine's compute copies and extra buffers."""
    unsharded_grads: Callable[[Rank, Array, Array, Mask], Array]
    """Gradients with ZeRO-3's kept-gathered unsharded gradients (r, gradients, their bytes, where accumulated)."""
    layer_extra: Callable[[Rank], Array]
    """Bytes per micro-batch the engine saves beyond the layer inventory."""
    stage_io: Callable[[Rank], tuple[Array, Array, Array, Array]]
    """(head and loss activations, pipeline buffers held, p2p transient, loss buffers freed before backward)."""
    freed_gradients: Callable[[Rank, Array, Array], Array]
    """Gradients less those that only appear once activations are freed (r, gradients, per micro-batch bytes)."""
    working: Callable[[Rank, Array], Array]
    """The backward working set with the engine's own transients."""


def _stage_io(r: Rank) -> tuple[Array, Array, Array, Array]:
    """The last stage (or the only one) holds the final norm input and LM-head input (sbh each) and the logits at
    the loss (vocab-parallel: / t) at the stack's bytes per logit (StackRecord.loss_bytes, else the calibration's),
    once more per multi-token-prediction module; pipeline send/receive buffers of the stage input and its gradient
    are transient (2 x 2 sbh, / t with SP)."""
    pc, m = r.pc, r.scn.model
    heads = 1.0 + m.mtp_layers  # the output head runs once more per multi-token-prediction module
    logit_bytes = r.cal.logits_bytes if r.rec.loss_bytes is None else r.rec.loss_bytes
    head = heads * (2 * r.sbh / r.sp_div * r.act_bytes + r.s * r.b * m.vocab_size / pc.tp * logit_bytes)
    p2p = np.where(pc.pp > 1, 2 * 2 * r.sbh / r.sp_div * r.act_bytes, 0.0)
    zero = np.zeros(len(pc))
    return np.where(r.has_head, head, 0.0), zero, p2p, zero


def _added_unsharded_grads(r: Rank, gradients: Array, held_bytes: Array, accumulated: Mask) -> Array:
    """Unsharded gradients accumulated between micro-batches, beside the sharded ones."""
    return gradients + np.where(accumulated, held_bytes, 0.0)


# master_weights True: the stack's states are the whole story (Megatron, DeepSpeed, nanotron); False: torch's
# DDP / FSDP2 / autocast / pipelining, whose own copies and buffers are evaluators/memory_engine.py's terms.
ENGINES: dict[bool, EngineTerms] = {
    True: EngineTerms(
        own_copies=False, host_shards=lambda r: 0.0, copies=lambda r, blocks: dict(blocks),
        unsharded_grads=_added_unsharded_grads, layer_extra=lambda r: np.zeros(len(r.pc)), stage_io=_stage_io,
        freed_gradients=lambda r, gradients, per_mb: gradients, working=lambda r, working: working),
    False: EngineTerms(
        own_copies=True, host_shards=eng.torch_host_shards, copies=eng.torch_copies,
        unsharded_grads=lambda r, gradients, held_bytes, accumulated: eng.torch_unsharded_grads(r, gradients,
                                                                                               held_bytes),
        layer_extra=lambda r: eng.engine_layer_bytes(r.scn, r.pc, r.s, r.b, r.layers, r.redone),
        stage_io=eng.torch_stage_io, freed_gradients=eng.torch_freed_gradients, working=eng.torch_working),
}
