"""`stratagem trace`: one plan's per-rank memory traced in the harness's own training step on fake tensors."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from stratagem.cli.app import JsonOpt, PlanOpt, ScenarioArg, StorageOpt, StudyOpt, app, console
from stratagem.cli.plans import TrialOpt, pick_plan
from stratagem.spaces import format_plan
from stratagem.units import GIB

if TYPE_CHECKING:
    from stratagem.evaluators import Calibration, Evaluation
    from stratagem.launch.trace.run import TracedRole
    from stratagem.search.screening import Mode
    from stratagem.search.traced import TracedResult
    from stratagem.spaces import Scenario

__all__ = ["trace_table", "traced_phase", "TRACE_FORMAT"]

TRACE_FORMAT = "stratagem-trace/1"
"""The `format` of the JSON `stratagem trace -o` writes (stratagem.files recognises it as stratagem's)."""


_NAMES = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer", "activations": "activations",
          "rest": "rest / transient"}


def trace_table(role: TracedRole) -> Table:
    """Traced vs analytic memory per block for one rank role (GiB, or MiB below 1 GiB)."""
    from stratagem.launch.trace.fake import BLOCKS
    from stratagem.launch.trace.run import ANALYTIC_BLOCKS

    table = Table(title=f"{role.role} stage (rank {role.rank}, chunks {role.stage_ids})", title_justify="left")
    unit, scale = ("GiB", GIB) if role.peak_bytes >= GIB else ("MiB", float(2**20))
    for col in ("block", f"traced {unit}", f"analytic {unit}", "difference"):
        table.add_column(col, justify="left" if col == "block" else "right")
    for block, analytic in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True):
        t, a = role.blocks[block] / scale, role.analytic[analytic] / scale
        table.add_row(_NAMES[block], f"{t:.2f}", f"{a:.2f}", f"{t - a:+.2f}")
    table.add_section()
    peak, apeak = role.peak_bytes / scale, role.analytic["peak"] / scale
    table.add_row("[bold]peak", f"[bold]{peak:.2f}", f"[bold]{apeak:.2f}", f"{peak - apeak:+.2f}")
    table.add_row("overhead (analytic, not traced)", "", f"{role.analytic['overhead'] / scale:.2f}", "")
    return table


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

    from stratagem.files import check_owned, write_owned
    from stratagem.launch.trace.run import trace_plan

    if output is not None:
        check_owned(output, force)  # before the trace: a path it must not replace is refused now (its one line)
    picked = pick_plan("trace", scenario, plan, trial, storage, study)
    scn, pl = picked.scenario, picked.plan
    (Console(stderr=True) if as_json else console).print(picked.origin, markup=False, highlight=False,
                                                         soft_wrap=True)
    start = time.perf_counter()
    roles = trace_plan(scn, pl)
    wall = time.perf_counter() - start
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    if output is not None:
        doc = {"format": TRACE_FORMAT, "scenario": scn.name, "plan": format_plan(pl),
               "roles": [r.to_json() for r in roles]}
        write_owned(output, json.dumps(doc, indent=1) + "\n", force)
        Console(stderr=True).print(f"wrote {output}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps([r.to_json() for r in roles], indent=1))
        return
    console.print(f"[bold]{scn.name}[/bold]  plan: {pl.short()}  world size {pl.world_size}")
    for role in roles:
        console.print(trace_table(role))
    worst = max(roles, key=lambda r: r.peak_bytes)
    console.print(f"worst rank: {worst.role} stage, traced peak {worst.peak_bytes / GIB:.2f} GiB (+ analytic "
                  f"overhead {worst.analytic['overhead'] / GIB:.2f} GiB) against {scn.cluster.gpu.hbm_gib:g} GiB HBM",
                  markup=False)
    console.print(f"traced in {wall:.1f} s wall, {cpu.ru_utime + cpu.ru_stime:.1f} s CPU (roles: "
                  + ", ".join(f"{r.role} {r.cpu_seconds:.1f} s" for r in roles) + ")", markup=False)


def traced_phase(scn: Scenario, url: str, name: str, mode: Mode, traced: int, calibration: Calibration | None,
                 quiet: bool) -> TracedResult:
    """`stratagem search --traced K`: the analytic search, then up to K traced trials (one line each)."""
    from rich.console import Console

    from stratagem.launch.trace.run import trace_plan
    from stratagem.search.traced import run_traced

    out = Console(stderr=True) if quiet else console

    def on_trace(key: str, ev: Evaluation | None, reason: str) -> None:
        if ev is None or ev.memory is None:
            out.print(f"traced {key}: not traced: {reason}", markup=False, soft_wrap=True)
            return
        predicted = ev.prediction.memory.peak_gib if ev.prediction and ev.prediction.memory else float("nan")
        out.print(f"traced {key}: peak {ev.memory.peak_gib:.2f} GiB (analytic {predicted:.2f}), {ev.status}",
                  markup=False, soft_wrap=True)

    result = run_traced(scn, url, name, trace_plan, traced, sampler=mode, on_trace=on_trace,
                        calibration=calibration)
    out.print(f"traced {result.traced} plan(s) in {result.seconds:.0f} s; logits_bytes refitted to "
              f"{result.calibration.logits_bytes:.2f}", markup=False)
    return result
