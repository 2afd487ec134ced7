"""How a plan is judged: the analytic model (formulas) and, later, real runs. One narrow interface:
`evaluator.evaluate(scenario, plan) -> Evaluation`."""

from stratagem.evaluators.advice import Advice, NeighbourSummary, advise
from stratagem.evaluators.analytic import AnalyticEvaluator, evaluate, evaluate_many
from stratagem.evaluators.base import BatchEvaluator, Evaluator, MeasuringEvaluator
from stratagem.evaluators.calibration import DEFAULT_CALIBRATION, Calibration
from stratagem.evaluators.evaluation import (
    BLOCKS,
    ZONE_NAMES,
    CheckpointRisk,
    Evaluation,
    MemoryBreakdown,
    Throughput,
    TimeBreakdown,
    Zone,
    Zones,
)
from stratagem.evaluators.figures import PlanFigures
from stratagem.evaluators.spread import StepSpread, distinct, spread_of, spread_of_samples
from stratagem.evaluators.zones import THRESHOLDS

__all__ = [
    "Advice", "NeighbourSummary", "advise", "THRESHOLDS", "ZONE_NAMES",
    "AnalyticEvaluator", "evaluate", "evaluate_many", "PlanFigures", "Evaluator", "BatchEvaluator",
    "MeasuringEvaluator",
    "DEFAULT_CALIBRATION", "Calibration",
    "StepSpread", "distinct", "spread_of", "spread_of_samples",
    "BLOCKS", "CheckpointRisk", "Evaluation", "MemoryBreakdown", "Throughput", "TimeBreakdown", "Zone", "Zones",
]
