"""How many steady-state steps a real run times: a time budget, not a fixed count (a fixed count is too few
for a fast step's noise and too many for a slow step).

After the warm-up, every rank knows how long one step takes (the fastest warm-up step: the first allocates and
the last is memory-traced, so both overstate it); the run then times

    N = clamp(ceil(budget_s / step_s), min_steps, max_steps)

steps, the same N on every rank (the estimate is the maximum over ranks). `min_steps` >= 6 because no
order-statistic interval of the median reaches 95 % with fewer samples (stratagem.evaluators.spread: with
n = 6 the interval is (min, max), coverage 1 - 2/64 = 96.9 %); `max_steps` bounds a run whose steps are tiny.

The defaults come from this machine's noise: one demo-sized plan (examples/demo-cpu.yaml, dp=2,pp=2,mbs=2,
world 4, torchrun, 2 warm-up + 40 timed steps) run 6 times in a row on 2 cores shared with 7 other
engineers' work (load average 7.8 -> 26 over the 6 runs, 2026-12-01); each run's first N timed steps:

    N    timed s   95% half-width of the median (median over runs)   run-to-run CV of the medians
    4      1.8          +-18.8 %  (n < 6: the full range, not 95 %)        32.8 %
    8      3.7          +-24.5 %                                           35.6 %
    12     5.5          +-14.0 %                                           31.4 %
    16     7.6          +-16.3 %                                           33.2 %
    24    11.6          +-13.6 %                                           34.6 %
    40    20.4          +-10.3 %                                           42.8 %

The interval narrows until about 12 steps and slowly after; the run-to-run spread of the medians does not
shrink with N at all: it follows the host's load (medians 0.31 s at load 7.8, 1.05 s at load 26), which is
why the result records the load (`host_load`) and why two runs are told apart only by non-overlapping
intervals. Hence min_steps 12, a 6 s budget (12-20 steps at this machine's 0.3-0.5 s loaded steps) and at
most 40 steps (a 0.1 s step: 4 s). Torch-free.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["StepBudget", "DEFAULT_BUDGET_S", "DEFAULT_MIN_STEPS", "DEFAULT_MAX_STEPS", "timed_steps",
           "budget_args"]

DEFAULT_BUDGET_S = 6.0
"""Seconds of timed steps per run."""
DEFAULT_MIN_STEPS = 12
"""Timed steps at least (>= 6: a real 95 % interval of the median)."""
DEFAULT_MAX_STEPS = 40
"""Timed steps at most."""


class StepBudget(BaseModel):
    """The timed-step budget of one real run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget_s: float = Field(DEFAULT_BUDGET_S, gt=0)
    """Seconds of timed (steady-state) steps to spend."""
    min_steps: int = Field(DEFAULT_MIN_STEPS, ge=1)
    """Fewest timed steps (6 or more for a 95 % interval of the median)."""
    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1)
    """Most timed steps."""

    @model_validator(mode="after")
    def _ordered(self) -> StepBudget:
        if self.max_steps < self.min_steps:
            raise ValueError(f"step budget: max_steps ({self.max_steps}) must be >= min_steps ({self.min_steps})")
        return self


def timed_steps(budget: StepBudget, step_s: float) -> int:
    """N = clamp(ceil(budget_s / step_s), min_steps, max_steps) for a step of `step_s` seconds."""
    if not (step_s > 0 and math.isfinite(step_s)):
        return budget.min_steps
    return max(budget.min_steps, min(budget.max_steps, math.ceil(budget.budget_s / step_s)))


def budget_args(budget: StepBudget) -> list[str]:
    """The harness command-line options that ask for `budget` (instead of --steps N)."""
    return ["--step-budget-s", f"{budget.budget_s:g}", "--min-steps", str(budget.min_steps),
            "--max-steps", str(budget.max_steps)]
