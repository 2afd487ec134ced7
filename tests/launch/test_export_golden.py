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
from stratagem.spaces import parse_plan, scenario_from_dict

GOLDEN = Path(__file__).parent / "golden"
_DATA = yaml.safe_load((GOLDEN / "cases.yaml").read_text())
GOLDEN_CASES = [name for name, c in _DATA["cases"].items() if c.get("golden")]
SKIP = {"scenario.yaml"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden(name: str, target: str) -> None:
    case = _DATA["cases"][name]
    scn = scenario_from_dict(_DATA["scenarios"][case["scenario"]], source=case["scenario"])
    bundle = export_plan(scn, parse_plan(case["plan"]), target, source=f"golden case {name}")
    folder = GOLDEN / name / target
    files = {k: v for k, v in bundle.files.items() if k not in SKIP}
    if os.environ.get("STRATAGEM_REGEN_GOLDEN"):
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for rel, text in files.items():
            (folder / rel).write_text(text)
    assert folder.is_dir(), f"no golden files for {name}/{target}: run with STRATAGEM_REGEN_GOLDEN=1"
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    for rel, text in files.items():
        assert text == (folder / rel).read_text(), f"{name}/{target}/{rel} differs from the golden file"


def test_golden_cases_exist() -> None:
    assert len(GOLDEN_CASES) >= 3
