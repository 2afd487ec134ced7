"""Fault injection for the launchers' own tests (not public API): STRATAGEM_FAULTS is a JSON object mapping a
plan's `format_plan` text to "crash" (the last rank raises after the first step), "hang" (it sleeps),
"cap=GiB" (a memory cap for that plan alone, so a real tracked peak trips it) or "exit-abort" (rank 0 aborts,
SIGABRT, after writing its result: the runner's exit-fault classification)."""

from __future__ import annotations

import json
import os

from stratagem.spaces.plan import Plan, format_plan


def injected_fault(plan: Plan) -> str:
    """The fault STRATAGEM_FAULTS injects into `plan`'s run; empty when unset or not named."""
    raw = os.environ.get("STRATAGEM_FAULTS")
    if not raw:
        return ""
    return str(json.loads(raw).get(format_plan(plan), ""))
