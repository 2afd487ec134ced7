"""The `stratagem` command line (typer + rich). User mistakes exit 2 with one line; never a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from stratagem.errors import StratagemError
from stratagem.evaluators import BLOCKS, Evaluation, evaluate
from stratagem.spaces import GPU_PRESETS, MODEL_PRESETS, Plan, Scenario, load_scenario, parse_plan

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


def main() -> None:
    """Entry point: run the app; a StratagemError becomes one line on stderr and exit status 2."""
    try:
        app()
    except StratagemError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
