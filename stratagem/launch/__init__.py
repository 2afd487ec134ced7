"""launch: a plan becomes a job. Four parts, each its own package or module:

    harness/    the training harness (torch): model, parallelize, pipeline, train, memory, checkpoint
    runners/    where it runs: local gloo ranks, a Ray cluster, the real-run evaluator, node calibration
    trace/      the harness's step on fake tensors at full size (the traced fidelity)
    export/     a plan as a torchrun / torchtitan / Megatron-LM / DeepSpeed job
    reproduce   a stored measured trial rerun and compared

Importing this package imports nothing heavy: each public name loads its module (and torch or ray) on first
use, so `stratagem.launch.export` and the analytic path stay free of torch.

    from stratagem.launch import run_harness
    result = run_harness("examples/tiny-cpu.yaml", "dp=1", steps=5, out="result.json")
"""

from __future__ import annotations

from stratagem.launch._lazy import lazy_exports

_LAZY = {
    "run_harness": "harness.run", "run_plan": "harness.run", "validate_plan": "harness.run",
    "unsupported": "harness.support",  # torch-free: what the harness cannot run, and why
    "HarnessResult": "harness.result", "read_result": "harness.result", "parse_result": "harness.result",
    "run_local": "runners.local", "RayRunner": "runners.ray_runner", "RunResult": "runners.ray_runner",
    "RayRunEvaluator": "runners.real", "measured_evaluation": "runners.real",
    "trace_plan": "trace.run", "TracedRole": "trace.run",
    "reproduce_trial": "reproduce",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
