"""Per-term multipliers in the calibration and the predictive distribution of every plan (evaluators.posterior)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from pydantic import ValidationError

from stratagem.evaluators import evaluate_many
from stratagem.evaluators.calibration import Calibration, LogMultipliers, default_calibration
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.posterior import expand, predictive, predictive_basis, predictive_from_figures
from stratagem.evaluators.posterior_fit import fit_multipliers, log_phi, mills
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.step_parts import TIME_TERMS, term_seconds
from stratagem.evaluators.timing import time_columns
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


# ---- the fit (evaluators.posterior_fit) -------------------------------------------------------------------------
def _runs(name: str, n: int, seed: int) -> tuple[Scenario, object]:
    scn = load_scenario(f"examples/{name}.yaml")
    sp = SearchSpace(scn)
    return scn, sp.decode(np.random.default_rng(seed).choice(len(sp), n, replace=False))


def _synthetic_steps(scn: Scenario, pc: object, truth: dict[str, float], noise: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(terms by the formulas, log measured steps) of runs generated by the model itself with the `truth`
    multipliers and log-normal noise."""
    cal = default_calibration(scn.cluster.gpu.name)
    a = term_seconds(time_columns(scn, pc, cal))
    theta = np.array([np.log(truth.get(t, 1.0)) for t in TIME_TERMS])
    y = np.log(a @ np.exp(theta)) + np.random.default_rng(seed).normal(0.0, noise, len(a))
    return a, y


def test_the_fit_recovers_a_mispriced_term() -> None:
    """Runs generated by the model with TP comm 1.5x too cheap and 3 % noise: the posterior finds TP x1.5 within
    two of its sds and leaves the terms the runs say little about near 1 with their prior width."""
    scn, pc = _runs("demo-cpu", 20, 0)
    a, y = _synthetic_steps(scn, pc, {"tp_comm_s": 1.5}, 0.03, 1)
    prior = prior_for("cpu").time()
    post = fit_multipliers(a, y, prior)
    tp = TIME_TERMS.index("tp_comm_s")
    assert abs(post.mean[tp] - np.log(1.5)) < 2 * post.sd("tp_comm_s") and post.sd("tp_comm_s") < 0.1
    for term in ("ep_comm_s", "cp_comm_s"):  # no EP or CP in a dense model without cp: the prior, unmoved
        i = TIME_TERMS.index(term)
        assert post.mean[i] == pytest.approx(0.0, abs=1e-9) and post.sd(term) == pytest.approx(prior.sd(term))
    assert post.runs == 20 and 0.02 < post.noise_sd < prior.noise_sd


def test_predictive_sd_shrinks_with_runs() -> None:
    scn, pc = _runs("demo-cpu", 24, 2)
    a, y = _synthetic_steps(scn, pc, {"tp_comm_s": 1.5, "compute_s": 0.8}, 0.03, 3)
    cal = default_calibration("cpu")
    unseen = _space("demo-cpu", 300)[1]
    sds = [predictive(scn, unseen, cal).log_tokens.model_var().mean()]
    for n in (4, 12, 24):
        post = fit_multipliers(a[:n], y[:n], prior_for("cpu").time())
        sds.append(predictive(scn, unseen, cal.model_copy(update={"time_multipliers": post})).log_tokens
                   .model_var().mean())
    assert all(later < earlier for earlier, later in zip(sds, sds[1:], strict=False)), sds


def test_censored_ooms_move_the_memory_posterior_up() -> None:
    """Plans predicted to fit that ran out of memory (their activations 1.4x the formula's): the censored
    observations alone push the posterior so that each OOM plan's peak is predicted at least near the cap, most
    through the block with the largest share, and the predicted chance of fitting falls."""
    scn, pc = _runs("demo-cpu", 40, 4)
    cal = default_calibration("cpu")
    mem = evaluate_many(scn, pc, cal)
    blocks = np.stack([mem.block_gib(b) for b in BLOCKS], axis=1)
    truth = blocks @ np.array([1.4 if b == "activations" else 1.0 for b in BLOCKS])
    cap = float(np.quantile(mem.peak_gib, 0.5)) * 1.05
    oom = (truth > cap) & (mem.peak_gib < cap)  # ran out though predicted to fit
    assert oom.sum() >= 2
    prior = prior_for("cpu").memory()
    post = fit_multipliers(np.zeros((0, len(BLOCKS))), np.zeros(0), prior, blocks[oom], np.log(cap))
    before = predictive(scn, pc, cal).log_peak
    after = predictive(scn, pc, cal.model_copy(update={"memory_multipliers": post})).log_peak
    assert (after.mean[oom] > before.mean[oom]).all()
    assert np.exp(after.mean[oom]).min() > 0.97 * cap
    act = BLOCKS.index("activations")
    moved = np.array(post.mean) - np.array(prior.mean)
    assert moved[act] == max(moved) and moved[act] > 0

    def fits(ln: object) -> np.ndarray:
        z = (np.log(cap) - ln.mean) / ln.sd()
        return 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))

    assert (fits(after)[oom] < fits(before)[oom]).all()


def test_normal_tail_functions() -> None:
    z = np.array([-40.0, -8.0, -5.0 - 1e-9, -5.0, -1.0, 0.0, 3.0])
    exact = np.array([math.log(0.5 * math.erfc(-v / math.sqrt(2))) if v > -30 else np.nan for v in z])
    got = log_phi(z)
    np.testing.assert_allclose(got[1:], exact[1:], rtol=1e-3)
    assert np.isfinite(got[0]) and got[0] < -800
    lam = mills(z)
    assert lam[2] == pytest.approx(lam[3], rel=1e-3) and lam[0] == pytest.approx(40.0, rel=1e-3)
    assert mills(np.array([0.0]))[0] == pytest.approx(math.sqrt(2 / math.pi))


@pytest.mark.parametrize("name", ["demo-cpu", "mixtral-8x7b-64xh200"])
def test_a_basis_gives_the_predictive_of_any_posterior_without_the_model(name: str) -> None:
    """predictive_basis keeps the formulas' terms; `at` a calibration with moved multipliers (activations x2 can
    change which stage is the worst) it is predictive's distribution; other constants are refused."""
    scn, pc = _space(name)
    cal = default_calibration(scn.cluster.gpu.name)
    basis = predictive_basis(scn, pc, cal)
    moved = cal.model_copy(update={"time_multipliers": multipliers(TIME_TERMS, tp_comm_s=0.4, compute_s=-0.2),
                                   "memory_multipliers": multipliers(BLOCKS, activations=np.log(2.0))})
    for c in (cal, moved):
        want, got = predictive(scn, pc, c), basis.at(c)
        for a, b in ((want.log_tokens, got.log_tokens), (want.log_peak, got.log_peak)):
            np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12)
            np.testing.assert_allclose(b.shares, a.shares, atol=1e-12)
            np.testing.assert_array_equal(b.cov, a.cov)
            assert b.noise_sd == a.noise_sd
    with pytest.raises(ValueError, match="constants differ"):
        basis.at(cal.model_copy(update={"fragmentation": 0.5}))


@pytest.mark.parametrize("name", ["demo-cpu", "mixtral-8x7b-64xh200", "tiny-moe-cpu"])
def test_a_basis_at_refitted_constants_keeps_the_memory_blocks_of_the_same_plans(name: str) -> None:
    """A study's refit moves the time constants (MEMORY_FREE), fragmentation and context: a basis made `like` one
    of the same plans at other constants keeps its memory blocks (the overhead block recomputed) and is the basis
    made afresh, bit for bit; the memory model reads none of MEMORY_FREE (its blocks are the same at any of them)."""
    from stratagem.evaluators.memory import rank_memory_columns
    from stratagem.evaluators.posterior import MEMORY_FREE

    scn, pc = _space(name)
    cal = default_calibration(scn.cluster.gpu.name)
    refit = cal.model_copy(update={**{f: getattr(cal, f) * 0.7 + 0.01 for f in MEMORY_FREE},
                                   "fragmentation": 0.13, "context_gib": 0.9})
    for stage in ("first", "last"):
        a, b = rank_memory_columns(scn, pc, cal, stage), rank_memory_columns(
            scn, pc, refit.model_copy(update={"fragmentation": cal.fragmentation, "context_gib": cal.context_gib}),
            stage)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    before = predictive_basis(scn, pc, cal)
    for c in (refit, refit.model_copy(update={"logits_bytes": 3.0})):  # logits: the blocks are computed again
        kept, fresh = predictive_basis(scn, pc, c, like=before), predictive_basis(scn, pc, c)
        assert kept.constants == fresh.constants
        for f in ("terms", "first", "last"):
            np.testing.assert_array_equal(getattr(kept, f), getattr(fresh, f))
