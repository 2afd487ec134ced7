"""The regret benchmark runs: every method replayed on every measured table in bench/data and on a few groups of
the published sweep (one seed, a small budget), through the same suites, pool and report as
`python bench/search_regret.py`, so a change that breaks the benchmark fails the default suite."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import search_regret  # noqa: E402
from regret.instances import Truth  # noqa: E402
from regret.replay import METHODS, run_method, suite_tasks  # noqa: E402
from regret.report import render_readme, text_table  # noqa: E402

from stratagem.evaluators.calibration import default_calibration  # noqa: E402

BUDGET = 4
"""Runs per method and instance: enough for the loop to refit and to re-rank after a refit."""
SWEEP_GROUPS = 2
"""The sweep's groups with the fewest candidates (every column: in sample, refitted, out of sample)."""


def _suites() -> list[search_regret.Suite]:
    tables = search_regret.default_tables()
    assert search_regret.DEFAULT_TABLE in tables, "the history table bench/data/cpu-table.json is replayed too"
    name, instances, folds, head = search_regret.sweep_suite(search_regret.DEFAULT_SWEEP, search_regret.DATA /
                                                             "regret-folds.json", "model")
    few = sorted(instances, key=lambda i: len(i.table.runs))[:SWEEP_GROUPS]
    return [(name, few, folds, head), *(search_regret.table_suite(p) for p in tables)]


def test_every_method_replays_on_every_table_and_the_sweep() -> None:
    suites = _suites()
    doc = search_regret.replay(suites, list(METHODS), BUDGET, repeats=1, jobs=1)
    for name, instances, folds, _ in suites:
        suite = doc["suites"][name]
        columns, tasks = suite_tasks(instances, list(METHODS), BUDGET, 1, folds, "model")
        assert list(suite["columns"]) == columns
        for column in suite["columns"].values():
            assert set(column) == set(METHODS), name
            for m, s in column.items():
                assert s["n"] >= len(instances), (name, m)
                assert len(s["curve_mean"]) == BUDGET and all(0.0 <= x <= 1.0 for x in s["curve_mean"]), (name, m)
                assert 1 <= s["runs_to_best_median"] <= BUDGET + 1, (name, m)
    text = "\n".join(text_table(doc))
    assert all(m in text for m in METHODS)
    assert render_readme(doc).count("| stratagem |") == len(suites)


def test_the_loop_runs_only_candidates_each_job_once_before_its_budget_is_spent() -> None:
    """On every table the loop (its policy, storage and exclusions; without refits, which cost seconds per run)
    spends a budget of 10 on distinct table plans: it re-measures only after K plans, and K is the budget here.
    A table row that names a job by a non-canonical plan (dp2 pp2 z3 on torch is ZeRO-2's job) once ran again
    and again: the loop excludes measured plans by their canonical key (regret/instances.py)."""
    for path in search_regret.default_tables():
        _, (instance,), _, _ = search_regret.table_suite(path)
        truth = Truth(instance)
        cal = default_calibration(truth.scenario.cluster.gpu.name)
        runner = run_method("no_recalibration", truth, 10, np.random.default_rng(0), cal)
        assert len(runner.order) == min(10, len(truth.keys)), path.name
        assert set(runner.order) <= set(truth.keys), path.name
        assert len(set(runner.order)) == len(runner.order), (path.name, runner.order)
