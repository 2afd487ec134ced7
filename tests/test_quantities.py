"""The one rule for numbers (issue 26 item 2, stratagem/quantities.py): 3 significant figures, memory in the
unit its magnitude calls for, one duration unit per card, fractions as percentages."""

from __future__ import annotations

import math

import pytest

from stratagem import quantities as q
from stratagem.units import GIB, MIB


@pytest.mark.parametrize(("x", "text"), [
    (13_207_585, "13,200,000"), (80.94, "80.9"), (0.000722048, "0.000722"), (2.0, "2.00"), (0, "0"),
    (3439.5, "3,440"), (-0.1234, "-0.123"), (None, "–"), (math.nan, "–"), (999.96, "1,000"),
    (3.83e-12, "3.83e-12"), (-6.14e-14, "-6.14e-14"), (0.0001, "0.000100"),
])
def test_three_significant_figures(x, text) -> None:
    assert q.sig(x) == text


def test_counts_money_and_percentages() -> None:
    assert q.count(722_048) == "722k" and q.count(8.03e9) == "8.03B" and q.count(1.5e13) == "15.0T"
    assert q.count(999) == "999" and q.count(999_999) == "1.00M"
    assert q.money(13_207_585) == "13.2M USD"
    assert q.percent(0.085) == "8.50%" and q.percent(3e-5) == "0.00300%" and q.percent(1.0) == "100%"


def test_memory_unit_by_magnitude() -> None:
    # the CPU demo's 10 MiB workers: never "0.0 of 0.0 GiB"
    assert q.memory(0.01) == "10.2 MiB"
    assert q.memory(9.5 * MIB / GIB) == "9.50 MiB"
    assert q.memory(79.6) == "79.6 GiB" and q.memory(2048.0) == "2.00 TiB" and q.memory(1 / GIB) == "1.00 B"
    unit = q.memory_unit(0.0093, 0.01)  # figures shown together share the largest's unit
    assert unit[0] == "MiB"
    assert f"{q.memory_in(0.0093, unit)} of {q.memory_in(0.01, unit, True)}" == "9.52 of 10.2 MiB"


def test_one_duration_unit_per_card() -> None:
    assert q.duration(80.9) == "80.9 s" and q.duration(4980) == "83.0 min" and q.duration(0.0123) == "12.3 ms"
    assert q.duration(3439.5 * 86400) == "3,440 days"
    unit = q.duration_unit(80.9, 78.0, 1800.0)  # a checkpoint card: save, stall, interval in one unit
    assert unit[0] == "min"
    assert [q.duration_in(s, unit, False) for s in (80.9, 1800.0)] == ["1.35", "30.0"]


def test_round_off_durations_print_as_zero() -> None:
    """Issue 34 item 7: '1.76e-12 ms of it hidden' (DP traffic minus its exposed part, float round-off): below
    quantities.TIME_FLOOR_S a duration is 0, and it does not pull the unit of the figures beside it to ms."""
    from stratagem.quantities import TIME_FLOOR_S, duration, duration_in, duration_unit

    assert duration(1.76e-15) == "0 s" and duration(-3e-13) == "0 s"
    assert duration_unit(1.76e-15, 2.5) == ("s", 1.0) and duration_in(1.76e-15, ("ms", 1e-3)) == "0 ms"
    assert duration(2 * TIME_FLOOR_S) != "0 s" and duration(0.0015) == "1.50 ms"
