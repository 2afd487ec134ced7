"""`OpenSession`: what a search step that runs on a session (search/measure.py, search/traced.py) reads and sets
on it. SearchSession (search/session.py) satisfies it; the steps type against this protocol so that they import
no session module while the session imports them (imports run one way, as Optuna's `_optimize` receives a
study it does not construct)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import optuna

    from stratagem.evaluators.base import Evaluator
    from stratagem.evaluators.calibration import Calibration
    from stratagem.search.events import Event
    from stratagem.search.runner import SearchResult
    from stratagem.search.screening import Screening
    from stratagem.spaces.scenario import Scenario
    from stratagem.spaces.space import SearchSpace

__all__ = ["OpenSession"]


class OpenSession(Protocol):
    """A search session a step runs on (search/session.py SearchSession)."""

    scenario: Scenario
    study_name: str
    calibration: Calibration | None
    space: SearchSpace
    usable_gib: float
    screening: Screening | None
    host_noise: bool

    @property
    def start_calibration(self) -> Calibration:
        """The calibration the session's predictions start from."""

    @property
    def study(self) -> optuna.Study:
        """The open study."""

    @property
    def backend(self) -> optuna.storages.BaseStorage:
        """The open storage."""

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """The storage's lock."""

    def emit(self, event: Event) -> None:
        """Hand an event to the listener."""

    def say(self, text: str) -> None:
        """A Notice."""

    def screen(self, n_trials: int | None = None, timeout: float | None = None) -> Screening:
        """Screen the space analytically."""

    def store(self, evaluator: Evaluator | None = None) -> SearchResult:
        """Store the screening's selection as trials."""

    def result(self) -> SearchResult:
        """The search result as the study stands now."""
