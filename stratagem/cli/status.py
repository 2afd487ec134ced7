"""`stratagem status`: what a (possibly running) search's study holds now, for the person on call."""

from __future__ import annotations

import json
import math
import signal
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from stratagem.cli.app import (
    RetryOpt,
    SearchedScenarioArg,
    StorageOpt,
    StudyOpt,
    app,
    console,
    study_location,
)
from stratagem.errors import StratagemError
from stratagem.quantities import DASH, duration_in, percent

if TYPE_CHECKING:
    from stratagem.search.status import StudyStatus


_MAX_INTERVAL_S = 86400.0
"""Longest --interval: a day (a longer wait is a status run by cron, not a watch)."""


@app.command("status")
def status_cmd(
    scenario: SearchedScenarioArg = None,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C; a storage outage is waited out "
                                        "(one line when it starts and one when it ends).")] = False,
    interval: Annotated[float, typer.Option("--interval", min=1.0, help="Seconds between refreshes with "
                                            "--watch.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    retry: RetryOpt = None,
) -> None:
    """Trials stored, measured runs done/claimed/failed by kind, workers alive (by heartbeat), K and how many
    are done, retries pending and done, releases by a signal, best plan so far (measured and predicted),
    calibration error per batch, time spent and left of the real-run budget. Never creates a storage."""
    from stratagem.reports.counts import count_lines
    from stratagem.search.retry import STOP, set_retry_minutes
    from stratagem.search.view import StudyView

    if not 1.0 <= interval <= _MAX_INTERVAL_S:  # inf or nan passes typer's min=1.0
        raise StratagemError(f"--interval ({interval}): give seconds between refreshes, 1 to {_MAX_INTERVAL_S:g} "
                             "(a day)")
    url, name = study_location("status", scenario, storage, study)
    view = StudyView.open(url, name)
    if watch:
        set_retry_minutes(math.inf if retry is None else retry)  # watching waits out an outage, however long
    # Ctrl-C while watching sets STOP instead of raising inside a database read: a KeyboardInterrupt raised in
    # psycopg / SQLAlchemy mid-query was seen swallowed (the watch ran on); a read in flight finishes, a retry
    # through an outage stops at once (search.retry.STOP), and the loop ends with exit 0.
    previous = signal.getsignal(signal.SIGINT)
    STOP.clear()
    if watch:
        signal.signal(signal.SIGINT, lambda *_: STOP.set())
    try:
        while not STOP.is_set():
            s = view.status()
            counts = view.counts()
            if as_json:
                print(json.dumps({**s.as_dict(), "counts": counts.as_dict()}), flush=True)
            else:
                _render(console, s, count_lines(counts, s.study), counts.measured_plans)
            if not watch or STOP.wait(interval):
                break
    except KeyboardInterrupt:
        pass
    finally:
        if watch:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        STOP.clear()  # this process's later storage calls retry as before
    if watch:
        raise typer.Exit(0)


def _minutes(seconds: float | None) -> str:
    """A duration in minutes (3 significant figures), as the budget is given."""
    return duration_in(seconds, ("min", 60.0))


def _render(out: Console, s: StudyStatus, counts: list[str], plans: int) -> None:
    """The count lines (`reports.counts.count_lines`, as search and report print them), then the status;
    `plans`: the measured plans, which K counts."""
    ended = " (ended)" if s.finished else ""
    if s.target is not None:
        of_k = f"{plans} of {s.target} done (the last call's --real-runs {s.k}: {s.k} more than it found)"
    elif s.k is not None:
        of_k = f"{plans} done (--real-runs {s.k})"
    else:
        of_k = f"{plans} done (K not recorded)"
    lines = [
        *counts,
        f"measured plans: {of_k}; {s.claimed} claimed now",
        f"lost runs: {s.infra} infra failure(s), {s.signal_released} released by a signal, {s.budget_released} "
        f"stopped at a budget window's end, {s.expired} expired claim(s); retries: {s.retries_pending} pending, "
        f"{s.retries_done} done",
        f"workers alive: {len(s.workers)}" + (f" ({', '.join(s.workers)})" if s.workers else ""),
        f"best measured: {s.best_measured or DASH}",
        f"best predicted: {s.best_predicted or DASH}",
        "calibration (measured: step-time / peak-memory median error): "
        + (", ".join(f"{n}: {percent(t)}/{percent(m)}" for n, t, m in s.calibration_trend[-6:]) or DASH),
        *s.taught,  # what the runs taught per term and block (evaluators.taught)
        f"real runs{ended}: {_minutes(s.run_s)} of run time (the sum of {s.runs} runs' durations); "
        f"{_minutes(s.elapsed_s)} since the first began (wall span, gaps between calls included); "
        f"{_minutes(s.budget_left_s)} left of the budget",
        *(f"budget window {i} of {len(s.windows)} ({m:g} min): {_minutes(spent)} spent, {_minutes(left)} left"
          for i, (m, spent, left) in enumerate(s.windows, 1)),
    ]
    for line in lines:
        out.print(line, markup=False, soft_wrap=True)
