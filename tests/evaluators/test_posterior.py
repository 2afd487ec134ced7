"""Per-term multipliers in the calibration and the predictive distribution of every plan (evaluators.posterior)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pydantic import ValidationError

from stratagem.evaluators import evaluate_many
from stratagem.evaluators.calibration import Calibration, LogMultipliers, default_calibration
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.posterior import expand, predictive, predictive_from_figures
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.timing import TIME_TERMS, term_seconds, time_columns
from stratagem.spaces import load_scenario
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

SCENARIOS = ("demo-cpu", "llama3-8b-8xh100", "mixtral-8x7b-64xh200", "tiny-moe-cpu")


def _space(name: str, limit: int = 400) -> tuple[Scenario, object]:
    scn = load_scenario(f"examples/{name}.yaml")
    sp = SearchSpace(scn)
    return scn, sp.decode(np.unique(np.linspace(0, len(sp) - 1, min(len(sp), limit)).astype(np.int64)))


def multipliers(names: tuple[str, ...], **means: float) -> LogMultipliers:
    """A posterior with the given log means (others 0) and a small diagonal covariance."""
    k = len(names)
    return LogMultipliers(names=names, mean=tuple(means.get(n, 0.0) for n in names),
                          cov=tuple(tuple(0.01 if i == j else 0.0 for j in range(k)) for i in range(k)),
                          noise_sd=0.05, runs=3)


@pytest.mark.parametrize("name", SCENARIOS)
def test_multipliers_of_one_are_the_formulas_exactly(name: str) -> None:
    """Log multipliers 0 give evaluate_many's figures bit for bit, as no multipliers do (None: the code path is the
    formulas'; checked against main before the multipliers landed on 35,702 plans of four scenarios)."""
    scn, pc = _space(name)
    cal = default_calibration(scn.cluster.gpu.name)
    ones = cal.model_copy(update={"time_multipliers": multipliers(TIME_TERMS),
                                  "memory_multipliers": multipliers(BLOCKS)})
    plain, same = evaluate_many(scn, pc, cal), evaluate_many(scn, pc, ones)
    for f in dataclasses.fields(plain):
        assert np.array_equal(getattr(plain, f.name), getattr(same, f.name), equal_nan=True), f.name


def test_a_term_multiplier_scales_that_term_and_the_step_is_the_sum() -> None:
    scn, pc = _space("llama3-8b-8xh100")
    cal = default_calibration(scn.cluster.gpu.name)
    tp = cal.model_copy(update={"time_multipliers": multipliers(TIME_TERMS, tp_comm_s=np.log(1.5))})
    a, b = time_columns(scn, pc, cal), time_columns(scn, pc, tp)
    np.testing.assert_allclose(b["tp_comm_s"], 1.5 * a["tp_comm_s"], rtol=1e-12)
    np.testing.assert_allclose(b["tp_hidden_s"], 1.5 * a["tp_hidden_s"], rtol=1e-12)
    np.testing.assert_array_equal(b["compute_s"], a["compute_s"])
    np.testing.assert_allclose(term_seconds(b).sum(axis=1), b["step_s"], rtol=1e-12)
    assert (a["tp_comm_s"] > 0).any() and (b["step_s"] >= a["step_s"]).all()


def test_a_block_multiplier_scales_that_block_before_the_worst_stage() -> None:
    scn, pc = _space("demo-cpu")
    cal = default_calibration("cpu")
    act = cal.model_copy(update={"memory_multipliers": multipliers(BLOCKS, activations=np.log(2.0))})
    a, b = evaluate_many(scn, pc, cal), evaluate_many(scn, pc, act)
    total = sum(b.block_gib(x) for x in BLOCKS)
    np.testing.assert_allclose(total, b.peak_gib, rtol=1e-12)
    assert (b.peak_gib >= a.peak_gib).all() and (b.peak_gib > a.peak_gib).any()
    same_stage = b.worst_stage == a.worst_stage
    np.testing.assert_allclose(b.activations_gib[same_stage], 2 * a.activations_gib[same_stage], rtol=1e-12)


def test_multiplier_names_are_checked() -> None:
    with pytest.raises(ValidationError, match="not memory blocks"):
        Calibration(memory_multipliers=multipliers(("weights", "kv_cache")))
    with pytest.raises(ValidationError, match="one entry per name"):
        LogMultipliers(names=("compute_s",), mean=(0.0, 1.0), cov=((1.0,),), noise_sd=0.1, runs=1)
    scn, pc = _space("demo-cpu", 5)
    with pytest.raises(ValueError, match="not step-time terms"):
        time_columns(scn, pc, Calibration(time_multipliers=multipliers(("compute_s", "nccl_s"))))


@pytest.mark.parametrize("name", SCENARIOS)
def test_predictive_is_the_model_at_the_mean_with_shares_that_sum_to_one(name: str) -> None:
    scn, pc = _space(name)
    cal = default_calibration(scn.cluster.gpu.name)
    pred, figs = predictive(scn, pc, cal), evaluate_many(scn, pc, cal)
    np.testing.assert_allclose(pred.log_tokens.mean, np.log(figs.tokens_per_s), rtol=1e-12)
    np.testing.assert_allclose(pred.log_peak.mean, np.log(figs.peak_gib), rtol=1e-12)
    np.testing.assert_allclose(pred.log_tokens.shares.sum(axis=1), -1.0, atol=1e-9)
    np.testing.assert_allclose(pred.log_peak.shares.sum(axis=1), 1.0, atol=1e-9)
    assert (pred.log_tokens.shares <= 1e-12).all() and (pred.log_peak.shares >= 0).all()
    same = predictive_from_figures(scn, figs, cal)
    np.testing.assert_allclose(same.log_tokens.shares, pred.log_tokens.shares, atol=1e-12)
    # no multipliers: the prior covariance, so every plan has a spread before any run
    prior = prior_for(scn.cluster.gpu.name)
    np.testing.assert_array_equal(np.diag(pred.log_tokens.cov), [prior.time_widths[t] ** 2 for t in TIME_TERMS])
    assert (pred.log_tokens.sd() > prior.time_noise_sd).all() and (pred.log_peak.sd() > 0).all()


def test_predictive_linearisation_matches_the_model() -> None:
    """shares are d log value / d log multiplier: a small move of one multiplier moves log tokens/s and log peak by
    its share (first order)."""
    scn, pc = _space("llama3-8b-8xh100", 200)
    cal = default_calibration(scn.cluster.gpu.name)
    pred = predictive(scn, pc, cal)
    eps = 1e-4
    for k, term in enumerate(TIME_TERMS):
        moved = evaluate_many(scn, pc, cal.model_copy(update={"time_multipliers": multipliers(TIME_TERMS,
                                                                                              **{term: eps})}))
        np.testing.assert_allclose((np.log(moved.tokens_per_s) - pred.log_tokens.mean) / eps,
                                   pred.log_tokens.shares[:, k], atol=1e-3)
    for k, block in enumerate(BLOCKS):
        moved = evaluate_many(scn, pc, cal.model_copy(update={"memory_multipliers": multipliers(BLOCKS,
                                                                                               **{block: eps})}))
        np.testing.assert_allclose((np.log(moved.peak_gib) - pred.log_peak.mean) / eps, pred.log_peak.shares[:, k],
                                   atol=1e-3)


def test_expand_fills_missing_terms_from_the_prior() -> None:
    prior = prior_for("cpu").time()
    some = LogMultipliers(names=("tp_comm_s", "compute_s"), mean=(0.4, -0.1), cov=((0.04, 0.01), (0.01, 0.02)),
                          noise_sd=0.2, runs=4)
    full = expand(some, prior)
    i, j = TIME_TERMS.index("tp_comm_s"), TIME_TERMS.index("compute_s")
    assert full.names == TIME_TERMS and full.mean[i] == 0.4 and full.mean[j] == -0.1
    assert full.cov[i][j] == 0.01 and full.cov[i][i] == 0.04
    other = TIME_TERMS.index("bubble_s")
    assert full.cov[other][other] == prior.cov[other][other] and full.cov[other][i] == 0.0
    assert expand(None, prior) is prior
