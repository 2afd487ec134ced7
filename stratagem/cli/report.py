"""`stratagem report` and `capacity`: a finished study rendered; capacity planning for a scenario."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from stratagem.cli.app import (
    RetryOpt,
    ScenarioArg,
    SearchedScenarioArg,
    StorageOpt,
    StudyOpt,
    app,
    console,
    study_location,
)
from stratagem.cli.calibrate import CalibrationOpt, scenario_calibration
from stratagem.errors import StratagemError
from stratagem.spaces import load_scenario

if TYPE_CHECKING:
    from stratagem.reports.capacity import CapacityInfo


@app.command("report")
def report_cmd(
    scenario: SearchedScenarioArg = None,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="The file: .html, .md, .json, .csv (default: "
                                              "STUDY.html beside SCENARIO, where search writes it; report.html "
                                              "here without SCENARIO).")]
    = None,
    fmt: Annotated[str | None, typer.Option("--format", "-f", help="html | md | json | csv (default: -o's suffix; "
                                            "without -o, md/json/csv go to stdout).")] = None,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Add capacity planning, e.g. 8,16,32.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace -o even if stratagem did not write it.")] = False,
    retry: RetryOpt = None,
) -> None:
    """Report a finished search: Pareto plots, front table, plan cards, explorer (HTML); Markdown; JSON/CSV."""
    from stratagem import reports
    from stratagem.search.view import StudyView

    kind = reports.output_format(output, fmt)
    url, name = study_location("report", scenario, storage, study)
    if output is None and kind == "html":  # where search writes it: STUDY.html beside the scenario
        output = scenario.parent / f"{name}.html" if scenario is not None else Path("report.html")
    if output is not None:
        reports.check_output(output, force=force)
    capacity = reports.parse_nodes(nodes) if nodes else None
    built = reports.build_report(StudyView.open(url, name).study, kind, capacity)
    err = Console(stderr=True)
    for note in built.notes:
        err.print(f"note: {note}", markup=False, soft_wrap=True)
    if output is None:
        sys.stdout.write(built.text)
        return
    reports.write_text_atomic(output, built.text, force, built.fmt)
    console.print(f"wrote {output} ({len(built.info.plans):,} distinct plans, {len(built.info.front):,} on the Pareto "
                  "front now)",
                  markup=False, soft_wrap=True)


@app.command("capacity")
def capacity_cmd(
    scenario: ScenarioArg,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Node counts, e.g. 8,16,32,64,128 "
                                              "(default: half, the same and twice the scenario's).")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write .md or .html.")] = None,
    calibration: CalibrationOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace -o even if stratagem did not write it.")] = False,
    price: Annotated[float | None, typer.Option("--price", min=0.0, help="USD per GPU-hour (default: the "
                                                "scenario's cluster.price_per_gpu_hour, else the GPU preset's).")] = None,
    days: Annotated[float | None, typer.Option("--days", help="The reverse question: the fewest GPUs that train "
                                               "in D days (sizes: --nodes, else 1, 2, 3, 4, 6, 8, 12, ... up to 1024 nodes, then the sizes "
                                               "between bisected).")] = None,
    budget: Annotated[float | None, typer.Option("--budget", help="The reverse question: the fastest size whose cost "
                                                 "stays within USD (sizes as for --days).")] = None,
) -> None:
    """Best plan, time, GPU-hours and cost to train the scenario's training_tokens at each cluster size."""
    from stratagem import reports

    scn = load_scenario(scenario)
    if price is not None:
        if not price < float("inf"):  # nan, inf
            raise StratagemError(f"--price ({price}): give USD per GPU-hour as a finite number >= 0, e.g. 2.5")
        scn = scn.model_copy(update={"cluster": scn.cluster.model_copy(update={"price_per_gpu_hour": price})})
    cal, cal_label = scenario_calibration(scn, calibration)
    kind = reports.output_format(output, None) if output is not None else None
    if output is not None and kind not in ("md", "html"):
        raise StratagemError(f"-o ({output}): capacity writes .md or .html")
    if output is not None:
        reports.check_output(output, force=force)
    for name, value in (("--days", days), ("--budget", budget)):
        if value is not None and not 0 < value < float("inf"):
            raise StratagemError(f"{name} ({value}): give a finite number > 0")
    if days is not None and budget is not None:
        raise StratagemError("--days and --budget: ask one question at a time")
    from stratagem.reports.capacity import pick_lines

    given = reports.parse_nodes(nodes) if nodes else None
    answer = ""
    if days is not None or budget is not None:
        cap, answer = reports.reverse_answer(scn, given, cal, days, budget)
    else:
        cap = reports.capacity_plan(scn, given or reports.default_nodes(scn), cal)
    console.print(f"calibration: {cal_label}", markup=False, highlight=False, soft_wrap=True)
    console.print(_capacity_table(cap))
    for line in pick_lines(cap):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if answer:
        console.print(answer, markup=False, highlight=False, soft_wrap=True)
    if output is not None:
        text = reports.capacity_markdown(cap, heading="#") if kind == "md" else reports.render_capacity_html(cap)
        reports.write_text_atomic(output, text, force, kind)
        console.print(f"wrote {output}", markup=False, soft_wrap=True)


def _capacity_table(cap: CapacityInfo) -> Table:
    """The capacity rows for the terminal: the chosen plan with its risk beside it (headroom, checkpoint loss:
    reports.capacity.risk_cells), then speed, time, GPU-hours and cost (stratagem.quantities: 3 significant
    figures, counts past a thousand with k/M/B)."""
    from rich.markup import escape

    from stratagem import quantities as q
    from stratagem.reports.capacity import RISK_NOTE, risk_cells

    scn = cap.scenario
    unit = q.memory_unit(scn.cluster.gpu.hbm_gib)
    table = Table(title=escape(f"Training {q.count(cap.training_tokens)} tokens of {scn.model.name} on "
                               f"{scn.cluster.gpu.name} at {q.money(cap.price_per_gpu_hour)} per GPU-hour"),
                  title_justify="left")
    for col in ("nodes", "GPUs", "best plan", f"headroom {unit[0]}", "ckpt loss", "tokens/s", "days", "GPU-h",
                "USD", "ckpt stall", "fail"):
        table.add_column(col, justify="left" if col == "best plan" else "right", no_wrap=col != "best plan",
                         overflow="fold")
    for r in cap.rows:
        if r.best is None or r.hours is None or r.days is None:
            table.add_row(str(r.num_nodes), str(r.num_gpus), f"[red]{escape(r.note)}", *[q.DASH] * 8)
            continue
        table.add_row(str(r.num_nodes), str(r.num_gpus), escape(r.best.label), *risk_cells(r, unit),
                      q.count(r.tokens_per_s), q.sig(r.days), q.count(r.gpu_hours), q.count(r.cost_usd),
                      q.percent(r.checkpoint_overhead), q.percent(r.failure_loss))
    table.caption = (f"{RISK_NOTE}. ckpt stall: time blocked saving checkpoints; fail: expected time lost to "
                     "failures (rework since the last checkpoint + restarts); ckpt loss = ckpt stall + fail. Days "
                     "include both.")
    return table
