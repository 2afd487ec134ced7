"""The typer app, shared options and the entry point. User mistakes exit 2 with one line; never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from stratagem.errors import StratagemError
from stratagem.spaces import Plan, Scenario, load_scenario, resolve_plan

try:  # typer >= 0.2x vendors its own click; older typer uses click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx  # type: ignore[no-redef]

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
    """The scenario and the plan to judge (`stratagem.spaces.resolve_plan`: --plan over the scenario's plan,
    dp filling the cluster when --plan does not give it)."""
    scenario = load_scenario(path)
    return scenario, resolve_plan(scenario, plan_text)


def _fail(message: str) -> None:
    """One line on stderr and exit status 2."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; a StratagemError or a usage error (unknown option, bad value, missing
    argument) becomes one line on stderr and exit status 2; help and `typer.Exit(code)` keep their code."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="stratagem", standalone_mode=False)
    except StratagemError as e:
        _fail(str(e))
    except _cx.NoArgsIsHelpError as e:
        e.show()  # `stratagem` alone: the help (already printed by typer) and click's exit status 2
        sys.exit(e.exit_code)
    except _cx.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "stratagem"
        message = " ".join(e.format_message().split())
        _fail(f"{where}: {message} (see {where} --help)")
    except _cx.ClickException as e:
        _fail(" ".join(e.format_message().split()))
    except typer.Abort:
        Console(stderr=True).print("aborted", markup=False)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
