"""One Ray run's fixed parts, spelled before it waits for resources: its folder under the run directory
(`run_folder_name`, scenario.yaml), the harness command and arguments every rank gets (`harness_command`,
`Trial`), and each rank's torchrun environment from where its actor sits (`rank_envs`: rendezvous on rank 0's
node, the per-node layout `local_layout`). RayRunner (ray_runner.py) runs it."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from stratagem.launch.harness.budget import StepBudget, budget_args
from stratagem.launch.runners.ray_outcome import RunResult, RunStatus
from stratagem.spaces.plan import Plan, format_plan
from stratagem.spaces.scenario import Scenario

__all__ = ["harness_command", "run_folder_name", "local_layout", "Trial", "rank_envs"]


def harness_command(scenario_path: str, plan: Plan, steps: int, warmup: int, seed: int, out: str,
                    memory_cap_gib: float | None = None, python: str | None = None,
                    budget: StepBudget | None = None) -> list[str]:
    """The harness invocation one rank runs (torchrun-compatible environment supplied separately); with
    `budget` the number of timed steps comes from it (--step-budget-s ...) instead of `steps`."""
    cmd = [python or sys.executable, "-m", "stratagem.launch.harness", "--scenario", scenario_path,
           "--plan", format_plan(plan), *_step_args(steps, budget), "--warmup", str(warmup),
           "--seed", str(seed), "--out", out]
    if memory_cap_gib is not None:
        cmd += ["--memory-cap-gib", f"{memory_cap_gib:g}"]
    return cmd


def run_folder_name(name: str) -> str:
    """`name` as one folder name: every character outside letters, digits and `._,=+-` (a split label's `/`,
    spaces, ...) becomes `_`, leading dots go (a split label's `split2/-` would make nested folders)."""
    return re.sub(r"[^\w.,=+-]", "_", name, flags=re.ASCII).lstrip(".") or "run"


def _step_args(steps: int, budget: StepBudget | None) -> list[str]:
    return budget_args(budget) if budget is not None else ["--steps", str(steps)]


def local_layout(nodes: Sequence[str], gpus: Sequence[Sequence[str]] | None = None) -> list[dict[str, str]]:
    """Per global rank, the per-node environment: LOCAL_RANK, LOCAL_WORLD_SIZE (ranks on the same node, in
    global-rank order) and, given each rank's GPU ids (Ray's), CUDA_VISIBLE_DEVICES = the GPUs of that node's
    ranks in local-rank order (so cuda:LOCAL_RANK is the rank's own GPU)."""
    out = []
    for rank, node in enumerate(nodes):
        peers = [r for r, n in enumerate(nodes) if n == node]
        env = {"LOCAL_RANK": str(peers.index(rank)), "LOCAL_WORLD_SIZE": str(len(peers))}
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for r in peers for g in gpus[r])
        out.append(env)
    return out


@dataclass(frozen=True)
class Trial:
    """One run's fixed parts, set before it waits for resources."""

    log_dir: Path
    """The driver's folder of this run (scenario.yaml written at once; rank logs and result.json later)."""
    scenario_yaml: str
    """The scenario every rank receives (its `search` section left out)."""
    plan_text: str
    """The plan as every rank receives it (format_plan)."""
    extra: list[str]
    """The harness arguments after --scenario/--plan/--out: steps or budget, warm-up, seed, memory cap."""
    command: str
    """The harness command each rank runs, as RunResult.command shows it."""
    world: int
    """Ranks, one per bundle."""
    start: float
    """perf_counter() at submission: RunResult.wall_s counts from it."""

    @classmethod
    def open(cls, run_dir: Path, scenario: Scenario, plan: Plan, steps: int, warmup: int, seed: int,
             memory_cap_gib: float | None, name: str | None, budget: StepBudget | None) -> Trial:
        """Start the clock, make the run's folder under `run_dir` with its scenario.yaml, spell the ranks'
        arguments and the command."""
        start = time.perf_counter()
        world = plan.world_size
        log_dir = run_dir / run_folder_name(name or f"run-{uuid.uuid4().hex[:8]}")
        log_dir.mkdir(parents=True, exist_ok=True)
        scenario_yaml = yaml.safe_dump(scenario.model_dump(mode="json", exclude={"search"}), sort_keys=False)
        (log_dir / "scenario.yaml").write_text(scenario_yaml)
        extra = [*_step_args(steps, budget), "--warmup", str(warmup), "--seed", str(seed)]
        if memory_cap_gib is not None:
            extra += ["--memory-cap-gib", f"{memory_cap_gib:g}"]
        command = shlex.join(harness_command("scenario.yaml", plan, steps, warmup, seed, "result.json",
                                             memory_cap_gib, python="python", budget=budget))
        return cls(log_dir, scenario_yaml, format_plan(plan), extra, command, world, start)

    def result(self, status: RunStatus, reason: str, ranks: list[dict[str, Any]] | None = None) -> RunResult:
        """The run's end without a harness result, timed from submission."""
        return RunResult(status, reason, None, str(self.log_dir), self.command, time.perf_counter() - self.start,
                         ranks or [])


def rank_envs(places: list[dict[str, Any]], use_gpus: bool) -> list[dict[str, str]]:
    """Per rank, from where each rank's actor sits (RankWorker.where): the torchrun rendezvous environment
    (rank 0's node and port as master), the per-node layout, one thread, and the driver's STRATAGEM_* settings."""
    layout = local_layout([p["node"] for p in places], [p["gpus"] for p in places] if use_gpus else None)
    master = places[0]
    return [{"MASTER_ADDR": master["ip"], "MASTER_PORT": str(master["port"]), "RANK": str(rank),
             "WORLD_SIZE": str(len(places)), **layout[rank], "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
             # STRATAGEM_* settings of the driver (e.g. STRATAGEM_FAULTS) reach every rank.
             **{k: v for k, v in os.environ.items() if k.startswith("STRATAGEM_")}}
            for rank in range(len(places))]
