"""Coordinate descent over Calibration fields: the fitting machinery shared by a study's refit
(search.calibrate) and a hardware calibration (evaluators.fit_hardware).

Each field is tried at its current value times a multiplicative grid, clipped to the field's bounds (read from
the pydantic constraints); sweeps repeat until no field improves the loss. `descend(..., refine=True)` then
repeats with finer grids (+-20 %, +-2 %, +-0.2 %) so that a value between the coarse grid's points is
reachable. Deterministic, numpy only (no scipy), no torch, no optuna.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import annotated_types
import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration

__all__ = ["FACTORS", "FINE_FACTORS", "field_bounds", "candidates", "coupled", "descend", "polish", "median_error",
           "lower_bound_loss"]

Array = NDArray[np.float64]
FACTORS: Array = np.exp(np.linspace(np.log(1 / 16), np.log(16), 33))
"""Coarse grid: 1/16 .. 16 in 32 log steps (x1.19 apart)."""
FINE_FACTORS: tuple[Array, ...] = tuple(np.exp(np.linspace(-w, w, 11)) for w in (np.log(1.2), np.log(1.02),
                                                                                  np.log(1.002)))
"""Refinement grids: +-20 %, +-2 %, +-0.2 % in 10 steps each."""


def field_bounds(name: str) -> tuple[float, float, bool]:
    """(lower, upper, lower is strict) from the Calibration field's constraints."""
    lo, hi, strict = 0.0, float("inf"), False
    for m in Calibration.model_fields[name].metadata:
        if isinstance(m, annotated_types.Ge):
            lo = float(m.ge)  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Gt):
            lo, strict = float(m.gt), True  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Le):
            hi = float(m.le)  # type: ignore[arg-type]
    return lo, hi, strict


def candidates(cal: Calibration, name: str, factors: Array = FACTORS) -> list[float]:
    """The current value times `factors`, clipped to the field's bounds (0 where allowed)."""
    lo, hi, strict = field_bounds(name)
    current = float(getattr(cal, name))
    base = current if current > 0 else 1e-3
    values = {float(min(hi, base * f)) for f in factors}
    values = {v for v in values if v > lo or (v == lo and not strict)}
    if lo == 0.0 and not strict:
        values.add(0.0)
    return sorted(values)


def coupled(cal: Calibration, name: str, value: float) -> dict[str, float]:
    """The update setting `name`: attention efficiency moves with matmul efficiency (same kernels' achieved
    fraction of peak)."""
    update = {name: value}
    if name == "matmul_efficiency" and cal.matmul_efficiency > 0:
        ratio = value / cal.matmul_efficiency
        update["attention_efficiency"] = float(min(1.0, cal.attention_efficiency * ratio))
    return update


def _sweeps(cal: Calibration, fields: Sequence[str], loss: Callable[[Calibration], float], factors: Array,
            sweeps: int) -> Calibration:
    best, best_loss = cal, loss(cal)
    for _ in range(sweeps):
        improved = False
        for name in fields:
            for value in candidates(best, name, factors):
                trial = best.model_copy(update=coupled(best, name, value))
                current = loss(trial)
                if current < best_loss - 1e-12:
                    best, best_loss, improved = trial, current, True
        if not improved:
            break
    return best


def descend(cal: Calibration, fields: Sequence[str], loss: Callable[[Calibration], float], sweeps: int = 8,
            refine: bool = False, refine_sweeps: int = 3) -> Calibration:
    """Minimise `loss` over `fields` from `cal` by coordinate descent on FACTORS (at most `sweeps` sweeps), then
    when `refine` on each of FINE_FACTORS (at most `refine_sweeps` sweeps each)."""
    best = _sweeps(cal, fields, loss, FACTORS, sweeps)
    if refine:
        for factors in FINE_FACTORS:
            best = _sweeps(best, fields, loss, factors, refine_sweeps)
    return best


def _clip(name: str, value: float) -> float:
    lo, hi, strict = field_bounds(name)
    floor = max(lo * (1 + 1e-9), 1e-12) if strict else lo
    return float(min(hi, max(floor, value)))


def polish(cal: Calibration, fields: Sequence[str], loss: Callable[[Calibration], float],
           iterations: int = 300) -> Calibration:
    """Nelder-Mead (Nelder & Mead 1965; standard coefficients 1, 2, 0.5, 0.5) over log(value) of `fields`
    from `cal`, clipped to the fields' bounds: follows the curved valleys (matmul efficiency vs the small-GEMM
    half point) that coordinate descent stalls in. Returns `cal` unless it finds a lower loss. A field at 0
    starts at 1e-6 (its log is otherwise undefined)."""
    names = list(fields)
    if not names:
        return cal

    def build(x: Array) -> Calibration:
        update: dict[str, float] = {}
        current = cal
        for name, v in zip(names, x, strict=True):
            update.update(coupled(current, name, _clip(name, float(np.exp(v)))))
            current = cal.model_copy(update=update)
        return current

    def f(x: Array) -> float:
        value = loss(build(x))
        return value if np.isfinite(value) else float("inf")

    x0 = np.log(np.array([max(float(getattr(cal, n)), 1e-6) for n in names]))
    simplex = [x0] + [x0 + np.eye(len(names))[i] * 0.3 for i in range(len(names))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-14:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    best = int(np.argmin(values))
    return build(simplex[best]) if values[best] < loss(cal) - 1e-15 else cal


def median_error(pred: Array, meas: Array) -> float:
    """Median |predicted / measured - 1| (0 for no runs)."""
    return float(np.median(np.abs(pred / meas - 1.0))) if len(meas) else 0.0


def lower_bound_loss(pred: Array, bound: float) -> float:
    """Sum of squared log shortfalls below a lower bound: max(0, log bound - log pred)^2 per value. A measured
    OOM says only that the peak exceeded the device's memory: a prediction above the bound costs nothing."""
    short = np.maximum(0.0, np.log(bound) - np.log(np.maximum(pred, 1e-300)))
    return float(np.sum(short**2))
