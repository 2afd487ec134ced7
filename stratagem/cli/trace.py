"""`stratagem trace`: one plan's per-rank memory traced in the harness's own training step on fake tensors."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from stratagem import quantities as q
from stratagem.cli.app import JsonOpt, PlanOpt, ScenarioArg, StorageOpt, StudyOpt, app, console
from stratagem.cli.plans import TrialOpt, pick_plan
from stratagem.spaces import format_plan
from stratagem.units import GIB

if TYPE_CHECKING:
    from stratagem.launch.trace.run import TracedRole

__all__ = ["trace_table", "TRACE_FORMAT"]

TRACE_FORMAT = "stratagem-trace/1"
"""The `format` of the JSON `stratagem trace -o` writes (stratagem.files recognises it as stratagem's)."""


_NAMES = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer", "activations": "activations",
          "rest": "rest / transient"}


def _signed(gib: float, unit: tuple[str, float]) -> str:
    """A difference in the table's unit with its sign (+0.250, -0.160, 0)."""
    text = q.memory_in(gib, unit)
    return f"+{text}" if gib > 0 else text


def trace_table(role: TracedRole) -> Table:
    """Traced vs analytic memory per block for one rank role, in one unit for the table (stratagem.quantities:
    the unit of the largest figure)."""
    from stratagem.launch.trace.fake import BLOCKS
    from stratagem.launch.trace.run import ANALYTIC_BLOCKS

    table = Table(title=f"{role.role} stage (rank {role.rank}, chunks {role.stage_ids})", title_justify="left")
    peak, apeak = role.peak_bytes / GIB, role.analytic["peak"] / GIB
    unit = q.memory_unit(peak, apeak, *(b / GIB for b in (*role.blocks.values(), *role.analytic.values())))
    for col in ("block", f"traced {unit[0]}", f"analytic {unit[0]}", f"difference {unit[0]}"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for block, analytic in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True):
        t, a = role.blocks[block] / GIB, role.analytic[analytic] / GIB
        table.add_row(_NAMES[block], q.memory_in(t, unit), q.memory_in(a, unit), _signed(t - a, unit))
    table.add_section()
    table.add_row("[bold]peak", f"[bold]{q.memory_in(peak, unit)}", f"[bold]{q.memory_in(apeak, unit)}",
                  _signed(peak - apeak, unit))
    table.add_row("overhead (analytic, not traced)", "", q.memory_in(role.analytic["overhead"] / GIB, unit), "")
    return table


def _summary(roles: list[TracedRole], hbm_gib: float, wall: float, cpu: float) -> list[str]:
    """The worst rank against HBM (one memory unit for the line) and the time the trace took (one duration
    unit for the line)."""
    worst = max(roles, key=lambda r: r.peak_bytes)
    peak, overhead = worst.peak_bytes / GIB, worst.analytic["overhead"] / GIB
    mem = q.memory_unit(peak, overhead, hbm_gib)
    secs = q.duration_unit(wall, cpu, *(r.cpu_seconds for r in roles))
    return [f"worst rank: {worst.role} stage, traced peak {q.memory_in(peak, mem, True)} (+ analytic overhead "
            f"{q.memory_in(overhead, mem, True)}) against {q.memory_in(hbm_gib, mem, True)} HBM",
            f"traced in {q.duration_in(wall, secs)} wall, {q.duration_in(cpu, secs)} CPU (roles: "
            + ", ".join(f"{r.role} {q.duration_in(r.cpu_seconds, secs)}" for r in roles) + ")"]


@app.command("trace")
def trace_cmd(
    scenario: ScenarioArg, plan: PlanOpt = None, as_json: JsonOpt = False,
    trial: TrialOpt = None, storage: StorageOpt = None, study: StudyOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write the traced roles as JSON "
                                                "(format stratagem-trace/1) to this file.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace -o even if stratagem did not write it.")] = False,
) -> None:
    """Trace one full training step of the plan's first, middle and last pipeline ranks at full size on fake
    tensors (the harness's own model, parallelism and optimizer; a fake process group of the plan's world
    size): the peak bytes split into weights, gradients, optimizer states, activations and the rest, beside
    the analytic prediction. Plans the harness cannot run are refused with its reason."""
    from rich.console import Console

    from stratagem.cli.calibrate import scenario_calibration
    from stratagem.files import check_owned, write_owned
    from stratagem.launch.trace.run import trace_plan

    if output is not None:
        check_owned(output, force, style="json")  # before the trace: a path it must not replace is refused now (its one line)
    picked = pick_plan("trace", scenario, plan, trial, storage, study)
    scn, pl = picked.scenario, picked.plan
    (Console(stderr=True) if as_json else console).print(picked.origin, markup=False, highlight=False,
                                                         soft_wrap=True)
    cal, _ = scenario_calibration(scn, None)  # the analytic side as `explain` predicts it: cluster.calibration
    start = time.perf_counter()
    roles = trace_plan(scn, pl, calibration=cal)
    wall = time.perf_counter() - start
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    if output is not None:
        doc = {"format": TRACE_FORMAT, "scenario": scn.name, "plan": format_plan(pl),
               "roles": [r.to_json() for r in roles]}
        write_owned(output, json.dumps(doc, indent=1) + "\n", force, style="json")
        Console(stderr=True).print(f"wrote {output}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps([r.to_json() for r in roles], indent=1))
        return
    console.print(f"[bold]{scn.name}[/bold]  plan: {pl.short()}  world size {pl.world_size}")
    for role in roles:
        console.print(trace_table(role))
    for line in _summary(roles, scn.cluster.gpu.hbm_gib, wall, cpu.ru_utime + cpu.ru_stime):
        console.print(line, markup=False, highlight=False)


