"""The training harness in-process: run one plan for a few steps and write one JSON result (rank 0). Its
command line (`python -m stratagem.launch.harness`: `main`, `cli`) is harness/cli.py, which imports this module.

In-process, for a launcher that has set torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK; e.g. inside a Ray actor):

    run_harness(scenario, plan, steps, warmup=1, seed=0, out=None, memory_cap_gib=None,
                checkpoint_dir=None, checkpoint=True, budget=None) -> dict

`scenario` is a Scenario or a YAML path, `plan` a Plan or a "dp=2,tp=2" string. It initialises the process
group (gloo on CPU, nccl on GPU) when WORLD_SIZE > 1, validates the plan against that world size (a 1-rank
plan is the single-process reference whatever the scenario's cluster; the other rules still apply), trains
warmup + steps optimizer steps (steps None and a harness.budget.StepBudget: as many timed steps as the
budget buys at the warm-up's step time, clamped), writes the result to `out` on rank 0 and returns it (on every rank, with every
rank's figures). The CPU memory trace (a dispatch-mode counter) runs during one untimed step: the last warm-up
step, or step 0 when warmup is 0. Raises StratagemError for a plan it cannot apply, MemoryCapExceeded when the tracked peak passes
the cap, torch.cuda.OutOfMemoryError on a CUDA OOM.

Result keys: plan, plan_text, world_size, backend, device, steps, warmup, seed, losses (one per optimizer
step, warm-up first), step_times_s (one per step), step_s (median of the timed steps), step_spread (their
median and 95 % interval: stratagem.evaluators.spread.StepSpread), step_budget (or null), host_load (the
1-minute load average when the timed steps began and ended), tokens_per_s,
tokens_per_step, build_s, memory_tracked_step, mechanisms, ranks (per rank: stage ids, param_bytes,
unsharded_param_bytes, grad_bytes, optimizer_bytes (on the compute device), host_state_bytes (offloaded params, grads
and optimizer states), peak_bytes and its source figures, rss_bytes,
rss_peak_bytes), checkpoint (save_s, async_save_blocking_s, async_save_total_s, load_s), versions.

`unsupported(scenario, plan) -> str | None` (from stratagem.launch.harness.support; importing this module imports no
torch) is the one-line reason the harness would stop on a plan, or None: the multi-fidelity loop skips such plans.
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stratagem.errors import StratagemError
from stratagem.evaluators.spread import spread_of_samples
from stratagem.launch.harness._faults import injected_fault
from stratagem.launch.harness.budget import StepBudget, timed_steps
from stratagem.launch.harness.collective_timeout import SETUP_TIMEOUT_S, set_timeout, tighten
from stratagem.launch.harness.result import HarnessResult
from stratagem.launch.harness.support import DEFAULT_LR
from stratagem.quantities import memory_in, memory_unit
from stratagem.spaces.plan import Plan, format_plan, parse_plan
from stratagem.spaces.rules import violations
from stratagem.spaces.scenario import Scenario, load_scenario
from stratagem.units import GIB

if TYPE_CHECKING:  # torch is imported by the functions that run: `unsupported` must stay torch-free
    import torch

    from stratagem.launch.harness.train import Job

__all__ = ["validate_plan", "run_plan", "run_harness"]

# Our model never modifies a module's output in place, which is what this FSDP2 warning is about.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

EXIT_FAULTS: list[str] = []
"""Faults injected at the process's exit, after the result was written (_faults): "abort" (cli reads it)."""

Teardown = Literal["destroy", "leave"]
"""How run_harness ends a process group it started (run_harness says each)."""


def validate_plan(scenario: Scenario, plan: Plan, world_size: int) -> None:
    """The plan's degrees must multiply to the launched world size; the scenario's other rules apply with
    a cluster of exactly that many devices (its GPU count is ignored)."""
    if plan.world_size != world_size:
        raise StratagemError(
            f"plan: dp*tp*pp*cp ({plan.dp}*{plan.tp}*{plan.pp}*{plan.cp} = {plan.world_size}) must equal the "
            f"{world_size} rank(s) the harness was launched with; launch {plan.world_size} ranks or change the plan")
    cluster = scenario.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": world_size})
    broken = violations(scenario.model_copy(update={"cluster": cluster}), plan)
    if broken:
        raise StratagemError(f"plan: {broken[0]}")


def pick_device() -> tuple[torch.device, str]:
    """cuda:LOCAL_RANK with nccl when a GPU is present, else cpu with gloo."""
    import torch

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _sync(device: torch.device) -> None:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _load_average() -> float:
    """This host's 1-minute load average (0 where the OS has none): loaded hosts stretch CPU steps."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return 0.0


def _check_cap(peak_bytes: float, cap_gib: float | None) -> None:
    """Collective: every rank raises together when any rank's peak passed the cap."""
    from stratagem.launch.harness.memtrack import MemoryCapExceeded

    if cap_gib is None:
        return
    worst = _max_over_ranks(peak_bytes)
    if worst > cap_gib * GIB:
        unit = memory_unit(worst / GIB, cap_gib)  # one unit for both (MiB on the CPU demo's 10 MiB workers)
        raise MemoryCapExceeded(f"peak {memory_in(worst / GIB, unit, True)} over the "
                                f"{memory_in(cap_gib, unit, True)} cap (--memory-cap-gib {cap_gib:g})")


def _gather(obj: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_plan(scenario: Scenario, plan: Plan, steps: int | None, warmup: int = 1, seed: int = 0, *,
             memory_cap_gib: float | None = None, checkpoint_dir: str | Path | None = None,
             checkpoint: bool = True, lr: float = DEFAULT_LR, job: Job | None = None,
             budget: StepBudget | None = None) -> dict[str, Any]:
    """Train `plan` on the already-initialised process group (or a single process); the result dict.

    `steps` timed steps follow `warmup` untimed ones; with `budget` (and steps None) their number comes from
    the warm-up's step time (harness.budget.timed_steps, the same on every rank; needs warmup >= 1). The
    memory is traced during one untimed step (the last warm-up step; step 0 when warmup is 0).
    """
    import torch.distributed as dist

    from stratagem.launch.harness.train import build_job

    world = dist.get_world_size() if dist.is_initialized() else 1
    validate_plan(scenario, plan, world)
    fault = injected_fault(plan)
    if fault.startswith("cap="):
        memory_cap_gib = float(fault.removeprefix("cap="))
    _check_step_counts(steps, warmup, budget)
    device, backend = pick_device()
    start = time.perf_counter()
    job = job or build_job(scenario, plan, device, seed, lr)
    _sync(device)
    build_s = time.perf_counter() - start
    rec = _train(job, plan, device, steps, warmup, seed, budget, memory_cap_gib, fault, world)
    figures = _rank_figures(job, rec)
    ckpt: dict[str, Any] = {}
    if checkpoint:
        from stratagem.launch.harness.checkpoint import save_load_times

        ckpt = save_load_times(job, checkpoint_dir)  # default: each node's temp dir (no shared filesystem)
    return _result(scenario, plan, job, rec, device, backend, world, warmup, seed, lr, budget, build_s, figures,
                   ckpt)


def _check_step_counts(steps: int | None, warmup: int, budget: StepBudget | None) -> None:
    """Either a step count (>= 1) or a budget (with a warm-up to time), and warmup >= 0."""
    if (steps is None) == (budget is None):
        raise StratagemError("give either steps (a fixed count) or a step budget, not both or neither")
    if (steps is not None and steps < 1) or warmup < 0 or (budget is not None and warmup < 1):
        raise StratagemError(f"steps ({steps}) must be >= 1 and warmup ({warmup}) >= 0 (>= 1 with a step budget: "
                             "the warm-up times the step the budget divides)")


@dataclass
class _Steps:
    """What the training steps leave behind."""

    tracked: int
    """The step whose memory is traced (the last warm-up step; 0 without warm-up)."""
    losses: list[float] = field(default_factory=list)
    """One loss per optimizer step, warm-up first."""
    times: list[float] = field(default_factory=list)
    """Each step's wall time (synchronised before and after), warm-up first."""
    memory: dict[str, Any] = field(default_factory=dict)
    """The peak-memory figures (the traced step's on CPU; the whole run's on CUDA)."""
    grads: list[int] = field(default_factory=list)
    """Gradient bytes after the traced step's backward: on the device, on the host."""
    held: int = 0
    """Peak bytes of unsharded parameters held during the traced step (memtrack.HeldParams)."""
    load_at_timed: float = 0.0
    """The host's load average when the timed steps began."""


def _train(job: Job, plan: Plan, device: torch.device, steps: int | None, warmup: int, seed: int,
           budget: StepBudget | None, memory_cap_gib: float | None, fault: str, world: int) -> _Steps:
    """warmup + steps training steps (with a budget: as many timed steps as it buys at the warm-up's fastest
    step, slowest rank), each timed; the memory cap checked after each (CUDA) or after the traced step."""
    import torch

    rec = _Steps(tracked=warmup - 1 if warmup > 0 else 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    total = warmup + steps if steps is not None else None
    step = 0
    rec.load_at_timed = _load_average()
    while total is None or step < total:
        _sync(device)
        t0 = time.perf_counter()
        loss = _step(job, step, seed, device, rec)
        _injected_step_fault(fault, step, plan, world)
        _sync(device)
        rec.times.append(time.perf_counter() - t0)
        rec.losses.append(loss)
        if device.type == "cuda":
            _check_cap(torch.cuda.max_memory_allocated(device), memory_cap_gib)
        elif step == rec.tracked:
            _check_cap(rec.memory["peak_bytes"], memory_cap_gib)
        step += 1
        if step == warmup:
            rec.load_at_timed = _load_average()
        if total is None and step == warmup and budget is not None:
            # the fastest warm-up step (step 0 allocates, the last is traced), slowest rank: one N for all
            total = warmup + timed_steps(budget, _max_over_ranks(min(rec.times)))
        if step == max(warmup, 1) and world > 1:  # warmed up: a lost peer is seen within seconds
            tighten(rec.times)
    set_timeout(SETUP_TIMEOUT_S)
    if device.type == "cuda":
        rec.memory = {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                      "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}
        rec.memory["peak_bytes"] = rec.memory["peak_allocated_bytes"]
    return rec


def _step(job: Job, step: int, seed: int, device: torch.device, rec: _Steps) -> float:
    """One train_step; the traced one under the memory meters (CPU: peak live bytes; CUDA keeps its own peak over
    all steps, reset once in _train) and the held-parameter counter, its gradient bytes taken after backward."""
    from stratagem.launch.harness.memtrack import HeldParams, grad_bytes, peak_memory
    from stratagem.launch.harness.train import train_step

    if step != rec.tracked:
        return train_step(job, step, seed)
    meter: AbstractContextManager[dict[str, Any]] = (
        peak_memory(job.parts, job.optimizer, device) if device.type != "cuda" else nullcontext({}))
    with HeldParams(job.parts) as hp, meter as memory:
        rec.memory = memory
        loss = train_step(job, step, seed, after_backward=lambda: rec.grads.extend(
            (grad_bytes(job.parts), grad_bytes(job.parts, "host"))))
    rec.held = hp.peak
    return loss


def _injected_step_fault(fault: str, step: int, plan: Plan, world: int) -> None:
    """STRATAGEM_FAULTS' crash or hang of the last rank in step 0 (harness._faults)."""
    import torch.distributed as dist

    if step == 0 and fault in ("crash", "hang") and (dist.get_rank() if dist.is_initialized() else 0) == world - 1:
        if fault == "crash":
            raise RuntimeError(f"fault injected by STRATAGEM_FAULTS for {format_plan(plan)}")
        time.sleep(24 * 3600)


def _rank_figures(job: Job, rec: _Steps) -> dict[str, Any]:
    """This rank's figures for the result's `ranks`: stages, state bytes, held and gradient bytes, peak memory, RSS."""
    import torch.distributed as dist

    from stratagem.launch.harness.memtrack import rss_bytes, state_bytes

    figures: dict[str, Any] = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "stage_ids": job.stage_ids,
        **state_bytes(job.parts, job.optimizer),
        "unsharded_param_bytes": rec.held,
        "grad_bytes": rec.grads[0] if rec.grads else 0,
        **rec.memory,
        **rss_bytes(),
    }
    figures["host_state_bytes"] += rec.grads[1] if rec.grads else 0
    return figures


def _result(scenario: Scenario, plan: Plan, job: Job, rec: _Steps, device: torch.device, backend: str, world: int,
            warmup: int, seed: int, lr: float, budget: StepBudget | None, build_s: float, figures: dict[str, Any],
            ckpt: dict[str, Any]) -> dict[str, Any]:
    """The result dict (the module docstring's keys); every rank's figures gathered last."""
    import torch

    from stratagem.launch.harness.train import mechanisms

    times = rec.times
    timed = times[warmup:] or times
    spread = spread_of_samples(timed)
    step_s = spread.median_s
    tokens = scenario.training.tokens_per_step
    return {
        "plan": plan.model_dump(mode="json"),
        "plan_text": format_plan(plan),
        "world_size": world,
        "backend": backend if world > 1 else "none",
        "device": device.type if device.type != "cuda" else torch.cuda.get_device_name(device),
        "steps": len(times) - warmup,
        "warmup": warmup,
        "step_budget": budget.model_dump() if budget is not None else None,
        "seed": seed,
        "lr": lr,
        "losses": rec.losses,
        "step_times_s": times,
        "step_s": step_s,
        "step_spread": spread.model_dump(),
        "host_load": [rec.load_at_timed, _load_average()],
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "build_s": build_s,
        "memory_tracked_step": rec.tracked,
        "mechanisms": mechanisms(job),
        "ranks": _gather(figures),
        "checkpoint": ckpt,
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda or "none"},
    }


def run_harness(scenario: Scenario | str | Path, plan: Plan | str, steps: int | None, warmup: int = 1, seed: int = 0,
                out: str | Path | None = None, memory_cap_gib: float | None = None,
                checkpoint_dir: str | Path | None = None, checkpoint: bool = True,
                budget: StepBudget | None = None, teardown: Teardown = "destroy") -> dict[str, Any]:
    """Initialise the process group from the torchrun environment, run the plan, write `out` on rank 0.

    teardown, for a process group this call started: "destroy" destroys it (a library call in a process that
    goes on); "leave" waits at a barrier after a successful run, so no rank exits while another still
    communicates, and leaves the group to the process's end (the command line, which exits by os._exit: `cli`
    says why)."""
    import torch
    import torch.distributed as dist

    scn = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    the_plan = plan if isinstance(plan, Plan) else parse_plan(plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if the_plan.world_size != world:  # fail before any rendezvous
        validate_plan(scn, the_plan, world)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        device, backend = pick_device()
        dist.init_process_group(backend, timeout=timedelta(seconds=SETUP_TIMEOUT_S),
                                device_id=device if device.type == "cuda" else None)
    finished = False
    try:
        result = run_plan(scn, the_plan, steps, warmup, seed, memory_cap_gib=memory_cap_gib,
                          checkpoint_dir=checkpoint_dir, checkpoint=checkpoint, budget=budget)
        if out is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            path = Path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            HarnessResult.model_validate(result)  # the schema every reader uses (stratagem.launch.harness.result)
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(path)
            if injected_fault(the_plan) == "exit-abort":
                EXIT_FAULTS.append("abort")
        finished = True
        return result
    finally:
        if own_group and dist.is_initialized():
            _end_group(teardown, finished)


def _end_group(teardown: Teardown, finished: bool) -> None:
    """End the process group run_harness started: destroy it, or (teardown "leave") only make every rank wait
    for the others after a successful run; a failed run leaves at once (its peers' collectives fail or time out
    as they would on a crash)."""
    import torch.distributed as dist

    if teardown == "destroy":
        dist.destroy_process_group()
    elif finished:
        dist.barrier()  # gloo's barrier also waits for this rank's earlier work (ProcessGroupGloo::barrier)
