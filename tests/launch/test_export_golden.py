"""Golden files: the exact text each exporter writes for the `golden: true` cases of golden/cases.yaml.

A change in an exporter shows up here as a diff to review. After a deliberate change, regenerate with
    STRATAGEM_REGEN_GOLDEN=1 .venv/bin/pytest tests/launch/test_export_golden.py
scenario.yaml (torchrun) is not kept: it is the scenario dump, checked by a round trip in test_export_parsers.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from stratagem.launch.export import TARGETS, export_plan
from stratagem.launch.export.bundle import TARGET_STACK
from stratagem.spaces import parse_plan, scenario_from_dict
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.rules import capability_violations, plan_facts
from stratagem.spaces.stacks import stack_record

GOLDEN = Path(__file__).parent / "golden"
_DATA = yaml.safe_load((GOLDEN / "cases.yaml").read_text())
GOLDEN_CASES = [name for name, c in _DATA["cases"].items() if c.get("golden")]
SKIP = {"scenario.yaml"}


def _runs(name: str, target: str) -> bool:
    """Whether the target's engine runs the case (the automodel export refuses the others with the capability or
    the exclusion that Automodel's code enforces)."""
    case = _DATA["cases"][name]
    plan = parse_plan(case["plan"])
    scn = scenario_from_dict(_DATA["scenarios"][case["scenario"]], source=case["scenario"])
    rec = stack_record(TARGET_STACK[target])
    facts = plan_facts(plan, scn.model.moe is not None, micro_batches(plan, scn.training.global_batch_size))
    return target != "automodel" or not (capability_violations(rec, plan) or rec.plan_exclusion(facts, "harness"))


@pytest.mark.parametrize(("name", "target"), [(n, t) for n in GOLDEN_CASES for t in TARGETS if _runs(n, t)])
def test_golden(name: str, target: str) -> None:
    case = _DATA["cases"][name]
    scn = scenario_from_dict(_DATA["scenarios"][case["scenario"]], source=case["scenario"])
    bundle = export_plan(scn, parse_plan(case["plan"]), target, source=f"golden case {name}")
    folder = GOLDEN / name / target
    files = {k: v for k, v in bundle.files.items() if k not in SKIP}
    stored = {p.name: p.read_text() for p in folder.iterdir()} if folder.is_dir() else {}
    changed = sorted(rel for rel in set(files) | set(stored) if files.get(rel) != stored.get(rel))
    if os.environ.get("STRATAGEM_REGEN_GOLDEN"):
        # Regenerating never passes: the files are rewritten, and the check runs on the next, plain run.
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for rel, text in files.items():
            (folder / rel).write_text(text)
        pytest.skip(f"regenerated {name}/{target} ({', '.join(changed) or 'unchanged'}): rerun without "
                    "STRATAGEM_REGEN_GOLDEN to check")
    assert stored, f"no golden files for {name}/{target}: run with STRATAGEM_REGEN_GOLDEN=1"
    assert not changed, f"{name}/{target}: {', '.join(changed)} differ from the golden files"


def test_golden_cases_exist() -> None:
    assert len(GOLDEN_CASES) >= 3
