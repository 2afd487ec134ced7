"""The `stratagem` command line (typer + rich). User mistakes exit 2 with one line; never a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from stratagem.errors import StratagemError
from stratagem.evaluators import BLOCKS, Evaluation, evaluate
from stratagem.spaces import GPU_PRESETS, MODEL_PRESETS, Plan, Scenario, load_scenario, parse_plan

if TYPE_CHECKING:
    from stratagem.search.screening import Mode

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find how to train a large model on a given cluster.",
    pretty_exceptions_enable=False,
)
console = Console()

ScenarioArg = Annotated[Path, typer.Argument(help="Scenario YAML (model, cluster, training[, plan]).")]
PlanOpt = Annotated[
    str | None, typer.Option("--plan", "-p", help="Plan as key=value pairs, e.g. dp=8,tp=2,zero=1,mbs=2.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the Evaluation as JSON.")]


def scenario_and_plan(path: Path, plan_text: str | None) -> tuple[Scenario, Plan]:
    """The scenario and the plan to judge: --plan over the scenario's plan over pure data parallelism."""
    scenario = load_scenario(path)
    base = scenario.plan or Plan(dp=scenario.cluster.num_gpus)
    plan = parse_plan(plan_text, base=Plan(**{**base.model_dump(), "dp": 1}) if plan_text else base)
    if plan_text and "dp" not in plan_text.replace("dp_replicate", ""):
        # dp fills the cluster when --plan does not say it.
        rest = plan.tp * plan.pp * plan.cp
        plan = plan.model_copy(update={"dp": max(1, scenario.cluster.num_gpus // rest)})
    return scenario, plan


def memory_table(ev: Evaluation) -> Table:
    """The memory stack of the worst rank against HBM."""
    mem = ev.memory
    if mem is None:
        raise StratagemError(ev.reason)
    table = Table(title=f"Memory per GPU, stage {mem.worst_stage}", title_justify="left")
    table.add_column("block")
    table.add_column("GiB", justify="right")
    table.add_column("share", justify="right")
    for b in BLOCKS:
        gib = mem.block_gib(b)
        marker = "  <- first to break" if b == mem.first_block_to_break else ""
        table.add_row(b + marker, f"{gib:.2f}", f"{gib / mem.hbm_gib:.0%}")
    table.add_section()
    table.add_row("[bold]peak", f"[bold]{mem.peak_gib:.2f}", f"{mem.peak_gib / mem.hbm_gib:.0%}")
    table.add_row("HBM", f"{mem.hbm_gib:.2f}", "100%")
    style = "green" if mem.headroom_gib >= 0 else "red"
    table.add_row(f"[{style}]headroom", f"[{style}]{mem.headroom_gib:.2f}", f"{mem.headroom_fraction:.0%}")
    return table


@app.command("evaluate")
def evaluate_cmd(scenario: ScenarioArg, plan: PlanOpt = None, as_json: JsonOpt = False) -> None:
    """Judge one plan: the memory stack per GPU against HBM and the block that breaks first."""
    scn, pl = scenario_and_plan(scenario, plan)
    ev = evaluate(scn, pl)
    if as_json:
        print(ev.model_dump_json(indent=2))
        return
    console.print(f"[bold]{scn.name}[/bold]  plan: {pl.short()}")
    if ev.status == "infeasible":
        raise StratagemError(ev.reason)
    console.print(memory_table(ev))
    verdict = "[green]fits" if ev.status == "ok" else f"[red]OOM: {ev.reason}"
    console.print(verdict)


@app.command("presets")
def presets_cmd(as_json: JsonOpt = False) -> None:
    """List the model and GPU presets."""
    if as_json:
        print(json.dumps({
            "models": {k: m.model_dump(mode="json") for k, m in MODEL_PRESETS.items()},
            "gpus": {k: g.model_dump(mode="json") for k, g in GPU_PRESETS.items()},
        }, indent=2))
        return
    models = Table(title="Models", title_justify="left")
    for col in ("name", "params", "layers", "hidden", "heads/kv", "ffn", "vocab", "moe"):
        models.add_column(col, justify="left" if col == "name" else "right")
    for m in MODEL_PRESETS.values():
        moe = f"{m.moe.num_experts}x top{m.moe.top_k}" if m.moe else "-"
        models.add_row(m.name, f"{m.num_params() / 1e9:.2f}B", str(m.num_layers), str(m.hidden_size),
                       f"{m.num_attention_heads}/{m.kv_heads}", str(m.ffn_hidden_size), str(m.vocab_size), moe)
    gpus = Table(title="GPUs", title_justify="left")
    for col in ("name", "HBM GiB", "bf16 TF/s", "fp8 TF/s", "HBM TB/s"):
        gpus.add_column(col, justify="left" if col == "name" else "right")
    for g in GPU_PRESETS.values():
        gpus.add_row(g.name, f"{g.hbm_gib:g}", f"{g.peak_tflops_bf16:g}",
                     f"{g.peak_tflops_fp8:g}" if g.peak_tflops_fp8 else "-", f"{g.hbm_tbps:g}")
    console.print(models)
    console.print(gpus)


@app.command("report")
def report_cmd(
    storage: Annotated[str, typer.Option("--storage", help="The search's storage: sqlite:///F.db, journal:F.log, RDB URL.")]
    = "sqlite:///stratagem.db",
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: the storage's only one).")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="report.html (default), .md, .json, .csv.")]
    = None,
    fmt: Annotated[str | None, typer.Option("--format", "-f", help="html | md | json | csv (default: -o's suffix; "
                                            "without -o, md/json/csv go to stdout).")] = None,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Add capacity planning, e.g. 8,16,32.")] = None,
) -> None:
    """Report a finished search: Pareto plots, front table, plan cards, explorer (HTML); Markdown; JSON/CSV."""
    from stratagem import reports

    kind = reports.output_format(output, fmt)
    if output is None and kind == "html":
        output = Path("report.html")
    if output is not None:
        reports.check_output(output)
    info = reports.pareto_info(reports.open_study(storage, study))
    cap = (reports.capacity_plan(info.scenario, reports.parse_nodes(nodes))
           if nodes and kind in ("html", "md") else None)
    text = reports.render_report(info, kind, cap)
    if output is None:
        sys.stdout.write(text)
        return
    reports.write_text_atomic(output, text)
    console.print(f"wrote {output} ({len(info.plans)} plans, {len(info.front)} on the Pareto front)",
                  markup=False, soft_wrap=True)


@app.command("capacity")
def capacity_cmd(
    scenario: ScenarioArg,
    nodes: Annotated[str | None, typer.Option("--nodes", help="Node counts, e.g. 8,16,32,64,128 "
                                              "(default: half, the same and twice the scenario's).")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Also write .md or .html.")] = None,
) -> None:
    """Best plan, time, GPU-hours and cost to train the scenario's training_tokens at each cluster size."""
    from stratagem import reports

    scn = load_scenario(scenario)
    kind = reports.output_format(output, None) if output is not None else None
    if output is not None and kind not in ("md", "html"):
        raise StratagemError(f"-o ({output}): capacity writes .md or .html")
    if output is not None:
        reports.check_output(output)
    cap = reports.capacity_plan(scn, reports.parse_nodes(nodes) if nodes else reports.default_nodes(scn))
    from rich.markup import escape

    table = Table(title=escape(f"Training {scn.training.training_tokens:.3g} tokens of {scn.model.name} on "
                               f"{scn.cluster.gpu.name}"), title_justify="left")
    for col in ("nodes", "GPUs", "best plan", "tokens/s", "days", "GPU-h", "USD", "ckpt", "fail"):
        table.add_column(col, justify="left" if col == "best plan" else "right", no_wrap=col != "best plan",
                         overflow="fold")

    def si(x: float) -> str:
        return next((f"{x / d:.3g}{u}" for d, u in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if abs(x) >= d), f"{x:.3g}")

    for r in cap.rows:
        if r.best is None or r.hours is None or r.days is None:
            table.add_row(str(r.num_nodes), str(r.num_gpus), f"[red]{escape(r.note)}", *["-"] * 6)
            continue
        table.add_row(str(r.num_nodes), str(r.num_gpus), r.best.label, si(r.tokens_per_s or 0), f"{r.days:,.1f}",
                      si(r.gpu_hours or 0), si(r.cost_usd or 0), f"{r.checkpoint_overhead:.2%}",
                      f"{r.failure_loss:.2%}")
    table.caption = ("ckpt: time stalled by checkpoint saves; fail: expected time lost to failures "
                     "(rework since the last checkpoint + restarts). Days include both.")
    console.print(table)
    if output is not None:
        text = reports.capacity_markdown(cap, heading="#") if kind == "md" else reports.render_capacity_html(cap)
        reports.write_text_atomic(output, text)
        console.print(f"wrote {output}", markup=False, soft_wrap=True)


@app.command("search")
def search_cmd(
    scenario: ScenarioArg,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna storage URL: sqlite:///F.db (default: "
                                                "stratagem.db beside the scenario), postgresql://..., journal:F.log")]
    = None,
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: <scenario>-<space hash>); "
                                              "rerunning with the same name resumes.")] = None,
    sampler: Annotated[str, typer.Option("--sampler", help="auto | exhaustive | nsga2 | tpe | random.")] = "auto",
    n_trials: Annotated[int | None, typer.Option("--n-trials", help="Plans the sampler proposes (nsga2/random "
                                                 "default 2000, tpe 300); measured runs: runs in this call.")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Stop the sampler / measured runs after S "
                                                  "seconds.")] = None,
    top: Annotated[int, typer.Option("--top", help="Rows of the front to show.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print counts and the front as JSON.")] = False,
    real_runs: Annotated[int, typer.Option("--real-runs", help="After screening, measure up to K plans as "
                                           "short real training runs through Ray (0: analytic only).")] = 0,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join a running Ray cluster "
                                                    "('auto'); default: start a local one.")] = None,
    budget_minutes: Annotated[float | None, typer.Option("--budget-minutes", help="Bound the real-run "
                                                         "phase (minutes).")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per real run.")] = 4,
    report: Annotated[Path | None, typer.Option("--report", help="HTML report path (default: <study>.html "
                                                "beside the scenario).")] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Do not write the HTML report.")] = False,
) -> None:
    """Search the plan space: screen it analytically, store the Pareto front in an Optuna study, optionally
    measure the best survivors as real runs through Ray (recalibrating the model), show the front and write
    the HTML report."""
    from stratagem.search import console as view
    from stratagem.search import default_storage, run_search

    scn = load_scenario(scenario)
    mode = view.check_sampler(sampler)
    name = study or view.default_study_name(scenario, scn)
    url = storage or default_storage(scenario)
    if real_runs:
        result = _search_with_real_runs(scn, scenario, url, name, mode, real_runs, ray_address, budget_minutes,
                                        steps, as_json)
    else:
        with view.progress_bar(Console(stderr=True), enabled=not as_json) as progress:
            result = run_search(scn, url, name, sampler=mode, n_trials=n_trials, timeout=timeout,
                                progress=progress)
    if as_json:
        print(view.result_json(result))
    else:
        view.print_result(console, result, top)
    if not no_report:
        from stratagem.reports import open_study as load_study
        from stratagem.reports import write_report

        path = write_report(load_study(result.storage.url, result.study_name),
                            report or scenario.with_name(f"{result.study_name}.html"))
        (Console(stderr=True) if as_json else console).print(f"report:   {path}", markup=False, soft_wrap=True)


def _search_with_real_runs(scn: Scenario, scenario_path: Path, url: str, name: str, mode: Mode, real_runs: int,
                           ray_address: str | None, budget_minutes: float | None, steps: int,
                           quiet: bool) -> Any:
    """The multi-fidelity search: screening, real runs through Ray, calibration; prints the measured runs."""
    from stratagem.evaluators.real import RayRunEvaluator
    from stratagem.search import console as view
    from stratagem.search.multifidelity import run_multifidelity

    run_dir = scenario_path.parent / "runs" / name
    num_cpus = scn.cluster.num_gpus if scn.cluster.gpu.kind == "cpu" and ray_address is None else None
    out = Console(stderr=True) if quiet else console
    out.print(f"starting Ray ({ray_address or 'local cluster'}); run logs under {run_dir}", markup=False)
    evaluator = RayRunEvaluator(run_dir, address=ray_address, num_cpus=num_cpus, steps=steps, warmup=2)
    try:
        def on_batch(entry: dict[str, Any]) -> None:
            out.print(f"measured {entry['measured']}/{real_runs}: step-time error {entry['step_error_before']:.0%}"
                      f" -> {entry['step_error_after']:.0%} after calibration, peak-memory error "
                      f"{entry['memory_error_before']:.0%} -> {entry['memory_error_after']:.0%}", markup=False)

        with view.progress_bar(Console(stderr=True), enabled=not quiet) as progress:
            mf = run_multifidelity(scn, url, name, evaluator, real_runs, budget_minutes, sampler=mode,
                                   progress=progress, on_batch=on_batch)
    finally:
        evaluator.close()
    view.print_measured(out, mf)
    return mf.search


@app.command("explain")
def explain_cmd(scenario: ScenarioArg, plan: PlanOpt = None, as_json: JsonOpt = False) -> None:
    """Explain one plan: memory stack, step time by part, the four zones, the bottleneck and advice."""
    from stratagem.evaluators import advise

    scn, pl = scenario_and_plan(scenario, plan)
    ev = evaluate(scn, pl)
    if ev.status == "infeasible":
        raise StratagemError(ev.reason)
    advice = advise(scn, pl, ev)
    if as_json:
        print(json.dumps({"evaluation": ev.model_dump(mode="json"),
                          "advice": [a.model_dump(mode="json") for a in advice]}, indent=2))
        return
    assert ev.time is not None and ev.throughput is not None and ev.zones is not None  # set for feasible plans
    tm, tp, zones = ev.time, ev.throughput, ev.zones
    console.print(f"[bold]{scn.name}[/bold]  plan: {pl.short()}")
    console.print(memory_table(ev))
    times = Table(title=f"Step time: {tm.step_s:.3g} s", title_justify="left")
    times.add_column("part")
    times.add_column("s", justify="right")
    times.add_column("share", justify="right")
    parts = {"compute": tm.compute_s, "recompute": tm.recompute_s, "TP comm (exposed)": tm.tp_comm_s,
             "DP comm (exposed)": tm.exposed_comm_s - tm.tp_comm_s - tm.pp_comm_s - tm.cp_comm_s,
             "PP comm": tm.pp_comm_s, "CP comm": tm.cp_comm_s, "pipeline bubble": tm.bubble_s,
             "optimizer": tm.optimizer_s}
    parts["overhead"] = tm.step_s - sum(parts.values())
    for name, sec in parts.items():
        if sec > 0.0005 * tm.step_s:
            times.add_row(name, f"{sec:.3g}", f"{sec / tm.step_s:.0%}")
    times.add_section()
    times.add_row("DP traffic before overlap", f"{tm.dp_comm_s:.3g}", "")
    console.print(times)
    console.print(f"{tp.tokens_per_s:,.0f} tokens/s ({tp.tokens_per_s_per_gpu:,.0f} per GPU), MFU {tp.mfu:.1%}")
    colour = {"ok": "green", "warn": "yellow", "bad": "red"}
    ztable = Table(title="Zones", title_justify="left", show_lines=False)
    for col in ("zone", "level", "value", "diagnosis"):
        ztable.add_column(col, justify="right" if col == "value" else "left", overflow="fold")
    for z in (zones.hbm, zones.communication, zones.bubbles, zones.checkpoint):
        c = colour[z.level]
        ztable.add_row(z.name, f"[{c}]{z.level}", f"{z.value:.1%}", z.sentence)
    console.print(ztable)
    console.print(f"bottleneck: [bold]{zones.bottleneck}[/bold]")
    if not advice:
        console.print("advice: none; no neighbouring plan improves a zone that needs it")
    for i, a in enumerate(advice, 1):
        console.print(f"{i}. [{a.zone}] {a.effect}\n   {a.rationale}", highlight=False)


@app.command("export")
def export_cmd(
    to: Annotated[str, typer.Option("--to", help="torchrun | torchtitan | deepspeed | megatron.")],
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna storage of the search (default: "
                                                "sqlite:///stratagem.db unless --scenario is given).")] = None,
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: the storage's only one).")] = None,
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
) -> None:
    """Export a plan: torchrun + stratagem's harness, a torchtitan TOML, a DeepSpeed JSON or Megatron-LM args."""
    from stratagem.launch.export import choose_trial, export_plan, write_bundle

    if scenario is not None:
        if storage is not None or study is not None or trial is not None or best is not None:
            raise StratagemError("--scenario: give either --scenario [--plan] or --storage/--study [--trial|--best]")
        scn, pl = scenario_and_plan(scenario, plan)
        ev: Evaluation | None = evaluate(scn, pl)
        source, run_steps, run_seed, run_warmup = f"scenario {scenario}", None, None, None
    else:
        if plan is not None:
            raise StratagemError("--plan: only with --scenario; pick a study's trial with --trial or --best")
        from stratagem import reports

        chosen = choose_trial(reports.open_study(storage or "sqlite:///stratagem.db", study), trial, best)
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
    written = write_bundle(bundle, output)
    err.print(f"wrote {', '.join(str(p) for p in written)} ({source})", markup=False, soft_wrap=True)


@app.command("reproduce")
def reproduce_cmd(
    storage: Annotated[str, typer.Option("--storage", help="Optuna storage URL of the study.")],
    trial: Annotated[int, typer.Option("--trial", help="Number of the measured trial to reproduce.")],
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: the only one).")] = None,
    result: Annotated[Path | None, typer.Option(
        "--result", help="Compare this harness result JSON (e.g. from the exported torchrun command) "
                         "instead of rerunning through Ray.")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join a running Ray cluster.")] = None,
) -> None:
    """Rerun a measured trial with the same harness, plan and seed; compare tokens/s, step time, peak memory
    and losses with the record. Exit 0 reproduced, 1 differences beyond the original run's noise, 3 the
    environment differs so the comparison is meaningless."""
    from stratagem.launch.reproduce import reproduce_trial
    from stratagem.reports import open_study

    rep = reproduce_trial(open_study(storage, study), trial, result_file=result, address=ray_address)
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
        table.add_row(row.metric, f"{row.recorded:.4g}", f"{row.now:.4g}", f"{row.rel_diff:+.1%}",
                      f"±{row.threshold:.1%}", flag)
    console.print(table)
    console.print("losses: " + ("[green]identical trajectory" if rep.losses_match else "[red]differ"))
    console.print("[green]reproduced" if rep.reproduced else "[red]not reproduced")
    if not rep.reproduced:
        raise typer.Exit(1)


def main() -> None:
    """Entry point: run the app; a StratagemError becomes one line on stderr and exit status 2."""
    try:
        app()
    except StratagemError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
