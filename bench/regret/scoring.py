"""Figures of a method's runs on one instance, and their summary over instances and seeds.

After k runs a method recommends the plan whose runs showed the highest mean (its profiling runs excluded); the
figures judge that recommendation by its median value (instances.Truth):
  runs to the best   the first k at which the recommendation counts as the best (within the measured noise);
                     budget + 1 when it never does within the budget;
  regret after k     1 - median value of the recommendation / best median (1 before anything ran ok); a
                     method that stopped early keeps its last recommendation;
  failed runs        runs whose drawn sample failed (OOM or crash) before the best was found.
Summaries: median and p90 of runs to the best, the fraction found within 10 runs, mean regret after 1/3/5/10
runs, and the regret curve's mean and 10/50/90 % quantiles per run count (the plot's bands) over every
(instance, seed).
Wins and losses of one method against another after k runs (k in AT), with an exact two-sided sign test
(Conover 1999, Practical Nonparametric Statistics, 3rd ed., sec. 3.4: binomial(n, 1/2) over the n pairs that
are not ties, p = min(1, 2 P(X <= min(wins, losses)))); the paired units: (instance, seed r) where both methods
replayed the instance with the same number of seeds (seed r's draws are independent of the other method's, so
the pairs are independent), else the instance, each method by the mean of its seeds; a win is a regret lower
by more than TIE (1e-9), a tie is within it.

This scoring (the recommendation rule, the figures, AT, the success rule, the sign test and its units) was fixed
before the runs it reports and is not changed to suit their results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from regret.instances import Runner, Truth

__all__ = ["AT", "score", "summarise", "BANDS", "TIE", "sign_test", "wins_losses"]

AT = (1, 3, 5, 10)
"""Run counts at which regret is reported."""
BANDS = (0.1, 0.5, 0.9)
"""Quantiles of the regret curve over instances and seeds."""
TIE = 1e-9
"""Regrets closer than this are a tie (the same recommendation)."""


def score(truth: Truth, runner: Runner, budget: int) -> dict[str, Any]:
    """Runs to the best, the regret curve (1..budget), failed runs before the best, for one method's runs."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    best_key: str | None = None
    curve: list[float] = []
    found = budget + 1
    n = min(budget, len(runner.order))
    for i in range(n):
        key = runner.order[i]
        if runner.candidate[i]:
            sums[key] = sums.get(key, 0.0) + runner.seen[i]
            counts[key] = counts.get(key, 0) + 1
            best_key = max(sums, key=lambda k: (sums[k] / counts[k], -runner.order.index(k)))
        ok = best_key is not None and sums[best_key] > 0
        regret = 1.0 - truth.value[best_key] / truth.best if ok and best_key is not None else 1.0
        curve.append(regret)
        if found > budget and ok and best_key is not None and truth.is_best(best_key):
            found = i + 1
    curve += [curve[-1] if curve else 1.0] * (budget - len(curve))
    failed = sum(runner.oom[: min(found, n)])
    return {"runs_to_best": found, "curve": curve, "oom_runs": int(failed)}


def summarise(scores: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over every (instance, seed): the figures of the module docstring."""
    rtb = np.array([s["runs_to_best"] for s in scores], dtype=float)
    curves = np.array([s["curve"] for s in scores], dtype=float)
    return {
        "n": len(scores),
        "runs_to_best_median": float(np.median(rtb)),
        "runs_to_best_p90": float(np.percentile(rtb, 90)),
        "found_within_10": float(np.mean(rtb <= 10)),
        "regret_at": {str(k): float(curves[:, k - 1].mean()) for k in AT if k <= curves.shape[1]},
        "curve_mean": [round(float(x), 5) for x in curves.mean(axis=0)],
        "curve_bands": {f"q{int(q * 100)}": [round(float(x), 5) for x in np.quantile(curves, q, axis=0)]
                        for q in BANDS},
        "oom_runs": int(sum(s["oom_runs"] for s in scores)),
    }


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test p-value, ties already dropped (module docstring; 1.0 when n = 0)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n
    return min(1.0, 2.0 * tail)


def _units(mine: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """Paired values per instance: seed against seed where the seed counts agree, else the two means."""
    out: list[tuple[float, float]] = []
    for a, b in zip(mine, theirs, strict=True):
        if len(a) == len(b):
            out += list(zip(a, b, strict=True))
        else:
            out.append((float(np.mean(a)), float(np.mean(b))))
    return out


def wins_losses(mine: Sequence[Sequence[dict[str, Any]]], theirs: Sequence[Sequence[dict[str, Any]]]
                ) -> dict[str, dict[str, Any]]:
    """Per k in AT (within the budget): wins, losses, ties of `mine` against `theirs` and the sign test's p; each
    argument holds, per instance, the scores of every seed (module docstring)."""
    budget = len(mine[0][0]["curve"]) if mine and mine[0] else 0
    out: dict[str, dict[str, Any]] = {}
    for k in (k for k in AT if k <= budget):
        pairs = _units([[s["curve"][k - 1] for s in seeds] for seeds in mine],
                       [[s["curve"][k - 1] for s in seeds] for seeds in theirs])
        wins = sum(a < b - TIE for a, b in pairs)
        losses = sum(a > b + TIE for a, b in pairs)
        out[str(k)] = {"wins": wins, "losses": losses, "ties": len(pairs) - wins - losses,
                       "p": sign_test(wins, losses)}
    return out
