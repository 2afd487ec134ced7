"""Per-stage layer counts and parameters for every plan, vectorised: the worst stage decides memory, the slowest
decides time.

The split itself (which layers each model chunk holds: even, embedding and loss counted as layers, or explicit
first/last stage counts) is `stratagem.spaces.pipeline_split`, shared with the rules and the exporters. Here each
distinct (pp, virtual_stages, first_stage_layers, last_stage_layers, pp_split) of a batch of plans is split once,
and the per-rank sums are mapped back onto the plans:
  first / last     layers and (non-routed, routed-expert) parameters of pipeline rank 0 and rank pp-1, summed over
                   the layers each really holds (DeepSeek-V3's three dense layers sit on rank 0, so its MoE weights
                   are smaller there);
  middle           the most loaded rank strictly between them (0 when pp <= 2).
With pp = 1 the one rank is both first and last. The last rank also holds the multi-token-prediction modules
(ModelSpec.mtp_layers), each counted as one more layer with its parameters (ModelSpec.mtp_module_params), and runs
the output head once more for each (Megatron multi_token_prediction.py mtp_on_this_rank: the last stage).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.pipeline_split import chunk_layers, rank_layer_ranges
from stratagem.spaces.plan import PIPELINE_SPLITS
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["StageColumns", "stage_columns", "slowest_rank_s", "distinct_rows", "trained_scenario"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class StageColumns:
    """Per plan: transformer layers and their parameters on the first, last and most loaded middle rank."""

    first_layers: Array
    """Transformer layers on pipeline rank 0."""
    last_layers: Array
    """Transformer layers on pipeline rank pp-1."""
    middle_layers: Array
    """Transformer layers on the most loaded rank strictly between (0 when pp <= 2)."""
    first_dense: Array
    """Non-routed parameters of rank 0's layers (attention, norms, dense MLPs, routers, shared experts)."""
    first_expert: Array
    """Routed-expert parameters of rank 0's layers (before ep/etp split)."""
    last_dense: Array
    """Non-routed parameters of rank pp-1's layers."""
    last_expert: Array
    """Routed-expert parameters of rank pp-1's layers."""
    middle_dense: Array
    """Non-routed parameters of the most loaded middle rank's layers."""
    middle_expert: Array
    """Routed-expert parameters of the most loaded middle rank's layers."""
    last_heads: Array
    """Output-head runs per micro-batch on rank pp-1: 1 + the multi-token-prediction modules."""


def trained_scenario(scn: Scenario) -> Scenario:
    """The scenario as its stack's job trains it: without the multi-token-prediction modules on a stack that
    builds none (StackRecord.mtp; its exporter says so), else unchanged."""
    if not scn.model.mtp_layers or stack_record(scn.training.stack).mtp:
        return scn
    return scn.model_copy(update={"model": scn.model.model_copy(update={"mtp_layers": 0})})


@lru_cache(maxsize=64)
def _layer_table(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """(non-routed, routed) parameters of every layer."""
    return tuple(model.layer_params(i) for i in range(model.num_layers))


@lru_cache(maxsize=4096)
def _rank_sums(model: ModelSpec, key: tuple[int, int, int, int, int]) -> tuple[float, ...]:
    pp, v, first, last, split = key
    chunks = chunk_layers(model.num_layers, pp, v, first, last, PIPELINE_SPLITS[split])
    per_layer = _layer_table(model)
    ranges = rank_layer_ranges(chunks, pp)

    def sums(r: int) -> tuple[float, float, float]:
        idx = [i for rng in ranges[r] for i in rng if i < model.num_layers]
        return float(len(idx)), float(sum(per_layer[i][0] for i in idx)), float(sum(per_layer[i][1] for i in idx))

    mtp = model.mtp_layers
    mtp_dense, mtp_routed = model.mtp_module_params() if mtp else (0, 0)

    def with_mtp(x: tuple[float, float, float]) -> tuple[float, float, float]:
        return x[0] + mtp, x[1] + mtp * mtp_dense, x[2] + mtp * mtp_routed

    f, la = sums(0), with_mtp(sums(pp - 1))
    if pp == 1:
        f = la
    mids = [sums(r) for r in range(1, pp - 1)]
    mid = max(mids, key=lambda x: (x[0], x[1] + x[2])) if mids else (0.0, 0.0, 0.0)
    return (f[0], la[0], mid[0], f[1], f[2], la[1], la[2], mid[1], mid[2], 1.0 + mtp)


def distinct_rows(cols: list[NDArray[np.int64]]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """(index of each distinct row's first occurrence, row -> distinct row) of non-negative integer columns, as
    np.unique(np.stack(cols, 1), axis=0, return_index=True, return_inverse=True) gives them: one int64 per row
    (mixed radix over the columns' ranges), so the sort is 1-D (np.unique over axis=0 sorts void rows, ~8x slower
    on 200k rows: bench/screening_rate.py's largest cost)."""
    code = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        code = code * (int(c.max()) + 1) + c
    _, first_index, inverse = np.unique(code, return_index=True, return_inverse=True)
    return first_index, np.asarray(inverse).reshape(-1)


def _key(cols: list[NDArray[np.int64]], i: int) -> tuple[int, int, int, int, int]:
    return int(cols[0][i]), int(cols[1][i]), int(cols[2][i]), int(cols[3][i]), int(cols[4][i])


def stage_columns(model: ModelSpec, pc: PlanColumns) -> StageColumns:
    """The StageColumns of every plan in `pc` (each distinct pipeline split computed once, and cached; the columns
    of the last few plan sets kept, read-only: one evaluation asks for them from the memory and the time terms
    alike, nine times for the same plans)."""
    key = (id(pc), model)
    kept = _KEPT.get(key)
    if kept is not None and kept[0]() is pc:
        return kept[1]
    out = _stage_columns(model, pc)
    if len(_KEPT) >= _KEEP:
        for oldest in list(_KEPT)[:1]:  # a copy: a weakref callback may drop an entry at any time
            _KEPT.pop(oldest, None)
    _KEPT[key] = (weakref.ref(pc, _forget(key)), out)  # dropped with its plans
    return out


def _forget(key: tuple[int, ModelSpec]) -> Callable[[weakref.ref[PlanColumns]], None]:
    """The weakref callback that drops `key`'s entry when its plans go."""
    def forget(_: weakref.ref[PlanColumns]) -> None:
        _KEPT.pop(key, None)
    return forget


_KEEP = 8
"""Plan sets whose StageColumns stage_columns keeps (by identity: the PlanColumns object, alive, and the model;
an entry goes when its plans do)."""
_KEPT: dict[tuple[int, ModelSpec], tuple[weakref.ref[PlanColumns], StageColumns]] = {}


def _stage_columns(model: ModelSpec, pc: PlanColumns) -> StageColumns:
    if len(pc) == 0:
        empty = np.zeros(0)
        return StageColumns(*([empty] * 10))
    cols = [np.asarray(c, dtype=np.int64) for c in
            (pc.pp, pc.virtual_stages, pc.first_stage_layers, pc.last_stage_layers, pc.pp_split)]
    first_index, inverse = distinct_rows(cols)
    table = np.array([_rank_sums(model, _key(cols, int(i))) for i in first_index])
    rows = np.take(table.T, inverse, axis=1)  # (10, n): each figure's row contiguous, as the plans' columns are
    rows.setflags(write=False)
    return StageColumns(*rows)


def slowest_rank_s(st: StageColumns, pp: Array, layer_s: Array, head_s: Array) -> Array:
    """Seconds of the slowest pipeline rank per micro-batch: max over first, middle and last rank of its layers x
    the per-layer time, the last rank also running the output layer and loss (`head_s`), once more per
    multi-token-prediction module."""
    head = head_s * st.last_heads
    first = st.first_layers * layer_s + np.where(pp > 1, 0.0, head)
    last = st.last_layers * layer_s + head
    return np.maximum(np.maximum(first, st.middle_layers * layer_s), last)
