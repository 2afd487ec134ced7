"""The one interface every evaluator shares; search receives an Evaluator and never knows how it judges."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from stratagem.evaluators.evaluation import Evaluation, Fidelity
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Evaluator", "BatchEvaluator"]


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
