"""The step-time spread: the median's order-statistic interval against the published table values."""

from __future__ import annotations

import pytest

from stratagem.evaluators.spread import distinct, spread_of, spread_of_samples


@pytest.mark.parametrize(("n", "lower_rank"), [(6, 1), (12, 3), (20, 6), (30, 10)])
def test_median_interval_matches_the_binomial_table(n: int, lower_rank: int) -> None:
    # Conover, Practical Nonparametric Statistics, table A3 (95 %, two-sided): [x_(r), x_(n+1-r)], 1-based
    s = spread_of_samples([float(i) for i in range(1, n + 1)])
    assert (s.low_s, s.high_s) == (float(lower_rank), float(n + 1 - lower_rank))
    assert s.confident


def test_few_steps_give_the_full_range_and_say_so() -> None:
    s = spread_of_samples([2.0, 1.0, 3.0])
    assert (s.low_s, s.median_s, s.high_s, s.confident) == (1.0, 2.0, 3.0, False)


def test_overlapping_runs_are_not_told_apart() -> None:
    a = spread_of_samples([1.0, 1.1, 1.2, 1.0, 1.1, 1.05])
    b = spread_of_samples([1.15, 1.3, 1.25, 1.2, 1.3, 1.2])
    c = spread_of_samples([2.0, 2.1, 2.05, 2.0, 2.2, 2.1])
    assert not distinct(a, b) and distinct(a, c)
    assert spread_of({"step_spread": a.model_dump()}) == a and spread_of({}) is None


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError, match="finite and > 0"):
        spread_of_samples([1.0, float("nan")])
