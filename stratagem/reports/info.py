"""A finished study as plain data: `pareto_info(study) -> ParetoInfo`. Every renderer reads only this.

One row per plan (`PlanResult`): the trial that stands for the plan is chosen by the study schema
(`stratagem.search.records.standings`: measured beats traced beats analytic, the latest of a kind wins), and
the latest analytic evaluation becomes a measured or traced one's prediction when it carries none. The front is the set of feasible plans that no other
feasible plan dominates on the study's objectives (tokens/s up, headroom up, checkpoint goodput loss down);
plans with equal values are all on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from pydantic import ValidationError

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import BLOCKS, Evaluation, MemoryBreakdown
from stratagem.evaluators.taught import taught_lines
from stratagem.quantities import memory
from stratagem.reports.advice import AdviceView, advice_for, study_calibration
from stratagem.search.calibrate import CalibrationStep, calibration_history
from stratagem.search.counts import StudyCounts, study_counts
from stratagem.search.headline import headline_tokens
from stratagem.search.noise import best_measured
from stratagem.search.pareto import nondominated
from stratagem.search.records import (
    DIRECTIONS,
    OBJECTIVES,
    Standing,
    StudyKey,
    TrialKey,
    objective_values,
    standings,
    study_scenario,
    trial_constraint,
    trial_feasible,
    trial_fidelity,
    trial_plan,
    trial_status,
)
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

if TYPE_CHECKING:
    import optuna

__all__ = ["best_measured_line", "PlanResult", "ParetoInfo", "TrialRecord", "pareto_info", "pareto_front", "DEFAULT_ADVICE_LIMIT"]

DEFAULT_ADVICE_LIMIT = 200
"""Plans given advice in a report (the front first, then feasible plans by tokens/s); advice evaluates
neighbouring plans, so it is bounded to keep a 10,000-trial report fast."""


@dataclass(frozen=True)
class PlanResult:
    """One evaluated plan of the study, as the report shows it."""

    index: int
    """Position in ParetoInfo.plans."""
    plan: Plan
    key: str
    """plan_key(plan): the plan's identity in the study."""
    label: str
    """plan.short(): the compact human label."""
    trial_number: int
    """The trial that stands for the plan (records.standing: highest fidelity, then latest)."""
    number: int
    """The number that names the plan's record (records.Standing.number: its first measured trial once measured),
    the `#` every view prints and `--trial` takes."""
    trial_numbers: tuple[int, ...]
    """Every trial of this plan, ascending."""
    fidelity: str
    status: str
    """Evaluation.status, or the Optuna state for a trial that stored no evaluation."""
    reason: str
    values: tuple[float, ...] | None
    """Objective values (OBJECTIVES order) or None when the plan has none (e.g. rule-infeasible)."""
    constraint: float | None
    """Largest stored constraint (peak - usable GiB); > 0 means it does not fit."""
    feasible: bool
    """records.trial_feasible of the standing trial: COMPLETE, objective values, status ok, no violated
    constraint."""
    on_front: bool
    evaluation: Evaluation | None
    prediction: Evaluation | None
    """For a measured plan: the analytic prediction of the same plan (when known)."""
    advice: tuple[AdviceView, ...] | None
    """Advice for this plan; None when not computed (beyond the advice limit, or the plan breaks a rule)."""

    def value(self, objective: str) -> float | None:
        """One objective's value, or None."""
        if self.values is None:
            return None
        return self.values[OBJECTIVES.index(objective)]

    @property
    def why_infeasible(self) -> str:
        """A short reason for a plan that is not feasible ('' when feasible)."""
        if self.feasible:
            return ""
        if self.reason:
            return self.reason
        mem = self.evaluation.memory if self.evaluation else None
        if mem is not None and mem.first_block_to_break:
            return f"{mem.first_block_to_break} breaks HBM"
        if self.constraint is not None and self.constraint > 0:
            return f"peak exceeds usable HBM by {memory(self.constraint)}"
        return self.status if self.status != "ok" else "no objective values"


@dataclass(frozen=True)
class ParetoInfo:
    """What a study found."""

    study_name: str
    scenario: Scenario
    scenario_hash: str
    stratagem_version: str
    objectives: tuple[str, ...]
    directions: tuple[str, ...]
    plans: tuple[PlanResult, ...]
    front: tuple[int, ...]
    """Indices into plans, best tokens/s first."""
    best: dict[str, int]
    """Objective -> index of the best feasible plan on it (ties: higher tokens/s, then lower index)."""
    n_trials: int
    """All trials in the study."""
    n_unfinished: int
    """Trials running, waiting, or failed without an evaluation (not shown)."""
    n_superseded: int
    """Trials replaced by a later or measured trial of the same plan."""
    trials: tuple[TrialRecord, ...]
    """Every finished trial, by number (superseded ones included)."""
    plan_of_trial: dict[int, int]
    """Trial number -> index of its plan in plans."""
    advice_limit: int
    best_measured: str = ""
    """The best measured plan by the search's one rule (`search.noise.best_measured`): its tokens/s with the
    95 % interval, runs, and whether other plans are within its noise ('' when no measured plan fits)."""
    best_measured_trial: int | None = None
    """The number of its record (its first measured trial, kept through re-measurements; None: no measured plan
    fits)."""
    headline_note: str = ""
    """What the risk-aware headline rules did to best["tokens_per_s"] (search.headline), '' when nothing."""
    not_run: tuple[str, ...] = ()
    """Why the real runs left plans out, one line each (the harness cannot run them; their traced memory does
    not fit), from the study attribute "not_run"."""
    calibration: str = ""
    """Which calibration the predictions used: the search's starting one (its `calibration_source`, e.g. a
    `stratagem calibrate` file) and whether real runs refitted it."""
    history: tuple[CalibrationStep, ...] = ()
    """One entry per refit of the calibration on the real runs (study attribute "calibration_history")."""
    taught: tuple[str, ...] = ()
    """What the runs taught per term and block (evaluators.taught.taught_lines of the study's calibration)."""
    counts: StudyCounts | None = None
    """The study's counts by the one counting rule (`search.counts.study_counts`), as search and status print
    them (None: read from no study)."""
    in_force: Calibration | None = None
    """The calibration in force: the study's latest adopted refit (constants and per-term multipliers, what the
    search writes to runs/STUDY/calibration.yaml); None while no refit was adopted (the starting one stands)."""

    @property
    def feasible(self) -> list[int]:
        """Indices of the feasible plans."""
        return [p.index for p in self.plans if p.feasible]

    @property
    def measured(self) -> list[int]:
        """Indices of the plans a real run stands for."""
        return [p.index for p in self.plans if p.fidelity == "measured"]

    @property
    def infeasible_summary(self) -> list[tuple[str, int]]:
        """Why plans were not feasible: (cause, count), most frequent first."""
        counts: dict[str, int] = {}
        for p in self.plans:
            if p.feasible:
                continue
            mem = p.evaluation.memory if p.evaluation else None
            if mem is not None and mem.first_block_to_break:
                cause = f"{p.status}: {mem.first_block_to_break} breaks HBM first"
            elif mem is not None and p.constraint is not None and p.constraint > 0:
                block = _first_over(mem, mem.peak_gib - p.constraint)
                cause = f"fits HBM but not the search's memory margin: {block} crosses it first"
            elif p.status == "infeasible":
                cause = "infeasible: breaks a validity rule"
            else:
                cause = p.status
            counts[cause] = counts.get(cause, 0) + 1
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def _first_over(mem: MemoryBreakdown, usable_gib: float) -> str:
    """The block whose running sum (in BLOCKS order) first exceeds usable_gib."""
    total = 0.0
    for b in BLOCKS:
        total += mem.block_gib(b)
        if total > usable_gib:
            return b
    return BLOCKS[-1]


def pareto_front(values: NDArray[np.float64], directions: Sequence[str]) -> NDArray[np.bool_]:
    """Mask of the rows no other row dominates; rows with a NaN are never on it, equal rows all are.

    The same non-dominated filter the search uses (`stratagem.search.pareto.nondominated`).
    """
    v = np.asarray(values, dtype=np.float64)
    mask = np.zeros(v.shape[0], dtype=bool)
    ok = np.flatnonzero(np.isfinite(v).all(axis=1)) if v.size else np.zeros(0, dtype=np.intp)
    if ok.size:
        mask[ok[nondominated(v[ok], directions)]] = True
    return mask


def _evaluation(trial: optuna.trial.FrozenTrial) -> Evaluation | None:
    data = trial.user_attrs.get(TrialKey.EVALUATION)
    if not data:
        return None
    try:
        return Evaluation.model_validate(data)
    except ValidationError:
        return None


def _values(trial: optuna.trial.FrozenTrial, ev: Evaluation | None) -> tuple[float, ...] | None:
    vals: Sequence[float] | None = trial.values
    if vals is None and ev is not None:
        try:
            vals = objective_values(ev)
        except ValueError:
            vals = None
    if vals is None or len(vals) != len(OBJECTIVES) or any(not math.isfinite(x) for x in vals):
        return None
    return tuple(float(x) for x in vals)


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial as stored (several trials may evaluate the same plan)."""

    number: int
    plan: Plan
    fidelity: str
    status: str
    reason: str
    values: tuple[float, ...] | None
    constraint: float | None
    evaluation: Evaluation | None
    feasible: bool
    """records.trial_feasible: COMPLETE, objective values, status ok, no violated constraint."""


def _read_trial(trial: optuna.trial.FrozenTrial) -> TrialRecord | None:
    """The trial as a record (fields per the study schema), None when its plan cannot be read."""
    ev = _evaluation(trial)
    try:
        plan = ev.plan if ev is not None else trial_plan(trial)
    except (ValidationError, TypeError):
        return None
    reason = (ev.reason if ev is not None else "") or str(trial.user_attrs.get(TrialKey.PRUNED) or "")
    return TrialRecord(trial.number, plan, trial_fidelity(trial), trial_status(trial), reason, _values(trial, ev),
                       trial_constraint(trial), ev, trial_feasible(trial))


def _pick(s: Standing, records: dict[int, TrialRecord]) -> tuple[TrialRecord, Evaluation | None]:
    """The record of the trial standing for a plan and, for a measured or traced one, its analytic
    prediction (the one it carries, else the plan's latest analytic trial's)."""
    chosen = records[s.trial.number]
    if chosen.fidelity == "analytic":
        return chosen, None
    prediction = chosen.evaluation.prediction if chosen.evaluation else None
    analytic = s.latest("analytic")
    if prediction is None and analytic is not None and analytic.number in records:
        prediction = records[analytic.number].evaluation
    return chosen, prediction


def _best(plans: Sequence[PlanResult], objectives: Sequence[str], directions: Sequence[str]) -> dict[str, int]:
    best: dict[str, int] = {}
    feasible = [p for p in plans if p.feasible and p.values is not None]
    for k, (name, direction) in enumerate(zip(objectives, directions, strict=True)):
        if not feasible:
            break
        sign = 1.0 if direction == "maximize" else -1.0

        def rank(p: PlanResult, k: int = k, sign: float = sign) -> tuple[float, float, int]:
            assert p.values is not None
            return (sign * p.values[k], p.values[0], -p.index)

        best[name] = max(feasible, key=rank).index
    return best


def pareto_info(
    study: optuna.Study, advice_limit: int = DEFAULT_ADVICE_LIMIT, scenario: Scenario | None = None,
) -> ParetoInfo:
    """Read a stratagem study: one PlanResult per plan, the front, the best plan per objective, advice."""
    scn = scenario or study_scenario(study)
    all_trials = study.get_trials(deepcopy=False)
    stand: dict[str, Standing] = {}
    records: dict[int, TrialRecord] = {}
    for key, s in standings(all_trials).items():
        read = {t.number: r for t in s.trials if (r := _read_trial(t)) is not None}
        if s.trial.number in read:
            stand[key] = s
            records.update(read)
    by_key = {key: [records[t.number] for t in s.trials if t.number in records] for key, s in stand.items()}
    n_unfinished = len(all_trials) - len(records)

    directions = tuple(d.name.lower() for d in study.directions)
    if len(directions) != len(OBJECTIVES):
        directions = DIRECTIONS
    rows: list[PlanResult] = []
    for key, trials in by_key.items():
        chosen, prediction = _pick(stand[key], records)
        rows.append(PlanResult(
            index=len(rows), plan=chosen.plan, key=key, label=chosen.plan.short(),
            trial_number=chosen.number, number=stand[key].number, trial_numbers=tuple(t.number for t in trials),
            fidelity=chosen.fidelity, status=chosen.status, reason=chosen.reason, values=chosen.values,
            constraint=chosen.constraint, feasible=chosen.feasible, on_front=False,
            evaluation=chosen.evaluation, prediction=prediction, advice=None,
        ))

    vals = np.array([r.values if r.feasible and r.values else [np.nan] * len(OBJECTIVES) for r in rows],
                    dtype=np.float64).reshape(len(rows), len(OBJECTIVES))
    mask = pareto_front(vals, directions)
    rows = [replace(r, on_front=bool(mask[r.index])) for r in rows]
    front = sorted((r.index for r in rows if r.on_front), key=lambda i: (-vals[i, 0], i))

    # Advice: the front first, then feasible plans by tokens/s, then the rest, up to the limit; predicted with
    # the study's refitted calibration when its real runs made one (the figures the runs taught, not the defaults).
    calibration = study_calibration(study)
    others = sorted((r.index for r in rows if r.feasible and not r.on_front), key=lambda i: (-vals[i, 0], i))
    rest = [r.index for r in rows if not r.feasible]
    for i in (front + others + rest)[: max(0, advice_limit)]:
        ev = rows[i].evaluation
        if ev is not None and ev.status != "infeasible":
            rows[i] = replace(rows[i], advice=advice_for(scn, ev, rows[i].prediction, calibration))

    attrs: dict[str, Any] = study.user_attrs
    top = best_measured(study)
    best = _best(rows, OBJECTIVES, directions)
    headline, headline_note = headline_tokens(rows, scn, calibration)
    if headline is not None:
        best["tokens_per_s"] = headline
    return ParetoInfo(
        study_name=study.study_name, scenario=scn,
        scenario_hash=str(attrs.get(StudyKey.SCENARIO_HASH) or scn.problem_hash()),
        stratagem_version=str(attrs.get(StudyKey.STRATAGEM_VERSION) or ""),
        objectives=OBJECTIVES, directions=directions, plans=tuple(rows), front=tuple(front),
        best=best, headline_note=headline_note, n_trials=len(all_trials), n_unfinished=n_unfinished,
        n_superseded=sum(len(v) - 1 for v in by_key.values()),
        trials=tuple(sorted((t for ts in by_key.values() for t in ts), key=lambda t: t.number)),
        plan_of_trial={t.number: r.index for r in rows for t in by_key[r.key]}, advice_limit=advice_limit,
        calibration=_calibration_text(attrs), not_run=_not_run_lines(attrs),
        best_measured=top.note if top else "", best_measured_trial=top.number if top else None,
        history=tuple(calibration_history(attrs.get(StudyKey.CALIBRATION_HISTORY))), counts=study_counts(study),
        taught=tuple(taught_lines(calibration, scn.cluster.gpu.name)),
        in_force=calibration if any(h.adopted for h in calibration_history(
            attrs.get(StudyKey.CALIBRATION_HISTORY))) else None,
    )


def best_measured_line(info: ParetoInfo) -> str:
    """The best measured note with its trial number on its own plan: 'Best measured (trial 65): LABEL: figure;
    within noise of ...' (the number after the note would read as the last plan's)."""
    note = info.best_measured
    head = "best measured: "
    rest = note[len(head):] if note.startswith(head) else note
    return f"Best measured (trial {info.best_measured_trial}): {rest}"


_NOT_RUN_WHY = {"harness": "not runnable by the harness", "traced": "not run: traced memory does not fit"}


def _not_run_lines(attrs: dict[str, Any]) -> tuple[str, ...]:
    """One line per reason the real runs left plans out (study attribute "not_run")."""
    found = attrs.get(StudyKey.NOT_RUN) or {}
    return tuple(f"{_NOT_RUN_WHY.get(why, why)}: {entry.get('count', 0)} plan(s), e.g. {entry.get('example', '')}"
                 for why, entry in found.items() if isinstance(entry, dict))


def _calibration_text(attrs: dict[str, Any]) -> str:
    """The study's calibration in words (study attributes calibration_source, calibration_history)."""
    source = str(attrs.get(StudyKey.CALIBRATION_SOURCE) or "published defaults")
    history = calibration_history(attrs.get(StudyKey.CALIBRATION_HISTORY))
    adopted = [h for h in history if h.adopted]  # a refit is adopted only when it predicts held-out runs better
    if attrs.get(StudyKey.CALIBRATION) is not None and adopted:
        return f"{source}, then refitted on this study's {adopted[-1].runs_used} measured runs"
    if history:
        return (f"{source}, kept: no refit on this study's {history[-1].runs_used} measured runs predicted "
                "held-out runs better")
    return source
