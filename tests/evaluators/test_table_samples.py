"""A table outcome is a distribution: samples per plan, a seeded draw per run, epsilon from the between-run spread,
and the old single-sample format still loads."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from stratagem.evaluators.spread import spread_of, spread_of_samples
from stratagem.evaluators.table import (
    EPSILON_TOP_K,
    OutcomeTable,
    TableEvaluator,
    TableOutcome,
    TableSample,
    load_table,
    noise_epsilon,
)
from stratagem.spaces import SearchSpace, format_plan, parse_plan, scenario_from_dict

RAW = {
    "model": {"name": "table-test", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 8, "num_kv_heads": 4,
              "ffn_hidden_size": 256, "vocab_size": 512},
    "cluster": {"gpu": {"preset": "cpu", "hbm_gib": 0.010}, "num_nodes": 1, "gpus_per_node": 4},
    "training": {"seq_len": 64, "global_batch_size": 8, "stack": "torch"},
    "search": {"precision": "fp32", "pp_schedule": "1f1b", "activation_checkpointing": ["none", "full"],
               "memory_margin_gib": 0.0},
}
TOKENS_PER_STEP = 8 * 64


def _sample(tps: float, steps: list[float] | None = None) -> TableSample:
    """An ok sample whose tokens/s and step spread agree (tokens per step / (median step x 4 ranks))."""
    median = TOKENS_PER_STEP / (tps * 4)
    xs = [median * f for f in (steps or [0.9, 0.95, 1.0, 1.0, 1.05, 1.1])]
    return TableSample(status="ok", tokens_per_s_per_gpu=tps, peak_gib=0.008,
                       step_spread=spread_of_samples(xs), load_before=3.0, load_after=4.5, wall_s=9.0)


OOM = TableSample(status="oom", reason="peak 11 MiB over the 10 MiB cap", load_before=2.0, load_after=2.0, wall_s=0.5)


def _plans(n: int) -> list[str]:
    cols = SearchSpace(scenario_from_dict(RAW)).enumerate()
    return [format_plan(cols.plan(i)) for i in range(n)]


def _table(values: list[list[float | None]]) -> OutcomeTable:
    """One plan per row of `values`; None is an oom sample."""
    keys = _plans(len(values))
    runs = [TableOutcome(plan=k, samples=[OOM if v is None else _sample(v) for v in row])
            for k, row in zip(keys, values, strict=True)]
    return OutcomeTable(name="samples", scenario=RAW, runs=runs, epsilon=noise_epsilon(runs), meta={"x": 1})


def test_round_trip_keeps_samples_spreads_and_epsilon(tmp_path: Path) -> None:
    table = _table([[100.0, 120.0, 110.0], [None, None, None], [90.0, None, 80.0]])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.model_dump(mode="json")))
    back = load_table(path)
    assert back == table
    assert back.runs[0].samples[1].step_spread == table.runs[0].samples[1].step_spread
    assert back.epsilon is not None and back.epsilon.rule.startswith("epsilon = median over the top")


def test_median_sample_orders_non_ok_as_zero() -> None:
    table = _table([[100.0, 120.0, 110.0], [None, 50.0, None], [90.0, None, 80.0]])
    a, b, c = table.runs
    assert a.median_index() == 2 and a.tokens_per_s_per_gpu == 110.0 and a.status == "ok"
    assert b.status == "oom" and b.value == 0.0 and b.reason.startswith("peak")  # 2 of 3 runs hit the cap
    assert c.tokens_per_s_per_gpu == 80.0 and c.peak_gib == 0.008  # one oom among 3: the slower ok run
    assert c.ok_tokens() == [90.0, 80.0]


def test_draws_are_reproducible_with_a_seed_and_cover_the_samples() -> None:
    table = _table([[100.0, 130.0, 70.0], [60.0, 61.0, 62.0]])
    scn = table.load_scenario()
    plan = parse_plan(table.runs[0].plan)

    def draw(seed: int) -> list[float]:
        ev = TableEvaluator(table, rng=np.random.default_rng(seed))
        out = [e.throughput.tokens_per_s_per_gpu for e in ev.evaluate_batch(scn, [plan] * 30) if e.throughput]
        assert [i for _, i in ev.draws] == [[100.0, 130.0, 70.0].index(t) for t in out]
        return out

    first = draw(7)
    assert first == draw(7)
    assert set(first) == {100.0, 130.0, 70.0}  # with replacement, 30 draws of 3 samples reach all of them
    assert first != draw(8)
    median = TableEvaluator(table).evaluate(scn, plan)  # no Generator: the median sample, as before
    assert median.throughput is not None and median.throughput.tokens_per_s_per_gpu == 100.0


def test_a_drawn_run_carries_its_step_spread() -> None:
    table = _table([[100.0, 130.0, 70.0]])
    scn = table.load_scenario()
    ev = TableEvaluator(table, rng=np.random.default_rng(0))
    out = ev.evaluate(scn, parse_plan(table.runs[0].plan))
    sample = table.runs[0].samples[ev.draws[0][1]]
    assert spread_of(out.measurements) == sample.step_spread
    assert out.measurements is not None and out.provenance == {"source": "table", "sample": ev.draws[0][1]}
    # the step the refit reads is the spread's median step: tokens per step / (tokens/s per GPU x ranks)
    assert sample.step_spread is not None
    assert out.measurements["step_s"] == pytest.approx(sample.step_spread.median_s)
    low, high = sample.tokens_interval() or (0.0, 0.0)
    assert low < (sample.tokens_per_s_per_gpu or 0.0) < high


def test_epsilon_is_the_median_between_run_range_of_the_top_plans() -> None:
    # six plans that ran 3 times, best first by median; one faster plan ran once ok (no range) and is skipped;
    # the sixth plan's range is outside the top 5 and must not count
    rows: list[list[float | None]] = [[1000.0, None, None], [200.0, 180.0, 220.0], [190.0, 171.0, 199.0],
                                      [150.0, 150.0, 150.0], [140.0, 126.0, 147.0], [130.0, 65.0, 135.0],
                                      [100.0, 10.0, 190.0]]
    table = _table(rows)
    full = [[float(x or 0.0) for x in r] for r in rows[1:6]]
    ranges = [(max(r) - min(r)) / statistics.median(r) for r in full]
    assert len(ranges) == EPSILON_TOP_K
    eps = table.noise_epsilon()
    assert eps == pytest.approx(statistics.median(ranges))
    assert table.epsilon is not None and table.epsilon.plans == [r.plan for r in table.runs[1:6]]
    assert table.epsilon.best_plan == table.runs[1].plan and table.best_value() == 200.0
    keys = [r.plan for r in table.runs]
    assert table.within_noise(keys[1]) and table.within_noise(keys[2])  # 190 >= 200 * (1 - eps)
    assert not table.within_noise(keys[3]) and not table.within_noise(keys[0])  # 150; an oom-median plan
    # a stated epsilon wins over the one the samples give
    stated = table.model_copy(update={"epsilon": table.epsilon.model_copy(update={"value": 0.3})})
    assert stated.noise_epsilon() == 0.3 and stated.within_noise(keys[3])


def test_old_single_sample_format_loads_as_one_sample(tmp_path: Path) -> None:
    keys = _plans(2)
    old = {"name": "old", "scenario": RAW, "meta": {"steps": 4},
           "runs": [{"plan": keys[0], "status": "ok", "tokens_per_s_per_gpu": 292.9, "peak_gib": 0.0113,
                     "reason": ""},
                    {"plan": keys[1], "status": "oom", "tokens_per_s_per_gpu": None, "peak_gib": None,
                     "reason": "tracked peak 0.0127 GiB exceeds --memory-cap-gib 0.012"}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    table = load_table(path)
    ok, oom = table.runs
    assert [len(r.samples) for r in table.runs] == [1, 1]
    assert (ok.status, ok.tokens_per_s_per_gpu, ok.peak_gib) == ("ok", 292.9, 0.0113)
    assert oom.status == "oom" and oom.reason.startswith("tracked peak")
    assert table.epsilon is None and table.noise_epsilon() == 0.0 and table.within_noise(keys[0])
    ev = TableEvaluator(table, rng=np.random.default_rng(1))
    out = ev.evaluate(table.load_scenario(), parse_plan(keys[0]))
    assert out.throughput is not None and out.throughput.tokens_per_s_per_gpu == 292.9
    assert spread_of(out.measurements) is None  # a single 4-step measurement stored no spread
    # constructing a row the old way still works (bench/search_regret.py's sweep tables do), as does the typed form
    old_way = TableOutcome.model_validate({"plan": keys[0], "status": "ok", "tokens_per_s_per_gpu": 5.0, "peak_gib": 1.0})
    assert old_way == TableOutcome.single(keys[0], "ok", 5.0, 1.0) and old_way.samples[0].value == 5.0
