"""The typer app, shared options and the entry point. User mistakes exit 2 with one line; never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from stratagem.errors import StratagemError
from stratagem.spaces import Plan, Scenario, load_scenario, parse_plan

__all__ = ["app", "console", "main", "scenario_and_plan", "ScenarioArg", "PlanOpt", "JsonOpt"]

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


def main() -> None:
    """Entry point: run the app; a StratagemError becomes one line on stderr and exit status 2."""
    try:
        app()
    except StratagemError as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
