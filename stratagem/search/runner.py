"""`run_search`: screen the space analytically and store the front and a bounded sample as Optuna trials;
resumable, and safe to run twice at once on one storage. (Measured trials: search/multifidelity.py, the one
real-run path.)

What is stored: Optuna costs ~14 ms per trial written whole to SQLite (`study.add_trial`, one transaction
of ~37 statements, CPU-bound in SQLAlchemy; journal file ~0.7 ms) and 60-70 ms through ask/tell, so the
millions of screened plans stay in memory and only the feasible Pareto front, the pruned plans nearest the
memory limit and a random sample of the rest (search.stored_sample in all) become trials. Screening is
deterministic (seeded), so a rerun selects the same plans and stores only those still missing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from stratagem.errors import StratagemError
from stratagem.evaluators import AnalyticEvaluator, Calibration, Evaluator
from stratagem.search.records import StudyKey, front_trials, plan_key
from stratagem.search.screening import Mode, Progress, ScreenCounts, Screening, screen
from stratagem.search.storage import StorageSpec, check_storage, open_storage, parse_storage, storage_lock
from stratagem.search.study import evaluation_trial, held_keys, open_study, provenance
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["SearchResult", "run_search", "select_plans"]


@dataclass(frozen=True)
class SearchResult:
    """What a search did and what the study now holds."""

    study_name: str
    storage: StorageSpec
    counts: ScreenCounts
    """Plans valid / screened / pruned / feasible / on the predicted front (this run's screening)."""
    mode: str
    """exhaustive, or the sampler that explored a sampled space."""
    stored: int
    """Trials this call wrote."""
    already: int
    """Selected plans the study already held (a resumed or concurrent search stored them)."""
    front: list[FrozenTrial]
    """The study's Pareto front (feasible COMPLETE trials), highest tokens/s first."""
    trials: int
    """Trials in the study now."""
    seconds: float
    screening: Screening = field(repr=False)
    study: optuna.Study | None = field(default=None, repr=False, compare=False)
    """The study, open (callers reuse it rather than opening the storage again)."""
    backend: optuna.storages.BaseStorage | None = field(default=None, repr=False, compare=False)
    """The storage the study lives in, open (with `study`, what run_multifidelity continues in)."""


def select_plans(screening: Screening, sample: int, seed: int) -> list[tuple[int, str]]:
    """(plan index, role) to store, in priority order: the front (highest tokens/s first), the pruned plans
    nearest the memory limit (sample // 2), then a seeded random sample of the rest."""
    cols = screening.columns
    front = screening.front[np.argsort(-cols.tokens_per_s[screening.front], kind="stable")]
    pruned = np.flatnonzero(~screening.feasible)
    over = cols.peak_gib[pruned] - screening.usable_gib
    boundary = pruned[np.argsort(over, kind="stable")][: sample // 2]
    taken = np.zeros(len(screening.plans), dtype=bool)
    taken[front] = True
    taken[boundary] = True
    rest = np.flatnonzero(~taken)
    k = min(sample - len(boundary), len(rest))
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(rest, size=k, replace=False)) if k > 0 else np.zeros(0, dtype=np.int64)
    return ([(int(i), "front") for i in front] + [(int(i), "boundary") for i in boundary]
            + [(int(i), "sample") for i in picked])


def run_search(
    scenario: Scenario,
    storage: str,
    study_name: str,
    evaluator: Evaluator | None = None,
    sampler: Mode = "auto",
    n_trials: int | None = None,
    timeout: float | None = None,
    progress: Progress | None = None,
    calibration: Calibration | None = None,
) -> SearchResult:
    """Search the scenario's plan space into an Optuna study.

    The analytic model screens the space (`screen`); the selected plans (select_plans) become trials, written
    finished. A measured evaluator (real runs) is run by `run_multifidelity` instead. Everything checks the
    input before the study is touched; rerunning resumes.
    """
    t0 = time.perf_counter()
    space = SearchSpace(scenario)
    spec = parse_storage(storage)
    if n_trials is not None and n_trials < 0:
        raise StratagemError(f"--n-trials ({n_trials}): must be >= 0")
    if timeout is not None and timeout <= 0:
        raise StratagemError(f"--timeout ({timeout}): must be > 0 seconds")
    check_storage(spec)  # a storage problem is one line before any screening (issue 12 item 4)
    if evaluator is None:
        evaluator = AnalyticEvaluator(calibration)
    if evaluator.fidelity != "analytic":
        raise StratagemError(f"run_search: a {evaluator.fidelity} evaluator runs through "
                             "stratagem.search.multifidelity.run_multifidelity (the one measured-run path)")
    screening = screen(scenario, calibration, space=space, sampler=sampler, n_trials=n_trials, timeout=timeout,
                       progress=progress)
    chosen = select_plans(screening, space.config.stored_sample, space.config.seed)
    prov = provenance(scenario, space, screening=screening.mode)
    with storage_lock(spec):
        backend = open_storage(spec)  # inside the lock: two processes must not create the schema at once
        study = open_study(backend, spec, study_name, scenario, space)
        held = held_keys(study)
        keyed = [(i, role, screening.plan(i)) for i, role in chosen]
        todo = [(i, role, plan) for i, role, plan in keyed if plan_key(plan) not in held]
        already = len(keyed) - len(todo)
        stored = 0
        state = {"what": "screened plans", "planned": len(keyed)}
        if todo:  # a search killed while storing leaves this unfinished: reports say so (reports.unfinished_note)
            study.set_user_attr(StudyKey.SEARCH_STATE, {**state, "finished": False})
        for n, (i, role, plan) in enumerate(todo):
            ev = evaluator.evaluate(scenario, plan)
            study.add_trial(evaluation_trial(space, ev, screening.usable_gib, role, prov,
                                             screening.pruned_reason(i)))
            stored += 1
            if progress:
                progress("store", n + 1, len(todo))
        c = screening.counts
        study.set_user_attr(StudyKey.COUNTS, {"valid": c.valid, "screened": c.screened, "pruned": c.pruned,
                                       "feasible": c.feasible, "front": c.front})
        study.set_user_attr(StudyKey.SCREENING, screening.mode)
        if todo or not study.user_attrs.get(StudyKey.SEARCH_STATE, {}).get("finished", True):
            study.set_user_attr(StudyKey.SEARCH_STATE, {**state, "finished": True})
    return SearchResult(study_name=study_name, storage=spec, counts=screening.counts, mode=screening.mode,
                        stored=stored, already=already, front=front_trials(study), trials=len(study.trials),
                        seconds=time.perf_counter() - t0, screening=screening, study=study,
                        backend=backend)
