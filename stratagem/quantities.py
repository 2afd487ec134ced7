"""How stratagem writes a number for a person: one rule for the whole tool, so a figure reads the same in every view.

- Memory: the binary unit that keeps the figure between 1 and 1024 (KiB, MiB, GiB, TiB; IEC 80000-13, the
  constants of `stratagem.units`); figures shown together (one card, one table column) share the unit of the
  largest, so "peak 9.6 of 10.2 MiB" never reads "Peak 0.0 of 0.0 GiB".
- Every figure: 3 significant figures (trailing zeros kept: 10.0 MiB), thousands separated by commas; counts and
  money past a million with a suffix (k, M, B, T: 722k parameters, 13.2M USD).
- A fraction is a percentage (MFU, goodput loss, headroom share, prediction error): `percent`.
- Durations: one unit per card, chosen by the largest (s, min, h, days): `duration_unit`.

Layer 0 (imports nothing of stratagem but units): spaces, evaluators, reports and the CLI may all use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from stratagem.units import GIB, KIB, MIB, TIB

__all__ = ["DASH", "TIME_FLOOR_S", "sig", "count", "money", "percent", "memory_unit", "memory", "memory_in", "duration_unit",
           "duration", "duration_in", "seconds"]

DASH = "–"
"""What an absent figure prints as."""

_MEMORY_UNITS: tuple[tuple[str, float], ...] = (("B", 1.0), ("KiB", KIB), ("MiB", MIB), ("GiB", GIB),
                                                ("TiB", TIB))
_DURATION_UNITS: tuple[tuple[str, float], ...] = (("ms", 1e-3), ("s", 1.0), ("min", 60.0), ("h", 3600.0),
                                                  ("days", 86400.0))
_SUFFIXES: tuple[tuple[str, float], ...] = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3))


def _absent(x: float | None) -> bool:
    return x is None or not math.isfinite(x)


def sig(x: float | None, digits: int = 3) -> str:
    """`x` to `digits` significant figures, thousands separated (3 sig: 13207585 -> '13,200,000', 80.94 ->
    '80.9', 0.000722 -> '0.000722', 2.0 -> '2.00', below 1e-4 in powers of ten: 3.83e-12 -> '3.83e-12')."""
    if x is None or _absent(x):
        return DASH
    if x == 0:
        return "0"
    if abs(x) < 1e-4:  # past four leading zeros a figure reads better in powers of ten: 3.83e-12, not 0.00000000000383
        return f"{x:.{digits - 1}e}"
    rounded = float(f"{x:.{digits}g}")
    magnitude = math.floor(math.log10(abs(rounded)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{rounded:,.{decimals}f}"


def count(x: float | None, digits: int = 3) -> str:
    """A count with a suffix past a thousand (722048 -> '722k', 8.03e9 -> '8.03B'), 3 significant figures."""
    if x is None or _absent(x):
        return DASH
    for suffix, size in _SUFFIXES:
        if abs(x) >= size * (1 - 5 * 10 ** -(digits + 1)):
            return f"{sig(x / size, digits)}{suffix}"
    return sig(x, digits)


def money(usd: float | None, currency: str = "USD") -> str:
    """An amount with its currency: '13.2M USD', '980 USD'."""
    return DASH if usd is None or _absent(usd) else f"{count(usd)} {currency}"


def percent(fraction: float | None, digits: int = 3) -> str:
    """A fraction as a percentage, 3 significant figures: 0.085 -> '8.5%', 3e-05 -> '0.003%', 1 -> '100%'."""
    if fraction is None or _absent(fraction):
        return DASH
    return f"{sig(100.0 * fraction, digits)}%"


def memory_unit(*gib: float | None) -> tuple[str, float]:
    """(unit name, bytes per unit) for figures given in GiB shown together: the unit of the largest magnitude
    that keeps it >= 1 (B below 1 KiB)."""
    largest = max((abs(g) for g in gib if g is not None and math.isfinite(g)), default=0.0) * GIB
    name, size = _MEMORY_UNITS[0]
    for unit, unit_size in _MEMORY_UNITS:
        if largest >= unit_size * (1 - 5e-4):
            name, size = unit, unit_size
    return name, size


def memory_in(gib: float | None, unit: tuple[str, float], with_unit: bool = False) -> str:
    """A GiB figure in a chosen unit (`memory_unit`), 3 significant figures; the unit's name appended when
    asked."""
    if gib is None or _absent(gib):
        return DASH
    text = sig(gib * GIB / unit[1])
    return f"{text} {unit[0]}" if with_unit else text


def memory(gib: float | None) -> str:
    """One memory figure (given in GiB) in its own unit: 0.0095 -> '9.73 MiB', 79.6 -> '79.6 GiB'."""
    return memory_in(gib, memory_unit(gib), with_unit=True)


def duration_unit(*seconds_: float | None) -> tuple[str, float]:
    """(unit name, seconds per unit) for durations shown together: by the largest, kept below 120 of a unit
    (90 s stays seconds, 30 min stays minutes, 50 h stays hours) and above 1 where it can."""
    largest = max((abs(s) for s in seconds_ if s is not None and math.isfinite(s) and abs(s) >= TIME_FLOOR_S),
                  default=0.0)
    name, size = "s", 1.0
    for unit, unit_size in _DURATION_UNITS:
        if largest >= unit_size * (2.0 if unit_size > 1.0 else 1.0):
            name, size = unit, unit_size
    if largest < 1.0 and largest > 0:
        name, size = "ms", 1e-3
    return name, size


TIME_FLOOR_S = 1e-9
"""Durations below a nanosecond print as 0: no step-time figure is that short (a kernel launch takes microseconds),
so such a value is float round-off left by a subtraction (1.76e-15 s of DP traffic 'hidden')."""


def duration_in(seconds_: float | None, unit: tuple[str, float], with_unit: bool = True) -> str:
    """A duration in a chosen unit (`duration_unit`), 3 significant figures; below TIME_FLOOR_S, 0."""
    if seconds_ is None or _absent(seconds_):
        return DASH
    text = "0" if abs(seconds_) < TIME_FLOOR_S else sig(seconds_ / unit[1])
    return f"{text} {unit[0]}" if with_unit else text


def duration(seconds_: float | None) -> str:
    """One duration in its own unit: 80.9 -> '80.9 s', 4980 -> '83 min', 2.97e8 -> '3,440 days'."""
    return duration_in(seconds_, duration_unit(seconds_))


def seconds(values: Iterable[float | None]) -> tuple[str, float]:
    """The one duration unit for a card's figures (`duration_unit` over them)."""
    return duration_unit(*values)
