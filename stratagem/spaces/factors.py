"""Integer factors: the one definition of `divisors` (rules, the search space and advice all use it)."""

from __future__ import annotations

import math

__all__ = ["divisors"]


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending (O(sqrt n): the space enumerates them for worlds of 100k GPUs)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
