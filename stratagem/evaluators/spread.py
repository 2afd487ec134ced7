"""A measured step time with its noise: the median of N steady-state steps and a distribution-free interval.

The timed steps of one run are not independent draws of a known distribution (a loaded host makes them
heavy-tailed), so the interval is the one that assumes nothing but exchangeability: the 95 % confidence interval
of the median from order statistics (Conover, *Practical Nonparametric Statistics*, 3rd ed., sec. 3.2: the
number of samples below the median is Binomial(n, 1/2); the interval is [x_(j), x_(k)] with j, k the binomial
quantiles). With fewer than 6 samples no order-statistic interval reaches 95 %: the interval is then the full
range (min, max), and `confident` says so.

Two measured plans are told apart only when their intervals do not overlap (`distinct`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["StepSpread", "spread_of_samples", "spread_of", "distinct", "SPREAD_KEY"]

SPREAD_KEY = "step_spread"
"""Key of the spread in a measured Evaluation's `measurements` (the harness result's stored part)."""

_LEVEL = 0.95


class StepSpread(BaseModel):
    """The median step time of one run and its 95 % interval (seconds)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median_s: float
    """Median of the timed steady-state steps."""
    low_s: float
    """Lower end of the 95 % confidence interval of the median (order statistics)."""
    high_s: float
    """Upper end of the 95 % confidence interval of the median."""
    q1_s: float
    """First quartile of the timed steps."""
    q3_s: float
    """Third quartile of the timed steps."""
    n: int
    """Timed steps (after warm-up)."""
    confident: bool
    """Whether [low_s, high_s] reaches 95 % coverage (n >= 6); else it is the full range."""

    @model_validator(mode="after")
    def _ordered(self) -> StepSpread:
        if not (0 < self.low_s <= self.median_s <= self.high_s) or self.n < 1:
            raise ValueError(f"step spread: need 0 < low ({self.low_s}) <= median ({self.median_s}) <= high "
                             f"({self.high_s}) and n ({self.n}) >= 1")
        return self

    @property
    def relative_half_width(self) -> float:
        """Half the interval's width over the median (the +-band printed beside a measured figure)."""
        return (self.high_s - self.low_s) / (2.0 * self.median_s)

    def band(self) -> str:
        """`1.23 s (1.10-1.40, n=12)`: the median and its interval, for tables and logs."""
        return f"{self.median_s:.3g} s ({self.low_s:.3g}-{self.high_s:.3g}, n={self.n})"


def _quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of sorted `xs` (numpy's default 'linear' method)."""
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n


def _median_interval_ranks(n: int) -> tuple[int, int] | None:
    """0-based ranks (j, n-1-j) of the narrowest order-statistic interval that still covers the median with
    >= 95 %: [x_(j), x_(n-1-j)] misses it only when <= j samples fall on one side, so its coverage is
    1 - 2 P(B <= j), B ~ Binomial(n, 1/2) (Conover 3.2). None when even (min, max) covers less (n < 6)."""
    best = None
    for j in range(n // 2):
        if 1.0 - 2.0 * _binomial_cdf(j, n) < _LEVEL:
            break
        best = (j, n - 1 - j)
    return best


def spread_of_samples(step_times_s: Sequence[float]) -> StepSpread:
    """The spread of one run's timed steps (seconds, warm-up excluded)."""
    xs = sorted(float(t) for t in step_times_s)
    if not xs or xs[0] <= 0 or not all(math.isfinite(x) for x in xs):
        raise ValueError(f"step times must be finite and > 0, got {list(step_times_s)!r}")
    ranks = _median_interval_ranks(len(xs))
    low, high = (xs[0], xs[-1]) if ranks is None else (xs[ranks[0]], xs[ranks[1]])
    return StepSpread(median_s=_quantile(xs, 0.5), low_s=low, high_s=high, q1_s=_quantile(xs, 0.25),
                      q3_s=_quantile(xs, 0.75), n=len(xs), confident=ranks is not None)


def spread_of(measurements: dict[str, Any] | None) -> StepSpread | None:
    """The spread stored with a measured evaluation (its `measurements`), None when the run stored none."""
    if not measurements or SPREAD_KEY not in measurements:
        return None
    return StepSpread.model_validate(measurements[SPREAD_KEY])


def distinct(a: StepSpread, b: StepSpread) -> bool:
    """Whether two runs' median steps are told apart: their 95 % intervals do not overlap."""
    return a.high_s < b.low_s or b.high_s < a.low_s
