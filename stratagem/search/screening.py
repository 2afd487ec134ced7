"""Analytic screening: every valid plan (or, for a huge space, a uniform sample plus an Optuna sampler's
exploration) judged with the vectorised evaluator; plans over HBM minus the margin are pruned with the block
that broke; the feasible Pareto front over OBJECTIVES is found with `pareto.nondominated`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from stratagem.errors import StratagemError
from stratagem.evaluators import BLOCKS, Calibration, PlanFigures, evaluate_many
from stratagem.quantities import memory, memory_in, memory_unit
from stratagem.search.pareto import nondominated
from stratagem.search.records import CONSTRAINT, DIRECTIONS, OBJECTIVES
from stratagem.search.samplers import ProjectingSampler, make_sampler
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import usable_gib
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["Screening", "ScreenCounts", "Progress", "screen", "objective_matrix", "DEFAULT_EXPLORE_TRIALS"]

Array = NDArray[np.float64]
Progress = Callable[[str, int, int], None]
"""progress(phase, done, total): phases 'screen', 'explore', 'store', 'evaluate'."""
Mode = Literal["auto", "exhaustive", "nsga2", "tpe", "random"]
DEFAULT_EXPLORE_TRIALS = {"nsga2": 2000, "random": 2000, "tpe": 300}  # TPE costs grow with n^2
_CHUNK = 250_000  # plans per evaluate_many call (bounds the evaluator's temporaries)


@dataclass(frozen=True)
class ScreenCounts:
    """How many plans were valid, judged, pruned, feasible and on the front."""

    valid: int
    """Valid plans = distinct jobs: the canonical plans of the space (spaces/canonical.py; plans that build one
    job count once), exact, whether or not all were judged."""
    screened: int
    """Plans judged by the analytic model (== valid when exhaustive)."""
    pruned: int
    """Screened plans predicted over HBM minus the memory margin."""
    feasible: int
    """Screened plans that fit (screened - pruned)."""
    front: int
    """Feasible plans on the Pareto front."""


@dataclass(frozen=True)
class Screening:
    """The result of `screen`: plans as columns, their figures, feasibility and the front."""

    space: SearchSpace
    plans: PlanColumns
    columns: PlanFigures
    """evaluate_many's figures of `plans`, row for row."""
    feasible: NDArray[np.bool_]
    front: NDArray[np.intp]
    counts: ScreenCounts
    usable_gib: float
    """HBM minus the memory margin: the most a plan may use."""
    broke: NDArray[np.int64]
    """Per plan, index into BLOCKS of the first block whose running sum crosses usable_gib (-1 if it fits)."""
    mode: str
    """exhaustive, or the sampler that explored a sampled space (nsga2, tpe, random)."""
    seconds: float

    def plan(self, i: int) -> Plan:
        """Plan i as a Plan."""
        return self.plans.plan(int(i))

    def objectives(self) -> Array:
        """(n, 3) matrix of OBJECTIVES."""
        return objective_matrix(self.columns)

    def pruned_reason(self, i: int) -> str:
        """Why plan i was pruned (the block that broke), or '' when it fits."""
        b = int(self.broke[i])
        if b < 0:
            return ""
        c = self.columns
        margin = self.space.config.memory_margin_gib
        unit = memory_unit(c.peak_gib[i], c.hbm_gib[i])  # one unit for the figures (stratagem.quantities)
        limit = (f"(HBM {memory_in(c.hbm_gib[i], unit, True)} - margin {memory(margin)})" if margin
                 else "(HBM, no margin)")
        return (f"predicted peak {memory_in(c.peak_gib[i], unit, True)} exceeds "
                f"{memory_in(self.usable_gib, unit, True)} {limit} by {memory(c.peak_gib[i] - self.usable_gib)}; "
                f"{BLOCKS[b]} is the first block that does not fit")


def objective_matrix(columns: PlanFigures) -> Array:
    """(n, 3) array of OBJECTIVES from evaluate_many's figures."""
    return columns.objectives(OBJECTIVES)


def _evaluate(scenario: Scenario, pc: PlanColumns, calibration: Calibration | None,
              progress: Progress | None) -> PlanFigures:
    n = len(pc)
    parts: list[PlanFigures] = []
    for start in range(0, max(n, 1), _CHUNK):
        parts.append(evaluate_many(scenario, pc.take(slice(start, start + _CHUNK)), calibration))
        if progress:
            progress("screen", min(n, start + _CHUNK), n)
    return parts[0] if len(parts) == 1 else PlanFigures.concat(parts)


def _concat(a: PlanColumns, b: PlanColumns) -> PlanColumns:
    return PlanColumns(**{f.name: np.concatenate([getattr(a, f.name), getattr(b, f.name)]) for f in fields(a)})


def _unique(pc: PlanColumns) -> PlanColumns:
    """The distinct rows of `pc`, in first-seen order (canonical plans: one row per job)."""
    rows = np.stack([getattr(pc, f.name) for f in fields(pc)], axis=1)
    _, first = np.unique(rows, axis=0, return_index=True)
    return pc.take(np.sort(first))


def screen(
    scenario: Scenario,
    calibration: Calibration | None = None,
    *,
    space: SearchSpace | None = None,
    sampler: Mode = "auto",
    n_trials: int | None = None,
    timeout: float | None = None,
    progress: Progress | None = None,
) -> Screening:
    """Judge the scenario's plan space analytically and find the feasible Pareto front.

    sampler: auto (exhaustive up to search.exhaustive_limit valid plans, else nsga2), exhaustive, or an Optuna
    sampler (nsga2, tpe, random) exploring `n_trials` plans (default 2000; tpe 300) in memory, started from the front
    of a uniform sample of exhaustive_limit / 10 plans.
    """
    t0 = time.perf_counter()
    space = space or SearchSpace(scenario)
    cfg = space.config
    valid = space.count()
    mode: str = sampler
    if sampler == "auto":
        mode = "exhaustive" if valid <= cfg.exhaustive_limit else "nsga2"
    if mode == "exhaustive":
        if valid > cfg.exhaustive_limit:
            raise StratagemError(
                f"--sampler exhaustive: the space has {valid:,} valid plans, over search.exhaustive_limit "
                f"({cfg.exhaustive_limit:,}); use --sampler nsga2 or narrow the search section")
        plans = space.enumerate()
    else:
        plans = space.decode(space.sample_numbers(max(1, cfg.exhaustive_limit // 10)))
    usable = usable_gib(scenario, cfg)
    columns = _evaluate(scenario, plans, calibration, progress)
    if mode != "exhaustive":
        seeds = _front(columns, usable)
        explored = _explore(scenario, space, calibration, mode, n_trials or DEFAULT_EXPLORE_TRIALS[mode], timeout,
                            plans.take(seeds), usable, progress)
        plans = _unique(_concat(plans, explored))
        columns = _evaluate(scenario, plans, calibration, None)
    feasible = _feasible(columns, usable)
    front = _front(columns, usable)
    broke = _broke(columns, usable)
    counts = ScreenCounts(valid=valid, screened=len(plans), pruned=int((~feasible).sum()),
                          feasible=int(feasible.sum()), front=len(front))
    return Screening(space=space, plans=plans, columns=columns, feasible=feasible, front=front, counts=counts,
                     usable_gib=usable, broke=broke, mode=mode, seconds=time.perf_counter() - t0)


def _feasible(columns: PlanFigures, usable: float) -> NDArray[np.bool_]:
    finite = np.all(np.isfinite(objective_matrix(columns)), axis=1)
    ok: NDArray[np.bool_] = (columns.peak_gib <= usable) & finite
    return ok


def _front(columns: PlanFigures, usable: float) -> NDArray[np.intp]:
    ok = np.flatnonzero(_feasible(columns, usable))
    return ok[nondominated(objective_matrix(columns)[ok], DIRECTIONS)]


def _broke(columns: PlanFigures, usable: float) -> NDArray[np.int64]:
    cumulative = np.cumsum(np.stack([columns.block_gib(b) for b in BLOCKS]), axis=0)
    over = cumulative > usable
    return np.where(over.any(axis=0), over.argmax(axis=0), -1).astype(np.int64)


def _explore(scenario: Scenario, space: SearchSpace, calibration: Calibration | None, sampler: str,
             n_trials: int, timeout: float | None, seeds: PlanColumns, usable: float,
             progress: Progress | None) -> PlanColumns:
    """Let an Optuna sampler propose `n_trials` plans (in memory), judging them in batches."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    population = 50
    base = make_sampler(sampler, space.config.seed, population_size=population)
    study = optuna.create_study(directions=[*DIRECTIONS], sampler=ProjectingSampler(base, space))
    for i in range(min(len(seeds), population)):
        study.enqueue_trial(space.params(seeds.plan(i))[0])
    batch = population if sampler != "tpe" else 10
    found: list[Plan] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(found) < n_trials and (deadline is None or time.monotonic() < deadline):
        trials = [study.ask() for _ in range(min(batch, n_trials - len(found)))]
        plans = [space.suggest(t) for t in trials]
        cols = evaluate_many(scenario, plans, calibration)
        values = objective_matrix(cols)
        for i, t in enumerate(trials):
            t.set_constraint(CONSTRAINT, float(cols.peak_gib[i] - usable))
            v = values[i]
            if np.all(np.isfinite(v)):
                study.tell(t, v.tolist())
            else:
                study.tell(t, state=optuna.trial.TrialState.FAIL)
        found.extend(plans)
        if progress:
            progress("explore", len(found), n_trials)
    return PlanColumns.from_plans(found)
