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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from stratagem.evaluators import Calibration, Evaluation, evaluate_many
from stratagem.evaluators.calibration import default_calibration
from stratagem.evaluators.fitting import FACTORS, candidates, coupled, descend, field_bounds, median_error
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = ["CalibrationStep", "calibration_history", "CalibrationFit", "fit_calibration", "fields_to_fit", "TIME_FIELDS", "MEMORY_FIELDS"]

Array = NDArray[np.float64]
TIME_FIELDS: tuple[str, ...] = ("matmul_efficiency", "half_efficiency_gflop", "layer_floor_ms", "step_overhead_s")
MEMORY_FIELDS: tuple[str, ...] = ("fragmentation", "context_gib")
_FACTORS = FACTORS


class CalibrationStep(BaseModel):
    """One refit of a study's calibration (one per batch of real runs): the study attribute
    "calibration_history" is a list of these, written by the search and read by status and the reports."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measured: int
    """Measured trials in the study when the refit ran."""
    runs_used: int
    """Measured runs the fit used (ok runs with a step time / peak)."""
    step_error_before: float
    """Median relative step-time error of the calibration in force before this refit."""
    step_error_after: float
    """Median relative step-time error of the calibration in force after it."""
    memory_error_before: float
    """Median relative peak-memory error before."""
    memory_error_after: float
    """Median relative peak-memory error after."""
    adopted: bool = True
    """Whether the refitted constants replaced the previous ones (False: the refit did not earn its place)."""
    note: str = ""
    """Why a refit was refused, or how it was judged ('' when there is nothing to say)."""


def calibration_history(raw: Any) -> list[CalibrationStep]:
    """The typed history from the study attribute (entries that are not a CalibrationStep are skipped: a
    study written by an older stratagem may hold other keys)."""
    out: list[CalibrationStep] = []
    for entry in raw or []:
        try:
            out.append(CalibrationStep.model_validate(entry))
        except ValueError:
            continue
    return out


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


# The coordinate descent lives in evaluators.fitting (shared with the hardware calibration, which must not
# import this package: stratagem.search imports optuna).
_bounds, _candidates, _descend = field_bounds, candidates, descend
_coupled, _median_error = coupled, median_error


def fields_to_fit(fields: Sequence[str], runs: int) -> tuple[str, ...]:
    """Fewer constants than measured runs: the first `runs - 1` of `fields` (ordered global scale first: matmul
    efficiency, fragmentation), so a fit never interpolates its runs exactly. One run refits nothing (it cannot
    tell a model error from noise); two move only the scale. bench/search_regret.py measured on the published
    sweep that refitting all four time constants on 1-3 runs ranks the remaining plans worse than no refit."""
    return tuple(fields[: max(0, min(len(fields), runs - 1))])


def fit_calibration(scenario: Scenario, measured: Sequence[Evaluation],
                    base: Calibration | None = None, refit: bool = True) -> CalibrationFit:
    """Fit TIME_FIELDS on measured step times and MEMORY_FIELDS on measured peaks of `measured`, starting at
    `base` (refit=False: keep `base`; the errors before and after are then both `base`'s)."""
    base = base or default_calibration(scenario.cluster.gpu.name)  # the device's defaults
    runs = _usable(measured)
    if not runs:
        return CalibrationFit(base, 0, 0.0, 0.0, 0.0, 0.0)
    pc = PlanColumns.from_plans([e.plan for e in runs])
    step = np.array([float(e.measurements["step_s"]) for e in runs if e.measurements])
    peak = np.array([e.memory.peak_gib for e in runs if e.memory])

    def predict(cal: Calibration) -> tuple[Array, Array]:
        cols = evaluate_many(scenario, pc, cal)
        return cols.step_s, cols.peak_gib

    def time_loss(cal: Calibration) -> float:
        return float(np.mean((np.log(predict(cal)[0]) - np.log(step)) ** 2))

    def memory_loss(cal: Calibration) -> float:
        return float(np.mean((np.log(predict(cal)[1]) - np.log(peak)) ** 2))

    before_t, before_m = predict(base)
    fitted = base
    if refit:
        fitted = _descend(fitted, fields_to_fit(TIME_FIELDS, len(runs)), time_loss)
        fitted = _descend(fitted, fields_to_fit(MEMORY_FIELDS, len(runs)), memory_loss)
    after_t, after_m = predict(fitted)
    return CalibrationFit(
        calibration=fitted, runs=len(runs),
        time_error_before=_median_error(before_t, step), time_error_after=_median_error(after_t, step),
        memory_error_before=_median_error(before_m, peak), memory_error_after=_median_error(after_m, peak),
    )
