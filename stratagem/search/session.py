"""`SearchSession`: one search on one study, opened once (Optuna's `_optimize` split into steps).

    session = SearchSession(scenario, "sqlite:///stratagem.db", "my-study", calibration=cal, listener=print_event)
    session.screen()                  # the analytic screening (in memory)
    session.store()                   # the front and a bounded sample as trials -> SearchResult
    session.trace(k, tracer)          # optional: K traced trials, refit logits_bytes, re-screen and store
    session.measure(k, evaluator)     # optional: real runs measuring K more plans (search/measure.py)

The session holds what every step shares, resolved once: the storage spec and its lock, the open storage and
study, the search space, the usable memory (HBM - search.memory_margin_gib) and the calibration the predictions
start from. Everything a user can get wrong is checked before the study is touched. Events (search/events.py)
go to one listener; the CLI prints them.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import optuna

from stratagem.errors import StratagemError
from stratagem.evaluators import AnalyticEvaluator, Calibration, Evaluation, Evaluator, MeasuringEvaluator
from stratagem.evaluators.calibration import default_calibration
from stratagem.evaluators.calibration_file import CalibrationFile, study_calibration_file
from stratagem.evaluators.taught import taught_lines
from stratagem.search.budget import Deadline, check_run_timeout, close_window, open_window
from stratagem.search.calibrate import CalibrationStep, calibration_history, calibration_id
from stratagem.search.counts import screening_attr
from stratagem.search.events import Event, Listener, Notice, Phase, WindowOpened
from stratagem.search.measure import Measurement, measured_runs, target
from stratagem.search.noise import best_measured
from stratagem.search.records import (
    OBJECTIVES,
    StudyKey,
    front_trials,
    plan_key,
    trial_evaluation,
    trial_status,
)
from stratagem.search.run_order import (
    DEFAULT_RUN_ORDER,
    RUN_ORDERS,
    RunOrder,
    check_candidates,
    measured_trials,
)
from stratagem.search.runner import SearchResult, select_plans
from stratagem.search.screening import Mode, Screening, screen
from stratagem.search.status import beating
from stratagem.search.storage import check_storage, open_storage, parse_storage, storage_lock
from stratagem.search.study import evaluation_trial, held_keys, open_study, provenance, store_trials
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import usable_gib
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

if TYPE_CHECKING:
    from stratagem.search.traced import TracedResult, Tracer

__all__ = ["SearchSession", "MeasureResult", "DEFAULT_REMEASURE"]

DEFAULT_REMEASURE = 2
"""Re-measurement runs a call may spend after its K plans: the best once more (one run cannot show how far a
rerun moves) and the nearest rival within its noise, which gives the study its first estimate of run-to-run
noise with 2 degrees of freedom (search/noise.py run_noise)."""


def _stderr(event: Event) -> None:
    if isinstance(event, Notice):
        print(event.text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class MeasureResult:
    """What the real-run phase of one call did, and the study after it."""

    search: SearchResult
    """The search result (front and trial counts read after the runs)."""
    runs: int
    """Real runs this call started and saw end."""
    measured: int
    """Measured runs in the study now (every worker's, re-measurements included)."""
    statuses: dict[str, int]
    """The study's measured plans by status (ok, oom, failed, timeout); "infra": this call's infra releases."""
    calibration: Calibration
    """The calibration in force after the call (the latest adopted refit)."""
    history: list[CalibrationStep]
    """The study's calibration history (one step per batch, every worker's)."""
    seconds: float
    skipped: int = 0
    """Plans not run because the evaluator cannot run them (its `unsupported`)."""
    skipped_example: str = ""
    ok_runs: int = 0
    """Runs of this call that measured their plan (status ok)."""
    results: int = 0
    """Runs of this call that produced a result (ok, oom, timeout: events.RESULT_STATUSES)."""
    first_failure: str = ""
    """The first run of this call that did not end ok: "plan: status: reason" ('' when none)."""
    traced_out: int = 0
    """Plans never run because their traced memory does not fit."""
    traced_out_example: str = ""
    ended: str = ""
    """Why the loop stopped before the study reached K ('' when it did)."""
    best_note: str = ""
    """best_measured(...).note: the best measured plan and whether its ranking is within noise."""
    repredicted: int = 0
    """Trials re-predicted with the latest calibration at the end of this call."""
    plans: int = 0
    """Measured plans (distinct jobs) in the study now."""
    target: int = 0
    """Measured plans the call aimed the study at: those held when it started + K (or the target of a worker
    measuring beside it with the same K, joined)."""
    remeasured: int = 0
    """Re-measurement runs this call spent (at most its --remeasure)."""
    stopped: int = 0
    """Runs of this call stopped at the budget window's end (released for a later window)."""
    taught: tuple[str, ...] = ()
    """What the runs taught per term and block (evaluators.taught.taught_lines of `calibration`)."""

    @property
    def nothing_measured(self) -> str:
        """Why this call measured nothing ('' when some run produced a result, or there was nothing to run)."""
        ran = self.runs - self.stopped
        if ran and not self.results:
            return f"none of the {ran} real run(s) of this call produced a result; first: {self.first_failure}"
        if not self.runs and self.skipped and self.measured == 0:
            return (f"no plan could be run: {self.skipped} plan(s) the harness cannot run, e.g. "
                    f"{self.skipped_example}")
        return ""


@dataclass
class SearchSession:
    """One search of `scenario` into study `study_name` of `storage` (see the module docstring)."""

    scenario: Scenario
    storage: str
    study_name: str
    calibration: Calibration | None = None
    """The calibration predictions start from (default: the device's defaults)."""
    sampler: Mode = "auto"
    listener: Listener = _stderr
    calibration_source: str = ""
    """Which calibration the predictions start from, in words (recorded with the study when given)."""
    host_noise: bool = False
    """Keep the study's plans measured more than once in this host's noise file (search/noise_floor.py), where
    every later study's run-to-run noise pools them: real runs on this host (the CLI's) do; a replayed table or a
    stand-in evaluator must not. The noise is read from the file either way."""
    space: SearchSpace = field(init=False)
    usable_gib: float = field(init=False)
    screening: Screening | None = field(init=False, default=None)
    _backend: optuna.storages.BaseStorage | None = field(init=False, default=None, repr=False)
    _study: optuna.Study | None = field(init=False, default=None, repr=False)
    _stored: tuple[int, int] = field(init=False, default=(0, 0))
    _t0: float = field(init=False, default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.spec = parse_storage(self.storage)
        check_storage(self.spec)  # a storage problem is one line before any screening (no work lost to it)
        self.space = SearchSpace(self.scenario)
        self.usable_gib = usable_gib(self.scenario, self.space.config)
        self.calibration = self.calibration or default_calibration(self.scenario.cluster.gpu.name)

    # -- shared state ---------------------------------------------------------------------------------------------
    @property
    def start_calibration(self) -> Calibration:
        """The calibration the session's predictions start from."""
        assert self.calibration is not None  # set in __post_init__
        return self.calibration

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """The study's lock (its claims, counts and attribute read-modify-writes happen under it; other studies'
        writers never wait for it)."""
        return storage_lock(self.spec, self.study_name)

    def open(self) -> optuna.Study:
        """Open the storage and create or resume the study (once; later calls return it)."""
        if self._study is None:
            with storage_lock(self.spec):  # the storage's own lock: two processes must not create tables at once
                self._backend = open_storage(self.spec)
            with self.lock():
                self._study = open_study(self._backend, self.spec, self.study_name, self.scenario, self.space)
        return self._study

    @property
    def study(self) -> optuna.Study:
        """The open study."""
        return self.open()

    @property
    def backend(self) -> optuna.storages.BaseStorage:
        """The open storage."""
        self.open()
        assert self._backend is not None
        return self._backend

    def emit(self, event: Event) -> None:
        """Hand an event to the listener."""
        self.listener(event)

    def say(self, text: str) -> None:
        """A Notice."""
        self.emit(Notice(text))

    def _progress(self, phase: str, done: int, total: int) -> None:
        self.emit(Phase(phase, done, total))

    # -- steps ----------------------------------------------------------------------------------------------------
    def screen(self, n_trials: int | None = None, timeout: float | None = None) -> Screening:
        """Screen the space analytically with the start calibration (in memory; nothing stored)."""
        if n_trials is not None and n_trials < 0:
            raise StratagemError(f"--n-trials ({n_trials}): must be >= 0")
        if timeout is not None and timeout <= 0:
            raise StratagemError(f"--timeout ({timeout}): must be > 0 seconds")
        self.screening = screen(self.scenario, self.start_calibration, space=self.space, sampler=self.sampler,
                                n_trials=n_trials, timeout=timeout, progress=self._progress)
        return self.screening

    def store(self, evaluator: Evaluator | None = None) -> SearchResult:
        """Store the screening's selection (search/runner.select_plans) as finished trials; resumable (a plan
        already held is not stored again)."""
        evaluator = evaluator or AnalyticEvaluator(self.start_calibration)
        if evaluator.fidelity != "analytic":
            raise StratagemError(f"store: a {evaluator.fidelity} evaluator runs through SearchSession.measure "
                                 "(the one measured-run path)")
        screening = self.screening or self.screen()
        chosen = select_plans(screening, self.space.config.stored_sample, self.space.config.seed)
        prov = provenance(self.scenario, self.space, screening=screening.mode,
                          calibration=calibration_id(self.start_calibration))
        study = self.open()
        held = held_keys(study)  # a first look, without the lock: only the plans missing are evaluated
        keyed = [(i, role, screening.plan(i)) for i, role in chosen]
        todo = [(plan_key(plan), evaluation_trial(self.space, evaluator.evaluate(self.scenario, plan), self.usable_gib,
                                                  role, prov, screening.pruned_reason(i)))
                for i, role, plan in keyed if plan_key(plan) not in held]
        state = {"what": "screened plans", "planned": len(keyed)}
        if todo:  # a search killed while storing leaves this unfinished: reports say so
            with self.lock():
                study.set_user_attr(StudyKey.SEARCH_STATE, {**state, "finished": False})
        written = store_trials(study, self.lock, todo, lambda done, total: self._progress("store", done, total))
        with self.lock():
            study.set_user_attr(StudyKey.COUNTS, screening_attr(screening))  # search/counts.py
            study.set_user_attr(StudyKey.SCREENING, screening.mode)
            if self.calibration_source:
                study.set_user_attr(StudyKey.CALIBRATION_SOURCE, self.calibration_source)
            if todo or not study.user_attrs.get(StudyKey.SEARCH_STATE, {}).get("finished", True):
                study.set_user_attr(StudyKey.SEARCH_STATE, {**state, "finished": True})
        self._stored = (written, len(keyed) - written)
        return self.result()

    def result(self) -> SearchResult:
        """The search result as the study stands now."""
        screening = self.screening or self.screen()
        study = self.open()
        return SearchResult(study_name=self.study_name, storage=self.spec, counts=screening.counts,
                            mode=screening.mode, stored=self._stored[0], already=self._stored[1],
                            front=front_trials(study), trials=len(study.get_trials(deepcopy=False)),
                            seconds=time.perf_counter() - self._t0, screening=screening, study=study,
                            backend=self._backend)

    def trace(self, k: int, tracer: Tracer,
              on_trace: Callable[[str, Evaluation | None, str], None] | None = None) -> TracedResult:
        """Up to K traced trials (search/traced.py), the logits_bytes refit, and a re-screen stored with it."""
        from stratagem.search.traced import trace_session

        return trace_session(self, tracer, k, on_trace)

    def run_timeout(self, given: float | None) -> float | None:
        """The per-run timeout: `given` (--run-timeout), else the one an earlier call stored with the study; None:
        derived per plan (search/budget.py)."""
        check_run_timeout(given)
        stored = self.study.user_attrs.get(StudyKey.RUN_TIMEOUT)
        return given if given is not None else (float(stored) if stored is not None else None)

    def measure(self, k: int, evaluator: MeasuringEvaluator, order: RunOrder | None = None, *,
                budget_minutes: float | None = None, max_runs: int | None = None, timeout: float | None = None,
                recalibrate: bool = True, run_timeout_s: float | None = None,
                candidates: PlanColumns | None = None, remeasure: int = DEFAULT_REMEASURE) -> MeasureResult:
        """Real runs measuring K plans not measured before (the study's target: the plans it holds now + K, or the
        target of a worker measuring beside it with the same K), then up to `remeasure` runs re-measuring the best and
        the plans within its noise (search/measure.py, search/noise.py). `budget_minutes`: the budget
        window this call counts against (search/budget.py); `max_runs` / `timeout`: this call's runs / seconds;
        `run_timeout_s`: recorded with the study (the evaluator applies it); `candidates`: the default order
        runs only these plans."""
        t0 = time.perf_counter()
        _check_measure(k, evaluator, max_runs, timeout, budget_minutes)
        if remeasure < 0:
            raise StratagemError(f"--remeasure ({remeasure}): must be >= 0 (0: never run a plan twice)")
        check_run_timeout(run_timeout_s)
        if candidates is not None:
            check_candidates(self.space, candidates)
        if self._study is None:
            self.store()
        order = order or RUN_ORDERS[DEFAULT_RUN_ORDER](candidates=candidates)
        deadline = Deadline(call_end=None if timeout is None else time.monotonic() + timeout, max_runs=max_runs)
        window_index = self._begin_measure(budget_minutes, run_timeout_s, deadline)
        with self.lock():
            goal, joined = target(self.study, k)
        self._say_target(k, goal, joined)
        m = Measurement(self, evaluator, order, k, recalibrate, deadline, remeasure, goal)
        with beating(self.study, k, goal):  # this worker's heartbeat for `stratagem status` (search/status.py)
            m.run()
        repredicted = m.finish()
        return self._measure_result(m, window_index, repredicted, time.perf_counter() - t0)

    def _say_target(self, k: int, goal: int, joined: bool) -> None:
        """One line when --real-runs K does not start from an empty study: K more plans, or a joined target."""
        if joined:
            self.say(f"real runs: joining the target of another worker measuring this study with --real-runs {k}: "
                     f"{goal} measured plans")
        elif goal > k:
            self.say(f"real runs: {k} more plan(s) (--real-runs {k}): the study holds {goal - k} measured plan(s), "
                     f"its target is now {goal}")

    def calibration_file(self) -> CalibrationFile | None:
        """The study's calibration in force after its real runs (refitted constants, per-term multipliers) with the
        measured runs behind it, as a calibration file (evaluators.calibration_file.study_calibration_file); None
        while no refit was adopted. Errors: the first refit's before, the latest's after."""
        study = self.study  # opened outside the lock (opening takes it)
        with self.lock():
            stored = study.user_attrs.get(StudyKey.CALIBRATION)
            history = calibration_history(study.user_attrs.get(StudyKey.CALIBRATION_HISTORY))
            measured = [ev for t in measured_trials(study).values() if (ev := trial_evaluation(t)) is not None]
        if stored is None or not any(h.adopted for h in history):
            return None
        errors = {"step_error_before": history[0].step_error_before, "step_error_after": history[-1].step_error_after,
                  "peak_error_before": history[0].memory_error_before,
                  "peak_error_after": history[-1].memory_error_after}
        return study_calibration_file(self.scenario, Calibration.model_validate(stored), measured, self.study_name,
                                      errors)

    def _begin_measure(self, budget_minutes: float | None, run_timeout_s: float | None, deadline: Deadline) -> int:
        """Name the metrics, record the run timeout, open or join the budget window. Returns its index (0: none)."""
        study = self.study
        with self.lock():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "experimental"
                study.set_metric_names(list(OBJECTIVES))  # named for optuna-dashboard
            if run_timeout_s is not None:  # kept for later calls and workers (SearchSession.run_timeout)
                study.set_user_attr(StudyKey.RUN_TIMEOUT, run_timeout_s)
            if study.user_attrs.get(StudyKey.REAL_RUNS_STARTED) is None:
                study.set_user_attr(StudyKey.REAL_RUNS_STARTED, time.time())
            if budget_minutes is None:
                return 0
            index, window, joined = open_window(study, budget_minutes)
        deadline.budget_end = window.end
        self.emit(WindowOpened(index=index, minutes=budget_minutes, left_s=window.left_s(), joined=joined))
        return index

    def _measure_result(self, m: Measurement, window_index: int, repredicted: int,
                        seconds: float) -> MeasureResult:
        study = self.study
        with self.lock():
            done = measured_trials(study)
            runs = measured_runs(study)
            left = m.deadline.seconds_left()
            if window_index and ((left is not None and left <= 0) or len(done) >= m.target):
                close_window(study, window_index)
            history = calibration_history(study.user_attrs.get(StudyKey.CALIBRATION_HISTORY))
        statuses: dict[str, int] = {}
        for t in done.values():
            s = trial_status(t)
            statuses[s] = statuses.get(s, 0) + 1
        if m.tally.infra:
            statuses["infra"] = m.tally.infra
        best = best_measured(study)
        note = best.note if best is not None else ""
        if best is not None and best.within_noise and len(done) >= m.target and m.tally.remeasured >= m.remeasure:
            note += "; no re-measurement left to settle it (raise --remeasure)"
        skipped = m.order.skipped
        return MeasureResult(
            search=self.result(), runs=m.tally.runs, measured=runs, plans=len(done), target=m.target,
            remeasured=m.tally.remeasured, statuses=statuses, calibration=m.calibration,
            history=history, seconds=seconds, skipped=len(skipped), skipped_example=next(iter(skipped.values()), ""),
            ok_runs=m.tally.ok, results=m.tally.results, first_failure=m.tally.first_failure,
            traced_out=len(m.traced_out), traced_out_example=next(iter(m.traced_out.values()), ""),
            ended=m.tally.ended, best_note=note, repredicted=repredicted,
            stopped=m.tally.stopped, taught=tuple(taught_lines(m.calibration, self.scenario.cluster.gpu.name)))


def _check_measure(k: int, evaluator: MeasuringEvaluator, max_runs: int | None, timeout: float | None,
                   budget_minutes: float | None) -> None:
    if k < 0:
        raise StratagemError(f"--real-runs ({k}): must be >= 0")
    if budget_minutes is not None and not budget_minutes > 0:
        raise StratagemError(f"--budget-minutes ({budget_minutes}): must be > 0")
    if max_runs is not None and max_runs < 0:
        raise StratagemError(f"--max-runs ({max_runs}): must be >= 0")
    if timeout is not None and timeout <= 0:
        raise StratagemError(f"--timeout ({timeout}): must be > 0 seconds")
    if evaluator.fidelity != "measured":
        raise StratagemError("real runs need a measured evaluator")
