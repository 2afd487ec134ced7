"""Vectorised Pareto (non-dominated) filter for many points and a few objectives.

Rows are first made minimisation problems and reduced to distinct objective vectors (equal vectors share
their fate: neither dominates the other). Sorted lexicographically, a row can only be dominated by an
earlier row, so for 3 objectives a row is dominated iff some earlier row is <= it in objectives 2 and 3: a
2-D staircase query answered with `searchsorted` over a prefix minimum. Divide and conquer over the sorted
order (front of the first half, drop second-half rows that front dominates, recurse on the survivors) makes
that O(n log^2 n) in numpy calls; 2 objectives need one prefix minimum; more fall back to blockwise pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["nondominated", "dominates"]

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
_LEAF = 128


def _minimisation(values: FloatArray, directions: Sequence[str]) -> FloatArray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2 or v.shape[1] != len(directions):
        raise ValueError(f"values must be (n, {len(directions)}); got {v.shape}")
    if any(d not in ("maximize", "minimize") for d in directions):
        raise ValueError(f"directions must be maximize/minimize, got {list(directions)}")
    sign = np.array([-1.0 if d == "maximize" else 1.0 for d in directions])
    out: FloatArray = v * sign
    return out


def dominates(a: FloatArray, b: FloatArray, directions: Sequence[str]) -> bool:
    """Whether point a dominates point b (no worse in every objective, better in one)."""
    x = _minimisation(np.asarray(a, dtype=np.float64)[None, :], directions)[0]
    y = _minimisation(np.asarray(b, dtype=np.float64)[None, :], directions)[0]
    return bool(np.all(x <= y) and np.any(x < y))


def nondominated(values: FloatArray, directions: Sequence[str]) -> NDArray[np.intp]:
    """Indices (ascending) of the rows no other row dominates. Rows must be finite."""
    v = _minimisation(values, directions)
    n, k = v.shape
    if n == 0:
        return np.zeros(0, dtype=np.intp)
    if not np.all(np.isfinite(v)):
        raise ValueError("nondominated: values must be finite (filter infeasible rows first)")
    order = np.lexsort(v.T[::-1])  # lexicographic: column 0 first
    s = v[order]
    distinct = np.ones(n, dtype=bool)
    distinct[1:] = np.any(s[1:] != s[:-1], axis=1)
    group = np.cumsum(distinct) - 1  # sorted row -> distinct vector number
    u = s[distinct]
    if k == 1:
        front_u = np.zeros(len(u), dtype=bool)
        front_u[0] = True
    elif k == 2:
        prev_min = np.minimum.accumulate(np.concatenate([[np.inf], u[:-1, 1]]))
        front_u = u[:, 1] < prev_min
    elif k == 3:
        front_u = _front3(u[:, 1], u[:, 2])
    else:
        front_u = _front_pairwise(u)
    on_front = front_u[group]
    return np.sort(order[on_front])


def _front3(y: FloatArray, z: FloatArray) -> BoolArray:
    """For distinct rows in lexicographic order: True where no earlier row has y <= and z <=."""
    n = len(y)
    if n <= _LEAF:
        le = (y[:, None] <= y[None, :]) & (z[:, None] <= z[None, :])  # le[j, i]: row j <= row i
        earlier = np.tri(n, n, -1, dtype=bool).T  # earlier[j, i]: j < i
        leaf: BoolArray = ~np.any(le & earlier, axis=0)
        return leaf
    half = n // 2
    front_a = _front3(y[:half], z[:half])
    fy, fz = y[:half][front_a], z[:half][front_a]
    stair = np.argsort(fy, kind="stable")
    sy = fy[stair]
    min_z = np.minimum.accumulate(fz[stair])
    yb, zb = y[half:], z[half:]
    pos = np.searchsorted(sy, yb, side="right")  # front-A rows with y <= yb
    dominated = (pos > 0) & (min_z[np.maximum(pos - 1, 0)] <= zb)
    survivors = np.flatnonzero(~dominated)
    front_b = np.zeros(n - half, dtype=bool)
    if survivors.size:
        front_b[survivors] = _front3(yb[survivors], zb[survivors])
    return np.concatenate([front_a, front_b])


def _front_pairwise(u: FloatArray, block: int = 1024) -> BoolArray:
    """Any number of objectives: rows of u (distinct) not dominated by any other row, blockwise."""
    n = len(u)
    keep = np.ones(n, dtype=bool)
    for start in range(0, n, block):
        rows = u[start:start + block]
        cand = np.flatnonzero(keep)
        c = u[cand]
        le = np.all(c[:, None, :] <= rows[None, :, :], axis=2)
        lt = np.any(c[:, None, :] < rows[None, :, :], axis=2)
        keep[start:start + block] &= ~np.any(le & lt, axis=0)
    return keep
