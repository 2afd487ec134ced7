"""How many: the one counting rule of a study, computed here and printed the same way by
`stratagem search` (its end summary), `stratagem report` (HTML and Markdown) and `stratagem status`.

Three layers, each counted once:
- The space (the last screening, stored as the study attribute "counts" by `screening_attr`): valid plans
  (distinct jobs), screened, pruned (predicted peak over HBM minus the margin) by the block that broke first,
  fitting, and on the predicted front.
- The study: trials by kind (screened, measured, traced, recalibrated, unfinished: they add up to the trials),
  distinct plans holding a result (one standing trial each, `records.standings`) and how many of them fit, the
  stored plans by why the search stored them (front, boundary, sample, ...).
- The front now (`records.front_trials`: the standing trials no other dominates: measured figures where a run
  exists, the latest prediction elsewhere), and where it parts from the predicted front, why: a plan of the
  predicted front whose run ran out of memory or failed, or which measured / re-predicted figures now dominate;
  plans that joined it.
- Measured trials by status (ok, oom, failed, timeout), the plans they measured, runs in flight.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from stratagem.evaluators.evaluation import BLOCKS
from stratagem.search.records import (
    ROLES,
    STATUSES,
    StudyKey,
    TrialKey,
    front_trials,
    standings,
    trial_fidelity,
    trial_key,
    trial_status,
)

if TYPE_CHECKING:
    import optuna

    from stratagem.search.screening import Screening

__all__ = ["SpaceCounts", "StudyCounts", "study_counts", "screening_attr", "trial_kinds", "KINDS"]

KINDS: dict[str, str] = {"screened": "screened plans", "measured": "measured runs", "traced": "traced plans",
                         "recalibrated": "re-predicted with the refitted calibration", "unfinished": "unfinished",
                         "other": "other"}
"""Trial kinds, in the order they are printed, and their names."""


@dataclass(frozen=True)
class SpaceCounts:
    """The plan space as the last screening judged it (study attribute "counts")."""

    valid: int
    """Valid plans = distinct jobs (canonical plans of the space)."""
    screened: int
    """Plans judged by the analytic model (== valid when exhaustive)."""
    pruned: int
    """Screened plans predicted over HBM minus the memory margin."""
    fit: int
    """Screened plans that fit (screened - pruned)."""
    front: int
    """Plans on the predicted Pareto front of the screening."""
    pruned_by: dict[str, int] = field(default_factory=dict)
    """Pruned plans by the memory block whose running sum crosses the usable memory first (most first; "no
    finite figures" for a plan the model could not judge); empty for a study stored before it was counted."""
    margin_gib: float | None = None
    """The search's memory margin (GiB below HBM a plan must stay)."""
    mode: str = ""
    """exhaustive, or the sampler that explored a sampled space."""


@dataclass(frozen=True)
class StudyCounts:
    """What a study holds, by the one counting rule (module docstring)."""

    trials: int
    """Every trial, any state."""
    analytic: int
    """Analytic trials (screened plans, re-predictions)."""
    measured: int
    """Finished measured trials (ok, oom, failed, timeout): the sum of measured_by."""
    running: int
    """Trials running now (claims of real runs)."""
    plans: int
    """Distinct plans holding a result (one standing trial each)."""
    space: SpaceCounts | None = None
    """The last screening's counts (None: no search stored them, e.g. a study written by hand)."""
    kinds: dict[str, int] = field(default_factory=dict)
    """Trials by kind (KINDS order, zero counts left out); they add up to `trials`."""
    plans_fit: int = 0
    """Distinct plans whose standing trial fits (feasible: status ok, no violated constraint)."""
    roles: dict[str, int] = field(default_factory=dict)
    """Distinct plans by why the search first stored them (records.ROLES: front, boundary, sample, ...)."""
    front: int = 0
    """Plans on the study's Pareto front now (records.front_trials)."""
    front_measured: int = 0
    """Of `front`, plans whose figures are measured."""
    predicted_front: int = 0
    """Distinct plans the search stored from the predicted front (role "front"); front = predicted_front -
    sum(off_front) + joined_front."""
    off_front: dict[str, int] = field(default_factory=dict)
    """Plans of the predicted front (role "front") not on the front now, by why (most first; a run's status
    before a domination)."""
    joined_front: int = 0
    """Plans on the front now that were not on the predicted front (measured or re-predicted into it)."""
    measured_by: dict[str, int] = field(default_factory=dict)
    """Finished measured trials by status (ok, oom, failed, timeout)."""
    measured_plans: int = 0
    """Distinct plans with at least one finished measured trial (what --real-runs K counts)."""
    remeasured: int = 0
    """Finished measured trials that re-measured a plan already measured (role "remeasured"): measured =
    measured_plans + remeasured when every plan's first run is kept."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (`search --json`, `status --json`)."""
        return asdict(self)


def screening_attr(screening: Screening) -> dict[str, Any]:
    """The study attribute "counts" for a screening: its ScreenCounts, the pruned plans by the block that broke
    first (Screening.broke indexes BLOCKS, -1 for a plan without finite figures), the margin and the mode."""
    c = screening.counts
    broke = np.asarray(screening.broke)[~np.asarray(screening.feasible, dtype=bool)]
    by = Counter(BLOCKS[b] if b >= 0 else "no finite figures" for b in broke.tolist())
    return {"valid": c.valid, "screened": c.screened, "pruned": c.pruned, "feasible": c.feasible, "front": c.front,
            "pruned_by": dict(by.most_common()),
            "margin_gib": screening.space.config.memory_margin_gib, "mode": screening.mode}


def _space(attrs: dict[str, Any]) -> SpaceCounts | None:
    got = attrs.get(StudyKey.COUNTS)
    if not isinstance(got, dict) or not {"valid", "screened", "pruned", "feasible", "front"} <= set(got):
        return None
    margin = got.get("margin_gib")
    return SpaceCounts(valid=int(got["valid"]), screened=int(got["screened"]), pruned=int(got["pruned"]),
                       fit=int(got["feasible"]), front=int(got["front"]),
                       pruned_by={str(k): int(v) for k, v in (got.get("pruned_by") or {}).items()},
                       margin_gib=None if margin is None else float(margin),
                       mode=str(got.get("mode") or attrs.get(StudyKey.SCREENING) or ""))


def trial_kinds(trials: list[optuna.trial.FrozenTrial]) -> dict[str, int]:
    """How many trials are which kind (KINDS order, zero counts left out): unfinished (running, waiting,
    failed claims), else measured, traced, recalibrated (role), screened (analytic), other."""
    from optuna.trial import TrialState

    counts = dict.fromkeys(KINDS, 0)
    for t in trials:
        fidelity = t.user_attrs.get(TrialKey.FIDELITY)
        if not t.state.is_finished() or t.state == TrialState.FAIL:
            counts["unfinished"] += 1
        elif fidelity in ("measured", "traced"):
            counts[str(fidelity)] += 1
        elif t.user_attrs.get(TrialKey.ROLE) == "recalibrated":
            counts["recalibrated"] += 1
        elif fidelity == "analytic":
            counts["screened"] += 1
        else:
            counts["other"] += 1
    return {k: n for k, n in counts.items() if n}


def _order(names: tuple[str, ...], name: str) -> tuple[int, str]:
    """Sort key: the position in `names`, unknown names after, by name."""
    return (names.index(name) if name in names else len(names), name)


def _off_front_why(trial: optuna.trial.FrozenTrial, feasible: bool) -> str:
    """Why a plan of the predicted front is not on the front now, from the trial standing for it: its run's
    status ("measured oom"), or the figures on which other plans dominate it."""
    fidelity = trial_fidelity(trial)
    if not feasible and fidelity == "analytic":
        return "re-predicted not to fit"
    if not feasible:
        status = trial_status(trial)
        return f"{fidelity} {status}" if status != "ok" else f"{fidelity} over the usable memory"
    if fidelity != "analytic":
        return f"dominated on {fidelity} figures"
    if trial.user_attrs.get(TrialKey.ROLE) == "recalibrated":
        return "dominated on re-predicted figures"
    return "dominated by plans measured or re-predicted since"


def study_counts(study: optuna.Study) -> StudyCounts:
    """The study's counts by the one rule (module docstring), read now."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    stand = standings(trials)
    front = front_trials(study)
    front_keys = {t.number for t in front}
    on_front = {k for k, s in stand.items() if s.trial.number in front_keys}
    roles: Counter[str] = Counter()
    off: Counter[str] = Counter()
    joined = predicted_plans = 0
    for key, s in stand.items():
        role = next((str(t.user_attrs.get(TrialKey.ROLE)) for t in s.trials if t.user_attrs.get(TrialKey.ROLE)),
                    "unrecorded")
        roles[role] += 1
        predicted = any(t.user_attrs.get(TrialKey.ROLE) == "front" for t in s.trials)
        predicted_plans += predicted
        if predicted and key not in on_front:
            off[_off_front_why(s.trial, s.feasible)] += 1
        joined += key in on_front and not predicted
    done = [t for t in trials if trial_fidelity(t) == "measured" and t.state in (TrialState.COMPLETE,
                                                                                  TrialState.PRUNED)]
    by_status = Counter(trial_status(t) for t in done)
    return StudyCounts(
        trials=len(trials), analytic=sum(t.user_attrs.get(TrialKey.FIDELITY) == "analytic" for t in trials),
        measured=len(done), running=sum(t.state == TrialState.RUNNING for t in trials), plans=len(stand),
        space=_space(study.user_attrs), kinds=trial_kinds(trials), plans_fit=sum(s.feasible for s in stand.values()),
        roles=dict(sorted(roles.items(), key=lambda kv: _order(ROLES, kv[0]))),
        front=len(front),
        front_measured=sum(trial_fidelity(t) == "measured" for t in front), predicted_front=predicted_plans,
        off_front=dict(sorted(off.items(), key=lambda kv: (-kv[1], kv[0].startswith("dominated"), kv[0]))),
        joined_front=joined, measured_by=dict(sorted(by_status.items(), key=lambda kv: _order(STATUSES, kv[0]))),
        measured_plans=len({trial_key(t) for t in done}),
        remeasured=sum(t.user_attrs.get(TrialKey.ROLE) == "remeasured" for t in done))
