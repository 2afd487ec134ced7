"""The plan a command judges (evaluate, explain, trace, export): `--plan TEXT` over the scenario's `plan:` section,
or `--trial N` from the scenario's study; with one line saying where the plan's fields came from.

The rule for `--plan` with a scenario that has a `plan:` section: the fields `--plan` gives replace those of the
section, the section's other fields stay (merge); when `--plan` does not give dp, dp fills the cluster. A label
(`dp2 pp2 z1 mb4 bf16 1f1b`, as the front prints plans) names a whole plan: nothing of the section is used. The
origin line says which fields came from where, so the merge is never silent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from stratagem.errors import StratagemError
from stratagem.spaces import Plan, Scenario, load_scenario, resolve_plan
from stratagem.spaces.plan import is_label

__all__ = ["TrialOpt", "Picked", "pick_plan", "plan_origin", "trial_of_study"]

TrialOpt = Annotated[int | None, typer.Option(
    "--trial", help="Take the plan of this trial (its number, the `#` that search, report and status print) "
                    "from the scenario's study (stratagem.db beside the scenario, or --storage/--study).")]


@dataclass(frozen=True)
class Picked:
    """The scenario and plan a command judges, and where the plan came from."""

    scenario: Scenario
    plan: Plan
    origin: str
    """One line: `plan from ...` (the trial, or which fields came from --plan, the scenario, defaults)."""
    trial: int | None = None
    """The trial number when the plan is a study's trial."""


def _given_keys(text: str) -> list[str]:
    """The keys of `k=v,...` as typed, split as parse_plan splits them (commas or whitespace)."""
    parts = re.sub(r"\s*=\s*", "=", text.strip()).replace(" ", ",").split(",")
    return list(dict.fromkeys(p.split("=", 1)[0] for p in parts if p))


def plan_origin(scenario: Scenario, text: str | None, plan: Plan) -> str:
    """One line naming where each field of `plan` (resolved from `text` by spaces.resolve_plan) came from."""
    section = sorted(scenario.plan.model_fields_set) if scenario.plan is not None else []
    if not text:
        if scenario.plan is None:
            return f"plan from the scenario's defaults (no plan: section): dp={plan.dp} over the cluster"
        return "plan from the scenario's plan: section (" + ", ".join(section) + "; other fields default)"
    if is_label(text):
        used = " (its plan: section is not used)" if scenario.plan is not None else ""
        return f"plan from the --plan label, the whole plan{used}"
    given = _given_keys(text)
    from stratagem.spaces.plan import _ALIASES  # the short names --plan accepts (zero, mbs, ...)

    names = {_ALIASES.get(k, k) for k in given}
    kept = [f for f in section if f not in names and f != "dp"]
    parts = [f"--plan gave {', '.join(given)}"]
    if scenario.plan is not None:
        parts.append("the scenario's plan: section gave " + (", ".join(kept) if kept else "nothing else"))
    if "dp" not in names:
        parts.append(f"dp={plan.dp} fills the cluster")
    return "plan merged: " + "; ".join(parts) + "; other fields default"


def trial_of_study(command: str, path: Path | None, trial: int, storage: str | None,
                   study: str | None) -> tuple[Plan, str]:
    """The plan of trial `trial` in the study found by the one default rule (cli/app.study_location), and the
    line naming it: `plan from trial #N of study S (fidelity, status): LABEL`."""
    from stratagem.cli.app import study_location
    from stratagem.search.records import trial_fidelity, trial_plan, trial_status
    from stratagem.search.view import StudyView

    view = StudyView.open(*study_location(command, path, storage, study))
    trials = view.trials()
    found = [t for t in trials if t.number == trial]
    if not found:
        have = f"trials 0-{max(t.number for t in trials)}" if trials else "no trials"
        raise StratagemError(f"--trial ({trial}): study {view.name!r} has {have}")
    t = found[0]
    plan = trial_plan(t)
    return plan, (f"plan from trial #{trial} of study {view.name} ({trial_fidelity(t)}, {trial_status(t)}): "
                  f"{plan.short()}")


def pick_plan(command: str, path: Path, text: str | None, trial: int | None = None, storage: str | None = None,
              study: str | None = None) -> Picked:
    """The scenario at `path` and the plan to judge: trial `trial` of its study, else `text` over its plan:
    section (module docstring). --plan and --trial together are refused."""
    if trial is not None and text:
        raise StratagemError("--plan and --trial: give one of them (--trial N takes trial N's whole plan)")
    scenario = load_scenario(path)
    if trial is not None:
        plan, origin = trial_of_study(command, path, trial, storage, study)
        return Picked(scenario, plan, origin, trial)
    if storage is not None or study is not None:
        raise StratagemError("--storage/--study: only with --trial N (the study to take the trial from)")
    plan = resolve_plan(scenario, text)
    return Picked(scenario, plan, plan_origin(scenario, text, plan))
