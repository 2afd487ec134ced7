"""The typer app, shared options and the entry point. User mistakes exit 2 with one line; never a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperOption

from stratagem.errors import StratagemError
from stratagem.files import disk_error
from stratagem.spaces import load_scenario

try:  # typer >= 0.2x vendors its own click; older typer uses click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover
    from click import exceptions as _cx  # type: ignore[no-redef]

__all__ = ["app", "console", "main", "ScenarioArg", "PlanOpt", "JsonOpt", "StorageOpt", "StudyOpt",
           "RetryOpt", "SearchedScenarioArg", "study_location"]

def _flag_shows_no_type(self: TyperOption, ctx: Any) -> str | None:
    """A flag (--json, --force, --help) takes no value: its help row shows no type (typer 0.29 prints <bool>)."""
    return None if self.is_flag else _TYPE_OF(self, ctx)


_TYPE_OF = TyperOption.display_type_rich
TyperOption.display_type_rich = _flag_shows_no_type  # type: ignore[method-assign]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Find how to train a large model on a given cluster.",
    pretty_exceptions_enable=False,
)
# Width of stdout's console when it is a file or a pipe and COLUMNS is not set: rich would take 80 columns and squeeze
# the tables to fit (capacity's best-plan column to nothing); a report piped to a file keeps its tables whole.
PIPED_WIDTH = 200


def _stdout_console() -> Console:
    """stdout's console: a terminal's own width (or COLUMNS); PIPED_WIDTH when stdout is a file or a pipe."""
    probe = Console()
    if probe.is_terminal or "COLUMNS" in os.environ:
        return probe
    return Console(width=PIPED_WIDTH)


console = _stdout_console()

ScenarioArg = Annotated[Path, typer.Argument(help="Scenario YAML (model, cluster, training[, plan]).")]
PlanOpt = Annotated[
    str | None, typer.Option("--plan", "-p", help="Plan as key=value pairs, e.g. dp=8,tp=2,zero=1,mbs=2.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the plan's evaluation as JSON.")]


def _check_study(value: str | None) -> str | None:
    from stratagem.search.naming import check_study_name

    return None if value is None else check_study_name(value)


def _set_retry(value: float | None) -> float | None:
    from stratagem.search.retry import set_retry_minutes

    set_retry_minutes(value)  # this process's window for every storage call (None: env / default)
    return value


# The study options, declared once; every command that reads or writes a study takes them, with one default
# rule (`study_location`): the storage beside the scenario, as `search` writes it.
StorageOpt = Annotated[str | None, typer.Option(
    "--storage", help="The study's Optuna storage: sqlite:///F.db, journal:F.log or an RDB URL such as "
                      "postgresql://user@host/db (default: stratagem.db beside the scenario).")]
StudyOpt = Annotated[str | None, typer.Option(
    "--study", help="Study name (default: the scenario's, <scenario stem>-<space digest>; else the storage's only "
                    "study).", callback=_check_study)]
RetryOpt = Annotated[float | None, typer.Option(
    "--storage-retry-minutes", min=0.0, callback=_set_retry,
    help="Ride out a storage outage (database restart, failover) for this long, retrying with backoff; one line "
         "when it starts and one when it ends (default: $STRATAGEM_STORAGE_RETRY_MINUTES, else 5).")]
SearchedScenarioArg = Annotated[Path | None, typer.Argument(
    help="The scenario YAML the search ran: its storage (stratagem.db beside it) and study, as `search` "
         "defaults them.")]


def study_location(command: str, scenario: Path | None, storage: str | None,
                   study: str | None) -> tuple[str, str | None]:
    """(storage URL, study name or None for the storage's only study), by the one rule every command uses:
    --storage, else stratagem.db beside SCENARIO (where `search` writes it); --study, else SCENARIO's default
    study name. One line naming the calls that work when neither a scenario nor a storage is given."""
    from stratagem.search.naming import default_study_name
    from stratagem.search.storage import default_storage

    if scenario is not None:
        storage = storage or default_storage(scenario)
        study = study or default_study_name(scenario, load_scenario(scenario))
    if storage is None:
        raise StratagemError(f"stratagem {command}: give the scenario the search ran (stratagem {command} "
                             f"SCENARIO.yaml) or its storage (stratagem {command} --storage "
                             "sqlite:///DIR/stratagem.db [--study NAME])")
    return storage, study


def _fail(message: str) -> None:
    """One line on stderr and exit status 2."""
    Console(stderr=True).print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(2)


class OutputFailed(StratagemError):
    """Standard output could not be written (disk full, size limit, a closed pipe)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(f"standard output: cannot write: {disk_error(error)}; the output is incomplete")
        self.broken_pipe = error.errno == errno.EPIPE
        """The reader went away (`stratagem ... | head`): not an error worth a line."""


class _GuardedStdout:
    """sys.stdout whose write and flush failures (an OSError: stdout redirected to a full disk) become
    OutputFailed, one line like any user-facing error, instead of a traceback from deep inside rich."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        """Write to the real stdout."""
        try:
            return int(self._stream.write(text))
        except OSError as e:
            raise OutputFailed(e) from None

    def flush(self) -> None:
        """Flush the real stdout."""
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputFailed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _drop_stdout() -> None:
    """Point stdout's descriptor at /dev/null so the interpreter's final flush of what could not be written
    does not fail a second time (Python prints that as 'Exception ignored' on stderr)."""
    if sys.__stdout__ is None:
        return
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.__stdout__.fileno())
        os.close(fd)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; a StratagemError or a usage error (unknown option, bad value, missing
    argument) becomes one line on stderr and exit status 2; help and `typer.Exit(code)` keep their code. A
    stdout that cannot be written (a full disk) is one line too (OutputFailed)."""
    command = typer.main.get_command(app)
    real_stdout = sys.stdout
    sys.stdout = _GuardedStdout(real_stdout)
    try:
        code = command.main(args=argv, prog_name="stratagem", standalone_mode=False)
        sys.stdout.flush()  # a full disk found now, not in the interpreter's last flush
    except OutputFailed as e:
        sys.stdout = real_stdout
        if real_stdout is sys.__stdout__:
            _drop_stdout()
        if e.broken_pipe:
            sys.exit(128 + 13)  # as if killed by SIGPIPE, what a shell reports for `... | head`
        _fail(str(e))
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
    finally:
        if isinstance(sys.stdout, _GuardedStdout):
            sys.stdout = real_stdout
    sys.exit(code if isinstance(code, int) else 0)
