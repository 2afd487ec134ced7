"""README's "How many real runs the search needs" figures are generated from the committed bench/data/regret.json:
rendering the JSON must give exactly the README's block (no replay: fast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from regret.replay import METHODS  # noqa: E402
from regret.report import BEGIN, END, readme_section, render_readme, shortfalls  # noqa: E402


def _doc() -> dict:
    return json.loads((ROOT / "bench" / "data" / "regret.json").read_text())


def test_readme_block_is_rendered_from_the_committed_json() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## How many real runs the search needs", 1)[1].split("\n## ", 1)[0]
    block = readme_section(section)
    assert block.startswith(BEGIN) and block.endswith(END), "markers missing from the 'How many real runs' section"
    assert block == render_readme(_doc()), "README disagrees with bench/data/regret.json: run " \
        "`python bench/search_regret.py --readme`"


def test_json_has_every_method_in_every_column_with_bands() -> None:
    doc = _doc()
    assert doc["suites"], "no suite in bench/data/regret.json"
    for name, suite in doc["suites"].items():
        if name == "sweep":  # the published sweep: in sample, refitted in sample, out of sample
            assert set(suite["columns"]) == {"in_sample", "in_sample_refit", "out_of_sample"}
        budget = suite["config"]["budget"]
        for column in suite["columns"].values():
            assert set(METHODS) <= set(column), name
            for s in column.values():
                assert len(s["curve_mean"]) == budget and all(len(b) == budget for b in s["curve_bands"].values())
                assert all(lo <= hi + 1e-9 for lo, hi in zip(s["curve_bands"]["q10"], s["curve_bands"]["q90"],
                                                             strict=True))


def test_shortfalls_name_the_budgets_where_a_baseline_has_less_regret() -> None:
    flat = {"curve_mean": [0.0] * 10}
    summary = {"stratagem": {"curve_mean": [0.5, 0.2] + [0.0] * 8}, "rule": flat, "ds_autotuner": flat}
    assert shortfalls(summary) == ["rule at 1, 2 runs", "ds_autotuner at 1, 2 runs"]
    assert shortfalls({"stratagem": flat, "rule": flat}) == []
