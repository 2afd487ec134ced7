"""Runners: where a plan's harness runs. `local` (N gloo ranks in this host's processes), `ray_runner` (a
placement group on a Ray cluster), `real` (the real-run evaluator the search receives), `calibrate` (a
prepared set of runs on this node, fitted), `sweep` and `tabulate` (every plan of a small grid, for benches).
Importing the package imports neither torch nor ray: each name below loads its module on first use.
"""

from __future__ import annotations

from stratagem.launch._lazy import lazy_exports

_LAZY = {
    "run_local": "local", "LocalRunError": "local", "free_port": "local",
    "RayRunner": "ray_runner", "RunResult": "ray_runner", "harness_command": "ray_runner",
    "RayRunEvaluator": "real", "measured_evaluation": "real",
    "run_calibration": "calibrate", "calibration_plans": "calibrate",
    "run_sweep": "sweep", "measure_plans": "tabulate",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
