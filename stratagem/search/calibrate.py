"""Refit the analytic model's constants on a study's own measured trials (never on other studies).

Time: the achieved matmul efficiency (attention efficiency moves with it), the per-layer fixed cost
(`half_efficiency_gflop`), the per-layer launch floor and the per-step overhead are fitted to the measured
step times; memory: allocator fragmentation and the per-rank context are fitted to the measured peaks.
Loss: mean squared log error (a 2x miss costs the same whether too fast or too slow). Search: coordinate
descent over a multiplicative grid within each field's bounds, sweeps until no field improves (at most 8).
With fewer runs than constants the fit is underdetermined but still moves predictions of similar plans toward
what was measured. Deterministic, no scipy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import annotated_types
import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators import Calibration, Evaluation, evaluate_many
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = ["CalibrationFit", "fit_calibration", "TIME_FIELDS", "MEMORY_FIELDS"]

Array = NDArray[np.float64]
TIME_FIELDS: tuple[str, ...] = ("matmul_efficiency", "half_efficiency_gflop", "layer_floor_ms", "step_overhead_s")
MEMORY_FIELDS: tuple[str, ...] = ("fragmentation", "context_gib")
_FACTORS = np.exp(np.linspace(np.log(1 / 16), np.log(16), 33))


@dataclass(frozen=True)
class CalibrationFit:
    """The refitted constants and how well the model now matches the measured runs."""

    calibration: Calibration
    runs: int
    """Measured runs used."""
    time_error_before: float
    """Median |predicted / measured - 1| of step time before the fit."""
    time_error_after: float
    memory_error_before: float
    """Median |predicted / measured - 1| of peak memory before the fit."""
    memory_error_after: float


def _usable(measured: Sequence[Evaluation]) -> list[Evaluation]:
    return [e for e in measured if e.fidelity == "measured" and e.status == "ok" and e.measurements
            and e.memory is not None and "step_s" in e.measurements]


def _bounds(name: str) -> tuple[float, float, bool]:
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


def _candidates(cal: Calibration, name: str) -> list[float]:
    """The current value times a log grid of factors, clipped to the field's bounds (0 where allowed)."""
    lo, hi, strict = _bounds(name)
    current = float(getattr(cal, name))
    base = current if current > 0 else 1e-3
    values = {float(min(hi, base * f)) for f in _FACTORS}
    values = {v for v in values if v > lo or (v == lo and not strict)}
    if lo == 0.0 and not strict:
        values.add(0.0)
    return sorted(values)


def _descend(cal: Calibration, fields: Sequence[str], loss: Callable[[Calibration], float],
             sweeps: int = 8) -> Calibration:
    best, best_loss = cal, loss(cal)
    for _ in range(sweeps):
        improved = False
        for name in fields:
            for value in _candidates(best, name):
                trial = best.model_copy(update=_coupled(best, name, value))
                current = loss(trial)
                if current < best_loss - 1e-12:
                    best, best_loss, improved = trial, current, True
        if not improved:
            break
    return best


def _coupled(cal: Calibration, name: str, value: float) -> dict[str, float]:
    """Attention efficiency moves with matmul efficiency (same kernels' achieved fraction of peak)."""
    update = {name: value}
    if name == "matmul_efficiency" and cal.matmul_efficiency > 0:
        ratio = value / cal.matmul_efficiency
        update["attention_efficiency"] = float(min(1.0, cal.attention_efficiency * ratio))
    return update


def _median_error(pred: Array, meas: Array) -> float:
    return float(np.median(np.abs(pred / meas - 1.0))) if len(meas) else 0.0


def fit_calibration(scenario: Scenario, measured: Sequence[Evaluation],
                    base: Calibration | None = None) -> CalibrationFit:
    """Fit TIME_FIELDS on measured step times and MEMORY_FIELDS on measured peaks of `measured`."""
    base = base or Calibration()
    runs = _usable(measured)
    if not runs:
        return CalibrationFit(base, 0, 0.0, 0.0, 0.0, 0.0)
    pc = PlanColumns.from_plans([e.plan for e in runs])
    step = np.array([float(e.measurements["step_s"]) for e in runs if e.measurements])
    peak = np.array([e.memory.peak_gib for e in runs if e.memory])

    def predict(cal: Calibration) -> tuple[Array, Array]:
        cols = evaluate_many(scenario, pc, cal)
        return cols["step_s"], cols["peak_gib"]

    def time_loss(cal: Calibration) -> float:
        return float(np.mean((np.log(predict(cal)[0]) - np.log(step)) ** 2))

    def memory_loss(cal: Calibration) -> float:
        return float(np.mean((np.log(predict(cal)[1]) - np.log(peak)) ** 2))

    before_t, before_m = predict(base)
    fitted = _descend(base, TIME_FIELDS, time_loss)
    fitted = _descend(fitted, MEMORY_FIELDS, memory_loss)
    after_t, after_m = predict(fitted)
    return CalibrationFit(
        calibration=fitted, runs=len(runs),
        time_error_before=_median_error(before_t, step), time_error_after=_median_error(after_t, step),
        memory_error_before=_median_error(before_m, peak), memory_error_after=_median_error(after_m, peak),
    )
