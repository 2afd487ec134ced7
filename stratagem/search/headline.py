"""The headline "highest tokens/s" pick the report and `status` print: risk-aware, as capacity's
(evaluators.risk_pick).

Two rules, in order, over the feasible plans (measured values where measured, predicted otherwise):
1. A plan no real run measured is not a headline pick while its predicted HBM zone is bad and a real run of a plan
   predicted in that same bad zone ran out of memory: the runs refuted the model's memory there
   (`OOM_RULE`).
2. evaluators.risk_pick.RISK_RULE: a plan with a zone at bad (its standing evaluation's zones, measured where
   measured) loses to the fastest plan with none within the model's noise of it (the predicted gap's
   uncertainty under the study's calibration: both plans re-evaluated for their step-time shares).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.analytic import evaluate_many
from stratagem.evaluators.evaluation import ZONE_NAMES
from stratagem.evaluators.posterior import predictive_from_figures
from stratagem.evaluators.risk_pick import RISK_RULE, risk_aware_best

if TYPE_CHECKING:
    from stratagem.evaluators.calibration import Calibration
    from stratagem.evaluators.evaluation import Evaluation
    from stratagem.spaces.plan import Plan
    from stratagem.spaces.scenario import Scenario

__all__ = ["OOM_RULE", "PlanStanding", "headline_tokens"]


class PlanStanding(Protocol):
    """What the rules read of a plan's standing trial (reports.info.PlanResult; search.status builds its own)."""

    @property
    def index(self) -> int:
        """The plan's index in ParetoInfo.plans."""

    @property
    def plan(self) -> Plan:
        """The plan."""

    @property
    def fidelity(self) -> str:
        """Fidelity of the standing trial."""

    @property
    def status(self) -> str:
        """Evaluation.status of the standing trial."""

    @property
    def values(self) -> tuple[float, ...] | None:
        """Objective values, None when the plan has none."""

    @property
    def feasible(self) -> bool:
        """Whether the standing trial is feasible."""

    @property
    def evaluation(self) -> Evaluation | None:
        """The standing trial's evaluation."""

    @property
    def prediction(self) -> Evaluation | None:
        """For a measured plan: the analytic prediction of the same plan."""

    @property
    def label(self) -> str:
        """The plan's label."""


OOM_RULE = ("an unmeasured plan predicted in the HBM zone's bad level is no headline pick once a real run of a plan "
            "predicted in that zone ran out of memory")
"""Rule 1 in one line (module docstring)."""


def _predicted_hbm_bad(p: PlanStanding) -> bool:
    """Whether the plan's analytic prediction puts it in the HBM zone's bad level."""
    ev = p.evaluation if p.fidelity == "analytic" else p.prediction
    return ev is not None and ev.zones is not None and ev.zones.hbm.level == "bad"


def _stored_bad(p: PlanStanding, zone: str) -> bool:
    """Whether the plan's standing evaluation (measured where measured) puts zone `zone` at bad."""
    z = p.evaluation.zones if p.evaluation is not None else None
    return z is not None and getattr(z, zone).level == "bad"


def headline_tokens(plans: Sequence[PlanStanding], scn: Scenario,
                    calibration: Calibration | None) -> tuple[int | None, str]:
    """The index (into `plans`) of the headline highest-tokens/s plan by the module's rules, and one line saying
    what the rules did ('' when the fastest feasible plan was kept with no zone at bad); (None, '') when no
    plan is feasible."""
    feasible = [p for p in plans if p.feasible and p.values is not None]
    if not feasible:
        return None, ""
    refuted = any(p.fidelity != "analytic" and p.status == "oom" and _predicted_hbm_bad(p) for p in plans)
    notes = []
    candidates = feasible
    if refuted:
        kept = [p for p in feasible if not (p.fidelity == "analytic" and _predicted_hbm_bad(p))]
        if len(kept) < len(feasible):
            notes.append(f"{len(feasible) - len(kept)} unmeasured plan(s) left out: {OOM_RULE}")
        candidates = kept or feasible
    values = np.array([p.values[0] if p.values else 0.0 for p in candidates], dtype=np.float64)
    figs = evaluate_many(scn, [p.plan for p in candidates], calibration)
    pred = predictive_from_figures(scn, figs, calibration).log_tokens
    bad: dict[str, NDArray[np.bool_]] = {name: np.array([_stored_bad(p, name) for p in candidates], dtype=bool) for name in ZONE_NAMES}
    pick = risk_aware_best(values, np.ones(len(candidates), dtype=bool), bad, pred.shares, pred.cov)
    if pick is None:
        return None, ""
    said = pick.note(candidates[pick.fastest].label)
    if said:
        notes.append(f"{said} ({RISK_RULE})")
    return candidates[pick.index].index, "; ".join(notes)
