"""The risk-aware "best" pick every analytic choice uses (capacity's plan per cluster size, the report's headline).

Rule (`RISK_RULE`): take the plan with the highest value (effective tokens/s). When it sits in a zone at "bad"
(evaluators.zones THRESHOLDS: e.g. HBM headroom under 5 %), it loses to the highest-valued plan with no zone at
bad whose value is within the model's noise of it: the gap g = log(v_best) - log(v_other) is at most
`GAP_Z` standard deviations of the predicted gap.

The gap's standard deviation is the model's own throughput uncertainty about the difference of the two plans: both
are linear in the same log step-time multipliers (evaluators.posterior, the Laplace posterior), so
var(g) = (s_a - s_b) Sigma (s_a - s_b)^T with s the plans' term shares of the step and Sigma the multipliers'
posterior covariance (Bishop, PRML sec. 3.3.2, the predictive distribution of Bayesian linear regression, applied
to the difference). Terms the plans share cancel; run-to-run noise is left out (the pick is about the plans'
speeds, not one run of each). GAP_Z is the two-sided 95 % quantile of the normal distribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.evaluation import ZONE_NAMES
from stratagem.evaluators.figures import PlanFigures

__all__ = ["GAP_Z", "RISK_RULE", "RiskPick", "risk_aware_best", "bad_zones", "any_bad"]

Array = NDArray[np.float64]

GAP_Z = 1.959964
"""Two-sided 95 % quantile of the standard normal: a gap within GAP_Z sd of the predicted gap is noise."""

RISK_RULE = ("risk-aware pick: a plan with a zone at bad loses to the fastest plan with none that is within the "
             "model's noise of it (its lead at most 1.96 sd, 95 %, of the predicted gap's uncertainty: the "
             "step-time multipliers' posterior, evaluators.posterior)")
"""The rule in one line, printed wherever a pick applies it."""


@dataclass(frozen=True)
class RiskPick:
    """The chosen plan and, when the rule replaced the fastest, what it replaced and by how much."""

    index: int
    """The chosen plan (row of the candidates' columns)."""
    fastest: int
    """The plan with the highest value (== index when the rule kept it)."""
    gap: float
    """Relative lead of the fastest over the chosen, value_fastest / value_chosen - 1 (0 when kept)."""
    gap_sd: float
    """Standard deviation of the predicted log gap between them (0 when kept)."""
    bad: tuple[str, ...]
    """The zones at bad of the fastest plan (empty: the rule had nothing to do)."""

    @property
    def replaced(self) -> bool:
        """Whether the rule chose another plan than the fastest."""
        return self.index != self.fastest

    def note(self, fastest_label: str) -> str:
        """One line saying what the rule did ('' when the fastest has no zone at bad)."""
        if not self.bad:
            return ""
        zones = ", ".join(self.bad)
        if self.replaced:
            return (f"chosen over {fastest_label} ({zones} bad), {self.gap:.2%} faster, within the model's noise "
                    f"(1.96 sd of the gap: {float(np.expm1(GAP_Z * self.gap_sd)):.2%})")
        return f"kept although {zones} bad: no plan without a bad zone within the model's noise of it"


def bad_zones(figs: PlanFigures) -> dict[str, NDArray[np.bool_]]:
    """Zone name -> (N,) whether each plan is at bad in that zone (level 2), from evaluate_many's figures."""
    return {name: figs.zone_is(name, "bad") for name in ZONE_NAMES}


def any_bad(bad: Mapping[str, NDArray[np.bool_]]) -> NDArray[np.bool_]:
    """(N,) whether each plan has any zone at bad."""
    out: NDArray[np.bool_] = np.logical_or.reduce(list(bad.values()))
    return out


def risk_aware_best(values: Array, eligible: NDArray[np.bool_], bad: Mapping[str, NDArray[np.bool_]], shares: Array,
                    cov: Array) -> RiskPick | None:
    """The pick by RISK_RULE among the `eligible` plans (module docstring); None when none is eligible.
    `values` are what is maximised (e.g. effective tokens/s), `bad` each zone's at-bad mask (`bad_zones`),
    `shares` (N, K) and `cov` (K, K) the log tokens/s predictive's (evaluators.posterior.LogNormalColumns)."""
    v = np.where(eligible & (values > 0), values, -np.inf)
    if not np.isfinite(v).any():
        return None
    top = int(np.argmax(v))
    names = tuple(name for name, mask in bad.items() if mask[top])
    if not names:
        return RiskPick(index=top, fastest=top, gap=0.0, gap_sd=0.0, bad=())
    diff = shares - shares[top]
    sd = np.sqrt(np.maximum(((diff @ cov) * diff).sum(axis=1), 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.log(v[top]) - np.log(v)
    within = np.isfinite(v) & ~any_bad(bad) & (gap <= GAP_Z * sd)
    if not within.any():
        return RiskPick(index=top, fastest=top, gap=0.0, gap_sd=0.0, bad=names)
    pick = int(np.argmax(np.where(within, v, -np.inf)))
    return RiskPick(index=pick, fastest=top, gap=float(v[top] / v[pick] - 1.0), gap_sd=float(sd[pick]), bad=names)
