"""`run_multifidelity`: a SearchSession's screen, store and measure steps in one call (search/session.py), for
the callers that need no more (tests, tools, a worker script). The loop lives in search/measure.py, the run
order in search/run_order.py, the noise-aware ranking in search/noise.py; their names used elsewhere are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable

from stratagem.evaluators import Calibration, MeasuringEvaluator
from stratagem.search.events import BatchDone, Event, Notice, Phase
from stratagem.search.run_order import (
    check_candidates,
)
from stratagem.search.screening import Mode, Progress
from stratagem.search.session import DEFAULT_REMEASURE, MeasureResult, SearchSession
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = ["run_multifidelity"]


def run_multifidelity(
    scenario: Scenario,
    storage: str,
    study_name: str,
    evaluator: MeasuringEvaluator,
    real_runs: int,
    budget_minutes: float | None = None,
    sampler: Mode = "auto",
    progress: Progress | None = None,
    on_batch: Callable[[BatchDone], None] | None = None,
    *,
    candidates: PlanColumns | None = None,
    initial_calibration: Calibration | None = None,
    recalibrate: bool = True,
    n_trials: int | None = None,
    timeout: float | None = None,
    on_message: Callable[[str], None] | None = None,
    run_timeout_s: float | None = None,
    remeasure: int = DEFAULT_REMEASURE,
) -> MeasureResult:
    """Analytic search (stored as usual), then measured runs until the study holds `real_runs` measured plans and
    up to `remeasure` re-measurements
    (SearchSession.measure: several workers may share the study; see search/measure.py). `on_batch` receives
    each BatchDone event, `on_message` each Notice's text (default: stderr), `progress` the phases."""
    import sys

    def listener(event: Event) -> None:
        if isinstance(event, Phase) and progress is not None:
            progress(event.phase, event.done, event.total)
        elif isinstance(event, BatchDone) and on_batch is not None:
            on_batch(event)
        elif isinstance(event, Notice):
            (on_message or (lambda text: print(text, file=sys.stderr, flush=True)))(event.text)

    session = SearchSession(scenario, storage, study_name, calibration=initial_calibration, sampler=sampler,
                            listener=listener)
    if candidates is not None:
        check_candidates(session.space, candidates)  # before anything is written
    session.screen()
    session.store()
    return session.measure(real_runs, evaluator, budget_minutes=budget_minutes, n_trials=n_trials, timeout=timeout,
                           recalibrate=recalibrate, run_timeout_s=run_timeout_s, candidates=candidates,
                           remeasure=remeasure)
