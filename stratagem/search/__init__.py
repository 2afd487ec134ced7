"""The Optuna search over the plan space, one `SearchSession` per search (search/session.py): screen it
analytically (`screen`), store the predicted Pareto front and a bounded sample as trials (`store`), trace plans
(`trace`), measure the most informative plans as real runs and recalibrate (`measure`: the budget loop and batch lifecycle in search/measure.py, the `RunOrder` policy in search/run_order.py, the
noise-aware ranking in search/noise.py; several workers may share one study).
Never imports ray or torch: it receives an evaluator."""

from stratagem.search.counts import StudyCounts
from stratagem.search.naming import check_sampler, default_study_name
from stratagem.search.noise import BestMeasured, best_measured
from stratagem.search.pareto import dominates, nondominated
from stratagem.search.records import (
    CONSTRAINT,
    DIRECTIONS,
    FIDELITIES,
    OBJECTIVES,
    ROLES,
    STATUSES,
    Standing,
    StudyKey,
    TrialKey,
    front_trials,
    objective_values,
    plan_key,
    plan_params,
    standings,
    study_scenario,
    trial_evaluation,
    trial_feasible,
    trial_fidelity,
    trial_plan,
    trial_status,
)
from stratagem.search.retry import StorageUnavailable
from stratagem.search.run_order import ExpectedImprovementOrder, RankedOrder, RunOrder, RunState
from stratagem.search.runner import SearchResult, select_plans
from stratagem.search.samplers import SAMPLERS, ProjectingSampler, make_sampler
from stratagem.search.screening import ScreenCounts, Screening, objective_matrix, screen
from stratagem.search.session import MeasureResult, SearchSession
from stratagem.search.storage import (
    StorageSpec,
    check_storage,
    default_storage,
    load_study,
    open_storage,
    parse_storage,
    storage_lock,
)
from stratagem.search.view import StudyView

__all__ = [
    "check_sampler", "default_study_name",
    "dominates", "nondominated",
    "CONSTRAINT", "DIRECTIONS", "OBJECTIVES", "ROLES", "FIDELITIES", "STATUSES", "TrialKey", "StudyKey",
    "Standing", "standings", "trial_feasible", "trial_fidelity", "trial_status", "front_trials", "objective_values",
    "plan_key", "plan_params", "study_scenario", "trial_evaluation", "trial_plan",
    "SearchResult", "select_plans", "SearchSession", "MeasureResult",
    "RunOrder", "RunState", "RankedOrder", "ExpectedImprovementOrder", "BestMeasured", "best_measured",
    "SAMPLERS", "ProjectingSampler", "make_sampler",
    "ScreenCounts", "Screening", "objective_matrix", "screen",
    "StorageSpec", "check_storage", "default_storage", "open_storage", "parse_storage", "storage_lock",
    "load_study", "StorageUnavailable", "StudyView", "StudyCounts",
]
