"""The training harness: one plan trains for a few steps on torch (FSDP2, DTensor TP, pipelining, DCP).

Modules: `run` (the entry point) and `cli` (its command line, `python -m stratagem.launch.harness`), `model` and `moe` (the seeded
transformer), `parallelize` (with `tensor_parallel`), `expert_grid`, `pipeline` and `context` (the plan applied to it; `expert_grid`: where
MoE experts live and which ranks shard them; `context`: context parallelism),
`train` (the job and its step),
`memtrack` (per-rank memory), `checkpoint` (DCP timing, no shared filesystem assumed), `budget` (how many steps a run times), `support` (what it can run, torch-free), `result`
(its result file, torch-free), `verify` (plans against the single-process reference).
Importing the package imports no torch: each name below loads its module on first use.
"""

from __future__ import annotations

from stratagem.launch._lazy import lazy_exports

_LAZY = {
    "run_harness": "run", "run_plan": "run", "validate_plan": "run", "pick_device": "run",
    "unsupported": "support", "plan_refusals": "support", "DEFAULT_LR": "support",
    "MemoryCapExceeded": "memtrack", "peak_memory": "memtrack", "state_bytes": "memtrack",
    "Job": "train", "build_job": "train", "train_step": "train",
    "Transformer": "model", "build_model": "model", "synthetic_batch": "model",
    "parallelize": "parallelize", "build_mesh": "parallelize",
    "reference": "verify", "run_plans_local": "verify", "compare": "verify",
    "HarnessResult": "result", "RankFigures": "result", "read_result": "result", "parse_result": "result",
    "save_load_times": "checkpoint", "CheckpointEnvironmentError": "checkpoint",
    "StepBudget": "budget", "timed_steps": "budget",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
