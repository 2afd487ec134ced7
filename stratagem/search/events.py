"""What a search session tells its caller while it works: typed events (the CLI prints them; tests and the
bench read them), never an untyped dict read by string keys.

One listener receives them all: `Listener = Callable[[Event], None]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stratagem.search.calibrate import CalibrationStep

__all__ = ["Phase", "Notice", "RunDone", "RESULT_STATUSES", "BatchDone", "WindowOpened", "Event", "Listener"]


@dataclass(frozen=True)
class Phase:
    """Progress through one phase: "screen", "explore", "store", "real runs"."""

    phase: str
    done: int
    total: int


@dataclass(frozen=True)
class Notice:
    """One line worth saying (a plan not run and why, a budget window, a ranking within noise)."""

    text: str


@dataclass(frozen=True)
class RunDone:
    """One run of a batch and what became of it."""

    plan: str
    """The plan's label (Plan.short())."""
    status: str
    """ok, oom, timeout, failed, infeasible, infra or stopped (infra: the cluster's fault; stopped: the budget
    window ended; both released for a retry, not the plan's verdict)."""
    reason: str
    """The first line of why it did not end ok ('' when ok)."""
    remeasure: bool = False
    """Whether this was a re-measurement of a plan measured before (search/noise.py: a rerun of a close rival)."""

    @property
    def result(self) -> bool:
        """Whether the run produced a result about the plan (ok, oom, timeout: the study progressed)."""
        return self.status in RESULT_STATUSES


RESULT_STATUSES: tuple[str, ...] = ("ok", "oom", "timeout")
"""Run statuses that are a result, not an infrastructure failure: the plan ran, fits or not, finishes in
time or not."""


@dataclass(frozen=True)
class BatchDone:
    """A batch of real runs finished and the calibration was (re)considered."""

    measured: int
    """Measured runs in the study now (every worker's)."""
    target: int
    """The study's K (--real-runs)."""
    runs: tuple[RunDone, ...]
    step: CalibrationStep
    """The refit after this batch (adopted or refused, with its errors)."""


@dataclass(frozen=True)
class WindowOpened:
    """The budget window this call counts against (search/budget.py)."""

    index: int
    """1-based window number in the study."""
    minutes: float
    left_s: float
    """Seconds left in it now."""
    joined: bool
    """True: another worker's open window of the same length, joined; False: a new window."""


Event = Phase | Notice | BatchDone | WindowOpened
Listener = Callable[[Event], None]
