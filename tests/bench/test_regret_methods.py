"""The regret benchmark's baselines and figures on small hand-made tables (no loop replay: fast)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from regret import methods, procedures  # noqa: E402
from regret.instances import Instance, Runner, Truth  # noqa: E402
from regret.replay import METHODS, run_method  # noqa: E402
from regret.scoring import score, sign_test, wins_losses  # noqa: E402

from stratagem.evaluators.calibration import DEFAULT_CALIBRATION  # noqa: E402
from stratagem.evaluators.table import OutcomeTable, TableOutcome, TableSample  # noqa: E402
from stratagem.spaces import Plan, format_plan  # noqa: E402

SCENARIO = {"model": "llama3-8b", "cluster": {"gpu": "h100-sxm-80g", "num_nodes": 1, "gpus_per_node": 8},
            "training": {"seq_len": 4096, "global_batch_size": 64, "stack": "torch"},
            "search": {"precision": "bf16"}}


def _table(rows: list[tuple[Plan, list[float]]]) -> Truth:
    """A table whose plans have these samples (0: an OOM run)."""
    runs = [TableOutcome(plan=format_plan(p), samples=[
        TableSample(status="ok", tokens_per_s_per_gpu=v, peak_gib=60.0) if v > 0 else
        TableSample(status="oom", reason="out of memory") for v in values]) for p, values in rows]
    return Truth(Instance(OutcomeTable(name="t", scenario=SCENARIO, runs=runs)))


def _grid() -> list[tuple[Plan, list[float]]]:
    rows = []
    for tp in (1, 2):
        for zero in (0, 1, 3):
            for mbs in (1, 2, 4):
                fits = mbs * (3 - zero) <= 6 or tp == 2
                value = 1000.0 * mbs / (1 + 0.2 * zero) / tp if fits else 0.0
                rows.append((Plan(dp=8 // tp, tp=tp, zero_stage=zero, micro_batch_size=mbs), [value]))
    return rows


def test_rule_is_smallest_model_parallel_then_largest_micro_batch_then_lowest_stage() -> None:
    truth = _table(_grid())
    order = [truth.plans[truth.keys.index(k)] for k in methods.rule_order(truth)]
    assert [(p.tp, p.micro_batch_size, p.zero_stage) for p in order[:4]] == [(1, 4, 0), (1, 4, 1), (1, 4, 3),
                                                                              (1, 2, 0)]
    assert all(p.tp == 1 for p in order[:9]) and all(p.tp == 2 for p in order[9:])


def test_ds_autotuner_profiles_first_then_tunes_stages_in_order() -> None:
    truth = _table(_grid())
    runner = Runner(truth, np.random.default_rng(0))
    procedures.ds_autotuner(truth, runner, 20)
    first = truth.plans[truth.keys.index(runner.order[0])]
    assert (first.tp, first.zero_stage, first.micro_batch_size) == (1, 3, 1)  # least-memory profiling run
    stages = [truth.plans[truth.keys.index(k)].zero_stage for k in runner.order[1:]
              if truth.plans[truth.keys.index(k)].tp == 1]
    assert stages == sorted(stages)  # stages explored in the order 0, 1, 2, 3
    assert len(set(runner.order)) == len(runner.order)  # nothing run twice


def test_nemo_grid_follows_its_heuristic_row_for_the_named_model_size_at_4096_on_80gb() -> None:
    truth = _table(_grid())
    assert truth.scenario.model.num_params() > 8.0e9  # Llama-3-8B: 8.03e9 parameters, the "<= 13B" row by count
    assert procedures.nominal_size_b(truth) == 8.0  # AutoConfigurator is given the named size, 8B
    grid = procedures.nemo_grid(truth)
    # GPT3GridSearch's "<= 8B" row at seq 4096 on 80 GB: tp 1/2/4, pp 1-2, micro-batch 1/2/4
    assert {tp for tp, _, _ in grid} == {1, 2, 4} and {pp for _, pp, _ in grid} == {1, 2}
    assert {mbs for _, _, mbs in grid} == {1, 2, 4}
    assert grid[:4] == [(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1)]  # tp, then pp, then micro-batch


def test_the_named_size_is_the_sweep_groups_then_the_model_names_then_the_parameter_count() -> None:
    truth = _table(_grid())
    named = Truth(Instance(truth.table, model="1B", nodes=1))
    assert procedures.nominal_size_b(named) == 1.0
    unnamed = Truth(Instance(truth.table.model_copy(update={"scenario": {**SCENARIO, "model": {
        "name": "table-cpu", "num_layers": 4, "hidden_size": 128, "num_attention_heads": 8, "num_kv_heads": 4,
        "ffn_hidden_size": 256, "vocab_size": 512}}})))
    assert procedures.nominal_size_b(unnamed) == unnamed.scenario.model.num_params() / 1e9


def test_tpe_and_nsga2_draw_from_their_own_seed_streams() -> None:
    truth = _table(_grid())
    orders = {m: run_method(m, truth, 8, np.random.default_rng(np.random.SeedSequence([0, METHODS.index(m), 0])),
                            DEFAULT_CALIBRATION).order for m in ("tpe", "nsga2")}
    assert orders["tpe"] != orders["nsga2"]


def test_a_noisy_plan_is_judged_on_its_median_and_an_oom_draw_counts_as_failed() -> None:
    best = Plan(dp=8, micro_batch_size=4)
    other = Plan(dp=8, micro_batch_size=2)
    truth = _table([(best, [0.0, 1000.0, 1010.0]), (other, [600.0, 610.0, 620.0])])
    runner = Runner(truth, np.random.default_rng(0))
    runner.record(format_plan(best), 0.0)  # an OOM draw of the best plan
    runner.record(format_plan(other), 610.0)
    runner.record(format_plan(best), 1000.0)
    s = score(truth, runner, 10)
    assert s["curve"][:3] == [1.0, 1.0 - 610.0 / 1000.0, 1.0 - 610.0 / 1000.0]  # mean of best's runs 500 < 610
    assert s["runs_to_best"] == 11 and s["oom_runs"] == 1


def test_samplers_start_up_on_half_the_budget_and_nsga2_breeds_a_second_generation() -> None:
    truth = _table(_grid())
    assert methods.startup(10) == 5 and methods.startup(3) == 2
    runner = Runner(truth, np.random.default_rng(0))
    study = methods.blackbox(truth, runner, 10, 0, "nsga2")
    assert len(runner.order) == 10
    done = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished() and t.values]
    generations = [next(v for k, v in t.system_attrs.items() if k.endswith(":generation")) for t in done]
    assert generations == [0] * 5 + [1] * 5  # projected runs count in their suggestion's generation


def test_sign_test_is_the_exact_two_sided_binomial_and_pairs_seeds_only_when_their_counts_agree() -> None:
    assert sign_test(10, 0) == 2 / 2**10 and sign_test(8, 2) == 2 * (1 + 10 + 45) / 2**10
    assert sign_test(6, 7) == 1.0 and sign_test(0, 0) == 1.0

    def seeds(*firsts: float) -> list[dict]:
        return [{"curve": [f] * 10} for f in firsts]

    # instance 1: 3 seeds each (paired seed by seed: 2 wins, 1 tie); instance 2: 1 seed against 3 (means: a loss)
    mine = [seeds(0.1, 0.2, 0.5), seeds(0.4)]
    theirs = [seeds(0.3, 0.3, 0.5), seeds(0.0, 0.3, 0.6)]
    got = wins_losses(mine, theirs)
    assert set(got) == {"1", "3", "5", "10"}
    assert got["1"] == {"wins": 2, "losses": 1, "ties": 1, "p": 1.0}
