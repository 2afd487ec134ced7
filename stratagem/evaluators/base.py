"""The one interface every evaluator shares; search receives an Evaluator and never knows how it judges."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from stratagem.evaluators.evaluation import Evaluation, Fidelity
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Evaluator"]


@runtime_checkable
class Evaluator(Protocol):
    """Judges a plan: `evaluate(scenario, plan) -> Evaluation`."""

    fidelity: Fidelity

    def evaluate(self, scenario: Scenario, plan: Plan) -> Evaluation: ...
