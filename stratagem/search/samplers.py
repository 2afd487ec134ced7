"""Optuna samplers over the plan space: NSGA-II, TPE or random, wrapped so every proposal is a valid plan.

Optuna's categorical choices must be the same in every trial of a study, but which values an axis may take
depends on the earlier axes (cp on tp and pp, micro-batch on dp, ...). `ProjectingSampler` lets the base
sampler propose from the fixed choices, then moves each proposal to the nearest value the space allows
given the axes already chosen (`SearchSpace.project`), in define-by-run order. Relative proposals (NSGA-II
crossover, multivariate TPE) are kept per trial and projected one axis at a time as they are suggested.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    from stratagem.spaces.space import SearchSpace

__all__ = ["SAMPLERS", "ProjectingSampler", "make_sampler"]

SAMPLERS: tuple[str, ...] = ("nsga2", "tpe", "random")


def make_sampler(name: str, seed: int, population_size: int = 50) -> BaseSampler:
    """The named Optuna sampler, seeded."""
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=population_size, seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=50)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise StratagemError(f"--sampler ({name!r}): use one of {', '.join(SAMPLERS)} or exhaustive")


class ProjectingSampler(BaseSampler):
    """Wraps a sampler so that every suggested plan axis is valid given the axes before it."""

    def __init__(self, base: BaseSampler, space: SearchSpace) -> None:
        self.base = base
        self.space = space
        self._relative: dict[int, dict[str, Any]] = {}

    def __str__(self) -> str:
        return f"ProjectingSampler({self.base})"

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        """The base sampler's joint search space."""
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        """Keep the base sampler's joint proposal; each value is projected when its axis is suggested."""
        self._relative[trial._trial_id] = self.base.sample_relative(study, trial, search_space)
        return {}

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        """The base's value for this axis, projected onto the values valid with the axes already chosen."""
        proposal = self._relative.get(trial._trial_id, {})
        if param_name in proposal:
            value = proposal[param_name]
        else:
            value = self.base.sample_independent(study, trial, param_name, param_distribution)
        return self.space.project(param_name, value, dict(trial.params))

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        """Delegate to the base sampler."""
        self.base.before_trial(study, trial)

    def after_trial(
        self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        """Forget the trial's proposal; delegate to the base sampler."""
        self._relative.pop(trial._trial_id, None)
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        """Reseed the base sampler."""
        self.base.reseed_rng()

