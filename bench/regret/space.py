"""The search space a candidate-restricted replay stores its trials in: the scenario's space, with each axis's
Optuna choices widened to hold the candidates' own values.

A table's plans are what the harness ran when the table was measured. The product's space leaves out every
exclusion of the stack (spaces/exclusions.py), those the harness refuses and those it runs as planned but the
stack's exporter cannot express exactly ("export": ZeRO-1, stratagem's selective recompute, DDP beside tp/pp,
tp without sequence parallelism on torch). bench/data/cpu-table.json was measured when the torch space still
held the export ones, so its plans run (the harness ran them) but lie outside today's space, and the loop
stores every run as a trial of the space (SearchSpace.params: an Optuna categorical over the axis's choices).

The replay keeps the table as measured and gives the loop a space that holds it: the same enumeration (the
screening, the stored sample and Optuna's sampler see the scenario's space unchanged), and per axis the
categorical choices of the space plus the values the candidates take. Nothing in stratagem changes: a user's
candidate list outside the space is still refused (search.run_order.check_candidates); the replay never calls
that check because it never passes `candidates` to SearchSession.measure, it builds the run order with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stratagem.spaces import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["CandidateSpace"]


def _order(v: Any) -> tuple[bool, Any]:
    """Numbers before strings, each in natural order (bools are ints: False < True)."""
    return isinstance(v, str), v


class CandidateSpace(SearchSpace):
    """The scenario's SearchSpace whose per-axis categorical choices also hold `candidates`' values (module
    docstring); enumeration, counts and allowed values per partial plan are the scenario's."""

    def __init__(self, scenario: Scenario, candidates: Sequence[Plan]) -> None:
        self._candidates = list(candidates)
        super().__init__(scenario)

    def _global_choices(self) -> dict[str, tuple[Any, ...]]:
        """The space's choices per axis plus every value a candidate takes (a value on an axis that does not apply to
        its plan is never stored: an unused choice)."""
        choices = super()._global_choices()
        for plan in self._candidates:
            dump = plan.model_dump(mode="json")
            for name in choices:
                value = "+".join(plan.recompute_modules) if name == "recompute_modules" else dump[name]
                if value not in choices[name]:
                    choices[name] = tuple(sorted((*choices[name], value), key=_order))
        return choices
