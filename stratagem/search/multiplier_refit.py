"""Refit the per-term multipliers (evaluators.posterior_fit) on a study's own measured runs, after the constants'
refit (search/calibrate.py `refit_step`), and keep them only when they predict held-out runs better.

Time: each ok run's step-time terms by the formulas at the constants in force (no multipliers) and its measured
step; memory: each ok run's worst-rank blocks and measured peak, each OOM run's blocks as a censored observation
(its peak was above the device's memory, the harness's cap). The prior is the calibration the search started
from (its own multipliers, else the device's prior widths, evaluators.priors); the noise floor the study's
run-to-run noise (search/noise.py) when a plan was measured twice. The fit uses every run; the fits judged are
leave-one-out: each of the latest HELD_OUT ok runs (and OOM runs, for memory) held out in turn, the rest fitted,
the held-out run predicted; adopted when that error (median relative step error; memory_error, OOM shortfalls
included) is below the calibration in force's on the same runs, as refit_step judges the constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators import Calibration, Evaluation
from stratagem.evaluators.calibration import LogMultipliers
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.fitting import median_error
from stratagem.evaluators.memory import memory_columns
from stratagem.evaluators.posterior import expand
from stratagem.evaluators.posterior_fit import fit_multipliers, log_sum
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.step_parts import TIME_TERMS, term_seconds
from stratagem.evaluators.timing import time_columns
from stratagem.search.calibrate import (
    HELD_OUT,
    CalibrationFit,
    CalibrationStep,
    calibration_id,
    memory_error,
    oom_runs,
    usable_runs,
)
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["MultiplierRefit", "refit_multipliers", "with_multipliers"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class MultiplierRefit:
    """The calibration in force after the multipliers' refit, and how it was judged."""

    calibration: Calibration
    adopted: tuple[Literal["time", "memory"], ...]
    """"time" and/or "memory": the multipliers that replaced the previous ones."""
    step_error_held_out: float | None
    """Leave-one-out median step-time error of the time multipliers; None: not judged."""
    memory_error_held_out: float | None
    """Leave-one-out memory_error of the memory multipliers (OOMs included); None: not judged."""
    step_error_after: float
    """Median step-time error of the calibration in force after the refit, on every ok run."""
    memory_error_after: float
    """memory_error of the calibration in force after the refit, on every run."""
    note: str
    """One line per group: adopted or refused, with the held-out errors."""


def _blocks(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """(N, len(BLOCKS)) the worst rank's blocks in GiB by the formulas."""
    mem = memory_columns(scn, pc, cal)
    return np.stack([mem[b] / GIB for b in BLOCKS], axis=1)


class _Runs:
    """The study's ok and OOM runs as the fit sees them: terms at the constants in force, measured log values."""

    def __init__(self, scn: Scenario, runs: Sequence[Evaluation], ooms: Sequence[Evaluation],
                 current: Calibration) -> None:
        self.scn, self.n = scn, len(runs)
        self.pc = PlanColumns.from_plans([e.plan for e in runs]) if runs else None
        self.oom_pc = PlanColumns.from_plans([e.plan for e in ooms]) if ooms else None
        self.time, self.mem, self.oom = self.terms_at(current)
        self.step = np.array([float((e.measurements or {})["step_s"]) for e in runs])
        self.peak = np.array([e.memory.peak_gib for e in runs if e.memory is not None])
        self.bound = scn.cluster.gpu.hbm_gib  # the harness's cap: an OOM run's peak was above it
        self.now_step = time_columns(scn, self.pc, current)["step_s"] if self.pc else np.zeros(0)
        self.now_peak = memory_columns(scn, self.pc, current)["peak"] / GIB if self.pc else np.zeros(0)
        self.now_oom = memory_columns(scn, self.oom_pc, current)["peak"] / GIB if self.oom_pc else np.zeros(0)

    def terms_at(self, cal: Calibration) -> tuple[Array, Array, Array]:
        """(ok runs' time terms, their blocks, OOM runs' blocks) by the formulas at `cal`'s constants."""
        plain = cal.model_copy(update={"time_multipliers": None, "memory_multipliers": None})
        k_t, k_m = len(TIME_TERMS), len(BLOCKS)
        time = term_seconds(time_columns(self.scn, self.pc, plain)) if self.pc else np.zeros((0, k_t))
        mem = _blocks(self.scn, self.pc, plain) if self.pc else np.zeros((0, k_m))
        oom = _blocks(self.scn, self.oom_pc, plain) if self.oom_pc else np.zeros((0, k_m))
        return time, mem, oom


def _held(n: int) -> list[int]:
    return list(range(max(0, n - HELD_OUT), n))


def _without(n: int, i: int) -> NDArray[np.bool_]:
    keep = np.ones(n, dtype=bool)
    keep[i] = False
    return keep


def _at(r: _Runs, fold: Calibration | None) -> tuple[Array, Array, Array]:
    """The runs' terms at a fold's constants (None: the constants in force)."""
    return (r.time, r.mem, r.oom) if fold is None else r.terms_at(fold)


def _judge_time(r: _Runs, prior: LogMultipliers, floor: float | None, folds: Sequence[Calibration] | None,
                incumbent: float | None) -> tuple[LogMultipliers, float, float]:
    """(fit on every ok run, leave-one-out error, the incumbent's error on the same runs: `incumbent` when the
    constants were refitted at this step (their own leave-one-out error; each fold then predicts from the
    constants refitted without its run, `folds`), else the calibration in force's)."""
    held = _held(r.n)
    pred = np.empty(len(held))
    for j, i in enumerate(held):
        a = _at(r, folds[j] if folds else None)[0]
        keep = _without(r.n, i)
        post = fit_multipliers(a[keep], np.log(r.step[keep]), prior, noise_floor=floor)
        pred[j] = math.exp(log_sum(a[i:i + 1], np.array(post.mean))[0])
    now = incumbent if incumbent is not None else median_error(r.now_step[held], r.step[held])
    return (fit_multipliers(r.time, np.log(r.step), prior, noise_floor=floor), median_error(pred, r.step[held]),
            now)


def _judge_memory(r: _Runs, prior: LogMultipliers, folds: Sequence[Calibration] | None,
                  incumbent: float | None) -> tuple[LogMultipliers, float, float]:
    """(fit on every run, leave-one-out memory_error, the incumbent's on the same runs; as _judge_time, `folds`
    one per held-out ok run then one per held-out OOM run)."""
    m = len(r.oom)
    held, held_oom = _held(r.n), _held(m)
    log_cap = math.log(r.bound)

    def predict(fold: Calibration | None, keep: NDArray[np.bool_], keep_oom: NDArray[np.bool_]) -> Array:
        _, mem, oom = _at(r, fold)
        post = fit_multipliers(mem[keep], np.log(r.peak[keep]), prior, oom[keep_oom], log_cap)
        return np.exp(log_sum(np.vstack([mem, oom]), np.array(post.mean)))

    all_ok, all_oom = np.ones(r.n, dtype=bool), np.ones(m, dtype=bool)
    peak = np.array([predict(folds[j] if folds else None, _without(r.n, i), all_oom)[i] for j, i in enumerate(held)])
    oom = np.array([predict(folds[len(held) + j] if folds else None, all_ok, _without(m, k))[r.n + k]
                    for j, k in enumerate(held_oom)])
    now = incumbent if incumbent is not None else memory_error(r.now_peak[held], r.peak[held], r.now_oom[held_oom],
                                                               r.bound)
    return (fit_multipliers(r.mem, np.log(r.peak), prior, r.oom, log_cap),
            memory_error(peak, r.peak[held], oom, r.bound), now)


_LABELS = {"time": "term multipliers (time)", "memory": "block multipliers (memory)"}


def _verdict(group: Literal["time", "memory"], post: LogMultipliers, loo: float, now: float,
             update: dict[str, LogMultipliers], parts: list[str]) -> None:
    """Adopt `post` for `group` into `update` when its leave-one-out error beats the incumbent's, and say so."""
    if loo < now:
        update[f"{group}_multipliers"] = post
    parts.append(f"{_LABELS[group]} {'adopted' if loo < now else 'refused'} (held-out error {loo:.0%} vs {now:.0%})")


def _prior(given: LogMultipliers | None, device: LogMultipliers, study: str) -> LogMultipliers:
    """The prior of a fit: the start calibration's posterior over every term, unless the same study's runs made it
    (they would count twice): then the device's."""
    return device if given is None or (study and given.study == study) else expand(given, device)


def refit_multipliers(scenario: Scenario, measured: Sequence[Evaluation], base: Calibration, current: Calibration,
                      run_noise_sd: float | None = None, study: str = "",
                      constants: CalibrationFit | None = None) -> MultiplierRefit:
    """Fit the time and memory multipliers on `measured` (the runs of `study`) with the prior from `base` and the
    constants of `current` (the calibration in force after the constants' refit `constants`); keep each group only
    where its leave-one-out error beats the incumbent's (module docstring): where `constants` adopted that group's
    constants at this step, their own leave-one-out error, each fold predicting from the constants refitted without
    its run (a fair race: neither saw the held-out run); else `current`'s error on the held-out runs."""
    runs, ooms = usable_runs(measured), oom_runs(measured)
    r = _Runs(scenario, runs, ooms, current)
    prior = prior_for(scenario.cluster.gpu.name)
    update: dict[str, LogMultipliers] = {}
    parts: list[str] = []
    step_loo = memory_loo = None
    if r.n >= 2:
        took = constants is not None and "time" in constants.took
        post, step_loo, now = _judge_time(r, _prior(base.time_multipliers, prior.time(), study), run_noise_sd,
                                          constants.folds if took and constants else None,
                                          constants.time_error_held_out if took and constants else None)
        _verdict("time", post.model_copy(update={"study": study}), step_loo, now, update, parts)
    else:
        parts.append(f"term multipliers (time): {r.n} run(s), not judged before 2")
    if r.n + len(r.oom) >= 2:
        took = constants is not None and "memory" in constants.took
        post, memory_loo, now = _judge_memory(r, _prior(base.memory_multipliers, prior.memory(), study),
                                              constants.folds if took and constants else None,
                                              constants.memory_error_held_out if took and constants else None)
        _verdict("memory", post.model_copy(update={"study": study}), memory_loo, now, update, parts)
    cal = current.model_copy(update=update)
    after = _Runs(scenario, runs, ooms, cal) if update else r
    groups: tuple[Literal["time", "memory"], ...] = ("time", "memory")
    adopted = tuple(g for g in groups if f"{g}_multipliers" in update)
    return MultiplierRefit(
        calibration=cal, adopted=adopted, step_error_held_out=step_loo,
        memory_error_held_out=memory_loo,
        step_error_after=median_error(after.now_step, after.step) if r.n else 0.0,
        memory_error_after=memory_error(after.now_peak, after.peak, after.now_oom, after.bound),
        note="; ".join(parts))


def with_multipliers(step: CalibrationStep, terms: MultiplierRefit) -> CalibrationStep:
    """The constants' calibration step with the multipliers' refit folded in: its note, adoption, held-out errors,
    the errors after and the id of the calibration in force after both."""
    note = "; ".join(n for n in (step.note, terms.note) if n)
    return CalibrationStep.model_validate(step.model_dump() | {
        "note": note, "adopted": step.adopted or bool(terms.adopted), "multipliers_adopted": terms.adopted,
        "multiplier_step_error_held_out": terms.step_error_held_out,
        "multiplier_memory_error_held_out": terms.memory_error_held_out,
        "step_error_after": terms.step_error_after, "memory_error_after": terms.memory_error_after,
        "calibration_id": calibration_id(terms.calibration)})
