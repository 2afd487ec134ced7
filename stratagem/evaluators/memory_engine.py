"""Memory terms that follow the torch engine's own code (DDP, ZeroRedundancyOptimizer, autocast, FSDP2, pipelining).

These apply to stacks whose parameters are the fp32 masters (`StackRecord.master_weights` False: torch's DDP /
FSDP2 as torchtitan composes them): mixed precision is FSDP2's MixedPrecisionPolicy under ZeRO 2/3 with dp > 1,
torch.autocast otherwise. Vectorised over `PlanColumns` like stratagem.evaluators.memory.

Sources:
  [AMP]   torch autocast (torch/amp/autocast_mode.py, aten/src/ATen/autocast_mode.cpp): linear/matmul cast their
          inputs to bf16, embedding/add/norms run in their inputs' dtype (fp32 weights: an fp32 residual stream);
          the cast cache keeps only leaf casts (weights), and only inside the autocast region, so an activation
          is cast again by every linear that reads it, and a weight's bf16 copy outlives the forward only where
          backward saved it.
  [CKPT]  torch/utils/checkpoint.py (non-reentrant): a checkpointed region saves its inputs only; its weight
          casts are redone in the recompute.
  [DDP]   torch/nn/parallel/distributed.py + reducer.cpp: with gradient_as_bucket_view the gradients become bucket
          views on the synced backward; under no_sync (every micro-batch but the last) AccumulateGrad keeps its
          own `.grad` tensors, beside the buckets, after zero_grad(set_to_none=True).
  [ZRO]   torch/distributed/optim/zero_redundancy_optimizer.py `_partition_parameters`: whole parameters, largest
          first, each to the rank with the smallest total so far.
  [PIPE]  torch/distributed/pipelining/stage.py `_prepare_forward_infra` / `_setup_backward_recv_info`: one
          activation receive buffer per micro-batch (non-first stages) and one gradient receive buffer per
          micro-batch (non-last stages), kept for the whole step.
  [FA2]   Dao 2023, FlashAttention-2, sec. 3.1: forward saves the logsumexp L per row (fp32, b x a x s).
  [SCHED] torch/distributed/pipelining/schedules.py Schedule1F1B, ScheduleInterleaved1F1B, ScheduleGPipe.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.memory_rank import Rank
from stratagem.evaluators.stages import distinct_rows
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import dp_shard, sp_divisor, uses_fsdp
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["fp32_masters", "uses_autocast", "autocast_copy_params", "autocast_layer_bytes",
           "logsumexp_bytes", "ddp_accumulates", "zero1_worst_fraction", "pipeline_recv_buffers",
           "lpt_worst_bin", "engine_layer_bytes", "torch_host_shards", "torch_copies", "torch_unsharded_grads",
           "torch_stage_io", "torch_freed_gradients", "torch_working"]

Array = NDArray[np.float64]


def fp32_masters(scn: Scenario) -> bool:
    """The stack keeps fp32 parameters as the master weights (torch: DDP, FSDP2)."""
    return not stack_record(scn.training.stack).master_weights


def uses_autocast(scn: Scenario, pc: PlanColumns) -> NDArray[np.bool_]:
    """Mixed precision by torch.autocast: an fp32-master stack, bf16/fp8 compute, no FSDP2 policy [AMP]."""
    return np.asarray(fp32_masters(scn) & (pc.precision != 0) & ~uses_fsdp(pc))


def autocast_copy_params(scn: Scenario, pc: PlanColumns, layers: Array, redone: Array, layer_linear: Array,
                         head_linear: Array | float) -> Array:
    """Parameters whose bf16 autocast copy backward keeps [AMP, CKPT]: the linear weights of every layer that does
    not recompute, of the recomputed layers outside the checkpointed region (selective: all but w2, whose
    region down(silu(g) * u) is recomputed; full / op: none), and the output projection. The embedding is not
    cast (an embedding lookup runs in the weight's dtype). `layer_linear`: one layer's linear weights on this
    rank; `head_linear`: the output projection's (0 on a stage without it)."""
    m = scn.model
    mlp_mats = 3.0 if m.mlp == "swiglu" else 2.0
    w2 = (layer_linear - (m.attention_params() / pc.tp)) / mlp_mats  # the MLP's down projection (1 of its mats)
    kept_in_redone = np.select([pc.recompute_is("none"), pc.recompute_is("selective")],
                               [layer_linear, layer_linear - w2], 0.0)
    return (layers - redone) * layer_linear + redone * kept_in_redone + head_linear


def autocast_layer_bytes(scn: Scenario, pc: PlanColumns, s: Array, b: Array) -> tuple[Array, Array]:
    """Bytes autocast adds per layer per micro-batch over bf16 saved activations [AMP]: (layer kept whole or
    selective, fully recomputed layer).

    The residual stream is fp32: both norm inputs are saved in fp32 (+2 bytes x sbh each, / t with SP); each
    linear casts its own bf16 copy of its input: q, k, v read one input (2 copies more than one), SwiGLU's gate
    and up another (1 more), GELU's fc1 alone: + (2 + 1) x 2 sbh bytes (full sequence: with SP the gathered
    input). A fully recomputed layer keeps its fp32 input: + 2 sbh (/ t with SP)."""
    m = scn.model
    sbh = s * b * m.hidden_size
    sp_div = sp_divisor(pc)
    extra_casts = 2.0 + (1.0 if m.mlp == "swiglu" else 0.0)
    whole = 2 * sbh / sp_div * 2.0 + extra_casts * sbh * 2.0
    return whole, sbh / sp_div * 2.0


def logsumexp_bytes(scn: Scenario, pc: PlanColumns, s: Array, b: Array) -> Array:
    """Flash attention's saved logsumexp per layer per micro-batch: fp32 [b, a/t, s] [FA2]."""
    return 4.0 * b * s * scn.model.num_attention_heads / pc.tp


def ddp_accumulates(pc: PlanColumns, microbatches: Array) -> NDArray[np.bool_]:
    """DDP with gradient accumulation holds its buckets and the accumulated `.grad` tensors [DDP]."""
    return np.asarray((pc.dp > 1) & (pc.zero_stage <= 1) & (microbatches > 1))


def pipeline_recv_buffers(pc: PlanColumns, microbatches: Array, first: bool, last: bool) -> Array:
    """Receive buffers [PIPE] one pipeline rank holds, in units of one stage input [b, s(/t), h]: each of its v
    chunks has m activation buffers unless it is the model's first chunk and m gradient buffers unless it is
    the last (loop placement: rank 0 holds the first chunk, rank pp - 1 the last)."""
    v = pc.virtual_stages
    n = 2 * v - (1.0 if first else 0.0) - (1.0 if last else 0.0)
    return np.where(pc.pp > 1, n * microbatches, 0.0)


# ---- ZeroRedundancyOptimizer's partition ----------------------------------------------------------------------
def lpt_worst_bin(sizes: tuple[tuple[float, int], ...], bins: int) -> float:
    """The largest bin total when items (size, count) go largest first to the currently smallest bin [ZRO]
    (longest-processing-time greedy). Equal items are placed a round at a time."""
    heap = [(0.0, i) for i in range(bins)]
    for size, count in sorted(sizes, reverse=True):
        left = count
        while left > 0:
            if left >= bins and heap[0][0] == max(t for t, _ in heap):  # all bins level: one item each
                rounds = left // bins
                heap = [(t + rounds * size, i) for t, i in heap]
                heapq.heapify(heap)
                left -= rounds * bins
                continue
            total, i = heapq.heappop(heap)
            heapq.heappush(heap, (total + size, i))
            left -= 1
    return max(t for t, _ in heap)


def _stage_tensors(m: ModelSpec, layers: int, tp: int, ep: int, has_embedding: bool, has_head: bool, tied: bool
                   ) -> tuple[tuple[float, int], ...]:
    """(numel, count) of the parameter tensors one rank's stage holds (TP shards local: DDP with TP holds them
    as plain tensors). Dense layers; an MoE layer's experts as three grouped tensors."""
    h, f = m.hidden_size, m.ffn_hidden_size
    out: dict[float, int] = {}

    def add(n: float, c: int = 1) -> None:
        out[n] = out.get(n, 0) + c

    add(h * m.q_size / tp, 2 * layers)  # wq, wo
    add(h * m.kv_size / tp, 2 * layers)  # wk, wv
    add(m.norm_params(), 2 * layers)
    if m.moe is None:
        add(h * f / tp, (3 if m.mlp == "swiglu" else 2) * layers)
    else:
        e = m.moe
        add(e.num_experts / ep * h * e.expert_ffn_hidden_size, 3 * layers)  # w1, w3, w2 [E/ep, f, h]
        add(e.num_experts * h, layers)  # router
    if has_embedding:
        add(m.vocab_size * h / tp)
    if has_head:
        add(m.norm_params())
        if not tied or not has_embedding:
            add(m.vocab_size * h / tp)
    return tuple(out.items())


@lru_cache(maxsize=4096)
def _worst_fraction(m: ModelSpec, layers: int, tp: int, ep: int, shard: int, has_embedding: bool,
                    has_head: bool) -> float:
    items = _stage_tensors(m, layers, tp, ep, has_embedding, has_head, m.tied_embeddings)
    total = sum(n * c for n, c in items)
    return lpt_worst_bin(items, shard) / total if total else 1.0 / shard


def zero1_worst_fraction(scn: Scenario, pc: PlanColumns, layers: Array, first: bool, last: bool) -> Array:
    """Fraction of a stage's parameters whose optimizer states the fullest ZeroRedundancyOptimizer rank holds
    [ZRO] (1/shard when the parameters split evenly; the largest tensor's share when it alone exceeds 1/shard).
    `first` / `last`: whether the stage holds the embedding / the output projection (both when pp = 1)."""
    shard = dp_shard(pc).astype(np.int64)
    cols = [np.broadcast_to(layers, pc.tp.shape).astype(np.int64), pc.tp.astype(np.int64), pc.ep.astype(np.int64),
            shard, pc.pp.astype(np.int64)]
    first_index, inverse = distinct_rows(cols)  # each distinct (layers, tp, ep, shard, pp) once
    fractions = np.array([
        _worst_fraction(scn.model, int(n), int(t), int(e), max(int(d), 1), first or p == 1, last or p == 1)
        for n, t, e, d, p in (tuple(c[i] for c in cols) for i in first_index)])
    return fractions[inverse]


def engine_layer_bytes(scn: Scenario, pc: PlanColumns, s: Array, b: Array, layers: Array, redone: Array) -> Array:
    """Bytes per micro-batch that torch's engine saves beyond `_layer_elements` on one stage: autocast's fp32
    residual stream and per-linear input casts, flash attention's logsumexp (evaluators/memory_engine.py)."""
    ac = uses_autocast(scn, pc)
    whole, full_extra = autocast_layer_bytes(scn, pc, s, b)
    lse = logsumexp_bytes(scn, pc, s, b)
    kept = np.where(ac, whole, 0.0) + lse  # a layer that keeps its attention and MLP activations
    recomputing = np.select([pc.recompute_is("full"), pc.recompute_is("op")],
                            [np.where(ac, full_extra, 0.0), np.where(ac, full_extra, 0.0) + lse], kept)
    return recomputing * redone + kept * (layers - redone)


# ---- torch's engine as terms of one rank (evaluators/memory.py rank_memory_columns composes them) ------------
def torch_host_shards(r: Rank) -> Array:
    """FSDP2's CPUOffloadPolicy keeps the sharded parameters and gradients on the host (1) or not (0)."""
    return ((r.pc.optimizer_offload > 0) & uses_fsdp(r.pc)).astype(np.float64)


def torch_copies(r: Rank, blocks: dict[str, Array]) -> dict[str, Array]:
    """The compute copies and extra gradient buffers torch's engine holds beside the fp32 states [AMP, DDP, ZRO]."""
    scn, pc, m = r.scn, r.pc, r.scn.model
    out = dict(blocks)
    # bf16 compute copies kept for backward: FSDP2 zero 2 keeps the unsharded units (reshard_after_forward=False),
    # autocast the casts backward saved (autocast_copy_params); zero 3 gathers per unit. The output projection (the
    # tied copy with pp > 1) is cast, not the embedding.
    head_w = np.where(r.has_head, m.vocab_size * m.hidden_size / pc.tp, 0.0)
    cast = autocast_copy_params(scn, pc, r.layers, r.redone, r.layer_linear, 0.0)
    # autocast's cache holds every cast until each micro-batch's forward leaves its autocast region
    # (torch/amp/autocast_mode.py __exit__: clear_autocast_cache): each in-flight micro-batch keeps its own saved
    # layer casts, and the one in forward all the stage's casts at its end (the head's: the last chunk's one).
    # Only leaf weights are cached (aten/src/ATen/autocast_mode.cpp cached_cast: is_leaf): DDP with TP holds
    # local shards and makes DTensor views of them per forward (harness hold_tp_params_local), never cached
    cached = (pc.tp == 1) | (pc.dp == 1)  # one chunk's forward is one autocast region (harness model.forward)
    every = np.where(cached, autocast_copy_params(scn, pc, r.layers, 0.0 * r.redone, r.layer_linear, 0.0), 0.0)
    every = every / pc.virtual_stages
    held_casts = cast * (r.in_flight - 1) + np.maximum(cast, every) + head_w
    copy = np.where(uses_autocast(scn, pc), held_casts,
                    np.where(uses_fsdp(pc) & (pc.zero_stage == 2), r.dense + r.expert, 0.0))
    out["weights"] = out["weights"] + np.where(r.fp32, 0.0, 2.0 * copy)
    # DDP + gradient accumulation: the accumulated .grad tensors beside the buckets (param dtype, fp32)
    out["gradients"] = out["gradients"] + np.where(ddp_accumulates(pc, r.microbatches), 4.0 * (r.dense + r.expert),
                                                   0.0)
    # without data parallelism the TP embedding's gradient stays the whole [V, h] Partial DTensor that its backward
    # makes (no row-sharded strategy: tensor/_ops/_embedding_ops.py embedding_dense_backward_strategy)
    whole_emb = (pc.dp == 1) & (pc.tp > 1) & ((not r.last) | (pc.pp == 1))
    out["gradients"] = out["gradients"] + np.where(whole_emb, (1.0 - 1.0 / pc.tp) * m.vocab_size * m.hidden_size * 4.0,
                                                   0.0)
    # ZeroRedundancyOptimizer: whole parameters, greedily: the fullest rank's share, not 1/shard
    frac = zero1_worst_fraction(scn, pc, r.layers, not r.last, r.last)
    z1 = (pc.zero_stage == 1) & (pc.dp > 1)
    out["optimizer"] = np.where(z1, r.opt_bytes * (r.dense + r.expert) * frac * (1.0 - pc.optimizer_offload),
                                out["optimizer"])
    return out


def torch_unsharded_grads(r: Rank, gradients: Array, held_bytes: Array) -> Array:
    """ZeRO-3 with PP kept gathered: torch pipelining runs every backward without gradient sync (stage.py
    backward_maybe_with_nosync: set_requires_gradient_sync(False)) and reduce-scatters once after the last
    (perform_reduce_grad): FSDP2 (zero 2 or 3) holds the stage's unsharded gradients in the reduce dtype until
    then, and the sharded ones only after them (_fsdp_param_group.py post_backward): one or the other."""
    synced_late = uses_fsdp(r.pc) & (r.pc.pp > 1)
    return np.maximum(gradients, np.where(synced_late, held_bytes, 0.0))


def torch_stage_io(r: Rank) -> tuple[Array, Array, Array, Array]:
    """(head and loss activations, pipeline buffers held through the step, p2p transient, loss buffers freed
    before the layers' backward) under torch's engine [AMP, PIPE]."""
    scn, pc, cal, m = r.scn, r.pc, r.cal, r.scn.model
    sbh, sp_div, act = r.sbh, r.sp_div, r.act_bytes
    ac = uses_autocast(scn, pc)
    gathered = np.where(pc.sequence_parallel > 0, sbh, sbh / sp_div)  # LM-head input (SP all-gathers it)
    heads = 1.0 + m.mtp_layers  # the output head and loss run once more per multi-token-prediction module
    head_acts = heads * (sbh / sp_div * np.where(ac, 4.0, act) + gathered * act)
    # vocabulary-parallel logits and loss whenever tp > 1, with or without PP: torchtitan train.py runs
    # pp_schedule.step inside train_context(parallel_dims.loss_parallel_enabled) (output ColwiseParallel,
    # Shard(-1), use_local_output=False), and so does the harness (parallelize.uses_loss_parallel, 004d593);
    # under GPipe the last stage keeps every micro-batch's logits (stage output) and fp32 log-softmax output until
    # its backward (torch/distributed/pipelining/stage.py fwd_cache)
    v_split = pc.tp
    logits_el = heads * r.s * r.b * m.vocab_size / v_split
    gpipe_m = np.where((pc.pp > 1) & pc.schedule_is("gpipe"), r.microbatches, 1.0)  # 1F1B: each loss's backward next
    logits = logits_el * (cal.logits_bytes + (gpipe_m - 1) * (act + 4.0))
    # [PIPE] receive buffers: the stage input [b, s(/t), h] in the residual dtype (fp32 unless FSDP2's bf16)
    io_bytes = np.where(uses_fsdp(pc) & ~r.fp32, 2.0, 4.0)
    held = pipeline_recv_buffers(pc, r.microbatches, not r.last, r.last) * sbh / sp_div * io_bytes
    # a non-last stage also keeps each in-flight micro-batch's output until its backward (fwd_cache)
    held = held + np.where((pc.pp > 1) & (not r.last), r.in_flight * sbh / sp_div * io_bytes, 0.0)
    # the loss's buffers are freed once the LM head's backward is done, before the layers' backward
    loss_freed = np.where(r.has_head, logits_el * cal.logits_bytes, 0.0)
    return np.where(r.has_head, head_acts + logits, 0.0), held, np.zeros(len(pc)), loss_freed


def torch_freed_gradients(r: Rank, gradients: Array, per_mb: Array) -> Array:
    """Gradients that appear only as activations are freed [SCHED: torch/distributed/pipelining/schedules.py].

    The gradients made in backward (all but DDP's buckets) appear as the first backward frees its micro-batch:
    with one micro-batch, GPipe (every forward before the first backward) or 1F1B's first stage with m = pp (no
    forward after its first backward: Schedule1F1B warmup), they coexist with m - 1 micro-batches' activations
    only: peak m A + max(0, G - A) (else A + G). Interleaved 1F1B whose warmup, (v - 1) p + 2 (p - 1 - rank)
    forwards (ScheduleInterleaved1F1B), covers all v m of them: backwards then run chunk by chunk in rounds of p,
    the last chunk's first; its gradients (G/v) appear as A/v is freed, all of them once p A/v is."""
    pc = r.pc
    buckets = np.where((pc.dp > 1) & (pc.zero_stage <= 1), 4.0 * (r.dense + r.expert), 0.0)
    dynamic = np.maximum(gradients - buckets, 0.0)
    filled = pc.schedule_is("1f1b") & (r.microbatches <= pc.pp) & (not r.last)
    overlap = ((pc.schedule_is("gpipe") | filled) & (pc.pp > 1)) | (r.microbatches <= 1)
    gradients = gradients - np.where(overlap, np.minimum(dynamic, per_mb), 0.0)
    v, p = pc.virtual_stages, pc.pp
    warm = (v - 1) * p + 2 * (p - 1 - np.where(r.last, p - 1, 0.0))
    filled_v = pc.schedule_is("interleaved") & (p > 1) & (warm >= v * r.microbatches)
    extra = np.maximum(0.0, np.maximum(dynamic / v - per_mb / v, dynamic - p * per_mb / v))
    return gradients - np.where(filled_v, dynamic - extra, 0.0)


def torch_working(r: Rank, working: Array) -> Array:
    """DTensor has no row-sharded strategy for the embedding's backward (torch/distributed/tensor/_ops/
    _embedding_ops.py embedding_dense_backward_strategy): under TP the first stage makes the whole [V, h] gradient
    (param dtype) before reduce-scattering it; with pp > 1 other micro-batches' activations are still held then."""
    if r.last:
        return working
    m, pc = r.scn.model, r.pc
    emb_grad = m.vocab_size * m.hidden_size * np.where(uses_fsdp(pc) & ~r.fp32, 2.0, 4.0)
    return np.where((pc.tp > 1) & (pc.pp > 1), np.maximum(working, emb_grad), working)
