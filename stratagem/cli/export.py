"""`stratagem export` and `reproduce`: a plan as files another stack runs; a measured trial rerun."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from stratagem.cli.app import (
    PlanOpt,
    RetryOpt,
    SearchedScenarioArg,
    StorageOpt,
    StudyOpt,
    app,
    console,
    scenario_and_plan,
    study_location,
)
from stratagem.errors import StratagemError
from stratagem.evaluators import Evaluation, evaluate


@app.command("export")
def export_cmd(
    to: Annotated[str, typer.Option("--to", help="torchrun | torchtitan | deepspeed | megatron.")],
    searched: SearchedScenarioArg = None,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    trial: Annotated[int | None, typer.Option("--trial", help="Export this trial (its number).")] = None,
    best: Annotated[str | None, typer.Option("--best", help="tokens | headroom | risk: the best feasible trial by "
                                             "that objective, measured runs first (default: tokens).")] = None,
    scenario: Annotated[Path | None, typer.Option("--scenario", help="Export from a scenario YAML instead of a "
                                                  "study (with --plan).")] = None,
    plan: PlanOpt = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes to launch on (default: the scenario's).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="torchrun: harness steps (default: the measured "
                                              "trial's, else 20).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="torchrun: harness seed (default: the trial's, else 0).")]
    = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the files into this directory "
                                                "(created); default: print them.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace files in -o even if stratagem did not write "
                                        "them.")] = False,
) -> None:
    """Export a plan: torchrun + stratagem's harness, a torchtitan TOML, a DeepSpeed JSON or Megatron-LM args."""
    from stratagem.launch.export import choose_trial, export_plan, write_bundle

    if steps is not None and steps < 1:
        raise StratagemError(f"--steps ({steps}): must be at least 1 (the harness times that many steps)")
    if output is not None:  # refused now, before a study is opened (stratagem.files: no path through a link)
        from stratagem.files import check_dir

        if output.exists() and not output.is_dir():
            raise StratagemError(f"-o ({output}): exists and is not a directory")
        if output.is_dir():
            check_dir(output, output, "-o")
    if scenario is not None:
        if (searched is not None or storage is not None or study is not None or trial is not None
                or best is not None):
            raise StratagemError("--scenario: give either --scenario [--plan] or a searched study (SCENARIO or "
                                 "--storage/--study) [--trial|--best]")
        scn, pl = scenario_and_plan(scenario, plan)
        ev: Evaluation | None = evaluate(scn, pl)
        source, run_steps, run_seed, run_warmup = f"scenario {scenario}", None, None, None
    else:
        if plan is not None:
            raise StratagemError("--plan: only with --scenario; pick a study's trial with --trial or --best")
        from stratagem import reports
        from stratagem.search.view import StudyView

        opened = StudyView.open(*study_location("export", searched, storage, study)).study
        note = reports.unfinished_note(opened)
        if note:
            Console(stderr=True).print(f"note: {note}", markup=False, soft_wrap=True)
        chosen = choose_trial(opened, trial, best)
        scn, pl, ev, source = chosen.scenario, chosen.plan, chosen.evaluation, chosen.source
        run_steps, run_seed, run_warmup = chosen.steps, chosen.seed, chosen.warmup
    bundle = export_plan(scn, pl, to, nodes, evaluation=ev, steps=steps or run_steps or 20,
                         seed=seed if seed is not None else (run_seed if run_seed is not None else 0), source=source,
                         warmup=run_warmup)
    err = Console(stderr=True)
    if bundle.notes:
        fields = ", ".join(dict.fromkeys(n.field for n in bundle.notes))
        err.print(f"{to}: {len(bundle.unexpressed)} field(s) not expressible, {len(bundle.approximated)} "
                  f"approximated ({fields}); see the comments in {bundle.main}", markup=False, soft_wrap=True)
    if output is None:
        for rel, text in bundle.files.items():
            sys.stdout.write(f"==> {rel} <==\n{text}" + ("" if text.endswith("\n") else "\n"))
        return
    written = write_bundle(bundle, output, force)
    err.print(f"wrote {', '.join(str(p) for p in written)} ({source})", markup=False, soft_wrap=True)


@app.command("reproduce")
def reproduce_cmd(
    trial: Annotated[int, typer.Option("--trial", help="Number of the measured trial to reproduce.")],
    searched: SearchedScenarioArg = None,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    result: Annotated[Path | None, typer.Option(
        "--result", help="Compare this harness result JSON (e.g. from the exported torchrun command) "
                         "instead of rerunning through Ray.")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join a running Ray cluster.")] = None,
    retry: RetryOpt = None,
) -> None:
    """Rerun a measured trial with the same harness, plan and seed; compare tokens/s, step time, peak memory
    and losses with the record. Exit 0 reproduced, 1 differences beyond the original run's noise, 3 the
    environment differs so the comparison is meaningless."""
    from stratagem.launch.reproduce import reproduce_trial
    from stratagem.search.view import StudyView

    view = StudyView.open(*study_location("reproduce", searched, storage, study))
    rep = reproduce_trial(view.study, trial, result_file=result, address=ray_address)
    console.print(f"[bold]trial {rep.trial}[/bold]  plan: {rep.plan}  logs: {rep.log_dir}")
    if rep.environment:
        for line in rep.environment:
            console.print(f"[red]environment differs[/red] {line}")
        console.print("[red]not comparable[/red]: rerun on the recorded environment")
        raise typer.Exit(3)
    table = Table(title="Recorded vs now", title_justify="left")
    for col in ("metric", "recorded", "now", "diff", "noise", ""):
        table.add_column(col, justify="left" if col in ("metric", "") else "right")
    for row in rep.rows:
        flag = "[red]beyond noise" if row.flagged else "[green]ok"
        # step time / tokens/s: median (95 % interval, steps); the band is where the intervals still overlap
        table.add_row(row.metric, row.band("recorded"), row.band("now"), f"{row.rel_diff:+.1%}",
                      f"±{row.threshold:.1%}", flag)
    console.print(table)
    if rep.load_note:
        console.print(rep.load_note, markup=False)
    console.print("losses: " + ("[green]identical trajectory" if rep.losses_match else "[red]differ"))
    console.print("[green]reproduced" if rep.reproduced else "[red]not reproduced")
    if not rep.reproduced:
        raise typer.Exit(1)
