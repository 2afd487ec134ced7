"""Fit the Calibration constants that one node's calibration runs inform (`stratagem calibrate`).

Three stages, each minimising the mean squared log error by coordinate descent, a Nelder-Mead polish (for the
curved valleys between coupled constants) and a refining descent to 0.2 % steps (evaluators.fitting):

1. compute, on the single-device runs' step times: matmul efficiency (attention efficiency moves with it),
   the small-GEMM half point `half_efficiency_gflop`, the per-layer launch floor and the per-step overhead;
2. memory, on every run's peak: allocator fragmentation and the per-rank context;
3. intra-node collectives, on the multi-device runs' step times with stage 1's constants held: the link
   efficiency (NVLink on a GPU node) and the per-ring-step software latency `collective_step_us`.

Each run is predicted on the scenario it ran on (its own world size and global batch), so single-device and
node runs share one fit. Numpy only: no torch, no optuna, no ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.analytic import evaluate_many
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.fitting import descend, median_error, polish
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["HardwareRun", "HardwareFit", "fit_hardware", "predict_runs", "COMPUTE_FIELDS", "MEMORY_FIELDS",
           "COMM_FIELDS"]

Array = NDArray[np.float64]
COMPUTE_FIELDS: tuple[str, ...] = ("matmul_efficiency", "half_efficiency_gflop", "layer_floor_ms",
                                   "step_overhead_s")
MEMORY_FIELDS: tuple[str, ...] = ("fragmentation", "context_gib")
COMM_FIELDS: tuple[str, ...] = ("overlap", "link_efficiency", "collective_step_us")


@dataclass(frozen=True)
class HardwareRun:
    """One calibration run: the plan, the scenario it ran on, and what it measured."""

    plan: Plan
    scenario: Scenario
    """The scenario of this run: one node of exactly plan.world_size devices, the run's global batch."""
    status: str
    """ok | oom | failed | infeasible | skipped (only ok runs are fitted)."""
    step_s: float = 0.0
    """Median measured step time, s."""
    peak_gib: float = 0.0
    """Measured peak memory of the worst rank, GiB (CUDA: max reserved + the context outside the allocator;
    CPU: the harness's tracked peak of live tensors)."""
    reason: str = ""
    """Why a run that is not ok failed."""
    result: dict[str, object] | None = field(default=None, compare=False)
    """The harness result (rank 0's dict), kept for the per-run files."""

    @property
    def ok(self) -> bool:
        """Measured successfully with a positive step time and peak."""
        return self.status == "ok" and self.step_s > 0 and self.peak_gib > 0


@dataclass(frozen=True)
class HardwareFit:
    """The fitted constants and the per-run predictions before and after."""

    calibration: Calibration
    base: Calibration
    """Where the fit started (the published defaults unless given)."""
    runs: tuple[HardwareRun, ...]
    """The ok runs, in the order of the arrays below."""
    step_before: tuple[float, ...]
    """Predicted step time of each run with `base`, s."""
    step_after: tuple[float, ...]
    peak_before: tuple[float, ...]
    """Predicted peak of each run with `base`, GiB."""
    peak_after: tuple[float, ...]

    def errors(self) -> dict[str, float]:
        """Median |predicted / measured - 1| of step time and peak, before and after the fit."""
        step = np.array([r.step_s for r in self.runs])
        peak = np.array([r.peak_gib for r in self.runs])
        return {"step_error_before": median_error(np.array(self.step_before), step),
                "step_error_after": median_error(np.array(self.step_after), step),
                "peak_error_before": median_error(np.array(self.peak_before), peak),
                "peak_error_after": median_error(np.array(self.peak_after), peak)}


class _Predictor:
    """Predicts a fixed list of runs: the runs grouped by scenario, each group's PlanColumns built once."""

    def __init__(self, runs: Sequence[HardwareRun]) -> None:
        self.n = len(runs)
        scenarios: list[Scenario] = []
        members: list[list[int]] = []
        for i, r in enumerate(runs):
            key = next((k for k, s in enumerate(scenarios) if s == r.scenario), None)
            if key is None:
                scenarios.append(r.scenario)
                members.append([])
                key = len(scenarios) - 1
            members[key].append(i)
        self.groups = [(scn, idx, PlanColumns.from_plans([runs[i].plan for i in idx]))
                       for scn, idx in zip(scenarios, members, strict=True)]

    def __call__(self, cal: Calibration) -> tuple[Array, Array]:
        step = np.zeros(self.n)
        peak = np.zeros(self.n)
        for scn, idx, pc in self.groups:
            cols = evaluate_many(scn, pc, cal)
            step[idx] = cols.step_s
            peak[idx] = cols.peak_gib
        return step, peak


def predict_runs(runs: Sequence[HardwareRun], cal: Calibration) -> tuple[Array, Array]:
    """(step_s, peak_gib) predicted for each run on its own scenario with `cal`."""
    return _Predictor(runs)(cal)


def _log_loss(pred: Array, meas: Array) -> float:
    if not len(meas):
        return 0.0
    bad = ~np.isfinite(pred) | (pred <= 0)
    if bad.any():
        return float("inf")
    return float(np.mean((np.log(pred) - np.log(meas)) ** 2))


def fit_hardware(runs: Sequence[HardwareRun], base: Calibration | None = None) -> HardwareFit:
    """Fit COMPUTE_FIELDS, MEMORY_FIELDS and COMM_FIELDS on the ok runs (see the module docstring); fields
    with no run to inform them keep `base`'s values."""
    base = base or Calibration()
    ok = tuple(r for r in runs if r.ok)
    single = [r for r in ok if r.plan.world_size == 1]
    multi = [r for r in ok if r.plan.world_size > 1]
    fitted = base
    if single:
        p1, meas = _Predictor(single), np.array([r.step_s for r in single])
        compute_loss = lambda c: _log_loss(p1(c)[0], meas)  # noqa: E731
        fitted = polish(descend(fitted, COMPUTE_FIELDS, compute_loss), COMPUTE_FIELDS, compute_loss)
        fitted = descend(fitted, COMPUTE_FIELDS, compute_loss, sweeps=0, refine=True)
    every = _Predictor(ok)
    if ok:
        meas_peak = np.array([r.peak_gib for r in ok])
        memory_loss = lambda c: _log_loss(every(c)[1], meas_peak)  # noqa: E731
        fitted = polish(descend(fitted, MEMORY_FIELDS, memory_loss), MEMORY_FIELDS, memory_loss)
        fitted = descend(fitted, MEMORY_FIELDS, memory_loss, sweeps=0, refine=True)
    if multi:
        p3, meas = _Predictor(multi), np.array([r.step_s for r in multi])
        comm_loss = lambda c: _log_loss(p3(c)[0], meas)  # noqa: E731
        fitted = polish(descend(fitted, COMM_FIELDS, comm_loss), COMM_FIELDS, comm_loss)
        fitted = descend(fitted, COMM_FIELDS, comm_loss, sweeps=0, refine=True)
    before = every(base)
    after = every(fitted)
    return HardwareFit(calibration=fitted, base=base, runs=ok,
                       step_before=tuple(map(float, before[0])), step_after=tuple(map(float, after[0])),
                       peak_before=tuple(map(float, before[1])), peak_after=tuple(map(float, after[1])))
