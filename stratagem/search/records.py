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
  user_attrs["plan"]            format_plan(plan) (compact key=value string, the identity used for dedup)
  user_attrs["fidelity"]        "analytic" | "measured"
  user_attrs["status"]          Evaluation.status
  user_attrs["evaluation"]      Evaluation.model_dump(mode="json")
  user_attrs["provenance"]      {"stratagem_version", "scenario_hash", ...}
  user_attrs["role"]            why the search stored it: "front" (predicted Pareto front), "boundary" (pruned, nearest
                                the memory limit), "sample" (a bounded random sample of the rest), "sampler"
                                (proposed by the Optuna sampler during measured runs)
  user_attrs["pruned"]          (PRUNED trials) the reason: predicted peak vs usable memory and the block that broke
Study (added by search):
  user_attrs["space_digest"]    SearchSpace.digest(): scenario + search section; a study serves one space
  user_attrs["counts"]          {"valid", "screened", "pruned", "feasible", "front"} of the last screening
  user_attrs["screening"]       "exhaustive" or the sampler that explored a sampled space
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from stratagem.evaluators.evaluation import Evaluation
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
    "study_scenario",
    "CONSTRAINT",
    "ROLES",
    "front_trials",
]

OBJECTIVES: tuple[str, ...] = ("tokens_per_s", "headroom_gib", "goodput_loss")
DIRECTIONS: tuple[Literal["maximize", "minimize"], ...] = ("maximize", "maximize", "minimize")
CONSTRAINT = "memory"
ROLES: tuple[str, ...] = ("front", "boundary", "sample", "sampler")


def plan_distributions() -> dict[str, optuna.distributions.BaseDistribution]:
    """One fixed Optuna distribution per Plan field, matching plan_params(); for trials written by hand
    (a storage refuses a parameter whose distribution changes within a study)."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    from stratagem.spaces.plan import PRECISIONS, RECOMPUTES, SCHEDULES

    count = IntDistribution(1, 1 << 20)
    return {
        "dp": count, "tp": count, "pp": count, "cp": count, "ep": count, "dp_replicate": count,
        "micro_batch_size": count, "virtual_stages": count, "zero_stage": CategoricalDistribution([0, 1, 2, 3]),
        "sequence_parallel": CategoricalDistribution([False, True]),
        "precision": CategoricalDistribution(list(PRECISIONS)),
        "activation_checkpointing": CategoricalDistribution(list(RECOMPUTES)),
        "pp_schedule": CategoricalDistribution(list(SCHEDULES)),
        "optimizer_offload": CategoricalDistribution(["none", "cpu"]),
    }


def plan_params(plan: Plan) -> dict[str, Any]:
    """The plan as Optuna params (every field, JSON scalars)."""
    return plan.model_dump(mode="json")


def plan_key(plan: Plan) -> str:
    """The identity of a plan in a study (used to never evaluate a plan twice)."""
    return format_plan(plan)


def objective_values(ev: Evaluation) -> list[float]:
    """[tokens_per_s, headroom_gib, goodput_loss] for an evaluation that has memory, time and checkpoint."""
    if ev.memory is None or ev.throughput is None or ev.checkpoint is None:
        raise ValueError(f"evaluation of {plan_key(ev.plan)} ({ev.status}) has no objective values")
    return [ev.throughput.tokens_per_s, ev.memory.headroom_gib, ev.checkpoint.goodput_loss]


def trial_plan(trial: optuna.trial.FrozenTrial) -> Plan:
    """The Plan a stored trial evaluated."""
    return Plan(**{k: v for k, v in trial.params.items() if k in Plan.model_fields})


def trial_evaluation(trial: optuna.trial.FrozenTrial) -> Evaluation | None:
    """The Evaluation stored with a trial, or None when it has none (e.g. a trial still running)."""
    data = trial.user_attrs.get("evaluation")
    return Evaluation.model_validate(data) if data else None


def study_scenario(study: optuna.Study) -> Scenario:
    """The Scenario a study was created for."""
    data = study.user_attrs.get("scenario")
    if data is None:
        from stratagem.errors import StratagemError

        raise StratagemError(f"study {study.study_name!r} was not made by stratagem (no scenario stored)")
    return scenario_from_dict(data, source=f"study {study.study_name}")


def front_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's Pareto front, highest tokens/s first: feasible trials no other dominates, where a plan that
    was measured is represented by its latest measured trial (a real run overrides its prediction)."""
    import numpy as np
    from optuna.trial import TrialState

    from stratagem.search.pareto import nondominated

    latest: dict[str, optuna.trial.FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        key = t.user_attrs.get("plan", f"#{t.number}")
        held = latest.get(key)
        measured = t.user_attrs.get("fidelity") == "measured"
        if held is None or measured or held.user_attrs.get("fidelity") != "measured":
            latest[key] = t
    rows = [t for t in latest.values() if t.state == TrialState.COMPLETE and t.values
            and all(c <= 0 for c in (t.constraints or {}).values())]
    if not rows:
        return []
    keep = nondominated(np.array([t.values for t in rows], dtype=np.float64), DIRECTIONS)
    return sorted((rows[i] for i in keep), key=lambda t: (-t.values[0], t.number))
