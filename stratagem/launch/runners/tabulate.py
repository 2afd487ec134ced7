"""Measure plans of a small scenario for a tabular benchmark (bench/measure_table.py, bench/search_regret.py --table).

`measure_plans(scenario, plans, ...)` runs the plans of one world size one after the other in local launches
(gloo on CPU, `launch.local.run_local`), each with the harness's own `run_plan`, and returns one outcome per
plan: ok (tokens/s per GPU, peak tracked memory of the worst rank, the timed steps and their spread, the host's
load when the timed steps began and ended, the plan's wall time in the launch), oom (the memory cap tripped on every rank
together: `MemoryCapExceeded` is collective) or failed (any other error: the launch is then retried plan by
plan so one broken plan does not take its neighbours' results with it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from stratagem.launch.harness.budget import StepBudget
from stratagem.spaces.plan import Plan, format_plan
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["measure_plans", "rank_measure"]


def rank_measure(rank: int, scenario: Scenario, plans: Sequence[Plan], steps: int, warmup: int,
                 cap_gib: float | None, budget: StepBudget | None = None) -> list[dict[str, Any]]:
    """On one rank: run each plan (`steps` timed steps, or as many as `budget` buys); its outcome (identical
    on every rank for ok and oom), with the timed steps' spread (step_spread: a StepSpread dump)."""
    from stratagem.launch.harness.memtrack import MemoryCapExceeded
    from stratagem.launch.harness.run import run_plan

    out: list[dict[str, Any]] = []
    for plan in plans:
        start = time.perf_counter()
        try:
            r = run_plan(scenario, plan, None if budget is not None else steps, warmup, seed=0,
                         memory_cap_gib=cap_gib, checkpoint=False, budget=budget)
        except MemoryCapExceeded as e:
            out.append({"plan": format_plan(plan), "status": "oom", "reason": str(e),
                        "wall_s": time.perf_counter() - start})
            continue
        peak = max(x.get("peak_bytes", 0) for x in r["ranks"]) / GIB
        out.append({"plan": format_plan(plan), "status": "ok", "peak_gib": peak,
                    "tokens_per_s_per_gpu": r["tokens_per_s"] / r["world_size"], "step_times_s": r["step_times_s"],
                    "step_spread": r["step_spread"], "host_load": r["host_load"], "steps": r["steps"],
                    "wall_s": time.perf_counter() - start, "versions": r["versions"], "device": r["device"]})
    return out


def measure_plans(scenario: Scenario, plans: Sequence[Plan], steps: int = 4, warmup: int = 1,
                  cap_gib: float | None = None, chunk: int = 12, timeout_s: float = 600.0,
                  budget: StepBudget | None = None) -> list[dict[str, Any]]:
    """Outcomes of `plans` (one world size), in order; see the module docstring. With `budget` the timed
    steps come from it (harness.budget; warmup >= 1) instead of `steps`."""
    from stratagem.launch.runners.local import LocalRunError, run_local

    worlds = {p.world_size for p in plans}
    if len(worlds) != 1:
        raise ValueError(f"plans of one call must share a world size; got {sorted(worlds)}")
    world = worlds.pop()
    results: list[dict[str, Any]] = []
    for i in range(0, len(plans), chunk):
        part = list(plans[i:i + chunk])
        try:
            results += run_local(rank_measure, world, (scenario, part, steps, warmup, cap_gib, budget), timeout_s)[0]
        except LocalRunError:
            for plan in part:  # one at a time, so a failing plan is named and the others still count
                try:
                    results += run_local(rank_measure, world, (scenario, [plan], steps, warmup, cap_gib, budget),
                                         timeout_s)[0]
                except LocalRunError as e:
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    results.append({"plan": format_plan(plan), "status": "failed", "reason": last[:300]})
    return results
