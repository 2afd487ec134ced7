"""`stratagem compare SCENARIO A B [C ...]`: plans side by side and why the fastest wins (reports/compare.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from stratagem.cli.app import (
    RetryOpt,
    ScenarioArg,
    StorageOpt,
    StudyOpt,
    app,
    console,
    study_location,
)
from stratagem.cli.calibrate import CalibrationOpt, scenario_calibration
from stratagem.errors import StratagemError
from stratagem.spaces import Plan, Scenario, load_scenario, resolve_plan

__all__ = ["resolve_plans"]

PlansArg = Annotated[list[str], typer.Argument(
    help="Two or more plans: a label as the front prints it ('dp2 pp2 z1 mb2 bf16 1f1b', quoted), key=value "
         "pairs ('dp=4,zero=2,mbs=4'), or a trial of the scenario's study: 'trial:N' or N.",
    show_default=False)]

CompareJsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print each plan's name, label and evaluation, the winner and the sentences as JSON.")]

_TRIAL = re.compile(r"^(?:trial:)?#?(\d+)$")


def _trial_plans(numbers: list[int], scenario_path: Path, storage: str | None,
                 study: str | None) -> dict[int, tuple[Plan, float | None]]:
    """Trial number -> (its plan, measured tokens/s when it is a measured run), read from the study."""
    from stratagem.evaluators.evaluation import Evaluation
    from stratagem.search.records import TrialKey, trial_plan
    from stratagem.search.view import StudyView

    url, name = study_location("compare", scenario_path, storage, study)
    view = StudyView.open(url, name)
    trials = {t.number: t for t in view.trials()}
    out: dict[int, tuple[Plan, float | None]] = {}
    for n in numbers:
        t = trials.get(n)
        if t is None:
            span = f"0-{max(trials)}" if trials else "none"
            raise StratagemError(f"trial:{n}: no such trial in study {view.name!r} (trials {span})")
        raw = t.user_attrs.get(TrialKey.EVALUATION)
        ev = Evaluation.model_validate(raw) if raw else None
        plan = ev.plan if ev is not None else trial_plan(t)
        measured = (ev.throughput.tokens_per_s if ev is not None and ev.fidelity == "measured"
                    and ev.status == "ok" and ev.throughput is not None else None)
        out[n] = (plan, measured)
    return out


def resolve_plans(scenario: Scenario, scenario_path: Path, given: list[str], storage: str | None = None,
                  study: str | None = None) -> list[tuple[str, Plan, float | None]]:
    """(name, plan, measured tokens/s or None) for each plan the user gave, in order."""
    numbers = [int(m.group(1)) for text in given if (m := _TRIAL.match(text.strip()))]
    trials = _trial_plans(numbers, scenario_path, storage, study) if numbers else {}
    out = []
    for text in given:
        m = _TRIAL.match(text.strip())
        if m:
            plan, measured = trials[int(m.group(1))]
            out.append((f"trial:{m.group(1)}", plan, measured))
        else:
            out.append((text.strip(), resolve_plan(scenario, text), None))
    return out


@app.command("compare")
def compare_cmd(scenario: ScenarioArg, plans: PlansArg, storage: StorageOpt = None, study: StudyOpt = None,
                retry: RetryOpt = None, as_json: CompareJsonOpt = False, calibration: CalibrationOpt = None) -> None:
    """Compare plans side by side: memory blocks, step-time parts, zones, and why the fastest wins."""
    from stratagem.evaluators import evaluate
    from stratagem.reports.compare import Compared, compare

    if len(plans) < 2:
        raise StratagemError(f"compare: give two or more plans to compare (got {len(plans)}); e.g. stratagem "
                             f"compare {scenario} 'dp=8,zero=1' trial:12")
    scn = load_scenario(scenario)
    cal, cal_label = scenario_calibration(scn, calibration)
    resolved = resolve_plans(scn, scenario, plans, storage, study)
    result = compare([Compared(name, evaluate(scn, plan, cal), measured) for name, plan, measured in resolved],
                     scn, cal)
    if as_json:
        print(json.dumps({**result.as_json(), "calibration": cal_label}, indent=2))
        return
    head, rows = result.table()
    table = Table(title=Text(f"{scn.name}: {len(plans)} plans (predicted, calibration: {cal_label})"),
                  title_justify="left")
    for k, h in enumerate(head):
        table.add_column(Text(h), justify="left" if k == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*(Text(c) for c in row))
    console.print(table, markup=False, highlight=False)
    for line in result.why:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
