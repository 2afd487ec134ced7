"""The interfaces every evaluator shares; search receives an Evaluator and never knows how it judges.

`Evaluator`: judges one plan. `BatchEvaluator`: several at once. `MeasuringEvaluator`: what the real-run loop
(search/session.py) needs beyond judging: how many ranks the cluster runs at once (`slots`), which plans it
cannot run (`unsupported`), how long one run is predicted to take (`run_seconds`, for the budget), and a way to
stop the runs in flight (`stop`, at the budget's end or on a signal). Declared here so the loop never probes an
evaluator with getattr.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from stratagem.evaluators.evaluation import Evaluation, Fidelity
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Evaluator", "BatchEvaluator", "MeasuringEvaluator"]


@runtime_checkable
class Evaluator(Protocol):
    """Judges a plan: `evaluate(scenario, plan) -> Evaluation`."""

    fidelity: Fidelity

    def evaluate(self, scenario: Scenario, plan: Plan) -> Evaluation:
        """The plan's Evaluation in the scenario."""
        ...


@runtime_checkable
class BatchEvaluator(Evaluator, Protocol):
    """An evaluator that judges several plans at once (real runs side by side on a cluster): `evaluate_batch`.
    (`evaluate_many` is the analytic model's columns function; one name, one meaning.)"""

    def evaluate_batch(self, scenario: Scenario, plans: Sequence[Plan]) -> list[Evaluation]:
        """The plans' Evaluations, in order."""
        ...


@runtime_checkable
class MeasuringEvaluator(BatchEvaluator, Protocol):
    """An evaluator of fidelity "measured" the real-run loop drives (the Ray runner, a table of measured runs,
    the tests' stand-in)."""

    @property
    def slots(self) -> int:
        """Ranks the cluster runs at once, read now (nodes come and go): a batch holds slots // widest plan."""
        ...

    def unsupported(self, scenario: Scenario, plan: Plan) -> str | None:
        """Why this evaluator cannot run `plan` (the loop skips it and counts it), or None."""
        ...

    def run_seconds(self, scenario: Scenario, plan: Plan) -> float:
        """Predicted wall time of one run of `plan` (build, warm-up, timed steps, checkpoint timing): the loop
        starts no run that could not finish in the budget left."""
        ...

    def stop(self) -> int:
        """Stop the runs in flight now (their evaluations come back with status "infra", reason "stopped");
        returns how many were in flight."""
        ...
