"""Multi-fidelity search: screen analytically, then spend a budget of real runs on the most informative
survivors, recalibrating the analytic model after each batch.

Order of real runs (re-ranked after every batch with the refitted calibration; `rank_candidates`), after the plans
whose run was lost (an infra failure, a dead or stopped worker: claims.orphaned), which run again first:
  1. plans that may fit by predicted tokens/s, fastest first: predicted to fit, or predicted over the limit by
     less than the memory model's error on this study's runs (a boundary run only where it can pay);
  2. what an Optuna NSGA-II sampler proposes, given the measured trials so far.
A batch holds as many plans as the cluster runs at once (slots // widest plan, re-read before each batch). Each
plan of a batch is claimed in the study while it runs (search/claims.py): other workers skip it, and a claim
whose worker died expires and the plan is run again. A claim becomes the measured trial when its run has
finished (COMPLETE, or PRUNED with its status: oom, failed, timeout), so a killed driver loses only its
in-flight batch, which a rerun (or another worker) runs again: no trial lost, none repeated. A run that failed
for the cluster's sake (status infra: actor or node lost, resources never came) is not the plan's verdict: its
claim is released and the plan retried.
Calibration is refitted on this study's measured trials only and stored as the study attribute
"calibration" (with "calibration_history", one entry per batch).
Never imports ray: the evaluator is given (a BatchEvaluator's `evaluate_batch` runs plans in parallel).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.trial import TrialState

from stratagem.errors import StratagemError
from stratagem.evaluators import BatchEvaluator, Calibration, Evaluation, Evaluator
from stratagem.evaluators.calibration import default_calibration
from stratagem.search.calibrate import fit_calibration
from stratagem.search.claims import (
    Claim,
    claim,
    expire_claims,
    finish,
    live_claims,
    orphaned,
    release,
    renewing,
)
from stratagem.search.records import (
    DIRECTIONS,
    OBJECTIVES,
    StudyKey,
    TrialKey,
    front_trials,
    plan_key,
    standings,
    trial_evaluation,
    trial_fidelity,
    trial_plan,
    trial_status,
)
from stratagem.search.runner import SearchResult, run_search
from stratagem.search.screening import Mode, Progress, Screening, screen
from stratagem.search.storage import open_storage, parse_storage, storage_lock
from stratagem.search.study import evaluation_trial, provenance
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["MultiFidelityResult", "run_multifidelity", "rank_candidates", "measured_trials", "screen_candidates",
           "check_candidates", "Stopped", "INFRA_RETRIES", "traced_over_limit"]


@dataclass(frozen=True)
class MultiFidelityResult:
    """The analytic search and what the real-run phase added."""

    search: SearchResult
    runs: int
    """Real runs done in this call."""
    measured: int
    """Measured trials in the study now."""
    statuses: dict[str, int]
    """Measured trials by status (ok, oom, failed, timeout)."""
    calibration: Calibration
    history: list[dict[str, Any]]
    """Per batch: runs, median step-time and peak-memory error before and after refitting."""
    seconds: float
    skipped: int = 0
    """Candidate plans not run because the harness cannot run them (the evaluator's `unsupported`)."""
    skipped_example: str = ""
    """One skipped plan and the harness's reason ('' when none was skipped)."""
    ok_runs: int = 0
    """Runs of this call that measured their plan (status ok)."""
    first_failure: str = ""
    """The first run of this call that did not end ok: "plan: status: reason" ('' when none)."""
    traced_out: int = 0
    """Plans never run because their traced memory does not fit (`traced_over_limit`)."""
    traced_out_example: str = ""
    """One such plan and its traced peak ('' when none)."""


_MAX_RANK_ROUNDS = 50  # rounds of ranking per batch when the harness keeps refusing plans
INFRA_RETRIES = 2
"""Times one call retries a plan whose run failed for the cluster's sake (a rerun retries again)."""
_POLL_S = 5.0  # while other workers hold the remaining plans


def measured_trials(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    """Plan key -> the finished measured trial that stands for the plan (records.standings: the latest)."""
    return {k: s.trial for k, s in standings(study.get_trials(deepcopy=False)).items() if s.fidelity == "measured"}


DEFAULT_MEMORY_BAND = 0.05
"""Relative memory error assumed before a study has measured peaks to fit on: a plan predicted within 5 % over
the limit may still fit (bench/memory_accuracy.py: median error 6.6 % on published runs)."""


def rank_candidates(screening: Screening, measured: set[str], limit: int, include_infeasible: bool = False,
                    memory_band: float = DEFAULT_MEMORY_BAND) -> list[tuple[Plan, str]]:
    """Up to `limit` unmeasured plans in run order, for finding the fastest plan that fits in few runs.

    1. Plans that may fit, by predicted tokens/s (fastest first): those predicted to fit, and those predicted
       over the usable memory by less than `memory_band` (the memory model's relative error on this study's
       measured runs): the best plan often sits at the limit, and only there does the memory model decide which
       plan is best, so a boundary run is spent only where it can pay (it is also the fastest left). Roles:
       "front" (on the predicted Pareto front), "boundary" (predicted over the limit, within the band),
       "candidate" (the rest).
    2. (include_infeasible) the plans predicted not to fit beyond the band, nearest the limit first.
    bench/search_regret.py measured the previous order (the whole predicted front, then the feasible plans with
    least headroom) against this one: see the README's "How many real runs" figures."""
    cols = screening.columns
    tokens, peak = cols.tokens_per_s, cols.peak_gib
    plausible = peak * (1.0 - max(0.0, memory_band)) <= screening.usable_gib
    on_front = np.zeros(len(tokens), dtype=bool)
    on_front[screening.front] = True
    first = np.flatnonzero(plausible)
    first = first[np.argsort(-tokens[first], kind="stable")]
    roles = np.where(on_front, "front", np.where(screening.feasible, "candidate", "boundary"))
    groups: list[tuple[np.ndarray, np.ndarray]] = [(first, roles[first])]
    if include_infeasible:
        rest = np.flatnonzero(~plausible)
        rest = rest[np.argsort(-cols.headroom_gib[rest], kind="stable")]
        groups.append((rest, np.full(len(rest), "candidate")))
    out: list[tuple[Plan, str]] = []
    seen = set(measured)
    for indices, labels in groups:
        for i, role in zip(indices, labels, strict=True):
            plan = screening.plan(int(i))
            key = plan_key(plan)
            if key in seen:
                continue
            seen.add(key)
            out.append((plan, str(role)))
            if len(out) >= limit:
                return out
    return out


def traced_over_limit(study: optuna.Study, usable_gib: float) -> dict[str, str]:
    """Plan key -> why not to run it, for each plan whose standing trial is traced and does not fit: the traced
    step (the harness's own code at full size) is closer to a real run than the analytic prediction, so no real
    run is spent on a plan whose traced memory is over the limit (issue 16 item 2). A measured trial stands above
    a traced one, so a plan already run is judged by its run."""
    out: dict[str, str] = {}
    for key, s in standings(study.get_trials(deepcopy=False)).items():
        if s.fidelity != "traced" or s.feasible:
            continue
        ev = trial_evaluation(s.trial)
        peak = ev.memory.peak_gib if ev is not None and ev.memory is not None else float("nan")
        out[key] = f"{trial_plan(s.trial).short()}: traced peak {peak:.1f} GiB over the usable {usable_gib:.1f} GiB"
    return out


def memory_band(study: optuna.Study) -> float:
    """The memory model's relative error on this study's measured peaks after the latest refit (the last
    calibration_history entry), at least 2 %; DEFAULT_MEMORY_BAND before any measured run."""
    history = study.user_attrs.get(StudyKey.CALIBRATION_HISTORY) or []
    if not history or not history[-1].get("runs_used"):
        return DEFAULT_MEMORY_BAND
    return max(0.02, float(history[-1].get("memory_error_after", DEFAULT_MEMORY_BAND)))


def _sampler_proposals(screening: Screening, study: optuna.Study, measured: set[str], limit: int,
                       seed: int) -> list[tuple[Plan, str]]:
    """Plans an NSGA-II sampler proposes after seeing the measured trials (in a scratch in-memory study)."""
    from stratagem.search.samplers import ProjectingSampler, make_sampler

    space = screening.space
    scratch = optuna.create_study(directions=list(DIRECTIONS),
                                  sampler=ProjectingSampler(make_sampler("nsga2", seed), space))
    for t in measured_trials(study).values():
        if t.state == TrialState.COMPLETE and t.values:
            scratch.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                        values=t.values))
    out: list[tuple[Plan, str]] = []
    seen = set(measured)
    for _ in range(20 * limit):
        trial = scratch.ask()
        plan = space.suggest(trial)
        scratch.tell(trial, state=TrialState.PRUNED)
        key = plan_key(plan)
        if key not in seen:
            seen.add(key)
            out.append((plan, "sampler"))
            if len(out) >= limit:
                break
    return out


def screen_candidates(scenario: Scenario, space: SearchSpace, calibration: Calibration,
                      candidates: PlanColumns) -> Screening:
    """A Screening of exactly `candidates` (duplicates dropped): the analytic figures, feasibility and front
    among them, so the real runs are ranked as usual but never leave this set."""
    from stratagem.search.screening import ScreenCounts, _broke, _evaluate, _feasible, _front, _unique

    t0 = time.perf_counter()
    plans = _unique(candidates)
    usable = scenario.cluster.gpu.hbm_gib - space.config.memory_margin_gib
    columns = _evaluate(scenario, plans, calibration, None)
    feasible = _feasible(columns, usable)
    front = _front(columns, usable)
    counts = ScreenCounts(valid=len(plans), screened=len(plans), pruned=int((~feasible).sum()),
                          feasible=int(feasible.sum()), front=len(front))
    return Screening(space=space, plans=plans, columns=columns, feasible=feasible, front=front, counts=counts,
                     usable_gib=usable, broke=_broke(columns, usable), mode="candidates",
                     seconds=time.perf_counter() - t0)


def check_candidates(space: SearchSpace, candidates: PlanColumns) -> None:
    """Raise StratagemError naming the first candidate plan outside the space (its trial could not be stored)."""
    for i in range(len(candidates)):
        plan = candidates.plan(i)
        params, dists = space.params(plan)
        for name, value in params.items():
            try:
                dists[name].to_internal_repr(value)
            except ValueError:
                raise StratagemError(
                    f"candidates: plan '{plan.short()}' has {name}={value!r}, outside the scenario's search space "
                    f"({dists[name]}); widen the search section or drop the plan") from None


def _evaluate_batch(evaluator: Evaluator, scenario: Scenario, plans: Sequence[Plan]) -> list[Evaluation]:
    if isinstance(evaluator, BatchEvaluator):
        return list(evaluator.evaluate_batch(scenario, plans))
    return [evaluator.evaluate(scenario, p) for p in plans]


def run_multifidelity(
    scenario: Scenario,
    storage: str,
    study_name: str,
    evaluator: Evaluator,
    real_runs: int,
    budget_minutes: float | None = None,
    sampler: Mode = "auto",
    progress: Progress | None = None,
    on_batch: Callable[[dict[str, Any]], None] | None = None,
    *,
    candidates: PlanColumns | None = None,
    initial_calibration: Calibration | None = None,
    recalibrate: bool = True,
    n_trials: int | None = None,
    timeout: float | None = None,
    on_message: Callable[[str], None] | None = None,
) -> MultiFidelityResult:
    """Analytic search (stored as usual), then measured trials until the study holds `real_runs` of them.

    Several workers (processes, hosts) may run this on one study at once: each plan is claimed while it runs
    (search/claims.py), so no plan is measured twice and a dead worker's plan is run again. Counting, across
    all workers: `real_runs` bounds the study's finished measured trials plus the live claims (a worker picks
    at most real_runs - done - claimed plans); `budget_minutes` runs from the first worker's start of the
    real-run phase (study attribute "real_runs_started"), so a worker joining later gets what is left.
    Per call: `n_trials` bounds the runs this call starts, `timeout` (seconds) the time it starts new ones.

    candidates: run only these plans (ranked as usual among themselves; no sampler proposals).
    initial_calibration: the calibration the predictions start from and the refit starts at (default: the
    model's defaults). recalibrate: refit after every batch (False: keep `initial_calibration`, still recording
    the prediction error per batch). Plans the evaluator's `unsupported(scenario, plan) -> str | None` names
    are skipped (counted in the result with one example) and never stored as trials. A run that fails for the
    cluster's sake (status "infra") releases its claim and is retried (INFRA_RETRIES times in this call; a
    rerun retries again). SIGINT/SIGTERM (main thread): the in-flight runs are killed, their claims released,
    and Stopped is raised.
    """
    if real_runs < 0:
        raise StratagemError(f"--real-runs ({real_runs}): must be >= 0")
    if budget_minutes is not None and budget_minutes <= 0:
        raise StratagemError(f"--budget-minutes ({budget_minutes}): must be > 0")
    if n_trials is not None and n_trials < 0:
        raise StratagemError(f"--n-trials ({n_trials}): must be >= 0")
    if timeout is not None and timeout <= 0:
        raise StratagemError(f"--timeout ({timeout}): must be > 0 seconds")
    if evaluator.fidelity != "measured":
        raise StratagemError("real runs need a measured evaluator")
    t0 = time.perf_counter()
    say = on_message or (lambda text: print(text, file=sys.stderr, flush=True))
    space = SearchSpace(scenario)
    if candidates is not None:
        check_candidates(space, candidates)
    study_cal = initial_calibration or default_calibration(scenario.cluster.gpu.name)  # the device's defaults
    unsupported: Callable[[Scenario, Plan], str | None] | None = getattr(evaluator, "unsupported", None)
    skipped: dict[str, str] = {}
    infra: dict[str, int] = {}
    result = run_search(scenario, storage, study_name, sampler=sampler, progress=progress, calibration=study_cal)
    spec = parse_storage(storage)
    with storage_lock(spec):
        # continue in the study run_search opened: one search opens its storage once (issue 11 item 1)
        backend = result.backend if result.backend is not None else open_storage(spec)
        study = result.study if result.study is not None else optuna.load_study(study_name=study_name,
                                                                               storage=backend)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental"
            study.set_metric_names(list(OBJECTIVES))  # named for optuna-dashboard
        started = study.user_attrs.get(StudyKey.REAL_RUNS_STARTED)
        if started is None:
            started = time.time()
            study.set_user_attr(StudyKey.REAL_RUNS_STARTED, started)
        if budget_minutes is not None:
            study.set_user_attr(StudyKey.REAL_RUNS_BUDGET_MINUTES, budget_minutes)
        done = measured_trials(study)
        traced_out = traced_over_limit(study, result.screening.usable_gib)
    if traced_out:
        say(f"not running {len(traced_out)} plan(s) whose traced memory does not fit, e.g. "
            f"{next(iter(traced_out.values()))}")
    history: list[dict[str, Any]] = list(study.user_attrs.get(StudyKey.CALIBRATION_HISTORY, []))
    cal = _refit(scenario, study, done, study_cal, history=None, recalibrate=recalibrate)
    budget_end = None if budget_minutes is None else float(started) + 60.0 * budget_minutes
    call_end = None if timeout is None else time.monotonic() + timeout
    prov = provenance(scenario, space, screening="multifidelity")
    runs = ok_runs = 0
    first_failure = ""
    with _stop_on_signals():
        while n_trials is None or runs < n_trials:
            if (budget_end is not None and time.time() >= budget_end) or (
                    call_end is not None and time.monotonic() >= call_end):
                break
            with storage_lock(spec):
                expire_claims(study, backend)
                done = measured_trials(study)
                claimed = live_claims(study)
                if len(done) >= real_runs:
                    break
                want = real_runs - len(done) - len(claimed)
                if n_trials is not None:
                    want = min(want, n_trials - runs)
                batch: list[Claim] = []
                if want > 0:
                    excluded = set(done) | set(claimed) | set(skipped) | set(traced_out) | {
                        k for k, n in infra.items() if n > INFRA_RETRIES}
                    # a plan whose run was lost (infra, a dead or stopped worker) runs again first (claims.orphaned)
                    ranked = [(p, r) for p, r in orphaned(study) if plan_key(p) not in excluded][:want]
                    if len(ranked) < want:
                        ranked += _rank(scenario, space, study, cal, candidates,
                                        excluded | {plan_key(p) for p, _ in ranked}, want - len(ranked), len(done),
                                        unsupported, skipped)
                    if ranked:
                        widest = max(p.world_size for p, _ in ranked)
                        slots = int(getattr(evaluator, "slots", 1) or 1)  # re-read: the cluster may have changed
                        batch = [claim(backend, study, space, p, role)
                                 for p, role in ranked[: max(1, slots // max(1, widest))]]
            if not batch:
                if claimed:  # the rest is being measured by other workers: wait for them (or their claims to expire)
                    time.sleep(_POLL_S)
                    continue
                break
            try:
                with renewing(backend, batch):
                    evaluations = _evaluate_batch(evaluator, scenario, [c.plan for c in batch])
            except Stopped as stop:
                say(f"stopping: killing {len(batch)} in-flight run(s); their plans are released for a rerun")
                with storage_lock(spec):
                    for c in batch:
                        release(backend, c, f"stopped by signal {stop.signum}")
                raise
            with storage_lock(spec):
                for c, ev in zip(batch, evaluations, strict=True):
                    key = plan_key(c.plan)
                    ok_runs += ev.status == "ok"
                    if ev.status != "ok" and not first_failure:
                        first_failure = f"{c.plan.short()}: {ev.status}: {ev.reason.splitlines()[0] if ev.reason else ''}"
                    if ev.status == "infra":
                        infra[key] = infra.get(key, 0) + 1
                        release(backend, c, f"infra: {ev.reason}")
                        continue
                    reason = "" if ev.status == "ok" else f"{ev.status}: {ev.reason}"
                    finish(backend, c, evaluation_trial(space, ev, result.screening.usable_gib, c.role, prov,
                                                        reason))
                done = measured_trials(study)
                cal = _refit(scenario, study, done, study_cal, history, recalibrate=recalibrate)
            runs += len(batch)
            if on_batch:
                on_batch(history[-1])
            if progress:
                progress("real runs", len(done), real_runs)
    with storage_lock(spec):
        done = measured_trials(study)
        _store_recalibrated(study, scenario, space, cal, done, prov)
        study.set_user_attr(StudyKey.NOT_RUN, {
            why: {"count": len(plans), "example": next(iter(plans.values()), "")}
            for why, plans in (("harness", skipped), ("traced", traced_out)) if plans})
    statuses: dict[str, int] = {}
    for t in done.values():
        s = trial_status(t)
        statuses[s] = statuses.get(s, 0) + 1
    if infra:
        statuses["infra"] = sum(infra.values())
    final = dataclasses.replace(result, front=front_trials(study), trials=len(study.get_trials(deepcopy=False)),
                                seconds=time.perf_counter() - t0)
    return MultiFidelityResult(search=final, runs=runs, measured=len(done), statuses=statuses,
                               calibration=cal, history=history, seconds=time.perf_counter() - t0,
                               skipped=len(skipped), skipped_example=next(iter(skipped.values()), ""),
                               ok_runs=ok_runs, first_failure=first_failure, traced_out=len(traced_out),
                               traced_out_example=next(iter(traced_out.values()), ""))


def _rank(scenario: Scenario, space: SearchSpace, study: optuna.Study, cal: Calibration,
          candidates: PlanColumns | None, excluded: set[str], want: int, measured: int,
          unsupported: Callable[[Scenario, Plan], str | None] | None,
          skipped: dict[str, str]) -> list[tuple[Plan, str]]:
    """Up to `want` plans to run next, none in `excluded`; plans the harness refuses go to `skipped`."""
    if candidates is not None:
        screening = screen_candidates(scenario, space, cal, candidates)
    else:
        screening = screen(scenario, cal, space=space)
    excluded = set(excluded)
    ranked: list[tuple[Plan, str]] = []
    for _ in range(_MAX_RANK_ROUNDS):
        if len(ranked) >= want:
            break
        more = rank_candidates(screening, excluded, want - len(ranked), include_infeasible=candidates is not None,
                               memory_band=memory_band(study))
        if len(more) < want - len(ranked) and candidates is None:
            more += _sampler_proposals(screening, study, excluded | {plan_key(p) for p, _ in more},
                                       want - len(ranked) - len(more), space.config.seed + measured)
        if not more:
            break
        for plan, role in more:
            key = plan_key(plan)
            excluded.add(key)
            why = unsupported(scenario, plan) if unsupported is not None else None
            if why:
                skipped[key] = f"{plan.short()}: {why}"
            else:
                ranked.append((plan, role))
    return ranked


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived during the real runs (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        """The signal: the process should exit with 128 + signum."""


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """In the main thread, SIGINT and SIGTERM raise Stopped (instead of KeyboardInterrupt / dying at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _calibration_id(cal: Calibration) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(cal.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def _store_recalibrated(study: optuna.Study, scenario: Scenario, space: SearchSpace, cal: Calibration,
                        done: dict[str, optuna.trial.FrozenTrial], prov: dict[str, Any]) -> int:
    """Re-predict every stored plan that was not measured with the study's calibration, as new analytic trials
    (role "recalibrated"; the latest analytic trial of a plan is the one reports and the front use). Skipped
    for plans whose latest prediction already used this calibration, so a rerun adds nothing."""
    from stratagem.evaluators import evaluate

    cid = _calibration_id(cal)
    latest: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        key = t.user_attrs.get(TrialKey.PLAN)
        if key and key not in done and trial_fidelity(t) == "analytic":
            latest[key] = t
    usable = scenario.cluster.gpu.hbm_gib - space.config.memory_margin_gib
    added = 0
    for t in latest.values():
        if t.user_attrs.get(TrialKey.PROVENANCE, {}).get("calibration") == cid:
            continue
        ev = trial_evaluation(t)
        if ev is None:
            continue
        new = evaluate(scenario, ev.plan, cal)
        study.add_trial(evaluation_trial(space, new, usable, "recalibrated", {**prov, "calibration": cid}))
        added += 1
    return added


def _refit(scenario: Scenario, study: optuna.Study, done: dict[str, optuna.trial.FrozenTrial], base: Calibration,
           history: list[dict[str, Any]] | None, recalibrate: bool = True) -> Calibration:
    """Refit on every measured trial of this study (recalibrate=False: keep `base`, only measure its error);
    record the fit when `history` is given."""
    evaluations = [ev for t in done.values() if (ev := trial_evaluation(t)) is not None]
    fit = fit_calibration(scenario, evaluations, base, refit=recalibrate)
    if history is not None:
        history.append({"measured": len(done), "runs_used": fit.runs,
                        "step_error_before": fit.time_error_before, "step_error_after": fit.time_error_after,
                        "memory_error_before": fit.memory_error_before,
                        "memory_error_after": fit.memory_error_after})
        study.set_user_attr(StudyKey.CALIBRATION, fit.calibration.model_dump(mode="json"))
        study.set_user_attr(StudyKey.CALIBRATION_HISTORY, history)
    return fit.calibration
