"""Budget windows of the real-run phase and the per-run timeout: a budget spans the calls that resume one
search, not each call.

A `--budget-minutes M` call counts against a window of M minutes recorded in the study (attribute
"budget_windows": one {"started", "minutes", "ended"} per window). A call joins the latest window when it is
still open and of the same length (another worker of the same night's command); otherwise it opens a new one
(a rerun "with 2 more hours" gets 2 more hours, and says so). "ended" is set when a call finds its window over
(budget spent) or the study's runs done. The current window is mirrored in "real_runs_started" /
"real_runs_budget_minutes" for readers of a single budget.

No run starts when it could not finish before the window ends, by the evaluator's predicted run time
(MeasuringEvaluator.run_seconds); runs still in flight at the window's end are stopped and their claims released.

Per-run timeout (`--run-timeout S`, stored with the study as "run_timeout_s"; None: derived per plan):
`derived_timeout` = max(RUN_TIMEOUT_FLOOR_S, RUN_TIMEOUT_FACTOR x the predicted run time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import optuna
from pydantic import BaseModel, ConfigDict

from stratagem.errors import StratagemError
from stratagem.search.records import StudyKey

__all__ = ["BudgetWindow", "budget_windows", "open_window", "close_window", "RUN_TIMEOUT_FLOOR_S",
           "RUN_TIMEOUT_FACTOR", "derived_timeout", "check_run_timeout", "Deadline"]

RUN_TIMEOUT_FLOOR_S = 180.0
"""No derived run timeout is shorter: a CPU demo run's build, gloo start-up and warm-up take 4-16 s on an idle
host and several times that at load 5-10 (the fixed timeout it replaces was 180 s)."""
RUN_TIMEOUT_FACTOR = 3.0
"""A run is killed after this many times its predicted wall time (a predicted step can be 2x off before a
refit: bench/throughput_accuracy.py; load on a shared host stretches every phase)."""


class BudgetWindow(BaseModel):
    """One --budget-minutes window of a study's real runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    started: float
    """When the window opened (Unix time)."""
    minutes: float
    """Its length."""
    ended: float | None = None
    """When a worker found it over (budget spent, or the study's runs done); None while open."""

    @property
    def end(self) -> float:
        """When the budget runs out (Unix time)."""
        return self.started + 60.0 * self.minutes

    def spent_s(self, now: float | None = None) -> float:
        """Seconds spent in the window (frozen once it ended)."""
        now = time.time() if now is None else now
        stop = min(now, self.end) if self.ended is None else min(self.ended, self.end)
        return max(0.0, stop - self.started)

    def left_s(self, now: float | None = None) -> float:
        """Seconds left (0 once it ended)."""
        now = time.time() if now is None else now
        return 0.0 if self.ended is not None else max(0.0, self.end - now)


def budget_windows(study: optuna.Study) -> list[BudgetWindow]:
    """The study's budget windows, oldest first."""
    return [BudgetWindow.model_validate(w) for w in study.user_attrs.get(StudyKey.BUDGET_WINDOWS) or []]


def _write(study: optuna.Study, windows: list[BudgetWindow]) -> None:
    study.set_user_attr(StudyKey.BUDGET_WINDOWS, [w.model_dump(mode="json") for w in windows])


def open_window(study: optuna.Study, minutes: float, now: float | None = None) -> tuple[int, BudgetWindow, bool]:
    """(1-based index, window, joined): join the latest window when it is open and `minutes` long, else open a
    new one. Call under the storage lock."""
    if not minutes > 0:
        raise StratagemError(f"--budget-minutes ({minutes:g}): must be > 0")
    now = time.time() if now is None else now
    windows = budget_windows(study)
    last = windows[-1] if windows else None
    if last is not None and last.ended is None and last.minutes == minutes and now < last.end:
        return len(windows), last, True
    if last is not None and last.ended is None:
        windows[-1] = last.model_copy(update={"ended": min(now, last.end)})
    window = BudgetWindow(started=now, minutes=minutes)
    windows.append(window)
    _write(study, windows)
    study.set_user_attr(StudyKey.REAL_RUNS_STARTED, now)
    study.set_user_attr(StudyKey.REAL_RUNS_BUDGET_MINUTES, minutes)
    return len(windows), window, False


def close_window(study: optuna.Study, index: int, now: float | None = None) -> None:
    """Mark window `index` (1-based) ended now (budget spent or the study's runs done). Under the lock."""
    windows = budget_windows(study)
    if 0 < index <= len(windows) and windows[index - 1].ended is None:
        now = time.time() if now is None else now
        windows[index - 1] = windows[index - 1].model_copy(update={"ended": min(now, windows[index - 1].end)})
        _write(study, windows)


def derived_timeout(predicted_run_s: float) -> float:
    """The per-run timeout when none is given: RUN_TIMEOUT_FACTOR x the predicted run time, at least the floor."""
    return max(RUN_TIMEOUT_FLOOR_S, RUN_TIMEOUT_FACTOR * predicted_run_s)


def check_run_timeout(value: float | None) -> float | None:
    """--run-timeout: None (derived per plan) or > 0 seconds."""
    if value is not None and not value > 0:
        raise StratagemError(f"--run-timeout ({value:g}): must be > 0 seconds (or leave it out: derived per plan "
                             f"from its predicted build and step time, at least {RUN_TIMEOUT_FLOOR_S:.0f} s)")
    return value


@dataclass
class Deadline:
    """The limits one call's loop checks: the budget window's end (Unix time), the call's --timeout
    (monotonic) and its --n-trials."""

    budget_end: float | None = None
    call_end: float | None = None
    max_runs: int | None = None

    def seconds_left(self) -> float | None:
        """Seconds left before the budget window ends (None: no budget)."""
        return None if self.budget_end is None else self.budget_end - time.time()

    def over(self, runs: int) -> str:
        """Why no further batch may start ('' while one may)."""
        left = self.seconds_left()
        if left is not None and left <= 0:
            return "the budget window is spent"
        if self.call_end is not None and time.monotonic() >= self.call_end:
            return "--timeout reached"
        if self.max_runs is not None and runs >= self.max_runs:
            return "--n-trials runs done"
        return ""
