"""How plans and evaluations are stored in an Optuna study: the one schema that search, reports, export and
reproduce share.

Study:
  user_attrs["scenario"]        the Scenario as JSON-able dict (model_dump(mode="json"), plan and search included)
  user_attrs["scenario_hash"]   Scenario.problem_hash()
  user_attrs["stratagem_version"]
  directions                    [maximize tokens_per_s, maximize headroom_gib, minimize goodput_loss] (OBJECTIVES)
Trial:
  params                        the Plan's fields (enums as strings, booleans as bool), see plan_params(); a search
                                records the axes that apply to the plan (SearchSpace.params: sequence_parallel only
                                with tp > 1, pp_schedule only with pp > 1, ...): an absent field has its Plan default,
                                which trial_plan() fills in
  state                         COMPLETE (fits), PRUNED (predicted or measured not to fit; user_attrs["pruned"] says
                                which block broke), FAIL (a run that crashed or was killed; its plan is re-queued)
  values                        [tokens_per_s, headroom_gib, goodput_loss] of the evaluation (COMPLETE trials)
  constraints (set_constraint)  [peak_gib - usable_gib]: > 0 means predicted or measured not to fit
                                (key CONSTRAINT = "memory"; usable_gib = HBM - search.memory_margin_gib)
  user_attrs["plan"]            plan_key(plan): format_plan of the canonical plan (compact key=value string, the identity
                                used for dedup: one key per job)
  user_attrs["fidelity"]        "analytic" | "traced" | "measured" (FIDELITIES; measured beats traced beats analytic)
  user_attrs["status"]          Evaluation.status (STATUSES)
  user_attrs["evaluation"]      Evaluation.model_dump(mode="json")
  user_attrs["provenance"]      {"stratagem_version", "scenario_hash", ...}
  user_attrs["role"]            why the search stored it (ROLES): "front" (predicted Pareto front), "boundary" (nearest
                                the memory limit), "sample" (a bounded random sample of the rest), "sampler"
                                (proposed by the Optuna sampler during measured runs), "candidate" (predicted not
                                to fit, measured anyway: multifidelity's include_infeasible), "recalibrated" (the
                                plan predicted again with the study's refitted calibration), "remeasured" (a measured
                                plan run again to settle a ranking within noise: its figures pool every run of the
                                plan, search/noise.py)
  user_attrs["pruned"]          (PRUNED trials) the reason: predicted peak vs usable memory and the block that broke
  user_attrs["worker"], ["claim"], ["released"], ["expired"], ["retry_of"], ["duplicate_of"]
                                who runs a measured trial and how a claim on it ended (search/claims.py)
Which trial stands for a plan (`standing`, the one rule every reader uses): among the plan's finished trials
(COMPLETE or PRUNED, or any trial holding an evaluation), the highest fidelity wins, and within one fidelity the
latest trial (a recalibrated prediction replaces the first one). The number that names a measured plan's record
(`Standing.number`) is its first measured run's: a re-measurement's trial holds the pooled figures and stands
for the plan, but the plan keeps its number in every table, status line and `reproduce --trial`. It is feasible when it is COMPLETE with finite
objective values, its status is "ok" and every constraint is <= 0.
Study (added by search):
  user_attrs["space_digest"]    SearchSpace.digest(): scenario + search section; a study serves one space
  user_attrs["counts"]          {"valid", "screened", "pruned", "feasible", "front"} of the last screening
  user_attrs["screening"]       "exhaustive" or the sampler that explored a sampled space
  user_attrs["search_state"]    {"finished": bool, ...}: whether the last analytic search ran to its end
  user_attrs["calibration"]     (real runs) the Calibration refitted on the study's measured trials
  user_attrs["calibration_history"]  one entry per batch of real runs
  user_attrs["calibration_source"]   which calibration the predictions started from (defaults, a file, the study)
  user_attrs["traced_calibration"]   (--traced) the Calibration refitted on the study's traced trials
  user_attrs["not_run"]         (real runs) plans the last real-run phase did not run, by why: {"harness": {"count",
                                "example"}: the harness cannot run them; "traced": their traced memory does not fit}
  user_attrs["real_runs_started"], ["real_runs_budget_minutes"]  when the first worker's real runs began (epoch
                                seconds) and the --budget-minutes every worker counts against (the current window)
  user_attrs["budget_windows"]  every --budget-minutes window: [{"started", "minutes", "ended"}] (search/budget.py)
  user_attrs["run_timeout_s"]   the --run-timeout of the last real-run call (None: derived per plan)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from stratagem.evaluators.evaluation import Evaluation, Fidelity, Status
from stratagem.spaces.canonical import canonical_plan
from stratagem.spaces.plan import Plan, format_plan
from stratagem.spaces.scenario import Scenario, scenario_from_dict

if TYPE_CHECKING:
    import optuna

__all__ = [
    "plan_distributions",
    "OBJECTIVES",
    "DIRECTIONS",
    "plan_params",
    "plan_key",
    "objective_values",
    "trial_plan",
    "trial_evaluation",
    "JOURNAL_DAMAGED",
    "study_scenario",
    "CONSTRAINT",
    "ROLES",
    "Role",
    "FIDELITIES",
    "STATUSES",
    "TrialKey",
    "StudyKey",
    "front_trials",
    "Standing",
    "standing",
    "standings",
    "record_numbers",
    "trial_fidelity",
    "trial_key",
    "trial_status",
    "trial_constraint",
    "trial_feasible",
]

OBJECTIVES: tuple[str, ...] = ("tokens_per_s", "headroom_gib", "goodput_loss")
DIRECTIONS: tuple[Literal["maximize", "minimize"], ...] = ("maximize", "maximize", "minimize")
CONSTRAINT = "memory"
Role = Literal["front", "boundary", "sample", "sampler", "candidate", "recalibrated", "remeasured"]
ROLES: tuple[Role, ...] = get_args(Role)
"""Why a trial was stored (user attribute "role")."""
FIDELITIES: tuple[Fidelity, ...] = get_args(Fidelity)
"""How a trial's figures were obtained, weakest first: a later entry beats an earlier one for the same plan."""
STATUSES: tuple[Status, ...] = tuple(s for s in get_args(Status) if s != "infra")
"""Evaluation.status values a trial stores (user attribute "status"); only "ok" can be feasible. "infra" (the
cluster failed, not the plan) is never stored: the plan's claim is released for a retry (search/claims.py)."""


class TrialKey:
    """Trial user-attribute keys (see the module docstring)."""

    PLAN = "plan"
    FIDELITY = "fidelity"
    STATUS = "status"
    EVALUATION = "evaluation"
    PROVENANCE = "provenance"
    ROLE = "role"
    PRUNED = "pruned"
    WORKER = "worker"
    CLAIM = "claim"
    RELEASED = "released"
    EXPIRED = "expired"
    RETRY_OF = "retry_of"
    DUPLICATE_OF = "duplicate_of"


class StudyKey:
    """Study user-attribute keys (see the module docstring)."""

    SCENARIO = "scenario"
    SCENARIO_HASH = "scenario_hash"
    STRATAGEM_VERSION = "stratagem_version"
    SPACE_DIGEST = "space_digest"
    SPACE = "space"
    COUNTS = "counts"
    SCREENING = "screening"
    SEARCH_STATE = "search_state"
    CALIBRATION = "calibration"
    CALIBRATION_HISTORY = "calibration_history"
    CALIBRATION_SOURCE = "calibration_source"
    TRACED_CALIBRATION = "traced_calibration"
    REAL_RUNS_STARTED = "real_runs_started"
    REAL_RUNS_BUDGET_MINUTES = "real_runs_budget_minutes"
    BUDGET_WINDOWS = "budget_windows"
    RUN_TIMEOUT = "run_timeout_s"
    NOT_RUN = "not_run"
    WORKER_PREFIX = "worker:"  # + "<host>:<pid>": a worker's heartbeat (search.status.beating)


def plan_distributions() -> dict[str, optuna.distributions.BaseDistribution]:
    """One fixed Optuna distribution per Plan field, matching plan_params(); for trials written by hand
    (a storage refuses a parameter whose distribution changes within a study)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    from stratagem.spaces.plan import PIPELINE_SPLITS, PRECISIONS, RECOMPUTE_MODULES, RECOMPUTES, SCHEDULES

    count = IntDistribution(1, 1 << 20)
    layers = IntDistribution(0, 1 << 20)
    return {
        "dp": count, "tp": count, "pp": count, "cp": count, "ep": count, "etp": count, "dp_replicate": count,
        "micro_batch_size": count, "virtual_stages": count, "zero_stage": CategoricalDistribution([0, 1, 2, 3]),
        "recompute_layers": layers, "first_stage_layers": layers, "last_stage_layers": layers,
        "pp_split": CategoricalDistribution(list(PIPELINE_SPLITS)),
        "sequence_parallel": CategoricalDistribution([False, True]),
        "precision": CategoricalDistribution(list(PRECISIONS)),
        "activation_checkpointing": CategoricalDistribution(list(RECOMPUTES)),
        "pp_schedule": CategoricalDistribution(list(SCHEDULES)),
        "optimizer_offload": CategoricalDistribution(["none", "cpu"]),
        # every set of modules, written a+b in RECOMPUTE_MODULES order ("" = none), as plan_params writes it
        "recompute_modules": CategoricalDistribution(
            ["+".join(m for i, m in enumerate(RECOMPUTE_MODULES) if bits >> i & 1)
             for bits in range(1 << len(RECOMPUTE_MODULES))]),
    }


def plan_params(plan: Plan) -> dict[str, Any]:
    """The plan as Optuna params (every field, JSON scalars; recompute_modules as "a+b", "" for none)."""
    return {**plan.model_dump(mode="json"), "recompute_modules": "+".join(plan.recompute_modules)}


def plan_key(plan: Plan, scenario: Scenario | None = None) -> str:
    """The identity of a plan in a study (used to never evaluate a plan twice): the key=value form of its
    canonical plan, so two plans that build one job have one key. With `scenario`, the full canonical form
    (`spaces.canonical.canonical_plan`: pipeline splits giving the same chunks, ...); without, the part the plan
    alone decides (`Plan.canonical()`), which is the same key for any plan the search space or a sampler made
    (they are canonical already)."""
    if scenario is not None:
        return format_plan(canonical_plan(scenario, plan))
    return format_plan(plan.canonical())


def objective_values(ev: Evaluation) -> list[float]:
    """[tokens_per_s, headroom_gib, goodput_loss] for an evaluation that has memory, time and checkpoint."""
    if ev.memory is None or ev.throughput is None or ev.checkpoint is None:
        raise ValueError(f"evaluation of {plan_key(ev.plan)} ({ev.status}) has no objective values")
    return [ev.throughput.tokens_per_s, ev.memory.headroom_gib, ev.checkpoint.goodput_loss]


JOURNAL_DAMAGED = "stratagem:journal_damaged"
"""System attribute of a placeholder trial a journal repair wrote where the record that created the trial was
damaged (search/journal.py repair_journal): kept so that every later trial keeps its number; it has no plan."""


def trial_plan(trial: optuna.trial.FrozenTrial) -> Plan:
    """The Plan a stored trial evaluated; one-line StratagemError for a trial whose record was damaged or whose
    parameters are not a plan (a study written by something else)."""
    from pydantic import ValidationError

    from stratagem.errors import StratagemError

    if JOURNAL_DAMAGED in trial.system_attrs:
        raise StratagemError(f"trial #{trial.number}: the journal record that created it was damaged (a journal "
                             "repair kept it only so the other trials keep their numbers): its plan is unknown; "
                             "choose another trial")
    try:
        return Plan(**{k: v for k, v in trial.params.items() if k in Plan.model_fields})
    except ValidationError as e:
        err = e.errors()[0]
        raise StratagemError(f"trial #{trial.number}: its parameters are not a plan stratagem stores "
                             f"({'.'.join(str(x) for x in err['loc'])}: {err['msg']}); the study was written by "
                             "something else or damaged") from None


def trial_evaluation(trial: optuna.trial.FrozenTrial) -> Evaluation | None:
    """The Evaluation stored with a trial, or None when it has none (e.g. a trial still running); one-line
    StratagemError when what is stored there is not an evaluation."""
    from pydantic import ValidationError

    from stratagem.errors import StratagemError

    data = trial.user_attrs.get("evaluation")
    if not data:
        return None
    try:
        return Evaluation.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise StratagemError(f"trial #{trial.number}: its stored evaluation is not one stratagem writes "
                             f"({'.'.join(str(x) for x in err['loc'])}: {err['msg']}); the study was written by "
                             "something else or damaged") from None


def study_scenario(study: optuna.Study) -> Scenario:
    """The Scenario a study was created for."""
    data = study.user_attrs.get(StudyKey.SCENARIO)
    if data is None:
        from stratagem.errors import StratagemError

        raise StratagemError(f"study {study.study_name!r} was not made by stratagem (no scenario stored)")
    return scenario_from_dict(data, source=f"study {study.study_name}")


def trial_fidelity(trial: optuna.trial.FrozenTrial) -> Fidelity:
    """The trial's fidelity (user attribute, else its evaluation's, else "analytic")."""
    value = trial.user_attrs.get(TrialKey.FIDELITY)
    if value not in FIDELITIES:
        data = trial.user_attrs.get(TrialKey.EVALUATION)
        value = data.get("fidelity", "analytic") if isinstance(data, dict) else "analytic"
    return value if value in FIDELITIES else "analytic"


def trial_status(trial: optuna.trial.FrozenTrial) -> str:
    """The trial's status: the "status" attribute, else its evaluation's, else "ok" for a COMPLETE trial and
    the Optuna state's name otherwise."""
    from optuna.trial import TrialState

    status = trial.user_attrs.get(TrialKey.STATUS)
    if status is not None:
        return str(status)
    data = trial.user_attrs.get(TrialKey.EVALUATION)
    if isinstance(data, dict) and data.get("status") in STATUSES:
        return str(data["status"])
    return "ok" if trial.state == TrialState.COMPLETE else trial.state.name.lower()


def trial_constraint(trial: optuna.trial.FrozenTrial) -> float | None:
    """The largest stored constraint (peak - usable GiB; > 0 does not fit), None when none is stored. Optuna 5
    keeps named constraints (CONSTRAINT); older studies a list in system_attrs["constraints"]."""
    named = getattr(trial, "constraints", None)
    values = list(named.values()) if isinstance(named, dict) else []
    if not values:
        values = list(trial.system_attrs.get("constraints") or [])
    return float(max(values)) if values else None


def trial_feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """COMPLETE with finite objective values, status "ok", and no constraint above 0."""
    from optuna.trial import TrialState

    if trial.state != TrialState.COMPLETE or not trial.values or len(trial.values) != len(OBJECTIVES):
        return False
    if not all(math.isfinite(v) for v in trial.values) or trial_status(trial) != "ok":
        return False
    c = trial_constraint(trial)
    return c is None or c <= 0


def trial_key(trial: optuna.trial.FrozenTrial) -> str:
    """The plan key of a trial: its "plan" attribute, else plan_key of its params, else "#<number>"."""
    key = trial.user_attrs.get(TrialKey.PLAN)
    if key is not None:
        return str(key)
    try:
        return plan_key(trial_plan(trial))
    except (ValueError, TypeError):
        return f"#{trial.number}"


def _holds_result(trial: optuna.trial.FrozenTrial) -> bool:
    from optuna.trial import TrialState

    return trial.state in (TrialState.COMPLETE, TrialState.PRUNED) or bool(trial.user_attrs.get(TrialKey.EVALUATION))


@dataclass(frozen=True)
class Standing:
    """A plan's trials in a study and the one that stands for it."""

    key: str
    """trial_key of the plan's trials."""
    trial: optuna.trial.FrozenTrial
    """The trial that stands for the plan: highest fidelity, then latest."""
    trials: tuple[optuna.trial.FrozenTrial, ...]
    """Every finished trial of the plan, by number."""

    @property
    def number(self) -> int:
        """The number that names the plan's record: its first measured trial once measured (re-measurements add
        trials that pool the runs, the plan keeps its number), else the standing trial's."""
        if trial_fidelity(self.trial) == "measured":
            return next(t.number for t in self.trials if trial_fidelity(t) == "measured")
        return self.trial.number

    @property
    def fidelity(self) -> Fidelity:
        """The standing trial's fidelity."""
        return trial_fidelity(self.trial)

    @property
    def status(self) -> str:
        """The standing trial's status."""
        return trial_status(self.trial)

    @property
    def feasible(self) -> bool:
        """Whether the standing trial is feasible (trial_feasible): a measured oom overrules a feasible
        prediction."""
        return trial_feasible(self.trial)

    def latest(self, fidelity: Fidelity) -> optuna.trial.FrozenTrial | None:
        """The plan's latest trial of one fidelity (e.g. the analytic prediction beside a measured run)."""
        found = [t for t in self.trials if trial_fidelity(t) == fidelity]
        return found[-1] if found else None


def standing(trials: Sequence[optuna.trial.FrozenTrial]) -> optuna.trial.FrozenTrial:
    """Which of one plan's finished trials stands for it: the highest fidelity (FIDELITIES order), then the
    latest (highest number)."""
    if not trials:
        raise ValueError("standing: a plan with no trials")
    return max(trials, key=lambda t: (FIDELITIES.index(trial_fidelity(t)), t.number))


def standings(trials: Iterable[optuna.trial.FrozenTrial]) -> dict[str, Standing]:
    """Plan key -> its Standing, over the finished trials (COMPLETE, PRUNED, or holding an evaluation) of a
    study (`study.get_trials(deepcopy=False)`); unfinished trials (queued, running, failed claims) stand for
    nothing. Keys in order of each plan's first trial."""
    grouped: dict[str, list[optuna.trial.FrozenTrial]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if _holds_result(t):
            grouped.setdefault(trial_key(t), []).append(t)
    return {k: Standing(key=k, trial=standing(ts), trials=tuple(ts)) for k, ts in grouped.items()}


def record_numbers(trials: Iterable[optuna.trial.FrozenTrial]) -> dict[int, int]:
    """Trial number -> the number of the record it belongs to (`Standing.number`), for every finished trial of a
    plan that was measured (a re-measurement's trial maps to its plan's first measured trial); other trials map
    to themselves."""
    out: dict[int, int] = {}
    for s in standings(trials).values():
        out.update({t.number: s.number for t in s.trials})
    return out


def front_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's Pareto front, highest tokens/s first: the feasible standing trials (one per plan, see
    `standings`) that no other dominates."""
    import numpy as np

    from stratagem.search.pareto import nondominated

    rows = [s.trial for s in standings(study.get_trials(deepcopy=False)).values() if s.feasible]
    if not rows:
        return []
    keep = nondominated(np.array([t.values for t in rows], dtype=np.float64), DIRECTIONS)
    return sorted((rows[i] for i in keep), key=lambda t: (-t.values[0], t.number))
