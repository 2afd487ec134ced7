"""Test helper: a SearchSession (stratagem.search.session) built and run through its steps in one call, as the
CLI's `search` does step by step. The product has one path (the session); these three calls only save the tests
from spelling out the listener and the steps each time."""

from __future__ import annotations

import sys
from collections.abc import Callable

from stratagem.evaluators import Calibration, MeasuringEvaluator
from stratagem.search.events import BatchDone, Event, Notice, Phase
from stratagem.search.run_order import check_candidates
from stratagem.search.runner import SearchResult
from stratagem.search.screening import Mode, Progress
from stratagem.search.session import DEFAULT_REMEASURE, MeasureResult, SearchSession
from stratagem.search.traced import TracedResult, Tracer, trace_session
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario


def _listener(progress: Progress | None, on_batch: Callable[[BatchDone], None] | None = None,
              on_message: Callable[[str], None] | None = None) -> Callable[[Event], None]:
    """Phases to `progress`, batches to `on_batch`, notices to `on_message` (default: stderr)."""
    def listener(event: Event) -> None:
        if isinstance(event, Phase) and progress is not None:
            progress(event.phase, event.done, event.total)
        elif isinstance(event, BatchDone) and on_batch is not None:
            on_batch(event)
        elif isinstance(event, Notice):
            (on_message or (lambda text: print(text, file=sys.stderr, flush=True)))(event.text)

    return listener


def run_search(scenario: Scenario, storage: str, study_name: str, sampler: Mode = "auto", n_trials: int | None = None,
               timeout: float | None = None, progress: Progress | None = None,
               calibration: Calibration | None = None) -> SearchResult:
    """The session's `screen` and `store` steps: the analytic search into an Optuna study (rerunning resumes)."""
    session = SearchSession(scenario, storage, study_name, calibration=calibration, sampler=sampler,
                            listener=_listener(progress, on_message=lambda _: None))
    session.screen(n_trials=n_trials, timeout=timeout)
    return session.store()


def run_multifidelity(scenario: Scenario, storage: str, study_name: str, evaluator: MeasuringEvaluator,
                      real_runs: int, budget_minutes: float | None = None, sampler: Mode = "auto",
                      progress: Progress | None = None, on_batch: Callable[[BatchDone], None] | None = None, *,
                      candidates: PlanColumns | None = None, initial_calibration: Calibration | None = None,
                      recalibrate: bool = True, max_runs: int | None = None, timeout: float | None = None,
                      on_message: Callable[[str], None] | None = None, run_timeout_s: float | None = None,
                      remeasure: int = DEFAULT_REMEASURE) -> MeasureResult:
    """The session's `screen`, `store` and `measure` steps: the analytic search, then measured runs until the
    study holds `real_runs` measured plans and up to `remeasure` re-measurements."""
    session = SearchSession(scenario, storage, study_name, calibration=initial_calibration, sampler=sampler,
                            listener=_listener(progress, on_batch, on_message))
    if candidates is not None:
        check_candidates(session.space, candidates)  # before anything is written
    session.screen()
    session.store()
    return session.measure(real_runs, evaluator, budget_minutes=budget_minutes, max_runs=max_runs, timeout=timeout,
                           recalibrate=recalibrate, run_timeout_s=run_timeout_s, candidates=candidates,
                           remeasure=remeasure)


def run_traced(scenario: Scenario, storage: str, study_name: str, tracer: Tracer, traced: int,
               sampler: Mode = "auto", progress: Progress | None = None,
               calibration: Calibration | None = None) -> TracedResult:
    """The session's traced step (search.traced.trace_session) on a session of its own."""
    session = SearchSession(scenario, storage, study_name, calibration=calibration, sampler=sampler,
                            listener=_listener(progress))
    return trace_session(session, tracer, traced)
