"""The table evaluator (tabular benchmarks) and the regret benchmark that replays search methods on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sessions import run_multifidelity

from stratagem.errors import StratagemError
from stratagem.evaluators import evaluate, evaluate_many
from stratagem.evaluators.table import OutcomeTable, TableEvaluator, TableOutcome, load_table
from stratagem.spaces import SearchSpace, format_plan, parse_plan, scenario_from_dict
from stratagem.spaces.columns import PlanColumns

ROOT = Path(__file__).resolve().parents[2]


RAW = {
    "model": {"name": "table-test", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 8, "num_kv_heads": 4,
              "ffn_hidden_size": 256, "vocab_size": 512},
    "cluster": {"gpu": "a100-80g", "num_nodes": 1, "gpus_per_node": 4},
    "training": {"seq_len": 64, "global_batch_size": 16, "stack": "torch"},
    "search": {"precision": "bf16", "pp_schedule": "1f1b", "activation_checkpointing": ["none", "full"]},
}


def _table(limit: int = 24) -> OutcomeTable:
    """A table whose truth is the analytic model itself (default calibration), one plan marked oom."""
    raw = RAW
    scn = scenario_from_dict(raw)
    cols = SearchSpace(scn).enumerate()
    plans = [cols.plan(i) for i in range(min(limit, len(cols)))]
    figures = evaluate_many(scn, plans)
    runs = [TableOutcome.single(format_plan(p), "ok", float(t), float(m))
            for p, t, m in zip(plans, figures.tokens_per_s_per_gpu, figures.peak_gib, strict=True)]
    slowest = int(np.argmin(figures.tokens_per_s_per_gpu))
    runs[slowest] = TableOutcome.single(runs[slowest].plan, "oom", reason="tracked peak exceeds the cap")
    return OutcomeTable(name="synthetic", scenario=raw, runs=runs)


def test_lookup_is_a_measured_evaluation_and_counts_runs() -> None:
    table = _table()
    scn = table.load_scenario()
    ev = TableEvaluator(table)
    plan = table.plans()[0]
    out = ev.evaluate(scn, plan)
    row = table.runs[0]
    assert out.fidelity == "measured" and out.status == "ok"
    assert out.throughput is not None and out.memory is not None and out.measurements is not None
    assert out.throughput.tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s_per_gpu)
    assert out.memory.peak_gib == pytest.approx(row.peak_gib)
    # the step time the calibration refit reads: tokens per step over the measured cluster tokens/s
    world = scn.cluster.num_gpus
    assert out.measurements["step_s"] == pytest.approx(scn.training.tokens_per_step / (row.tokens_per_s_per_gpu * world))
    assert out.prediction is not None and out.prediction.fidelity == "analytic"
    assert ev.runs == [format_plan(plan)]
    oom = next(r for r in table.runs if r.status == "oom")
    assert ev.evaluate(scn, parse_plan(oom.plan)).status == "oom"
    assert len(ev.runs) == 2


def test_a_plan_outside_the_table_is_an_error_not_a_made_up_figure() -> None:
    table = _table(limit=4)
    ev = TableEvaluator(table)
    outside = parse_plan("dp=1,tp=4")
    assert format_plan(outside) not in table.outcomes()
    with pytest.raises(StratagemError, match="not in table"):
        ev.evaluate(table.load_scenario(), outside)
    assert ev.runs == []


def test_load_table_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"name": "x", "scenario": {}, "runs": [{"plan": "dp=4", "status": "maybe"}]}))
    with pytest.raises(StratagemError, match=r"t\.json.*runs\.0\.samples\.0\.status"):
        load_table(bad)
    with pytest.raises(StratagemError, match="cannot read"):
        load_table(tmp_path / "missing.json")


def test_multifidelity_loop_runs_only_table_plans_each_once(tmp_path: Path) -> None:
    table = _table(limit=16)
    scn = table.load_scenario()
    ev = TableEvaluator(table)
    res = run_multifidelity(scn, f"journal:{tmp_path}/s.log", "t", ev, 6,
                            candidates=PlanColumns.from_plans(table.plans()))
    assert len(ev.runs) == 6 == len(set(ev.runs)) == res.measured
    assert set(ev.runs) <= set(table.outcomes())
    # truth == the analytic model: the first run is the plan predicted (and measured) fastest among those that fit
    fits = [r for r in table.runs if r.status == "ok" and evaluate(scn, parse_plan(r.plan)).status == "ok"]
    assert ev.runs[0] == format_plan(parse_plan(max(fits, key=lambda r: r.tokens_per_s_per_gpu or 0).plan))


def test_regret_benchmark_replays_every_method(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(limit=20).model_dump(mode="json")))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "search_regret.py"), "--table", str(path),
                           "--json", str(tmp_path / "r.json"),
                           "--repeats", "2", "--jobs", "1", "--plot", str(tmp_path / "r.png")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    columns = json.loads((tmp_path / "r.json").read_text())["suites"]["table"]["columns"]
    methods = columns["out_of_sample"]
    sys.path.insert(0, str(ROOT / "bench"))
    from regret.replay import METHODS

    assert set(methods) == set(METHODS)
    for m in methods.values():
        assert {"runs_to_best_median", "runs_to_best_p90", "found_within_10", "regret_at", "oom_runs"} <= set(m)
        assert set(m["regret_at"]) == {"1", "3", "5", "10"}
        assert all(0.0 <= v <= 1.0 for v in m["regret_at"].values())
    # the truth is the analytic model: model-guided orders find the best at once, with zero regret
    for name in ("stratagem", "no_recalibration", "analytic_order"):
        assert methods[name]["runs_to_best_median"] == 1.0, name
        assert methods[name]["regret_at"]["1"] == 0.0
    assert (tmp_path / "r.png").stat().st_size > 1000
