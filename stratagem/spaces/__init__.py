"""What can be tried: model, hardware, training and plan specs, validity rules."""

from stratagem.spaces.canonical import Job, canonical_plan, job_description
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.factors import divisors
from stratagem.spaces.hardware import GPU_PRESETS, ClusterSpec, GPUSpec, cluster_preset, gpu_preset
from stratagem.spaces.model import MODEL_PRESETS, MLASpec, ModelSpec, MoESpec, model_preset
from stratagem.spaces.plan import PRECISIONS, RECOMPUTES, SCHEDULES, Plan, format_plan, parse_plan
from stratagem.spaces.rules import RULES, Rule, check_plan, violations
from stratagem.spaces.scenario import Scenario, load_scenario, resolve_plan, scenario_from_dict
from stratagem.spaces.search_config import IntRange, SearchConfig
from stratagem.spaces.space import AXES, SearchSpace
from stratagem.spaces.training import CheckpointPolicy, TrainingSpec

__all__ = [
    "Job", "canonical_plan", "job_description",
    "PlanColumns",
    "GPU_PRESETS", "ClusterSpec", "GPUSpec", "cluster_preset", "gpu_preset",
    "MODEL_PRESETS", "MLASpec", "ModelSpec", "MoESpec", "model_preset",
    "PRECISIONS", "RECOMPUTES", "SCHEDULES", "Plan", "format_plan", "parse_plan",
    "RULES", "Rule", "check_plan", "divisors", "violations",
    "Scenario", "load_scenario", "resolve_plan", "scenario_from_dict",
    "AXES", "IntRange", "SearchConfig", "SearchSpace",
    "CheckpointPolicy", "TrainingSpec",
]
