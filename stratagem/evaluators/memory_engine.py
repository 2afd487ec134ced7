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
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["fp32_masters", "uses_fsdp", "uses_autocast", "autocast_copy_params", "autocast_layer_bytes",
           "logsumexp_bytes", "ddp_accumulates", "zero1_worst_fraction", "pipeline_recv_buffers",
           "lpt_worst_bin", "engine_layer_bytes"]

Array = NDArray[np.float64]


def fp32_masters(scn: Scenario) -> bool:
    """The stack keeps fp32 parameters as the master weights (torch: DDP, FSDP2)."""
    return not stack_record(scn.training.stack).master_weights


def uses_fsdp(pc: PlanColumns) -> NDArray[np.bool_]:
    """FSDP2 (ZeRO 2/3 with dp > 1), as the harness and torchtitan apply it; DDP / no data parallelism otherwise."""
    return np.asarray((pc.dp > 1) & (pc.zero_stage >= 2))


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
    sp_div = np.where(pc.sequence_parallel > 0, pc.tp, 1.0)
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
    shard = (pc.dp / pc.dp_replicate).astype(np.int64)
    keys = np.stack([np.broadcast_to(layers, pc.tp.shape).astype(np.int64), pc.tp.astype(np.int64),
                     pc.ep.astype(np.int64), shard, pc.pp.astype(np.int64)], axis=1)
    uniq, inverse = np.unique(keys, axis=0, return_inverse=True)
    fractions = np.array([
        _worst_fraction(scn.model, int(n), int(t), int(e), max(int(d), 1), first or p == 1, last or p == 1)
        for n, t, e, d, p in uniq])
    return fractions[inverse.reshape(-1)]


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
