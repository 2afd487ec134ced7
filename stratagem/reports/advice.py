"""Advice for a plan in report form, from `stratagem.evaluators.advise` (the seed's decision tree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stratagem.evaluators import Advice, Calibration, advise
from stratagem.evaluators.evaluation import Evaluation
from stratagem.search.records import StudyKey
from stratagem.spaces.scenario import Scenario

if TYPE_CHECKING:
    import optuna

__all__ = ["AdviceView", "MEASURED_ADVICE_TITLE", "advice_for", "study_calibration"]


@dataclass(frozen=True)
class AdviceView:
    """One piece of advice: the zone it addresses, why, the neighbouring plan and its predicted effect."""

    zone: str
    rationale: str
    plan: str
    """The neighbouring plan's short label ('' when only the checkpoint policy changes)."""
    effect: str
    """The change and its predicted effect, e.g. `zero_stage 1 -> 3: peak 92.1 -> 61.3 GiB, step +4%`."""


MEASURED_ADVICE_TITLE = "Advice (effects from the model's prediction of this plan, not from its runs)"
"""A measured plan's advice heading: advice reasons from the analytic model (`advice_for`), so its effects start
from the plan's prediction while the card's zones are the runs'."""


def _view(item: Advice, own_label: str) -> AdviceView:
    label = item.plan.short()
    return AdviceView(zone=item.zone, rationale=item.rationale, plan="" if label == own_label else label,
                      effect=item.effect or item.change)


def study_calibration(study: optuna.Study) -> Calibration | None:
    """The calibration a study's real runs refitted (its "calibration" attribute); None before any run."""
    fitted = study.user_attrs.get(StudyKey.CALIBRATION)
    return Calibration.model_validate(fitted) if fitted else None


def advice_for(scenario: Scenario, evaluation: Evaluation, prediction: Evaluation | None = None,
               calibration: Calibration | None = None) -> tuple[AdviceView, ...]:
    """The advice for an evaluated plan, predicted with `calibration` (a study's refitted one; None: the
    defaults). Advice reasons from the analytic model: a measured plan passes its analytic prediction (or none,
    and advise evaluates the plan itself)."""
    analytic = evaluation if evaluation.fidelity == "analytic" else prediction
    if analytic is not None and analytic.fidelity != "analytic":
        analytic = None
    own = evaluation.plan.short()
    return tuple(_view(a, own) for a in advise(scenario, evaluation.plan, analytic, calibration))
