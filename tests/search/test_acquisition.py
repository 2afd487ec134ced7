"""The acquisition (search/acquisition.py) and the expected-improvement run order (search/run_order.py
ExpectedImprovementOrder): the closed-form expected improvement against Monte Carlo, the probability of fitting,
the kriging believer's batch against greedy top-k and against a brute-force re-scoring, and the order over a
real SearchSession."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from standin import SCENARIO, KnownConstants

from stratagem.evaluators import Calibration
from stratagem.evaluators.posterior import LogNormalColumns, Predictive
from stratagem.search.acquisition import (
    believer_batch,
    expected_improvement,
    log_expected_improvement,
    log_normal_cdf,
    log_probability_of_fit,
    plug_in_incumbent,
)
from stratagem.search.events import Event
from stratagem.search.records import plan_key
from stratagem.search.run_order import ExpectedImprovementOrder, RunState
from stratagem.search.session import SearchSession
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2),
         Plan(dp=4, zero_stage=3)]


def _columns(mean: list[float], shares: list[list[float]], var: list[float], noise: float = 0.0) -> LogNormalColumns:
    return LogNormalColumns(mean=np.array(mean), shares=np.array(shares), cov=np.diag(var), noise_sd=noise)


@pytest.mark.parametrize("best", [0.0, 0.5, 3.0, 20.0])
def test_expected_improvement_is_the_monte_carlo_mean_of_the_gain(best: float) -> None:
    rng = np.random.default_rng(0)
    mu, sd = np.array([0.0, 1.0, 2.0, 1.5, -0.5]), np.array([0.3, 0.5, 0.1, 1.0, 0.8])
    x = np.exp(mu[:, None] + sd[:, None] * rng.standard_normal((len(mu), 1_000_000)))
    gain = np.maximum(x - best, 0.0)
    mc, se = gain.mean(axis=1), gain.std(axis=1) / 1000.0
    assert np.all(np.abs(expected_improvement(mu, sd, best) - mc) <= 4 * se + 1e-12)


def test_the_log_improvement_stays_ordered_far_below_the_incumbent() -> None:
    """Where the improvement underflows a float it keeps its order in log space: a plan 3 sd nearer the
    incumbent scores higher, all the way down (the tail through the Mills ratio)."""
    d = np.linspace(-60.0, 2.0, 300)
    s = np.full(len(d), 0.2)
    log_ei = log_expected_improvement(math.log(10.0) + d * s, s, 10.0)
    assert np.all(np.isfinite(log_ei)) and np.all(np.diff(log_ei) > 0)
    for switch in (-5.0, -30.0):  # the direct form, the Mills ratio's and its series agree where they meet
        at = np.array([switch - 1e-9, switch + 1e-9])
        assert np.ptp(log_expected_improvement(math.log(10.0) + at * 0.2, np.full(2, 0.2), 10.0)) < 1e-6
    exact = math.log(0.5 * math.erfc(35 / math.sqrt(2)))  # the series beyond -30 against erfc, still a float
    assert log_normal_cdf(np.array([-35.0]))[0] == pytest.approx(exact, rel=1e-12)


def test_probability_of_fit() -> None:
    usable = 10.0
    mu = np.log(np.array([5.0, 10.0, 11.0, 20.0]))
    p = np.exp(log_probability_of_fit(mu, np.full(4, 0.1), usable))
    assert p[0] > 0.999 and p[1] == pytest.approx(0.5) and 0.1 < p[2] < 0.5 and p[3] < 1e-9
    sure = np.exp(log_probability_of_fit(mu, np.zeros(4), usable))
    assert sure.tolist() == [1.0, 1.0, 0.0, 0.0]
    wider = np.exp(log_probability_of_fit(mu[2:3], np.array([0.5]), usable))
    assert wider[0] > p[2]  # an over-limit plan is likelier to fit the less the model knows


def test_the_believer_spreads_a_batch_over_what_the_runs_would_teach() -> None:
    """Plans 0 and 1 owe their promise to one uncertain term; plan 2 to another, slightly less. Greedy top-2 runs
    0 and 1; the believer, having believed 0's run, knows 1 would teach little more and runs 2."""
    tokens = _columns([1.0, 0.99, 0.95], [[1, 0], [1, 0], [0, 1]], [0.2, 0.2], noise=0.01)
    peak = _columns([0.0, 0.0, 0.0], [[1, 0], [1, 0], [0, 1]], [0.01, 0.01])
    pred = Predictive(log_tokens=tokens, log_peak=peak)
    score = log_expected_improvement(tokens.mean, tokens.sd(), math.exp(1.0)) + log_probability_of_fit(
        peak.mean, peak.sd(), 2.0)
    greedy = np.argsort(-score)[:2].tolist()
    batch = believer_batch(pred, math.exp(1.0), 2.0, np.ones(3, dtype=bool), 2)
    assert greedy == [0, 1] and batch == [0, 2]


def _brute_force(pred: Predictive, best: float, usable: float, k: int) -> list[int]:
    """The kriging believer re-scoring every plan after every pick (the lazy one must pick the same)."""
    covs = [pred.log_tokens.cov.copy(), pred.log_peak.cov.copy()]
    picks: list[int] = []
    for _ in range(k):
        sd = [np.sqrt(np.einsum("nk,kl,nl->n", c.shares, cov, c.shares) + c.noise_sd**2)
              for c, cov in zip((pred.log_tokens, pred.log_peak), covs, strict=True)]
        score = log_expected_improvement(pred.log_tokens.mean, sd[0], best) + log_probability_of_fit(
            pred.log_peak.mean, sd[1], usable)
        score[picks] = -np.inf
        i = int(np.argmax(score))
        picks.append(i)
        for c, cov in zip((pred.log_tokens, pred.log_peak), covs, strict=True):
            v = cov @ c.shares[i]
            cov -= np.outer(v, v) / (c.shares[i] @ v + c.noise_sd**2)
        if pred.log_peak.mean[i] <= math.log(usable):
            best = max(best, math.exp(pred.log_tokens.mean[i]))
    return picks


def test_the_lazy_believer_picks_what_rescoring_everything_picks() -> None:
    rng = np.random.default_rng(3)
    n, k = 20_000, 6  # over several of its chunks
    shares = rng.random((n, k))
    shares /= shares.sum(axis=1, keepdims=True)
    a = rng.normal(size=(k, k)) * 0.1
    tokens = LogNormalColumns(mean=rng.normal(10.0, 0.3, n), shares=shares, cov=a @ a.T, noise_sd=0.02)
    peak = LogNormalColumns(mean=rng.normal(0.0, 0.2, n), shares=shares, cov=np.eye(k) * 0.01, noise_sd=0.01)
    pred = Predictive(log_tokens=tokens, log_peak=peak)
    best = math.exp(10.4)
    assert believer_batch(pred, best, 1.0, np.ones(n, dtype=bool), 8) == _brute_force(pred, best, 1.0, 8)
    refused = _brute_force(pred, best, 1.0, 1)[0]  # a refused plan is passed over and conditions nothing
    got = believer_batch(pred, best, 1.0, np.ones(n, dtype=bool), 3, admit=lambda i: i != refused)
    assert refused not in got and len(got) == 3


def _session(tmp_path: Path) -> SearchSession:
    events: list[Event] = []
    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 'a.db'}", "a", listener=events.append)
    s.screen()
    s.store()
    return s


def _state(s: SearchSession) -> RunState:
    return RunState(scenario=s.scenario, space=s.space, study=s.study, calibration=s.start_calibration,
                    excluded=frozenset(), measured_runs=0, runs_left=4, unsupported=KnownConstants().unsupported)


def test_a_plan_that_surely_fits_beats_a_faster_one_that_probably_does_not(tmp_path: Path) -> None:
    """Two candidates: 5 % faster but predicted 5 % over the usable memory with 5 % memory error, or slower and
    far under it. The expected improvement alone would run the faster; times its probability of fitting
    (about 0.16) it runs the one that fits."""
    s = _session(tmp_path)
    fast, sure = PLANS[0], PLANS[1]
    usable = s.usable_gib

    def predict(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Predictive:
        is_fast = np.array([plan_key(pc.plan(i)) == plan_key(fast) for i in range(len(pc))])
        tokens = LogNormalColumns(mean=np.where(is_fast, math.log(105.0), math.log(100.0)),
                                  shares=np.ones((len(pc), 1)), cov=np.eye(1) * 0.01, noise_sd=0.01)
        peak = LogNormalColumns(mean=np.log(np.where(is_fast, 1.05, 0.7) * usable), shares=np.ones((len(pc), 1)),
                                cov=np.eye(1) * 0.05**2, noise_sd=0.0)
        return Predictive(log_tokens=tokens, log_peak=peak)

    order = ExpectedImprovementOrder(candidates=PlanColumns.from_plans([fast, sure]), predict=predict)
    picks = order.next_batch(_state(s), 1)
    assert [plan_key(p) for p, _ in picks] == [plan_key(sure)]
    pred = predict(s.scenario, PlanColumns.from_plans([fast, sure]), s.start_calibration)
    ei = log_expected_improvement(pred.log_tokens.mean, pred.log_tokens.sd(), 0.0)
    assert ei[0] > ei[1]  # the improvement alone prefers the faster


def test_the_order_runs_stores_and_remeasures_over_a_session(tmp_path: Path) -> None:
    """Over the loop with the stand-in evaluator (40 % step noise) and the calibration's own predictive
    distributions (evaluators.posterior.predictive): the ZeRO-3 plan the harness refuses is skipped, the other
    three are measured, and the two runs beyond them re-measure (search/noise.py)."""
    s = _session(tmp_path)
    order = ExpectedImprovementOrder(candidates=PlanColumns.from_plans(PLANS))
    mf = s.measure(5, KnownConstants(noise=0.4, seed=1), order)
    measured = [t for t in s.study.trials if t.user_attrs.get("fidelity") == "measured"]
    assert mf.measured == 5 and len({t.user_attrs["plan"] for t in measured}) == 3
    assert sum(t.user_attrs.get("role") == "remeasured" for t in measured) == 2
    assert list(order.skipped) == [plan_key(PLANS[3])]


def test_a_new_posterior_of_the_multipliers_reorders_without_the_model(tmp_path: Path) -> None:
    """The order keeps the formulas' terms (evaluators.posterior.PredictiveBasis) while the constants stay: after a
    refit that adopts time multipliers (the pipeline bubble x4, sure) the pipelined plan is no longer first, and
    the order picks what the full predictive picks."""
    from stratagem.evaluators.calibration import LogMultipliers
    from stratagem.evaluators.posterior import predictive
    from stratagem.evaluators.step_parts import TIME_TERMS

    s = _session(tmp_path)
    cands = PlanColumns.from_plans(PLANS[:3])
    k = len(TIME_TERMS)
    taught = LogMultipliers(names=TIME_TERMS, mean=tuple(math.log(4.0) if t == "bubble_s" else 0.0 for t in TIME_TERMS),
                            cov=tuple(tuple(1e-4 if i == j else 0.0 for j in range(k)) for i in range(k)),
                            noise_sd=0.01, runs=3)
    after = dataclasses.replace(_state(s), calibration=s.start_calibration.model_copy(
        update={"time_multipliers": taught}))
    kept = ExpectedImprovementOrder(candidates=cands)
    before = [plan_key(p) for p, _ in kept.next_batch(_state(s), 3)]  # the basis at the start's constants
    now = [plan_key(p) for p, _ in kept.next_batch(after, 3)]
    fresh = ExpectedImprovementOrder(candidates=cands, predict=predictive)
    assert before[0] == plan_key(PLANS[2]) and now[0] != before[0]
    assert now == [plan_key(p) for p, _ in fresh.next_batch(after, 3)]


def test_the_plug_in_incumbent_is_the_best_median_predicted_to_fit() -> None:
    """Before any measured plan fits, the incumbent is the highest predicted median tokens/s among eligible plans
    whose median peak fits and whose run did not fail (Picheny et al. 2013's plug-in); 0 when none does."""
    tokens = _columns([math.log(300.0), math.log(200.0), math.log(100.0)], [[1], [1], [1]], [0.1])
    peak = _columns([math.log(3.0), math.log(0.9), math.log(0.5)], [[1], [1], [1]], [0.01])
    pred = Predictive(log_tokens=tokens, log_peak=peak)
    assert plug_in_incumbent(pred, 1.0, np.ones(3, dtype=bool)) == pytest.approx(200.0)
    assert plug_in_incumbent(pred, 1.0, np.array([True, False, True])) == pytest.approx(100.0)
    assert plug_in_incumbent(pred, 1.0, np.ones(3, dtype=bool), failed=lambda i: i == 1) == pytest.approx(100.0)
    assert plug_in_incumbent(pred, 0.1, np.ones(3, dtype=bool)) == 0.0


def test_the_first_run_goes_where_it_can_beat_what_the_model_promises(tmp_path: Path) -> None:
    """Two candidates, nothing measured: one predicted at 200 tok/s with its median peak just under the usable
    memory (P(fit) about 0.5), one at 110 tok/s that surely fits. Over an incumbent of 0 the expected improvement
    is the mean x P(fit) (about 100 vs 110): the slow one runs, and it cannot be the best the model expects. Over
    the plug-in incumbent (200 tok/s) only the fast one can improve: it runs first."""
    s = _session(tmp_path)
    fast, safe = PLANS[0], PLANS[1]
    usable = s.usable_gib

    def predict(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Predictive:
        is_fast = np.array([plan_key(pc.plan(i)) == plan_key(fast) for i in range(len(pc))])
        tokens = LogNormalColumns(mean=np.where(is_fast, math.log(200.0), math.log(110.0)),
                                  shares=np.eye(len(pc)), cov=np.eye(len(pc)) * 0.01, noise_sd=0.0)
        peak = LogNormalColumns(mean=np.log(np.where(is_fast, 0.999, 0.5) * usable), shares=np.ones((len(pc), 1)),
                                cov=np.eye(1) * 0.05**2, noise_sd=0.0)
        return Predictive(log_tokens=tokens, log_peak=peak)

    pred = predict(s.scenario, PlanColumns.from_plans([fast, safe]), s.start_calibration)
    at_zero = log_expected_improvement(pred.log_tokens.mean, pred.log_tokens.sd(), 0.0) + log_probability_of_fit(
        pred.log_peak.mean, pred.log_peak.sd(), usable)
    assert at_zero[1] > at_zero[0]  # an incumbent of 0 would run the safe, slower plan
    order = ExpectedImprovementOrder(candidates=PlanColumns.from_plans([fast, safe]), predict=predict)
    assert [plan_key(p) for p, _ in order.next_batch(_state(s), 1)] == [plan_key(fast)]


def test_after_a_refit_of_the_constants_the_order_picks_what_a_new_order_picks(tmp_path: Path, monkeypatch) -> None:
    """The order keeps the plans and their memory blocks from one batch to the next (predictive_basis `like`): under
    refitted constants (time constants, fragmentation and context moved) it picks what a new order picks, without
    the memory model."""
    from stratagem.evaluators import posterior

    s = _session(tmp_path)
    cands = PlanColumns.from_plans(PLANS[:3])
    cal = s.start_calibration
    refit = cal.model_copy(update={"matmul_efficiency": cal.matmul_efficiency / 4, "layer_floor_ms": 40.0,
                                   "step_overhead_s": 0.3, "fragmentation": 0.2, "context_gib": 0.05})
    after = dataclasses.replace(_state(s), calibration=refit)
    kept = ExpectedImprovementOrder(candidates=cands)
    kept.next_batch(_state(s), 3)
    memory_model = posterior.rank_memory_columns
    monkeypatch.setattr(posterior, "rank_memory_columns", None)  # called: a TypeError
    now = [plan_key(p) for p, _ in kept.next_batch(after, 3)]
    monkeypatch.setattr(posterior, "rank_memory_columns", memory_model)
    assert now == [plan_key(p) for p, _ in ExpectedImprovementOrder(candidates=cands).next_batch(after, 3)]
