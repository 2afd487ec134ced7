"""Measured rates as tables: bus bandwidth per collective, group size, placement and message size, and GEMM
efficiency per GEMM size, read by the comm and compute terms in place of their formulas.

    tables = RateTables(source="...", collectives=(CollectiveTable(...), ...), gemms=(GemmTable(...),))
    t = collective_time_s(tables, "all_gather", n, inside, size, formula)   # formula where no table covers it

Conventions are nccl-tests' [NCCL-T] (nccl-tests doc/PERFORMANCE.md): a collective of `size` bytes (all-gather:
the gathered output; reduce-scatter: the input; all-reduce: the buffer; all-to-all: each rank's send buffer)
that takes t seconds has algorithm bandwidth algbw = size / t and bus bandwidth busbw = algbw x f, with
f = 2(n-1)/n for all-reduce and (n-1)/n for all-gather, reduce-scatter and all-to-all; so t = size x f / busbw.
A GEMM's efficiency is its achieved FLOP/s over the peak the table names (cuBLAS benchmarks' convention:
2 m n k / t over the datasheet peak).

Interpolation: busbw linear in log(size) between measured sizes and flat beyond them (nccl-tests' curves
saturate at large sizes; below the smallest size the latency floor is not extrapolated), then linear in log(n)
between measured group sizes, the nearest beyond them; GEMM efficiency linear in log(FLOPs), flat beyond.
A collective whose placement has no table keeps its formula.

Imports neither torch nor the calibration (evaluators.calibration imports this module).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Collective", "Placement", "GemmKind", "COLLECTIVES", "BUS_FACTOR", "CollectiveTable", "GemmTable",
           "RateTables", "bus_factor", "interp_log", "collective_busbw_gbps", "collective_time_s",
           "gemm_efficiency", "gemm_size", "LAYER_GEMMS", "EXPERT_GEMMS", "tables_summary", "joined"]

Array = NDArray[np.float64]
Collective = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
Placement = Literal["intra_node", "inter_node"]
GemmKind = Literal["dense", "grouped"]
COLLECTIVES: tuple[Collective, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
BUS_FACTOR: dict[str, float] = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
"""busbw / algbw = BUS_FACTOR x (n-1)/n [NCCL-T]."""
_FROZEN = ConfigDict(frozen=True, extra="forbid")


def _increasing(name: str, xs: tuple[float, ...], ys: tuple[float, ...]) -> None:
    """Points of one curve: as many values as abscissae, abscissae positive and strictly increasing, values > 0."""
    if not xs or len(xs) != len(ys):
        raise ValueError(f"{name}: needs one value per point and at least one point (got {len(xs)} and {len(ys)})")
    if any(x <= 0 for x in xs) or any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError(f"{name}: must be positive and strictly increasing (got {list(xs)})")
    if any(not np.isfinite(y) or y <= 0 for y in ys):
        raise ValueError(f"{name}: values must be finite and > 0 (got {list(ys)})")


class CollectiveTable(BaseModel):
    """One nccl-tests curve: a collective's bus bandwidth per message size, for one group size and placement."""

    model_config = _FROZEN

    collective: Collective
    """Which collective (nccl-tests all_gather_perf, reduce_scatter_perf, all_reduce_perf, alltoall_perf)."""
    ranks: int = Field(ge=2)
    """Ranks in the group (n)."""
    placement: Placement
    """intra_node: every rank on one node; inter_node: the group spans nodes."""
    sizes_bytes: tuple[float, ...]
    """Message sizes, bytes, increasing (nccl-tests' `size` column)."""
    busbw_gbps: tuple[float, ...]
    """Bus bandwidth at each size, GB/s (1e9 bytes/s; nccl-tests' `busbw` column)."""

    @model_validator(mode="after")
    def _points(self) -> CollectiveTable:
        """One bandwidth per size, sizes increasing."""
        _increasing("sizes_bytes", self.sizes_bytes, self.busbw_gbps)
        return self


class GemmTable(BaseModel):
    """GEMM efficiency per GEMM size: dense (one GEMM) or grouped (one kernel over several experts' GEMMs)."""

    model_config = _FROZEN

    kind: GemmKind
    """dense: torch.matmul / cuBLAS GEMM; grouped: the experts' GEMMs of one MoE layer together."""
    shapes: tuple[tuple[int, int, int, int], ...]
    """(groups, m, n, k) of each measured point (dense: groups 1), FLOPs 2 x groups x m x n x k increasing."""
    efficiency: tuple[float, ...]
    """Achieved FLOP/s over `peak_tflops` at each shape."""
    peak_tflops: float = Field(gt=0)
    """The peak the efficiencies are relative to (the GPU preset's datasheet peak in `dtype`), TFLOP/s."""
    dtype: str = "bf16"
    """Element type of the measured GEMMs."""

    @model_validator(mode="after")
    def _points(self) -> GemmTable:
        """One efficiency per shape, FLOPs increasing."""
        _increasing("shapes (FLOPs)", tuple(self.flops()), self.efficiency)
        return self

    def flops(self) -> list[float]:
        """2 x groups x m x n x k of each shape."""
        return [2.0 * g * m * n * k for g, m, n, k in self.shapes]


class RateTables(BaseModel):
    """What a calibration measured (or a published source gives) for collectives and GEMMs on one node."""

    model_config = _FROZEN

    source: str
    """Where the figures come from: the measurement (command, backend, device, date) or the publication."""
    collectives: tuple[CollectiveTable, ...] = ()
    """One curve per (collective, ranks, placement); a placement with none keeps the alpha-beta formula."""
    gemms: tuple[GemmTable, ...] = ()
    """At most one table per kind; a kind with none keeps the formula."""

    @model_validator(mode="after")
    def _distinct(self) -> RateTables:
        """One curve per (collective, ranks, placement) and one GEMM table per kind."""
        keys = [(c.collective, c.ranks, c.placement) for c in self.collectives]
        if len(set(keys)) != len(keys):
            raise ValueError("collectives: two curves for the same (collective, ranks, placement)")
        kinds = [g.kind for g in self.gemms]
        if len(set(kinds)) != len(kinds):
            raise ValueError("gemms: two tables of the same kind")
        return self


def bus_factor(collective: str, n: Array | float) -> Array:
    """busbw / algbw of `collective` over n ranks [NCCL-T]: 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    n_arr = np.asarray(n, dtype=np.float64)
    out: Array = BUS_FACTOR[collective] * (n_arr - 1.0) / np.maximum(n_arr, 1.0)
    return out


def interp_log(xs: tuple[float, ...] | list[float], ys: tuple[float, ...] | list[float], x: Array | float) -> Array:
    """ys linear in log(xs) at `x`, flat beyond the first and last points."""
    out: Array = np.interp(np.log(np.maximum(np.asarray(x, dtype=np.float64), 1e-300)),
                           np.log(np.asarray(xs, dtype=np.float64)), np.asarray(ys, dtype=np.float64))
    return out


def collective_busbw_gbps(tables: RateTables, collective: str, n: Array | float, inside: NDArray[np.bool_] | bool,
                          size: Array | float) -> Array:
    """Bus bandwidth (GB/s) of `collective` at each plan's group size `n`, placement (`inside` a node or not) and
    message `size` from the tables (module docstring: log-size then log-n interpolation); NaN where the placement
    has no curve for this collective."""
    n_arr, size_arr = np.broadcast_arrays(np.asarray(n, dtype=np.float64), np.asarray(size, dtype=np.float64))
    inside_arr = np.broadcast_to(np.asarray(inside, dtype=bool), n_arr.shape)
    out = np.full(n_arr.shape, np.nan)
    for placement, where in (("intra_node", inside_arr), ("inter_node", ~inside_arr)):
        curves = sorted((c for c in tables.collectives if c.collective == collective and c.placement == placement),
                        key=lambda c: c.ranks)
        if not curves or not where.any():
            continue
        at_size = np.stack([interp_log(c.sizes_bytes, c.busbw_gbps, size_arr) for c in curves])  # (curves, ...)
        ranks = np.log(np.array([c.ranks for c in curves], dtype=np.float64))
        x = np.clip(np.log(np.maximum(n_arr, 1.0)), ranks[0], ranks[-1])
        hi = np.clip(np.searchsorted(ranks, x), 1, len(ranks) - 1) if len(ranks) > 1 else np.zeros(x.shape, int)
        lo = np.maximum(hi - 1, 0)
        span = np.where(hi > lo, ranks[hi] - ranks[lo], 1.0)
        w = np.where(hi > lo, (x - ranks[lo]) / span, 0.0)
        pick = np.take_along_axis
        low = pick(at_size, lo[None, ...], axis=0)[0]
        high = pick(at_size, hi[None, ...], axis=0)[0]
        out = np.where(where, low + w * (high - low), out)
    return out


def collective_time_s(tables: RateTables | None, collective: str, n: Array | float,
                      inside: NDArray[np.bool_] | bool, size: Array | float, formula: Array) -> Array:
    """Time of `collective` from the measured bus bandwidth, t = size x bus_factor / busbw [NCCL-T], where the
    tables cover the plan's placement; `formula` (returned as is) elsewhere and when there are no tables; 0 for
    groups of one rank."""
    if tables is None:
        return formula
    busbw = collective_busbw_gbps(tables, collective, n, inside, size)
    n_arr = np.asarray(n, dtype=np.float64)
    measured = np.asarray(size, dtype=np.float64) * bus_factor(collective, n_arr) / (np.where(np.isnan(busbw), 1.0,
                                                                                              busbw) * 1e9)
    out: Array = np.where(n_arr > 1, np.where(np.isnan(busbw), formula, measured), 0.0)
    return out


def gemm_efficiency(tables: RateTables | None, kind: GemmKind, flops: Array | float) -> Array | None:
    """Measured efficiency (achieved / the table's peak) of a `kind` GEMM of `flops` FLOPs, linear in log(FLOPs),
    flat beyond the measured shapes; None when there is no table of that kind."""
    table = next((g for g in tables.gemms if g.kind == kind), None) if tables is not None else None
    if table is None:
        return None
    return interp_log(table.flops(), table.efficiency, flops)


# GEMMs one transformer layer's forward runs (Megatron-Core with Transformer Engine: attention linear_qkv and
# linear_proj, MLP linear_fc1 (gate and up fused) and linear_fc2; megatron/core/transformer/attention.py, mlp.py),
# and the grouped GEMMs of the routed experts (moe/experts.py TEGroupedMLP: linear_fc1, linear_fc2).
LAYER_GEMMS = 4.0
EXPERT_GEMMS = 2.0


def gemm_size(tables: RateTables | None, kind: GemmKind, flops: Array, gemms: float, ceiling: float,
              half_flops: float) -> Array:
    """The size factor of `flops` FLOPs of GEMMs (a layer's `gemms` GEMMs together) relative to the efficiency
    ceiling: without a `kind` table the formula F / (F + half_flops) (evaluators.step_terms: small GEMMs fill fewer
    tiles and waves), computed as before; with one, the measured efficiency of a GEMM of F / gemms FLOPs over the
    ceiling, so the GEMMs run at the measured efficiency (and what scales with the size factor, attention and the
    routed experts' relative size, follows the measured curve)."""
    measured = gemm_efficiency(tables, kind, flops / gemms)
    if measured is None:
        out: Array = flops / (flops + half_flops)
        return out
    return measured / ceiling


def tables_summary(tables: RateTables) -> list[str]:
    """One line per measured table for `explain`: which figures come from it."""
    lines = []
    for coll in COLLECTIVES:
        for placement in ("intra_node", "inter_node"):
            ranks = sorted(c.ranks for c in tables.collectives if c.collective == coll and c.placement == placement)
            if ranks:
                lines.append(f"{coll} {placement.replace('_', ' ')}: measured busbw at {len(ranks)} group size(s) "
                             f"({', '.join(map(str, ranks))} ranks)")
    for g in tables.gemms:
        lines.append(f"{g.kind} GEMM efficiency: measured at {len(g.shapes)} shape(s) ({g.dtype}, vs "
                     f"{g.peak_tflops:g} TFLOP/s)")
    return lines


def joined(first: RateTables, more: RateTables) -> RateTables:
    """`first`'s curves and GEMM tables, and those of `more` that `first` has no curve (collective, ranks,
    placement) or table kind for: a node's own measurement joined by a multi-node one's cross-node curves."""
    have = {(c.collective, c.ranks, c.placement) for c in first.collectives}
    kinds = {g.kind for g in first.gemms}
    return RateTables(source=f"{first.source}; {more.source}",
                      collectives=(*first.collectives,
                                   *(c for c in more.collectives if (c.collective, c.ranks, c.placement) not in have)),
                      gemms=(*first.gemms, *(g for g in more.gemms if g.kind not in kinds)))
