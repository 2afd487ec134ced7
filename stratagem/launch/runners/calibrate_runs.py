"""A calibration's runs on this node and what they measured: `Runner` (the interface `run_calibration` takes),
`local_runner` (the plans of one world size in one launch of launch.local's gloo/NCCL ranks, each rank running
the harness's run_plan one plan after the other) and `device_facts` (GPU, driver and versions of this machine).

On CUDA a run's peak is the allocator's max reserved plus the context outside it (device memory in use minus
reserved, read after the run: CUDA context, NCCL buffers); on CPU the harness's tracked live-tensor peak.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.errors import StratagemError
from stratagem.evaluators.fit_hardware import HardwareRun
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["Runner", "local_runner", "device_facts"]


Runner = Callable[[Scenario, Sequence[Plan], int, int, float], list[HardwareRun]]
"""runner(scenario, plans, steps, warmup, deadline) -> one HardwareRun per plan, in order (all plans of one
world size in one launch; a plan not started by `deadline` (time.time()) is "skipped")."""


def _context_bytes() -> int:
    """Device memory in use outside the caching allocator (CUDA context, NCCL): 0 on CPU."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return max(0, int(total - free - torch.cuda.memory_reserved()))


def _rank_runs(rank: int, scenario: Scenario, plans: Sequence[Plan], steps: int, warmup: int,
               deadline: float) -> list[dict[str, Any]]:
    """On every rank: run `plans` one after the other (the harness's run_plan, no checkpoint timing)."""
    import torch
    import torch.distributed as dist

    from stratagem.launch.harness.run import pick_device, run_plan

    pick_device()
    out: list[dict[str, Any]] = []
    for plan in plans:
        go = [time.time() < deadline]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(go, src=0)  # every rank takes the same decision
        if not go[0]:
            out.append({"status": "skipped", "reason": "budget spent before the run started"})
            continue
        try:
            result = run_plan(scenario, plan, steps, warmup, 0, checkpoint=False)
            out.append({"status": "ok", "result": result if rank == 0 else None, "context": _context_bytes()})
        except torch.cuda.OutOfMemoryError as e:
            out.append({"status": "oom", "reason": str(e).splitlines()[0]})
        except StratagemError as e:
            out.append({"status": "infeasible", "reason": str(e)})
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def _measured(result: dict[str, Any], contexts: Sequence[int]) -> tuple[float, float]:
    """(step_s, peak GiB of the worst rank: reserved + context on CUDA, tracked peak on CPU)."""
    peaks = [r.get("peak_reserved_bytes", r["peak_bytes"]) + (contexts[i] if i < len(contexts) else 0)
             for i, r in enumerate(result["ranks"])]
    return float(result["step_s"]), max(peaks) / GIB


def local_runner(timeout_s: float = 900.0) -> Runner:
    """A Runner over launch.local.run_local: one launch of plan.world_size ranks per call."""

    def run(scenario: Scenario, plans: Sequence[Plan], steps: int, warmup: int, deadline: float) -> list[HardwareRun]:
        from stratagem.launch.runners.local import LocalRunError, run_local

        world = plans[0].world_size
        try:
            per_rank = run_local(_rank_runs, world, args=(scenario, list(plans), steps, warmup, deadline),
                                 timeout_s=timeout_s, pg_timeout_s=min(300.0, timeout_s))
        except LocalRunError as e:
            reason = str(e).strip().splitlines()[-1][:300]
            return [HardwareRun(plan=p, scenario=scenario, status="failed", reason=reason) for p in plans]
        runs = []
        for i, plan in enumerate(plans):
            entry = per_rank[0][i]
            if entry["status"] != "ok":
                runs.append(HardwareRun(plan=plan, scenario=scenario, status=entry["status"],
                                        reason=entry.get("reason", "")))
                continue
            step, peak = _measured(entry["result"], [r[i].get("context", 0) for r in per_rank])
            runs.append(HardwareRun(plan=plan, scenario=scenario, status="ok", step_s=step, peak_gib=peak,
                                    result=entry["result"]))
        return runs

    return run


def device_facts() -> dict[str, str]:
    """GPU name, driver, torch, CUDA and Python versions of this machine."""
    import torch

    facts = {"gpu_name": "cpu", "driver": "none", "torch": torch.__version__, "cuda": torch.version.cuda or "none",
             "python": platform.python_version()}
    if torch.cuda.is_available():
        facts["gpu_name"] = torch.cuda.get_device_name(0)
        facts["gpu_memory_gib"] = f"{torch.cuda.get_device_properties(0).total_memory / GIB:.1f}"
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=False)
            facts["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
        except (OSError, subprocess.SubprocessError):
            facts["driver"] = "unknown"
        hip = getattr(torch.version, "hip", None)
        if hip:
            facts["cuda"] = f"hip {hip}"
    return facts
