"""`stratagem evaluate`, `explain` and `presets`: one plan judged by the analytic model; the presets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from stratagem import quantities as q
from stratagem.cli.app import JsonOpt, PlanOpt, ScenarioArg, StorageOpt, StudyOpt, app, console
from stratagem.cli.calibrate import CalibrationOpt, scenario_calibration
from stratagem.cli.plans import Picked, TrialOpt, pick_plan
from stratagem.errors import StratagemError
from stratagem.evaluators import BLOCKS, Calibration, Evaluation, TimeBreakdown, evaluate
from stratagem.evaluators.rate_tables import tables_summary
from stratagem.evaluators.step_parts import STEP_PARTS, before_overlap
from stratagem.evaluators.taught import taught_lines
from stratagem.evaluators.zones import bottleneck_label, placement_words
from stratagem.spaces import GPU_PRESETS, MODEL_PRESETS

__all__ = ["memory_table", "time_table", "say_origin"]


def _title(picked: Picked) -> str:
    """`scenario  plan: LABEL` (+ `trial #N` when the plan is a study's trial)."""
    trial = f"  trial #{picked.trial}" if picked.trial is not None else ""
    return f"[bold]{picked.scenario.name}[/bold]  plan: {picked.plan.short()}{trial}"


def say_origin(picked: Picked, as_json: bool) -> None:
    """The plan's origin line: on stdout beside a table, on stderr beside JSON (stdout stays parseable)."""
    from rich.console import Console

    (Console(stderr=True) if as_json else console).print(picked.origin, markup=False, highlight=False,
                                                          soft_wrap=True)


def memory_table(ev: Evaluation) -> Table:
    """The memory stack of the worst rank against HBM, in one unit for the column (stratagem.quantities: the
    unit of the largest figure, MiB for the CPU demo's 10 MiB workers), shares of HBM as percentages."""
    mem = ev.memory
    if mem is None:
        raise StratagemError(ev.reason)
    unit = q.memory_unit(mem.hbm_gib, mem.peak_gib, mem.headroom_gib)
    table = Table(title=f"Memory per GPU, stage {mem.worst_stage}", title_justify="left")
    table.add_column("block")
    table.add_column(unit[0], justify="right")
    table.add_column("share", justify="right")
    for b in BLOCKS:
        gib = mem.block_gib(b)
        marker = "  <- first to break" if b == mem.first_block_to_break else ""
        table.add_row(b + marker, q.memory_in(gib, unit), q.percent(gib / mem.hbm_gib))
    table.add_section()
    table.add_row("[bold]peak", f"[bold]{q.memory_in(mem.peak_gib, unit)}", q.percent(mem.peak_gib / mem.hbm_gib))
    table.add_row("HBM", q.memory_in(mem.hbm_gib, unit), q.percent(1.0))
    style = "green" if mem.headroom_gib >= 0 else "red"
    table.add_row(f"[{style}]headroom", f"[{style}]{q.memory_in(mem.headroom_gib, unit)}",
                  q.percent(mem.headroom_fraction))
    return table


def time_table(tm: TimeBreakdown) -> Table:
    """The step time by term (evaluators.step_parts: every term, the exposed communication of each group) in one
    duration unit for the column and the title (stratagem.quantities: ms for the CPU demo's 0.3 s steps), shares
    of the step as percentages; below, each group's traffic before overlap where overlap hid some of it."""
    terms = {p.label: float(getattr(tm, p.name)) for p in STEP_PARTS if p.term}
    traffic = {f"{p.group} traffic before overlap": float(before_overlap(tm.model_dump(), p.name))
               for p in STEP_PARTS if p.meaning == "exposed" and p.hidden and getattr(tm, p.hidden) > 0}
    unit = q.duration_unit(tm.step_s, *traffic.values())
    times = Table(title=f"Step time: {q.duration_in(tm.step_s, unit)}", title_justify="left")
    times.add_column("part")
    times.add_column(unit[0], justify="right")
    times.add_column("share", justify="right")
    for name, sec in terms.items():
        if sec > 0.0005 * tm.step_s:
            times.add_row(name, q.duration_in(sec, unit, with_unit=False), q.percent(sec / tm.step_s))
    if traffic:
        times.add_section()
    for name, sec in traffic.items():
        times.add_row(name, q.duration_in(sec, unit, with_unit=False), "")
    return times


def _judge(command: str, scenario: Path, plan: str | None, trial: int | None, storage: str | None,
           study: str | None, as_json: bool, calibration: Path | None) -> tuple[Picked, Calibration | None, str, Evaluation]:
    """The plan a command judges (said where it came from), the calibration in force and its label, and the
    plan's evaluation with that calibration recorded in its provenance."""
    picked = pick_plan(command, scenario, plan, trial, storage, study)
    say_origin(picked, as_json)
    cal, cal_label = scenario_calibration(picked.scenario, calibration)
    ev = evaluate(picked.scenario, picked.plan, cal).model_copy(update={"provenance": {"calibration": cal_label}})
    return picked, cal, cal_label, ev


@app.command("evaluate")
def evaluate_cmd(scenario: ScenarioArg, plan: PlanOpt = None, trial: TrialOpt = None, storage: StorageOpt = None,
                 study: StudyOpt = None, as_json: JsonOpt = False,
                 calibration: CalibrationOpt = None) -> None:
    """Judge one plan: the memory stack per GPU against HBM and the block that breaks first."""
    picked, _, cal_label, ev = _judge("evaluate", scenario, plan, trial, storage, study, as_json, calibration)
    if as_json:
        print(ev.model_dump_json(indent=2))
        return
    console.print(_title(picked))
    console.print(f"calibration: {cal_label}", markup=False, highlight=False, soft_wrap=True)
    if ev.status == "infeasible":
        raise StratagemError(ev.reason)
    console.print(memory_table(ev))
    verdict = "[green]fits" if ev.status == "ok" else f"[red]OOM: {ev.reason}"
    console.print(verdict)


PresetsJsonOpt = Annotated[bool, typer.Option("--json", help="Print every model and GPU preset as JSON.")]


@app.command("presets")
def presets_cmd(as_json: PresetsJsonOpt = False) -> None:
    """List the model and GPU presets."""
    if as_json:
        print(json.dumps({
            "models": {k: m.model_dump(mode="json") for k, m in MODEL_PRESETS.items()},
            "gpus": {k: g.model_dump(mode="json") for k, g in GPU_PRESETS.items()},
        }, indent=2))
        return
    models = Table(title="Models", title_justify="left", collapse_padding=True, pad_edge=False)
    longest = max(len(m.name) for m in MODEL_PRESETS.values())  # names are what --model takes: never cut them
    for col in ("name", "params", "layers", "hidden", "heads/kv", "ffn", "vocab", "moe"):
        models.add_column(col, justify="left" if col == "name" else "right", no_wrap=col == "name",
                          min_width=longest if col == "name" else None, overflow="fold")
    for m in MODEL_PRESETS.values():
        moe = f"{m.moe.num_experts}x top{m.moe.top_k}" if m.moe else "-"
        models.add_row(m.name, q.count(m.num_params()), str(m.num_layers), str(m.hidden_size),
                       f"{m.num_attention_heads}/{m.kv_heads}", str(m.ffn_hidden_size), str(m.vocab_size), moe)
    unit = q.memory_unit(*(g.hbm_gib for g in GPU_PRESETS.values()))  # one unit for the column
    gpus = Table(title="GPUs", title_justify="left")
    widest = max(len(g.name) for g in GPU_PRESETS.values())
    for col in ("name", f"HBM {unit[0]}", "bf16 TF/s", "fp8 TF/s", "HBM TB/s"):
        gpus.add_column(col, justify="left" if col == "name" else "right", no_wrap=col == "name",
                        min_width=widest if col == "name" else None, overflow="fold")
    for g in GPU_PRESETS.values():
        gpus.add_row(g.name, q.memory_in(g.hbm_gib, unit), q.sig(g.peak_tflops_bf16),
                     q.sig(g.peak_tflops_fp8) if g.peak_tflops_fp8 else "-", q.sig(g.hbm_tbps))
    console.print(models)
    console.print(gpus)


@app.command("explain")
def explain_cmd(scenario: ScenarioArg, plan: PlanOpt = None, trial: TrialOpt = None, storage: StorageOpt = None,
                 study: StudyOpt = None, as_json: JsonOpt = False,
                 calibration: CalibrationOpt = None) -> None:
    """Explain one plan: memory stack, step time by part, the four zones, the bottleneck and advice."""
    from stratagem.evaluators import advise

    picked, cal, cal_label, ev = _judge("explain", scenario, plan, trial, storage, study, as_json, calibration)
    scn, pl = picked.scenario, picked.plan
    if ev.status == "infeasible":
        raise StratagemError(ev.reason)
    advice = advise(scn, pl, ev, cal)
    taught = taught_lines(cal, scn.cluster.gpu.name)  # what a study's runs taught per term (evaluators.taught)
    tables = cal.rate_tables if cal is not None else None  # measured collective / GEMM rates (evaluators.rate_tables)
    taught += [f"measured tables ({tables.source}):", *(f"  {line}" for line in tables_summary(tables))] if tables else []
    if as_json:
        print(json.dumps({"evaluation": ev.model_dump(mode="json"), "calibration": cal_label, "taught": taught,
                          "advice": [a.model_dump(mode="json") for a in advice]}, indent=2))
        return
    assert ev.time is not None and ev.throughput is not None and ev.zones is not None  # set for feasible plans
    tm, tp, zones = ev.time, ev.throughput, ev.zones
    console.print(_title(picked))
    console.print(f"calibration: {cal_label}", markup=False, highlight=False, soft_wrap=True)
    for line in taught:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(memory_table(ev))
    console.print(time_table(tm))
    groups = placement_words(scn, pl)  # where each parallel group sits (evaluators.zones.group_placement)
    console.print("groups: " + ("; ".join(groups) if groups else "one GPU per replica, no model-parallel group"),
                  highlight=False)
    from stratagem.evaluators.timing import speed_rows  # every factor that scales compute, with its source

    speed = Table(title="Speed factors (scale compute)", title_justify="left")
    for col in ("factor", "value", "source"):
        speed.add_column(col, overflow="fold")
    for row in speed_rows(scn, pl, cal):
        speed.add_row(*row)
    console.print(speed)
    console.print(f"{q.sig(tp.tokens_per_s)} tokens/s ({q.sig(tp.tokens_per_s_per_gpu)} per GPU), "
                  f"MFU {q.percent(tp.mfu)} (of the dense bf16 peak)")
    colour = {"ok": "green", "warn": "yellow", "bad": "red"}
    ztable = Table(title="Zones", title_justify="left", show_lines=False)
    for col in ("zone", "level", "value", "diagnosis"):
        ztable.add_column(col, justify="right" if col == "value" else "left", overflow="fold")
    for z in (zones.hbm, zones.communication, zones.bubbles, zones.checkpoint):
        c = colour[z.level]
        ztable.add_row(z.name, f"[{c}]{z.level}", q.percent(z.value), z.sentence)  # each value a fraction
    console.print(ztable)
    console.print(f"bottleneck: [bold]{bottleneck_label(zones)}[/bold]")
    if not advice:
        console.print("advice: none; no neighbouring plan improves a zone that needs it")
    for i, a in enumerate(advice, 1):
        console.print(f"{i}. [{a.zone}] {a.effect}\n   {a.rationale}", highlight=False)
