"""Refit the analytic model's constants on a study's own measured trials (never on other studies).

Time: the achieved matmul efficiency (attention efficiency moves with it), the per-layer fixed cost
(`half_efficiency_gflop`), the per-layer launch floor and the per-step overhead are fitted to the measured
step times; memory: allocator fragmentation and the per-rank context are fitted to the measured peaks.
Loss: mean squared log error (a 2x miss costs the same whether too fast or too slow). Search: coordinate
descent over a multiplicative grid within each field's bounds, sweeps until no field improves (at most 8).
With fewer runs than constants the fit is underdetermined but still moves predictions of similar plans toward
what was measured. Deterministic, no scipy.

A refit must earn its place (`refit_step`): the time constants and the memory constants are
each adopted only when the refit procedure predicts runs it was not fitted on better than the calibration in
force: leave-one-out over the study's latest HELD_OUT runs (each held out in turn, the rest refitted, the held-out
run predicted; median relative error), against the calibration in force's median error on the same runs. Else
the previous constants stay and the calibration line says so (CalibrationStep.adopted/note).
Measured OOMs inform the memory fit as a lower bound: the run died at the device's memory (the harness's cap is
the scenario's HBM), so its true peak is above it; a prediction below it costs (log HBM - log predicted)^2, one
above it nothing (a one-sided, hinge loss; `fitting.lower_bound_loss`).
Memory error (`memory_error`): the MEAN relative error over the ok runs' peaks and the OOM runs' shortfalls
(HBM / predicted - 1 where the prediction is below the HBM the run died at, else 0), not a median: a peak is
deterministic to the allocator's granularity (no noisy host to be robust against), and each miss decides
whether a plan fits, so an OOM the model did not see coming counts in the figure and in the judgement of a
refit (each OOM run held out in turn, as the ok runs are). Step time keeps the median: timed steps carry a
loaded host's outliers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from stratagem.evaluators import Calibration, Evaluation
from stratagem.evaluators.calibration import LogMultipliers, default_calibration
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.fitting import (
    descend,
    lower_bound_loss,
    median_error,
)
from stratagem.evaluators.memory import overhead_bytes, rank_memory_columns
from stratagem.evaluators.posterior import MEMORY_FREE
from stratagem.evaluators.timing import time_columns, time_factors
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["CalibrationStep", "calibration_history", "CalibrationFit", "fit_calibration", "refit_step",
           "calibration_id", "fields_to_fit", "TIME_FIELDS", "MEMORY_FIELDS", "HELD_OUT", "usable_runs", "oom_runs",
           "memory_error", "oom_shortfall"]

Array = NDArray[np.float64]
TIME_FIELDS: tuple[str, ...] = ("matmul_efficiency", "half_efficiency_gflop", "layer_floor_ms", "step_overhead_s")
MEMORY_FIELDS: tuple[str, ...] = ("fragmentation", "context_gib")


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
    """Mean relative peak-memory error before: ok runs' peaks and OOM runs' shortfalls (`memory_error`)."""
    memory_error_after: float
    """Mean relative peak-memory error after (`memory_error`)."""
    adopted: bool = True
    """Whether the refitted constants replaced the previous ones (False: the refit did not earn its place)."""
    note: str = ""
    """Why a refit was refused, or how it was judged ('' when there is nothing to say)."""
    step_error_held_out: float | None = None
    """Median step-time error of the refit on runs it was not fitted on (leave-one-out); None: not judged."""
    memory_error_held_out: float | None = None
    """Mean peak-memory error of the refit on held-out runs, OOMs included (`memory_error`); None: not judged."""
    calibration_id: str = ""
    """calibration_id() of the calibration in force after this step (re-predicted trials carry it)."""
    ooms: int = 0
    """Measured OOM runs the memory fit used as lower bounds."""
    multipliers_adopted: tuple[Literal["time", "memory"], ...] = ()
    """The per-term multipliers (search/multiplier_refit.py) this step adopted: time, memory, both or none."""
    multiplier_step_error_held_out: float | None = None
    """Leave-one-out median step-time error of the time multipliers' fit; None: not judged."""
    multiplier_memory_error_held_out: float | None = None
    """Leave-one-out memory error of the memory multipliers' fit (OOMs included); None: not judged."""


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
    """Mean relative peak-memory error before the fit, OOM shortfalls included (`memory_error`)."""
    memory_error_after: float
    adopted: bool = True
    """Whether any refitted constant replaced the previous one (refit_step; fit_calibration always adopts)."""
    note: str = ""
    """How the refit was judged (refit_step)."""
    time_error_held_out: float | None = None
    """Leave-one-out median step-time error of the refit procedure (refit_step)."""
    memory_error_held_out: float | None = None
    """Leave-one-out mean peak-memory error, OOMs included (refit_step)."""
    ooms: int = 0
    """OOM runs used as lower bounds on the memory fit."""
    took: tuple[str, ...] = ()
    """The groups of constants this refit adopted: "time" and/or "memory" (refit_step)."""
    folds: tuple[Calibration, ...] = ()
    """The leave-one-out refits (refit_step): one per held-out ok run (the latest HELD_OUT), then one per held-out
    OOM run; a later fit judged on the same runs starts each fold from these constants."""

    def step(self, measured: int) -> CalibrationStep:
        """This fit as the study's calibration-history entry."""
        return CalibrationStep(measured=measured, runs_used=self.runs, step_error_before=self.time_error_before,
                               step_error_after=self.time_error_after, memory_error_before=self.memory_error_before,
                               memory_error_after=self.memory_error_after, adopted=self.adopted, note=self.note,
                               step_error_held_out=self.time_error_held_out,
                               memory_error_held_out=self.memory_error_held_out,
                               calibration_id=calibration_id(self.calibration), ooms=self.ooms)


def usable_runs(measured: Sequence[Evaluation]) -> list[Evaluation]:
    """The measured ok runs with a step time and a peak (what a time or memory fit can use)."""
    return [e for e in measured if e.fidelity == "measured" and e.status == "ok" and e.measurements
            and e.memory is not None and "step_s" in e.measurements]


def oom_runs(measured: Sequence[Evaluation]) -> list[Evaluation]:
    """The measured OOM runs (a peak above the device's memory)."""
    return [e for e in measured if e.fidelity == "measured" and e.status == "oom"]


def oom_shortfall(pred: Array, bound: float) -> Array:
    """Relative shortfall of predicted peaks below the memory an OOM run died at: bound / pred - 1 where the
    prediction is below it, else 0 (a prediction above it is not wrong: the run did not fit)."""
    return np.maximum(0.0, bound / np.maximum(pred, 1e-300) - 1.0)


def memory_error(pred: Array, measured: Array, oom_pred: Array, bound: float) -> float:
    """Mean relative error of peak memory over ok runs (|pred / measured - 1|) and OOM runs (`oom_shortfall`);
    0 without runs (module docstring: a mean, not a median)."""
    errors = np.concatenate([np.abs(pred / measured - 1.0), oom_shortfall(oom_pred, bound)])
    return float(errors.mean()) if errors.size else 0.0


# The coordinate descent lives in evaluators.fitting (shared with the hardware calibration, which must not
# import this package: stratagem.search imports optuna).
HELD_OUT = 6
"""Runs held out in turn when a refit is judged (the latest ones): leave-one-out costs one fit per held-out run."""
LOO_SWEEPS = 2
"""Coordinate-descent sweeps of each leave-one-out refit (warm-started; see _held_out)."""


def calibration_id(cal: Calibration) -> str:
    """A short stable id of a calibration's constants (re-predicted trials carry the id they were made with)."""
    import hashlib
    import json

    data = cal.model_dump(mode="json")
    for key in ("time_multipliers", "memory_multipliers"):  # absent ones leave the ids of earlier studies as they were
        if data[key] is None:
            del data[key]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def fields_to_fit(fields: Sequence[str], runs: int) -> tuple[str, ...]:
    """Fewer constants than measured runs: the first `runs - 1` of `fields` (ordered global scale first: matmul
    efficiency, fragmentation), so a fit never interpolates its runs exactly. One run refits nothing (it cannot
    tell a model error from noise); two move only the scale. bench/search_regret.py measured on the published
    sweep that refitting all four time constants on 1-3 runs ranks the remaining plans worse than no refit."""
    return tuple(fields[: max(0, min(len(fields), runs - 1))])


class _Predictions:
    """The model's figures for every run of one refit, cached per calibration: the full fit, each leave-one-out
    fold (a subset of the runs) and the judgement all read them from here. Exact (bit for bit the model's): the
    model predicts each plan alone (time_columns and rank_memory_columns are row by row), so a fold's figures are
    the rows of these, and the folds' descents, warm-started at one fit, try the same calibrations again and
    again. As the memory blocks are kept apart from the two memory constants (`stage_blocks`), the step time's
    terms are kept apart from the per-step overhead constant, which only adds (`_terms`): a descent's grid over
    step_overhead_s costs no model evaluation."""

    def __init__(self, scenario: Scenario, runs: Sequence[Evaluation], ooms: Sequence[Evaluation]) -> None:
        self.scenario = scenario
        self.pc = PlanColumns.from_plans([e.plan for e in runs])
        self.oom_pc = PlanColumns.from_plans([e.plan for e in ooms]) if ooms else None
        self._terms: dict[Key, tuple[Array, Array]] = {}
        self._blocks: dict[tuple[bool, Key], tuple[Array, Array]] = {}

    def step(self, cal: Calibration) -> Array:
        """Predicted step seconds of the ok runs: evaluate_many's step_s, without the memory, checkpoint and
        zone columns a time fit does not read (time_columns is independent of them), summed as time_columns sums
        it: the other terms, then overhead = (step_overhead_s + the launch waits) x its multiplier."""
        return _summed(cal, *self.terms(cal))

    def terms(self, cal: Calibration) -> tuple[Array, Array]:
        """(compute + recompute + exposed comm + bubble + optimizer, in time_columns' order; the overhead column
        less step_overhead_s, before its multiplier) at `cal`, computed once per value of the other constants:
        time_columns at step_overhead_s 0 and an overhead multiplier of exactly 1 (exp(0))."""
        key = _terms_key(cal)
        if key not in self._terms:
            self._terms[key] = _rest_and_waits(time_columns(self.scenario, self.pc, _bare(cal)))
        return self._terms[key]

    def stage_blocks(self, cal: Calibration, ooms: bool) -> tuple[Array, Array]:
        """Both end stages' blocks without the overhead block, at `cal`'s constants other than the fitted memory
        ones, computed once per plan set and constants but the time constants the memory model does not read
        (posterior.MEMORY_FREE): a memory fit varies only fragmentation and context, a fold the time constants."""
        key = (ooms, _key(cal, _BLOCKS_FREE))
        pc = self.oom_pc if ooms and self.oom_pc is not None else self.pc
        if key not in self._blocks:
            raw = cal.model_copy(update=_OVERHEAD_FREE)
            stages = (rank_memory_columns(self.scenario, pc, raw, s) for s in ("first", "last"))
            first, last = (np.stack([m[b] for b in BLOCKS[:-1]]) for m in stages)
            self._blocks[key] = (first, last)
        return self._blocks[key]


class _Data:
    """The measured runs a fit sees: ok runs (step time, peak) and OOM runs (a peak above the device's memory),
    rows `rows` / `oom_rows` of one refit's `_Predictions` (a fold's subset shares its cache)."""

    def __init__(self, scenario: Scenario, runs: Sequence[Evaluation], ooms: Sequence[Evaluation],
                 shared: tuple[_Predictions, NDArray[np.intp], NDArray[np.intp]] | None = None) -> None:
        self.scenario = scenario
        self.runs, self.ooms = list(runs), list(ooms)
        if shared is None:
            shared = (_Predictions(scenario, self.runs, self.ooms), np.arange(len(self.runs)),
                      np.arange(len(self.ooms)))
        self.predictions, self.rows, self.oom_rows = shared
        self.step = np.array([float(e.measurements["step_s"]) for e in self.runs if e.measurements])
        self.peak = np.array([e.memory.peak_gib for e in self.runs if e.memory])
        self.bound = scenario.cluster.gpu.hbm_gib  # the harness's cap: an OOM run's peak was above it

    def subset(self, keep: Sequence[int]) -> _Data:
        return _Data(self.scenario, [self.runs[i] for i in keep], self.ooms,
                     (self.predictions, self.rows[list(keep)], self.oom_rows))

    def without_oom(self, i: int) -> _Data:
        keep = [k for k in range(len(self.ooms)) if k != i]
        return _Data(self.scenario, self.runs, [self.ooms[k] for k in keep],
                     (self.predictions, self.rows, self.oom_rows[keep]))

    def predict(self, cal: Calibration) -> tuple[Array, Array]:
        return self.predict_step(cal), self.predict_peak(cal)

    def predict_step(self, cal: Calibration) -> Array:
        """Predicted step seconds of the ok runs (_Predictions.step)."""
        out: Array = self.predictions.step(cal)[self.rows]
        return out

    def predict_peak(self, cal: Calibration, ooms: bool = False) -> Array:
        """Predicted peak GiB of the ok runs' plans (or of the OOM runs' plans): evaluate_many's peak_gib alone,
        from the plans' cached blocks (`_Predictions.stage_blocks`)."""
        rows = self.oom_rows if ooms else self.rows
        first, last = self.predictions.stage_blocks(cal, ooms)
        return _peak_gib((first[:, rows], last[:, rows]), cal)

    def predict_ooms(self, cal: Calibration) -> Array:
        """Predicted peaks of the OOM runs' plans (empty without OOM runs)."""
        return np.empty(0) if not self.ooms else self.predict_peak(cal, ooms=True)

    def memory_error(self, peak_pred: Array, oom_pred: Array, held: slice | None = None) -> float:
        """`memory_error` of predictions of the ok runs (`held`: of those runs only) and of the OOM runs."""
        measured = self.peak if held is None else self.peak[held]
        return memory_error(peak_pred, measured, oom_pred, self.bound)

    def time_loss(self, cal: Calibration) -> float:
        return float(np.mean((np.log(self.predict_step(cal)) - np.log(self.step)) ** 2))

    def memory_loss(self, cal: Calibration) -> float:
        loss = float(np.sum((np.log(self.predict_peak(cal)) - np.log(self.peak)) ** 2))
        if self.ooms:
            loss += lower_bound_loss(self.predict_ooms(cal), self.bound)
        return loss / (len(self.runs) + len(self.ooms))


Key = tuple[Any, ...]
"""A cache key of a calibration: its fields' values but some (`_key`)."""


def _key(cal: Calibration, without: frozenset[str]) -> Key:
    """The values of `cal`'s fields but those `without`, in field order (cheaper than a JSON dump)."""
    return tuple(v for k, v in cal if k not in without)


def _terms_key(cal: Calibration) -> Key:
    """The key of `_bare(cal)` (its terms), without making it."""
    return (*_key(cal, _TERMS_FREE), _overhead_at_one(cal.time_multipliers))


_TERMS_FREE = frozenset({"step_overhead_s", "time_multipliers"})


def _bare(cal: Calibration) -> Calibration:
    """`cal` at step_overhead_s 0 and an overhead multiplier of exactly 1 (what `_Predictions.terms` evaluates)."""
    return cal.model_copy(update={"step_overhead_s": 0.0, "time_multipliers": _overhead_at_one(cal.time_multipliers)})


def _rest_and_waits(cols: dict[str, Array]) -> tuple[Array, Array]:
    """(compute + recompute + exposed comm + bubble + optimizer, as time_columns sums them; the overhead column)."""
    rest = cols["compute_s"] + cols["recompute_s"] + cols["exposed_comm_s"] + cols["bubble_s"] + cols["optimizer_s"]
    return rest, cols["overhead_s"]


def _summed(cal: Calibration, rest: Array, waits: Array) -> Array:
    """Step seconds under `cal` from `_rest_and_waits` at its bare calibration: overhead = (step_overhead_s + the
    launch waits) x its multiplier, added last, as time_columns adds it."""
    overhead = cal.step_overhead_s + waits
    if cal.time_multipliers is not None:
        overhead = overhead * time_factors(cal)["overhead_s"]
    out: Array = rest + overhead
    return out


def _overhead_at_one(m: LogMultipliers | None) -> LogMultipliers | None:
    """`m` with the overhead term's log multiplier at 0 (its factor exp(0) = 1 exactly)."""
    if m is None or "overhead_s" not in m.names:
        return m
    i = m.names.index("overhead_s")
    return m.model_copy(update={"mean": (*m.mean[:i], 0.0, *m.mean[i + 1:])})


_OVERHEAD_FREE: dict[str, Any] = {"fragmentation": 0.0, "context_gib": 0.0, "memory_multipliers": None}
"""The calibration fields that enter only the overhead block (memory.rank_memory_columns): zeroed for the cache."""
_BLOCKS_FREE = frozenset({*_OVERHEAD_FREE, *MEMORY_FREE})
"""The fields a plan's memory blocks but the overhead do not depend on (stage_blocks' key leaves them out)."""


def _peak_gib(stages: tuple[Array, Array], cal: Calibration) -> Array:
    """The worst stage's peak GiB under `cal` from both end stages' other blocks, as memory.rank_memory_columns
    adds them: overhead = fragmentation x allocated + context (before the multipliers), each block times its
    multiplier, the last stage where its peak is larger (memory_columns)."""
    f = cal.memory_multipliers.factors() if cal.memory_multipliers is not None else None
    peaks = []
    for blocks in stages:
        allocated = blocks[0] + blocks[1] + blocks[2] + blocks[3] + blocks[4]  # BLOCKS order, as the model sums
        overhead = overhead_bytes(allocated, cal)
        if f is None:
            peaks.append(allocated + overhead)
            continue
        parts = [*(blocks[i] * f.get(b, 1.0) for i, b in enumerate(BLOCKS[:-1])), overhead * f.get("overhead", 1.0)]
        peaks.append(sum(parts, np.zeros(blocks.shape[1])))
    first, last = peaks
    worst: Array = np.where(last > first, last, first) / GIB
    return worst


def _fit(data: _Data, start: Calibration, sweeps: int = 8) -> Calibration:
    fitted = descend(start, fields_to_fit(TIME_FIELDS, len(data.runs)), data.time_loss, sweeps=sweeps)
    return descend(fitted, fields_to_fit(MEMORY_FIELDS, len(data.runs) + len(data.ooms)), data.memory_loss,
                    sweeps=sweeps)


def fit_calibration(scenario: Scenario, measured: Sequence[Evaluation],
                    base: Calibration | None = None, refit: bool = True) -> CalibrationFit:
    """Fit TIME_FIELDS on measured step times and MEMORY_FIELDS on measured peaks (and OOM lower bounds) of
    `measured`, starting at `base` (refit=False: keep `base`; the errors before and after are then both
    `base`'s). Adopts the fit unconditionally: the loop judges it with `refit_step`."""
    base = base or default_calibration(scenario.cluster.gpu.name)  # the device's defaults
    runs = usable_runs(measured)
    if not runs:
        return CalibrationFit(base, 0, 0.0, 0.0, 0.0, 0.0, ooms=len(oom_runs(measured)))
    data = _Data(scenario, runs, oom_runs(measured))
    fitted = _fit(data, base) if refit else base
    before_t, before_m = data.predict(base)
    after_t, after_m = data.predict(fitted)
    return CalibrationFit(
        calibration=fitted, runs=len(runs),
        time_error_before=median_error(before_t, data.step), time_error_after=median_error(after_t, data.step),
        memory_error_before=data.memory_error(before_m, data.predict_ooms(base)),
        memory_error_after=data.memory_error(after_m, data.predict_ooms(fitted)),
        ooms=len(data.ooms),
    )


def _held_out(data: _Data, candidate: Calibration) -> tuple[Array, Array, Array, list[Calibration]]:
    """Leave-one-out predictions (step, peak) of the latest HELD_OUT ok runs and (peak) of the latest HELD_OUT OOM
    runs: each refitted without it, warm-started at the full fit `candidate` (which the held-out run helped
    make) with LOO_SWEEPS sweeps of the full grid (1/16..16): the descent can move anywhere the other runs pull,
    at a fraction of a fit from the defaults."""
    n = len(data.runs)
    held = list(range(max(0, n - HELD_OUT), n))
    step, peak = np.empty(len(held)), np.empty(len(held))
    folds = []
    for j, i in enumerate(held):
        fitted = _fit(data.subset([k for k in range(n) if k != i]), candidate, sweeps=LOO_SWEEPS)
        s, p = data.subset([i]).predict(fitted)
        step[j], peak[j] = s[0], p[0]
        folds.append(fitted)
    oom = np.empty(len(_held_ooms(data)))
    for j, i in enumerate(_held_ooms(data)):
        fitted = _fit(data.without_oom(i), candidate, sweeps=LOO_SWEEPS)
        oom[j] = data.predict_ooms(fitted)[i]
        folds.append(fitted)
    return step, peak, oom, folds


def _kept_fields(take_time: bool, take_memory: bool) -> list[str]:
    """The constants a fold keeps from the calibration in force: those of the groups the refit did not adopt."""
    return ([] if take_time else [*TIME_FIELDS, "attention_efficiency"]) + ([] if take_memory else [*MEMORY_FIELDS])


def _held_ooms(data: _Data) -> list[int]:
    """Indices of the OOM runs held out in turn (the latest HELD_OUT)."""
    return list(range(max(0, len(data.ooms) - HELD_OUT), len(data.ooms)))


def refit_step(scenario: Scenario, measured: Sequence[Evaluation], base: Calibration, current: Calibration,
               refit: bool = True) -> CalibrationFit:
    """Refit on `measured` from `base` and keep each group of constants (time, memory) only where the refit
    predicts held-out runs better than `current` (the calibration in force) does (see the module docstring).
    The errors "after" are those of the calibration in force after the step."""
    runs, ooms = usable_runs(measured), oom_runs(measured)
    if not runs:
        note = (f"{len(ooms)} OOM run(s), no step time to fit; constants unchanged" if ooms
                else "no measured run to fit; constants unchanged")
        return CalibrationFit(current, 0, 0.0, 0.0, 0.0, 0.0, adopted=False, note=note, ooms=len(ooms))
    data = _Data(scenario, runs, ooms)
    now_t, now_m = data.predict(current)
    now_oom = data.predict_ooms(current)
    before = (median_error(now_t, data.step), data.memory_error(now_m, now_oom))
    if not refit:
        return CalibrationFit(current, len(runs), before[0], before[0], before[1], before[1], adopted=False,
                              note="refit off", ooms=len(ooms))
    if len(runs) < 3:
        return CalibrationFit(current, len(runs), before[0], before[0], before[1], before[1], adopted=False,
                              ooms=len(ooms), note=f"{len(runs)} run(s): a refit cannot be judged on held-out runs "
                                                   "before 3; constants unchanged")
    candidate = _fit(data, base)
    loo_t, loo_m, loo_oom, folds = _held_out(data, candidate)
    held = slice(max(0, len(runs) - HELD_OUT), len(runs))
    held_oom = _held_ooms(data)
    loo = (median_error(loo_t, data.step[held]), data.memory_error(loo_m, loo_oom, held))
    incumbent = (median_error(now_t[held], data.step[held]), data.memory_error(now_m[held], now_oom[held_oom], held))
    take_time, take_memory = loo[0] < incumbent[0], loo[1] < incumbent[1]
    update: dict[str, Any] = {}
    if take_time:
        update.update({f: getattr(candidate, f) for f in (*TIME_FIELDS, "attention_efficiency")})
    if take_memory:
        update.update({f: getattr(candidate, f) for f in MEMORY_FIELDS})
    cal = current.model_copy(update=update)
    after_t, after_m = data.predict(cal)
    after_oom = data.predict_ooms(cal)
    parts = []
    for what, took, i in (("step time", take_time, 0), ("memory", take_memory, 1)):
        verb = "adopted" if took else "refused"
        parts.append(f"{what} refit {verb} (held-out error {loo[i]:.0%} vs {incumbent[i]:.0%})")
    return CalibrationFit(
        calibration=cal, runs=len(runs), time_error_before=before[0], memory_error_before=before[1],
        time_error_after=median_error(after_t, data.step), memory_error_after=data.memory_error(after_m, after_oom),
        adopted=take_time or take_memory, note="; ".join(parts), time_error_held_out=loo[0],
        memory_error_held_out=loo[1], ooms=len(ooms),
        took=tuple(g for g, took in (("time", take_time), ("memory", take_memory)) if took),
        folds=tuple(f.model_copy(update={k: getattr(current, k) for k in _kept_fields(take_time, take_memory)})
                    for f in folds))
