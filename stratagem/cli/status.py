"""`stratagem status`: what a (possibly running) search's study holds now, for the person on call."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from stratagem.cli.app import app, console
from stratagem.errors import StratagemError

if TYPE_CHECKING:
    from stratagem.search.status import StudyStatus


@app.command("status")
def status_cmd(
    storage: Annotated[str, typer.Option("--storage", help="Optuna storage URL of the study (sqlite:///F.db, "
                                         "postgresql://..., journal:F.log).")],
    study: Annotated[str, typer.Option("--study", help="Study name.")],
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=1.0, help="Seconds between refreshes with "
                                            "--watch.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
) -> None:
    """Trials stored, measured runs done/claimed/failed by kind, workers alive, best plan so far (measured and
    predicted), calibration error per batch, time spent and left of the real-run budget."""
    import optuna

    from stratagem.search.status import study_status
    from stratagem.search.storage import open_storage, parse_storage

    backend = open_storage(parse_storage(storage), write=False)
    try:
        st = optuna.load_study(study_name=study, storage=backend)
    except KeyError:
        raise StratagemError(f"--study ({study!r}): no such study in {storage}; `optuna studies --storage "
                             f"{storage}` lists them") from None
    while True:
        s = study_status(st)
        if as_json:
            print(json.dumps(s.as_dict()), flush=True)
        else:
            _render(console, s)
        if not watch:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            raise typer.Exit(0) from None


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _render(out: Console, s: StudyStatus) -> None:
    done = sum(s.measured.values())
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.measured.items())) or "none"
    lines = [
        f"study {s.study}: {s.analytic} analytic trials stored",
        f"measured: {done} done ({kinds}); {s.claimed} running (claimed); {s.infra} infra failure(s) and "
        f"{s.expired} expired claim(s) to retry",
        f"workers alive: {len(s.workers)}" + (f" ({', '.join(s.workers)})" if s.workers else ""),
        f"best measured: {s.best_measured or '-'}",
        f"best predicted: {s.best_predicted or '-'}",
        "calibration (measured: step-time / peak-memory median error): "
        + (", ".join(f"{n}: {t:.0%}/{m:.0%}" for n, t, m in s.calibration_trend[-6:]) or "-"),
        f"real runs: {_minutes(s.elapsed_s)} spent, {_minutes(s.budget_left_s)} left of the budget",
    ]
    for line in lines:
        out.print(line, markup=False, soft_wrap=True)
