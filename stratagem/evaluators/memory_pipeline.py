"""Pipelines for the memory model: layers on the first and last pipeline rank per stack, and the micro-batches
each schedule keeps in flight.

Sources: [NT] huggingface/nanotron src/nanotron/models/base.py build_model (pipeline blocks assigned by cumulative
compute cost), models/llama.py get_block_compute_costs; [MLM] Megatron-LM and torch.distributed.pipelining split
layers evenly with the remainder on the first ranks (evaluators/stages.py, spaces/pipeline_split.py).
[SCHED] torch/distributed/pipelining/schedules.py: Schedule1F1B warms up num_stages - stage_index forwards, then
one backward before each forward ("1B1F"); ScheduleInterleaved1F1B warms up (v - 1) p + 2 (p - 1 - rank) chunk
forwards; ScheduleGPipe runs every forward first. Megatron's schedules.py get_pp_rank_microbatches has the same
warm-ups (1F1B: p - rank - 1, + 1 in steady state; interleaved: (p - rank - 1) 2 + (v - 1) p). Korthikanti et al.
2022 sec. 4.2.3: interleaved holds p (1 + (p - 1)/(p v)) micro-batches' worth of a stage's layers on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.stages import stage_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import SCHEDULES, Schedule
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["stage_layers", "cost_split_layers", "pipeline_layers", "IN_FLIGHT", "in_flight"]

Array = NDArray[np.float64]


def stage_layers(num_layers: int, pp: Array, virtual: Array) -> Array:
    """Layers on the most loaded pipeline rank: ceil(L / (p v)) per chunk x v chunks (uneven splits put
    the extra layers on the first ranks, as Megatron's and torch.distributed.pipelining's splits do)."""
    return np.ceil(num_layers / (pp * virtual)) * virtual


def cost_split_layers(num_layers: int, layer_cost: float, head_cost: float, pp: Array) -> tuple[Array, Array]:
    """(first, last) stage layers under nanotron's split [NT models/base.py build_model].

    Blocks (embedding: cost 0, L layers: c each, LM head: V h) go in order to the current rank, which moves
    on once the cumulative cost exceeds its share C (r + 1)/p, C = L c + V h. Rank 0 thus takes the layer
    that crosses C/p: floor(C/(p c)) + 1 layers; the last rank keeps what follows the crossing of
    C (p - 1)/p (rules keep p <= L, so each block crosses at most one share).
    """
    total = num_layers * layer_cost + head_cost
    share = total / (pp * layer_cost)  # one rank's share, in layers
    first = np.minimum(float(num_layers), np.floor(share) + 1)
    before_last = np.minimum(float(num_layers), np.floor(share * (pp - 1)) + 1)
    last = np.maximum(0.0, num_layers - before_last)
    one = pp <= 1
    return np.where(one, float(num_layers), first), np.where(one, float(num_layers), last)


def pipeline_layers(scn: Scenario, pc: PlanColumns) -> tuple[Array, Array]:
    """(first, last) stage layers for the stack's split: nanotron by compute cost (non-interleaved),
    the others evenly with the remainder on the first ranks (`stage_layers`) [MLM, torch pipelining]."""
    m = scn.model
    even = stage_layers(m.num_layers, pc.pp, pc.virtual_stages)
    if stack_record(scn.training.stack).pipeline_split != "cost":
        st = stage_columns(m, pc)  # evaluators/stages.py: even, embedding+loss as layers, or uneven first/last
        return st.first_layers, st.last_layers
    # nanotron's costs [NT models/llama.py get_block_compute_costs]: 4 a d h + 3 f h per layer, V h the head.
    layer_cost = float(4 * m.num_attention_heads * m.dim_head * m.hidden_size + 3 * m.ffn_hidden_size * m.hidden_size)
    first, last = cost_split_layers(m.num_layers, layer_cost, float(m.vocab_size * m.hidden_size), pc.pp)
    interleaved = pc.virtual_stages > 1  # nanotron has no interleaved schedule: fall back to the even split
    return np.where(interleaved, even, first), np.where(interleaved, even, last)


# Micro-batches of a stage's activations held at its peak, per schedule: (first stage, last stage) as functions of
# (p, v, m) [SCHED]. Schedule1F1B: rank r warms up min(m, p - r) forwards, then runs each backward before the next
# forward: first min(p, m), last 1; ZB-H1 (Qi et al. 2023) splits backward but keeps 1F1B's peak. Interleaved: rank r
# warms up w = (v - 1) n + 2 (p - 1 - r) chunk forwards (n = a round: p when p divides m, else torch's flex rounds
# m // max(1, m // p)) and runs one more forward before its first backward, each chunk 1/v of the stage's layers:
# (w + 1) / v, at most m (first: p + (p - 1)/v, Korthikanti sec. 4.2.3; last: ((v - 1) p + 1)/v). Checked against
# torch's own action lists (tests/evaluators/test_memory_terms.py, test_schedules.py).
InFlight = Callable[[Array, Array, Array], tuple[Array, Array]]


def _round(p: Array, m: Array) -> Array:
    """Micro-batches per round of torch's looped schedules (flex rounds: m // max(1, m // p); p when p divides m)."""
    return np.floor(m / np.maximum(1.0, np.floor(m / p)))


IN_FLIGHT: dict[Schedule, InFlight] = {
    "gpipe": lambda p, v, m: (m, m),
    "1f1b": lambda p, v, m: (np.minimum(p, m), np.ones_like(m)),
    "interleaved": lambda p, v, m: (np.minimum(m, ((v - 1) * _round(p, m) + 2 * (p - 1) + 1) / v),
                                    np.minimum(m, ((v - 1) * _round(p, m) + 1) / v)),
    "zero_bubble": lambda p, v, m: (np.minimum(p, m), np.ones_like(m)),
}


def in_flight(pc: PlanColumns, microbatches: Array, last: bool) -> Array:
    """Micro-batches whose activations the first (or last) stage holds at its peak: `IN_FLIGHT` of the plan's
    schedule; 1 without pipeline parallelism."""
    p, v = pc.pp, pc.virtual_stages
    m = np.broadcast_to(np.asarray(microbatches, dtype=np.float64), p.shape)
    held = np.select([pc.schedule_is(s) for s in SCHEDULES],
                     [IN_FLIGHT[s](p, v, m)[1 if last else 0] for s in SCHEDULES], m)
    return np.where(p > 1, held, 1.0)
