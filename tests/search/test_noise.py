"""How repeated runs of one plan combine (search/noise.py): the timed steps pooled into one spread, the plan's
tokens/s from the pooled median, the peak the highest; without per-step times the runs' intervals are hulled."""

from __future__ import annotations

import pytest

from stratagem.evaluators import Evaluation, spread_of, spread_of_samples
from stratagem.evaluators.evaluation import MemoryBreakdown, Throughput
from stratagem.search.noise import pooled_evaluation, pooled_runs, tokens_interval
from stratagem.spaces import Plan

PLAN = Plan(dp=4)


def _run(times: list[float], peak: float, with_steps: bool = True) -> Evaluation:
    spread = spread_of_samples(times)
    tokens = 1000.0 / spread.median_s
    m: dict = {"step_s": spread.median_s, "step_spread": spread.model_dump(mode="json")}
    if with_steps:
        m |= {"step_times_s": [9.9, *times], "warmup": 1, "tokens_per_step": 1000, "tokens_per_s": tokens}  # one warm-up step, dropped
    mem = MemoryBreakdown(weights_gib=0, gradients_gib=0, optimizer_gib=0, activations_gib=peak, transient_gib=0,
                          overhead_gib=0, peak_gib=peak, hbm_gib=1.0, headroom_gib=1.0 - peak,
                          first_block_to_break=None, worst_stage=0)
    return Evaluation(plan=PLAN, status="ok", fidelity="measured", memory=mem, measurements=m,
                      throughput=Throughput(tokens_per_s=tokens, tokens_per_s_per_gpu=tokens / 4, mfu=0.1))


def test_runs_pool_their_timed_steps() -> None:
    a, b = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0], [2.0, 2.1, 1.9, 2.0, 2.2, 2.0]  # the second run on a loaded host
    pooled = pooled_evaluation([_run(a, 0.5), _run(b, 0.6)])
    spread = spread_of(pooled.measurements)
    assert spread is not None and spread.n == 12 and spread == spread_of_samples(a + b)
    assert spread.low_s <= 1.1 and spread.high_s >= 1.9  # the runs disagree: the interval says so
    assert pooled.throughput.tokens_per_s == pytest.approx(1000.0 / spread.median_s)
    assert pooled.measurements["tokens_per_s"] == pooled.throughput.tokens_per_s  # the stored result agrees
    assert pooled.memory.peak_gib == 0.6 and pooled_runs(pooled) == {"runs": 2, "run_step_s": [1.0, 2.0]}
    c = [1.5, 1.4, 1.6, 1.5, 1.5, 1.5]
    again = pooled_evaluation([_run(a, 0.5), pooled, _run(c, 0.4)])  # a pooled trial brings its own run's steps only
    assert spread_of(again.measurements).n == 18 and pooled_runs(again)["run_step_s"] == [1.0, 2.0, 1.5]


def test_runs_without_steps_hull_their_intervals() -> None:
    a, b = [1.0, 1.1, 0.9, 1.0, 1.2, 1.0], [1.4, 1.5, 1.3, 1.4, 1.6, 1.4]
    pooled = pooled_evaluation([_run(a, 0.5, False), _run(b, 0.5, False)])
    spread = spread_of(pooled.measurements)
    assert spread.low_s == 0.9 and spread.high_s == 1.6 and spread.median_s == pytest.approx(1.2)
    lo, hi = tokens_interval(pooled.throughput.tokens_per_s, spread)
    assert lo < pooled.throughput.tokens_per_s < hi
