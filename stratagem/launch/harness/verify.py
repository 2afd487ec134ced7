"""Check plans against the single-process reference: same losses, same parameters after the steps.

    ref = reference(scenario, steps=5)                         # one process, no parallelism, fp32
    runs = run_plans_local(scenario, [plan_a, plan_b], steps=5)  # one launch of plan.world_size ranks
    for run in runs:
        compare(run, ref)  # -> {"loss_rel": ..., "param_rel": ..., "worst_param": ...}

Plans of one world size run one after the other inside a single launch (process start-up dominates on CPU);
each builds its own DeviceMesh. Comparisons are relative: |a - b| / |b| for losses, and max |a - b| over a
tensor divided by max |b| of that tensor for parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["VERIFY_LR", "VERIFY_EPS", "reference", "rank_run_plans", "run_plans_local", "compare", "single_process_plan"]


# AdamW's update lr * m / (sqrt(v) + eps) responds to a gradient g << eps with slope lr / eps, and
# reduction-order noise in gradients that cancel to ~1e-8 is ~1e-9 here: with the default eps (1e-8) a
# single-process run with another micro-batch size already differs from itself by ~3e-5 in parameters.
# lr 1e-4 / eps 1e-5 (slope 10) brings that floor to ~2e-7, 50x under the 1e-5 tolerance, while every
# weight still moves by up to 5e-4 (0.5% of its scale) in 5 steps.
VERIFY_LR = 1e-4
VERIFY_EPS = 1e-5


def single_process_plan(scenario: Scenario) -> Plan:
    """The reference: one rank, fp32, no recompute, the whole global batch as one micro-batch."""
    return Plan(dp=1, precision="fp32", micro_batch_size=scenario.training.global_batch_size)


def _params_numpy(job: Any) -> dict[str, np.ndarray]:
    from stratagem.launch.harness.train import full_parameters

    return {k: v.numpy() for k, v in full_parameters(job).items()}


def reference(scenario: Scenario, steps: int, seed: int = 0, start_step: int = 0,
              load_from: str | Path | None = None, lr: float = VERIFY_LR) -> dict[str, Any]:
    """Losses and final parameters of the single-process reference (in this process, no process group)."""
    import torch

    from stratagem.launch.harness.checkpoint import load
    from stratagem.launch.harness.train import build_job, train_step

    plan = single_process_plan(scenario)
    job = build_job(scenario, plan, torch.device("cpu"), seed, lr, VERIFY_EPS)
    if load_from is not None:
        load(job, load_from)
    losses = [train_step(job, start_step + i, seed) for i in range(steps)]
    return {"plan": plan, "losses": losses, "params": _params_numpy(job)}


def rank_run_plans(rank: int, scenario: Scenario, plans: list[Plan], steps: int, seed: int = 0,
                   actions: list[dict[str, Any]] | None = None, lr: float = VERIFY_LR) -> list[dict[str, Any]]:
    """On every rank of a launched group: train each plan in turn; per plan its losses, this rank's full
    parameters (unsharded, its pipeline stage only) and state byte figures.

    `actions[i]` may hold `steps` (instead of `steps`), `start_step` (first batch index), `load` (a checkpoint
    to resume from), `save` (a directory to save to after the steps), or `measure` (run through `run_plan`
    and return its per-rank figures instead of parameters).
    """
    import torch

    from stratagem.launch.harness.checkpoint import load, save
    from stratagem.launch.harness.run import run_plan, validate_plan
    from stratagem.launch.harness.train import build_job, train_step

    out = []
    for i, plan in enumerate(plans):
        act = (actions or [{}] * len(plans))[i]
        validate_plan(scenario, plan, plan.world_size)
        n = int(act.get("steps", steps))
        if act.get("measure"):
            result = run_plan(scenario, plan, n, warmup=0, seed=seed, checkpoint=False, lr=lr)
            out.append({"plan": plan, "losses": result["losses"], "ranks": result["ranks"]})
            continue
        job = build_job(scenario, plan, torch.device("cpu"), seed, lr, VERIFY_EPS)
        if act.get("load"):
            load(job, act["load"])
        first = int(act.get("start_step", 0))
        losses = [train_step(job, first + s, seed) for s in range(n)]
        if act.get("save"):
            save(job, act["save"])
        out.append({"plan": plan, "losses": losses, "params": _params_numpy(job)})
        del job
    return out


def run_plans_local(scenario: Scenario, plans: list[Plan], steps: int, seed: int = 0,
                    actions: list[dict[str, Any]] | None = None, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run `plans` (all of one world size) in one local launch; per plan the losses and the parameters
    merged over ranks (each pipeline stage contributes its own)."""
    from stratagem.launch.runners.local import run_local

    worlds = {p.world_size for p in plans}
    if len(worlds) != 1:
        raise ValueError(f"plans of one launch must share a world size; got {sorted(worlds)}")
    per_rank = run_local(rank_run_plans, worlds.pop(), (scenario, plans, steps, seed, actions), timeout_s)
    merged = []
    for i, plan in enumerate(plans):
        runs = [r[i] for r in per_rank]
        entry: dict[str, Any] = {"plan": plan, "losses": runs[0]["losses"]}
        if "params" in runs[0]:
            params: dict[str, np.ndarray] = {}
            for r in runs:
                params.update(r["params"])
            entry["params"] = params
        if "ranks" in runs[0]:
            entry["ranks"] = runs[0]["ranks"]
        merged.append(entry)
    return merged


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Largest relative differences of losses and parameters between a run and the reference."""
    a, b = np.asarray(run["losses"]), np.asarray(ref["losses"])
    if a.shape != b.shape:
        raise ValueError(f"{len(a)} losses against {len(b)} in the reference")
    loss_rel = float(np.max(np.abs(a - b) / np.abs(b)))
    out: dict[str, Any] = {"loss_rel": loss_rel, "losses": a.tolist(), "reference": b.tolist()}
    if "params" in run:
        missing = set(ref["params"]) ^ set(run["params"])
        if missing:
            raise ValueError(f"parameter names differ from the reference: {sorted(missing)[:5]}")
        worst, worst_name = 0.0, ""
        for name, value in ref["params"].items():
            rel = float(np.max(np.abs(run["params"][name] - value)) / max(np.max(np.abs(value)), 1e-30))
            if rel > worst:
                worst, worst_name = rel, name
        out.update(param_rel=worst, worst_param=worst_name)
    return out
