"""stratagem: find how to train a large model on a given cluster.

    from stratagem import Scenario, Plan, evaluate
"""

from stratagem.errors import StratagemError
from stratagem.evaluators import Evaluation, evaluate, evaluate_many
from stratagem.spaces import Plan, Scenario, load_scenario, parse_plan

__version__ = "0.1.0"

__all__ = ["Evaluation", "Plan", "Scenario", "StratagemError", "evaluate", "evaluate_many", "load_scenario",
           "parse_plan", "__version__"]
