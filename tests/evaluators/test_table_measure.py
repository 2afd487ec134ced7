"""bench/measure_table.py's pieces that need no launch: which plans it measures, how a harness outcome becomes a
table sample, the resume guard and the printed figures."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from stratagem.evaluators.spread import spread_of_samples
from stratagem.evaluators.table import OutcomeTable, TableOutcome, TableSample, noise_epsilon
from stratagem.spaces import SearchSpace, format_plan, load_scenario

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "bench" / "data" / "cpu-table.yaml"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("measure_table", ROOT / "bench" / "measure_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["measure_table"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_space_less_the_plans_the_harness_refuses() -> None:
    mt = _script()
    scn = load_scenario(YAML)
    cols = SearchSpace(scn).enumerate()
    plans, refused = mt.table_plans(scn, None, None)
    assert len(plans) + len(refused) == len(cols)
    assert all("1f1b" in why for why in refused.values())  # fewer micro-batches than stages
    assert {format_plan(p) for p in plans}.isdisjoint(refused)
    # given plans go through the same filter: 1f1b over 4 stages with 2 micro-batches (8 / 4) is refused
    kept, said = mt.table_plans(scn, "pp=4,micro_batch_size=4,precision=fp32;dp=4,precision=fp32", None)
    assert [format_plan(p) for p in kept] == ["dp=4,precision=fp32"]
    assert list(said) == ["pp=4,micro_batch_size=4,precision=fp32"] and "1f1b" in said[list(said)[0]]
    assert {p.micro_batch_size for p in plans} == {1, 2, 4, 8}
    # stratagem's selective is not in the torch space (torchtitan has no such policy: spaces/exclusions.py); the
    # published table (bench/data/cpu-table.json) was measured before and keeps its selective plans
    assert {p.activation_checkpointing for p in plans} == {"none", "full"}
    assert [format_plan(p) for p in mt.table_plans(scn, None, 4)[0]] == [format_plan(p) for p in plans[:4]]


def test_a_harness_outcome_becomes_a_sample_with_its_load() -> None:
    mt = _script()
    spread = spread_of_samples([0.5, 0.52, 0.49, 0.55, 0.5, 0.51]).model_dump()
    ok = {"plan": "dp=4", "run": 0, "status": "ok", "tokens_per_s_per_gpu": 256.0, "peak_gib": 0.009,
          "step_spread": spread, "host_load": [3.25, 4.5], "wall_s": 9.123,
          "launch_load": [[2.0, 2.0, 2.0], [5.0, 3.0, 2.0]], "launch_start": "2026-12-01T19:20:00+00:00"}
    s = mt.sample_of(ok)
    assert (s.status, s.tokens_per_s_per_gpu, s.load_before, s.load_after, s.wall_s) == ("ok", 256.0, 3.25, 4.5, 9.12)
    assert s.step_spread is not None and s.step_spread.n == 6
    oom = {"plan": "dp=4", "run": 1, "status": "oom", "reason": "peak 11 MiB over the 10 MiB cap", "wall_s": 0.4,
           "launch_load": [[2.0, 2.0, 2.0], [5.0, 3.0, 2.0]], "launch_start": "2026-12-01T19:30:00+00:00"}
    s = mt.sample_of(oom)  # no timed steps: the launch's load
    assert (s.status, s.load_before, s.load_after, s.step_spread) == ("oom", 2.0, 5.0, None)
    rounds = mt.round_meta({("dp=4", 0): ok, ("dp=4", 1): oom}, 2)
    assert [(r["ok"], r["oom"], r["failed"]) for r in rounds] == [(1, 0, 0), (0, 1, 0)]


def test_resume_refuses_a_partial_measured_with_other_settings(tmp_path: Path) -> None:
    mt = _script()
    partial = tmp_path / "t.partial.jsonl"
    settings = {"scenario": {"a": 1}, "warmup": 2, "cap": 0.01, "budget": {"budget_s": 3.0}}
    row = {"plan": "dp=4", "run": 0, "status": "oom"}
    partial.write_text(json.dumps({"settings": settings}) + "\n" + json.dumps(row) + "\n")
    assert mt._read_partial(partial, settings) == {("dp=4", 0): row}
    with pytest.raises(SystemExit, match="other settings"):
        mt._read_partial(partial, {**settings, "warmup": 1})


def test_summary_states_cv_epsilon_and_whether_the_best_stands_apart() -> None:
    mt = _script()
    scn_raw = {"model": "x"}

    def ok(tps: float) -> TableSample:
        return TableSample(status="ok", tokens_per_s_per_gpu=tps, peak_gib=0.008)

    runs = [TableOutcome(plan="dp=4", samples=[ok(300.0), ok(330.0), ok(310.0)]),
            TableOutcome(plan="tp=4", samples=[ok(200.0), ok(210.0), ok(190.0)]),
            TableOutcome(plan="pp=4", samples=[TableSample(status="oom", reason="cap")] * 3)]
    table = OutcomeTable(name="t", scenario=scn_raw, runs=runs, epsilon=noise_epsilon(runs))
    text = "\n".join(mt.summary(table))
    assert "plans 3; median-sample status: ok 2, oom 1, failed 0" in text
    assert "best: dp=4: median 310 tok/s/GPU, runs 300-330" in text
    assert "runner-up: tp=4: median 200" in text
    assert "runs' ranges do not overlap; runner-up outside epsilon" in text
