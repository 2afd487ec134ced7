"""launch: a plan becomes a job. The training harness (torch), the Ray runner, exporters.

Importing this package imports nothing heavy: each public name loads its module (and torch or ray) on first
use, so `stratagem.launch.export` and the analytic path stay free of torch.

    from stratagem.launch import run_harness
    result = run_harness("examples/tiny-cpu.yaml", "dp=1", steps=5, out="result.json")
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    # training harness (torch)
    "run_harness": "harness", "run_plan": "harness", "validate_plan": "harness",
    "unsupported": "support",  # torch-free: what the harness cannot run, and why
    "MemoryCapExceeded": "memtrack",
    "Job": "train", "build_job": "train", "train_step": "train",
    "Transformer": "model", "build_model": "model", "synthetic_batch": "model",
    "parallelize": "parallelize", "build_mesh": "parallelize",
    "run_local": "local", "LocalRunError": "local",
    "reference": "verify", "run_plans_local": "verify", "compare": "verify",
    # Ray runner (ray)
    "RayRunner": "ray_runner", "RunResult": "ray_runner", "harness_command": "ray_runner",
    "RayRunEvaluator": "real", "measured_evaluation": "real",
    # the harness result file (no torch)
    "HarnessResult": "result", "RankFigures": "result", "read_result": "result", "parse_result": "result",
    "reproduce_trial": "reproduce",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stratagem.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"stratagem.launch.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
