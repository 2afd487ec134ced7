"""`stratagem export` and `reproduce`: a plan as files another stack runs; a measured trial rerun."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

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
    study_location,
)
from stratagem.cli.plans import pick_plan
from stratagem.errors import StratagemError
from stratagem.evaluators import Evaluation, evaluate
from stratagem.quantities import percent

if TYPE_CHECKING:
    from stratagem.launch.export import ExportBundle
    from stratagem.search.view import StudyView
    from stratagem.spaces.plan import Plan
    from stratagem.spaces.scenario import Scenario


def _existing_view(path: Path | None, storage: str | None, study: str | None) -> StudyView | None:
    """The study by the one default rule (cli/app.study_location), or None when neither --storage nor --study
    was given and the scenario's default storage does not hold its study (no search ran yet)."""
    from stratagem.search.storage import open_storage, parse_storage, study_names
    from stratagem.search.view import StudyView

    url, name = study_location("export", path, storage, study)
    if storage is None and study is None:
        spec = parse_storage(url)
        if spec.path is not None and not spec.path.exists():
            return None
        if name not in study_names(open_storage(spec, write=False)):
            return None
    return StudyView.open(url, name)


@app.command("export")
def export_cmd(
    to: Annotated[str, typer.Option("--to", help="torchrun | torchtitan | deepspeed | megatron | automodel.")],
    searched: SearchedScenarioArg = None,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    trial: Annotated[int | None, typer.Option("--trial", help="Export this trial (its number, the `#` search, "
                                              "report and status print).")] = None,
    best: Annotated[str | None, typer.Option("--best", help="tokens | headroom | risk: the best feasible trial by "
                                             "that objective, measured runs first (tokens: the best measured "
                                             "plan, pooled over its runs).")] = None,
    scenario: Annotated[Path | None, typer.Option("--scenario", help="The scenario YAML (same as the SCENARIO "
                                                  "argument).")] = None,
    plan: PlanOpt = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes to launch on (default: the scenario's).")] = None,
    steps: Annotated[int | None, typer.Option("--steps", help="Optimizer steps of the exported run (default: a "
                                              "throughput check: torchrun the measured trial's timed steps, else "
                                              "20; the engines 10 warm-up + 40 timed = 50, every step logged, no "
                                              "checkpoint; the full run's count in a comment; the full run's count "
                                              "itself exports the full run, saving).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="torchrun: harness seed (default: the trial's, else 0).")]
    = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the files into this directory "
                                                "(created); default: print them.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace files in -o even if stratagem did not write "
                                        "them.")] = False,
) -> None:
    """Export a plan: torchrun + stratagem's harness, a torchtitan TOML, a DeepSpeed JSON, Megatron-LM args or a
    NeMo Automodel YAML.
    Which plan: --plan over the scenario's plan: section; --trial N or --best from the study; with none of them
    the study's best plan (as --best tokens), or the scenario's plan when no search has stored a study. One line
    on stderr says which."""
    from stratagem.launch.export import export_plan, write_bundle

    _check_export_args(steps, output, scenario, searched)
    path = scenario or searched
    err = Console(stderr=True)
    if plan is not None:
        picked = _given_plan(path, plan, trial, best)
    else:
        picked = _study_plan(path, storage, study, trial, best, err)
    if steps is None and to == "torchrun":
        steps = picked.run_steps
    bundle = export_plan(picked.scenario, picked.plan, to, nodes, evaluation=picked.evaluation, steps=steps,
                         seed=seed if seed is not None else (picked.run_seed if picked.run_seed is not None else 0),
                         source=picked.source, warmup=picked.run_warmup)
    # said after the files are written: a refused -o is the one line of a failed export
    written = write_bundle(bundle, output, force) if output is not None else []
    _tell(err, picked.which, bundle, to)
    if output is None:
        for rel, text in bundle.files.items():
            sys.stdout.write(f"==> {rel} <==\n{text}" + ("" if text.endswith("\n") else "\n"))
        return
    err.print(f"wrote {', '.join(str(p) for p in written)} ({picked.source})", markup=False, soft_wrap=True)


def _check_export_args(steps: int | None, output: Path | None, scenario: Path | None,
                       searched: Path | None) -> None:
    """Refuse --steps below 1, an -o that is not a directory (or reached through a link) and two different
    scenarios, before any study is opened."""
    if steps is not None and steps < 1:
        raise StratagemError(f"--steps ({steps}): must be at least 1 (the harness times that many steps)")
    if output is not None:  # refused now, before a study is opened (stratagem.files: no path through a link)
        from stratagem.files import check_dir

        if output.exists() and not output.is_dir():
            raise StratagemError(f"-o ({output}): exists and is not a directory")
        if output.is_dir():
            check_dir(output, output, "-o")
    if scenario is not None and searched is not None and scenario != searched:
        raise StratagemError("--scenario: give the scenario once (SCENARIO or --scenario)")


@dataclass(frozen=True)
class _Picked:
    """The plan to export, where it comes from, and the measured run's settings when it is a trial."""

    scenario: Scenario
    """The scenario the plan runs in."""
    plan: Plan
    """The plan exported."""
    evaluation: Evaluation | None
    """Its evaluation (the trial's, else the analytic one)."""
    source: str
    """Where the plan comes from, as the bundle's comments and the `wrote` line name it."""
    which: str
    """The stderr line that says which plan is exported."""
    run_steps: int | None = None
    """The measured trial's timed steps (torchrun's default --steps); None for a plan not from a trial."""
    run_seed: int | None = None
    """The measured trial's seed (the default --seed); None for a plan not from a trial."""
    run_warmup: int | None = None
    """The measured trial's warm-up steps; None for a plan not from a trial."""


def _given_plan(path: Path | None, plan: str, trial: int | None, best: str | None) -> _Picked:
    """--plan over the scenario's plan: section (alone: not with --trial or --best)."""
    if trial is not None or best is not None:
        raise StratagemError("--plan: give one of --plan, --trial, --best")
    if path is None:
        raise StratagemError("--plan: needs the scenario (stratagem export SCENARIO.yaml --plan ...)")
    picked = pick_plan("export", path, plan)
    return _Picked(picked.scenario, picked.plan, evaluate(picked.scenario, picked.plan), f"scenario {path}",
                   picked.origin)


def _study_plan(path: Path | None, storage: str | None, study: str | None, trial: int | None, best: str | None,
                err: Console) -> _Picked:
    """--trial N or --best from the study (it must exist); with neither, the study's best plan when a search
    stored the study, else the scenario's plan. A note on stderr when the study's search did not finish."""
    from stratagem.launch.export import choose_trial
    from stratagem.search.view import StudyView

    view = (StudyView.open(*study_location("export", path, storage, study)) if trial is not None
            or best is not None else _existing_view(path, storage, study))
    if view is None:
        assert path is not None  # study_location refused a missing scenario and storage
        picked = pick_plan("export", path, None)
        pl = picked.plan
        ev = evaluate(picked.scenario, pl)
        url, name = study_location("export", path, storage, study)
        return _Picked(picked.scenario, pl, ev, f"scenario {path}",
                       f"exporting the scenario's plan {pl.short()}: no study {name} in {url} (run stratagem search "
                       f"{path} first to export its best plan)")
    from stratagem import reports

    note = reports.unfinished_note(view.study)
    if note:
        err.print(f"note: {note}", markup=False, soft_wrap=True)
    chosen = choose_trial(view.study, trial, best)
    pl = chosen.plan
    which = (f"exporting trial #{chosen.trial}: {pl.short()}" if trial is not None else
             f"exporting the study's best plan (--best {best or 'tokens'}), trial #{chosen.trial}: "
             f"{pl.short()}; {chosen.why}")
    return _Picked(chosen.scenario, pl, chosen.evaluation, chosen.source, which, chosen.steps, chosen.seed,
                   chosen.warmup)


def _tell(err: Console, which: str, bundle: ExportBundle, to: str) -> None:
    """On stderr: which plan is exported, and how many of its fields the target cannot express or approximates."""
    err.print(which, markup=False, highlight=False, soft_wrap=True)
    if bundle.notes:
        fields = ", ".join(dict.fromkeys(n.field for n in bundle.notes))
        err.print(f"{to}: {len(bundle.unexpressed)} field(s) not expressible, {len(bundle.approximated)} "
                  f"approximated ({fields}); see the comments in {bundle.main}", markup=False, soft_wrap=True)


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
    and losses with its record (all runs of the plan pooled). Exit 0 reproduced, 1 not reproduced (differences
    beyond the run-to-run noise, or the rerun ended oom/failed/timeout), 3 the environment differs so the
    comparison is meaningless, 4 an infrastructure error (Ray did not start or lost the rerun: no verdict)."""
    from stratagem.launch.reproduce import RerunNotStarted, reproduce_trial
    from stratagem.search.view import StudyView

    view = StudyView.open(*study_location("reproduce", searched, storage, study))
    try:
        rep = reproduce_trial(view.study, trial, result_file=result, address=ray_address)
    except RerunNotStarted as e:
        Console(stderr=True).print(f"infrastructure error, no verdict: {e}", markup=False, soft_wrap=True)
        raise typer.Exit(4) from None
    record = f" (its plan's record: trial #{rep.record})" if rep.record not in (-1, rep.trial) else ""
    console.print(f"[bold]trial #{rep.trial}[/bold]{record}  plan: {rep.plan}  logs: {rep.log_dir}")
    if rep.rerun:
        console.print(f"the rerun ended {rep.rerun}", markup=False)
        console.print("[red]not reproduced")
        raise typer.Exit(1)
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
        table.add_row(row.metric, row.band("recorded"), row.band("now"), ("+" if row.rel_diff >= 0 else "") + percent(row.rel_diff),
                      row.noise_text, flag)
    console.print(table)
    if rep.noise_note:
        console.print(rep.noise_note, markup=False)
    if rep.load_note:
        console.print(rep.load_note, markup=False)
    console.print("losses: " + ("[green]identical trajectory" if rep.losses_match else "[red]differ"))
    console.print("[green]reproduced" if rep.reproduced else "[red]not reproduced")
    if not rep.reproduced:
        raise typer.Exit(1)
