"""What a study holds right now, for whoever watches an unattended search: `study_status(study)`.

Read-only. Counts: analytic trials stored; measured trials by status (ok, oom, failed, timeout), live claims,
runs released for an infrastructure failure ("infra", retried later) and claims that expired; the workers
alive (distinct workers holding an unexpired claim); the best plan measured and predicted; the calibration
error after each batch; time since the real-run phase started and what is left of its budget.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState

from stratagem.search.claims import live_claims
from stratagem.search.records import StudyKey, TrialKey, front_trials, trial_evaluation, trial_status

__all__ = ["StudyStatus", "study_status"]


@dataclass(frozen=True)
class StudyStatus:
    """A study's progress (see the module docstring)."""

    study: str
    analytic: int
    """Analytic trials stored (screened plans, recalibrated predictions)."""
    measured: dict[str, int]
    """Finished measured trials by status (ok, oom, failed, timeout)."""
    claimed: int
    """Plans being measured now (live claims)."""
    infra: int
    """Runs released after an infrastructure failure (their plans are retried)."""
    expired: int
    """Claims whose worker died or stopped renewing (their plans are retried)."""
    workers: list[str]
    """host:pid of each worker holding a claim that has not expired."""
    best_measured: str
    """The measured plan with the highest tokens/s ('' when none): "plan (N tok/s)"."""
    best_predicted: str
    """The predicted front's highest tokens/s plan ('' when none)."""
    calibration_trend: list[tuple[int, float, float]] = field(default_factory=list)
    """Per batch: (measured trials, median step-time error, median peak-memory error) after refitting."""
    elapsed_s: float | None = None
    """Seconds since the real-run phase started (None: it has not)."""
    budget_left_s: float | None = None
    """Seconds left of --budget-minutes (None: no budget)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def _tokens(t: optuna.trial.FrozenTrial) -> float:
    return float(t.values[0]) if t.values else 0.0


def study_status(study: optuna.Study, now: float | None = None) -> StudyStatus:
    """Read the study once and summarise it."""
    now = time.time() if now is None else now
    trials = study.get_trials(deepcopy=False)
    analytic = sum(t.user_attrs.get(TrialKey.FIDELITY) == "analytic" for t in trials)
    measured: dict[str, int] = {}
    best: optuna.trial.FrozenTrial | None = None
    infra = expired = 0
    for t in trials:
        if t.user_attrs.get(TrialKey.FIDELITY) != "measured":
            continue
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            status = trial_status(t)
            measured[status] = measured.get(status, 0) + 1
            if t.state == TrialState.COMPLETE and (best is None or _tokens(t) > _tokens(best)):
                best = t
        elif t.state == TrialState.FAIL:
            infra += str(t.user_attrs.get(TrialKey.RELEASED, "")).startswith("infra")
            expired += TrialKey.EXPIRED in t.user_attrs
    claims = live_claims(study)
    workers = sorted({f"{c['worker'].get('host')}:{c['worker'].get('pid')}"
                      for t in claims.values() if float((c := t.user_attrs[TrialKey.CLAIM]).get("expires", 0)) >= now})
    predicted = [t for t in front_trials(study) if t.user_attrs.get(TrialKey.FIDELITY) != "measured"]
    attrs = study.user_attrs
    started = attrs.get(StudyKey.REAL_RUNS_STARTED)
    budget = attrs.get(StudyKey.REAL_RUNS_BUDGET_MINUTES)
    elapsed = None if started is None else now - float(started)
    left = None if budget is None or elapsed is None else max(0.0, 60.0 * float(budget) - elapsed)
    trend = [(int(h["measured"]), float(h["step_error_after"]), float(h["memory_error_after"]))
             for h in attrs.get(StudyKey.CALIBRATION_HISTORY, [])]
    return StudyStatus(study=study.study_name, analytic=analytic, measured=measured, claimed=len(claims),
                       infra=infra, expired=expired, workers=workers, best_measured=_describe(best),
                       best_predicted=_describe(max(predicted, key=_tokens) if predicted else None),
                       calibration_trend=trend, elapsed_s=elapsed, budget_left_s=left)


def _describe(t: optuna.trial.FrozenTrial | None) -> str:
    if t is None:
        return ""
    ev = trial_evaluation(t)
    name = ev.plan.short() if ev is not None else str(t.user_attrs.get(TrialKey.PLAN, t.number))
    return f"{name} ({_tokens(t):,.0f} tok/s, trial {t.number})"
