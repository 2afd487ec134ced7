"""Which unmeasured plan a real run should settle next, from the predictive distributions of its tokens/s and
its peak memory (evaluators.posterior.Predictive): pure numpy over every plan at once.

Sources:
  [EGO]    Jones, Schonlau & Welch 1998, "Efficient Global Optimization of Expensive Black-Box Functions", sec. 4.1:
           the expected improvement E[max(f - f*, 0)] over the best value measured, here of a log-normal tokens/s
           X = exp(N(mu, s^2)): E[max(X - f*, 0)] = e^(mu + s^2/2) Phi(d + s) - f* Phi(d), d = (mu - ln f*) / s
           (the Black-Scholes call price with strike f*).
  [cEI]    Gardner et al. 2014, "Bayesian Optimization with Inequality Constraints", sec. 3; Gelbart, Snoek & Adams
           2014, "Bayesian Optimization with Unknown Constraints", sec. 2.3: with an uncertain constraint, the
           expected improvement over the best plan that satisfied it, times the probability of satisfying it,
           here P(peak <= usable) = Phi((ln usable - mu_peak) / s_peak).
  [KB]     Ginsbourger, Le Riche & Carraro 2010, "Kriging Is Well-Suited to Parallelize Optimization", sec. 3.1
           (the kriging believer): a batch for several workers is picked one plan at a time, each pick's outcome
           believed at its predictive mean; in a model linear in the log multipliers (evaluators/posterior.py)
           the means stay and the multipliers' covariance takes the rank-1 update of a noisy observation
           (Bishop, PRML sec. 3.3): Sigma' = Sigma - Sigma g g^T Sigma / (g^T Sigma g + noise^2), so plans that
           share the picked plan's uncertain terms lose variance (and expected improvement) and the next pick goes
           where a run teaches something else.
  [PI]     Picheny, Wagner & Ginsbourger 2013, "A benchmark of kriging-based infill criteria for noisy
           optimization", Struct. Multidisc. Optim. 48, sec. 3.1 ("plug-in" EI): where the incumbent is not a
           measured value, the best value of the model's prediction stands for it. Before any measured plan fits
           there is none, and EI over f* = 0 is the predictive mean x P(fit): a first run goes to a plan whose
           expected tokens/s is high, not to one that can beat the best the model expects. The plug-in incumbent
           is the best predicted median among plans predicted to fit at their median (the rule the believer
           applies to its picks, [KB]) and not known to fail (measured OOM or failed): a first run is spent where
           it is expected to beat what the model already promises.
  [LogEI]  Ament et al. 2023, "Unexpected Improvements to Expected Improvement for Bayesian Optimization", sec. 4:
           the expected improvement underflows far below the incumbent and its ranking is lost there; computed in
           log space (the tail through the Mills ratio) it stays ordered.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.posterior import LogNormalColumns, Predictive

__all__ = ["log_normal_cdf", "log_expected_improvement", "expected_improvement", "log_probability_of_fit",
           "log_acquisition", "believer_batch", "plug_in_incumbent"]

Array = NDArray[np.float64]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_TAIL = -5.0  # below this d the improvement is computed through the Mills ratio ([LogEI]): no cancellation
_FAR = -30.0  # below this the normal tail is its asymptotic series (erfc underflows near -38)
_CHUNK = 4096  # plans scored per step of a lazy believer round


def _erfc_array(x: Array) -> Array:
    """math.erfc of each element (no numpy ufunc computes it; through a list, ~30 % cheaper than an object array)."""
    flat = np.asarray(x, dtype=np.float64)
    out: Array = np.fromiter(map(math.erfc, flat.ravel().tolist()), dtype=np.float64, count=flat.size)
    return out.reshape(flat.shape)


def _mills(x: Array) -> Array:
    """Phi(x) / phi(x) for x <= 30: exact through erfc above _FAR, else the asymptotic series of the Mills ratio
    (Abramowitz & Stegun 26.2.12), relative error < 1e-13 there."""
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    far = x < _FAR
    near = ~far
    xn = x[near]
    out[near] = 0.5 * _erfc_array(-xn / math.sqrt(2.0)) * np.exp(0.5 * xn * xn + _LOG_SQRT_2PI)
    z = -x[far]
    inv = 1.0 / (z * z)
    out[far] = (1.0 - inv * (1.0 - 3.0 * inv * (1.0 - 5.0 * inv * (1.0 - 7.0 * inv)))) / z
    return out


def log_normal_cdf(x: Array) -> Array:
    """log Phi(x), the standard normal CDF, finite far into the lower tail (log phi(x) + log Mills ratio)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    with np.errstate(divide="ignore"):
        low = x < _FAR
        mid = ~low & (x < 8.3)  # above, Phi(x) rounds to 1
        out[mid] = np.log(0.5 * _erfc_array(-x[mid] / math.sqrt(2.0)))
        out[low] = -0.5 * x[low] ** 2 - _LOG_SQRT_2PI + np.log(_mills(x[low]))
        out[np.isneginf(x)] = -np.inf
    return out


def log_expected_improvement(mu: Array, sd: Array, best: float) -> Array:
    """log E[max(X - best, 0)] for X = exp(N(mu, sd^2)) per plan ([EGO]); best <= 0 (nothing measured yet):
    log E[X] = mu + sd^2 / 2. -inf where no improvement is possible (sd = 0 and exp(mu) <= best)."""
    mu, sd = np.asarray(mu, dtype=np.float64), np.asarray(sd, dtype=np.float64)
    if best <= 0.0:
        out: Array = mu + 0.5 * sd * sd
        return out
    lb = math.log(best)
    out = np.full(mu.shape, -np.inf)
    sure = sd <= 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = mu[sure] - lb  # no spread: exp(mu) - best where positive
        out[sure] = np.where(gain > 0, lb + np.log(np.expm1(np.maximum(gain, 0.0))), -np.inf)
        s = sd[~sure]
        m = mu[~sure]
        d = (m - lb) / s
        res = np.empty_like(d)
        tail = (d < _TAIL) & (d + s < 30.0)
        # near: log(e^(mu + s^2/2) Phi(d + s) - f* Phi(d)), the second term the smaller one
        a = m[~tail] + 0.5 * s[~tail] ** 2 + log_normal_cdf(d[~tail] + s[~tail])
        b = lb + log_normal_cdf(d[~tail])
        res[~tail] = a + np.log1p(-np.exp(np.minimum(b - a, 0.0)))
        # tail: e^(mu + s^2/2) phi(d + s) = f* phi(d), so EI = f* phi(d) (M(d + s) - M(d)), M = Phi / phi
        dt, st = d[tail], s[tail]
        res[tail] = lb - 0.5 * dt * dt - _LOG_SQRT_2PI + np.log(np.maximum(_mills(dt + st) - _mills(dt), 0.0))
        out[~sure] = res
    return out


def expected_improvement(mu: Array, sd: Array, best: float) -> Array:
    """E[max(X - best, 0)] for X = exp(N(mu, sd^2)) per plan ([EGO]): tokens/s a run is expected to gain."""
    out: Array = np.exp(log_expected_improvement(mu, sd, best))
    return out


def log_probability_of_fit(mu: Array, sd: Array, usable_gib: float) -> Array:
    """log P(peak <= usable_gib) for a peak exp(N(mu, sd^2)) in GiB ([cEI]); sd = 0: 0 or -inf."""
    mu, sd = np.asarray(mu, dtype=np.float64), np.asarray(sd, dtype=np.float64)
    margin = math.log(usable_gib) - mu
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(sd > 0, margin / np.where(sd > 0, sd, 1.0), np.where(margin >= 0, np.inf, -np.inf))
    return log_normal_cdf(z)


def log_acquisition(pred: Predictive, best: float, usable_gib: float) -> Array:
    """log(expected improvement x probability of fitting) per plan ([EGO] x [cEI]): the run order's score."""
    return (log_expected_improvement(pred.log_tokens.mean, pred.log_tokens.sd(), best)
            + log_probability_of_fit(pred.log_peak.mean, pred.log_peak.sd(), usable_gib))


def plug_in_incumbent(pred: Predictive, usable_gib: float, eligible: NDArray[np.bool_],
                      failed: Callable[[int], bool] | None = None) -> float:
    """The incumbent before any measured plan fits ([PI]): the highest predicted median tokens/s,
    exp(log_tokens.mean), among the eligible plans whose median peak is within `usable_gib` and that `failed(i)`
    does not name (a plan whose run failed promises nothing); 0 when none is."""
    fits = np.flatnonzero(eligible & (pred.log_peak.mean <= math.log(usable_gib)) & np.isfinite(pred.log_tokens.mean))
    for i in fits[np.argsort(-pred.log_tokens.mean[fits], kind="stable")]:
        if failed is None or not failed(int(i)):
            return float(math.exp(float(pred.log_tokens.mean[i])))
    return 0.0


def _sd(col: LogNormalColumns, idx: NDArray[np.intp]) -> Array:
    """Predictive sd of plans `idx` (LogNormalColumns.sd through one matrix product, not an einsum)."""
    shares = col.shares[idx]
    var = ((shares @ col.cov) * shares).sum(axis=1)
    out: Array = np.sqrt(np.maximum(var, 0.0) + col.noise_sd ** 2)
    return out


class _Believer:
    """One column's covariance as the kriging believer conditions it, pick after pick ([KB])."""

    def __init__(self, col: LogNormalColumns) -> None:
        self.col = col
        self.cov = np.array(col.cov, dtype=np.float64)
        self.gains: list[tuple[Array, float]] = []  # (Sigma g, g^T Sigma g + noise^2) per pick

    def sd(self, idx: NDArray[np.intp]) -> Array:
        """Predictive sd of plans `idx` under the conditioned covariance."""
        shares = self.col.shares[idx]
        var = ((shares @ self.col.cov) * shares).sum(axis=1)
        for c, denom in self.gains:
            var -= (shares @ c) ** 2 / denom
        out: Array = np.sqrt(np.maximum(var, 0.0) + self.col.noise_sd ** 2)
        return out

    def observe(self, i: int) -> None:
        """Believe plan i measured (at its mean): Sigma <- Sigma - Sigma g g^T Sigma / (g^T Sigma g + noise^2)."""
        g = self.col.shares[i]
        c = self.cov @ g
        denom = float(g @ c) + self.col.noise_sd ** 2
        if denom <= 0.0:
            return
        self.gains.append((c, denom))
        self.cov = self.cov - np.outer(c, c) / denom


def believer_batch(pred: Predictive, best: float, usable_gib: float, eligible: NDArray[np.bool_], k: int,
                   admit: Callable[[int], bool] | None = None) -> list[int]:
    """Up to k plan indices, in pick order, by the kriging believer over log_acquisition ([KB]): each pick
    maximises expected improvement x probability of fitting under the posterior conditioned on the picks before
    it (their outcomes believed at the predictive means; the incumbent rises to a believed pick that is
    predicted to fit). `admit(i)` may refuse a plan (it is passed over and conditions nothing).

    Lazy and exact: conditioning only shrinks variances and raises the incumbent, so a plan's first-round
    improvement bounds every later one and its probability of fitting is bounded by 1 (mean under the limit) or
    its first-round value (mean over it); each later round scores plans in bound order until the best score
    found beats the next bound."""
    tok, peak = pred.log_tokens, pred.log_peak
    log_u = math.log(usable_gib)
    ok = np.flatnonzero(eligible)
    if k <= 0 or len(ok) == 0:
        return []
    log_fit = log_probability_of_fit(peak.mean[ok], _sd(peak, ok), usable_gib)
    log_ei = log_expected_improvement(tok.mean[ok], _sd(tok, ok), best)
    score = log_ei + log_fit  # round one: every plan's exact score
    tie = tok.mean[ok] + log_fit  # ranks plans whose improvement is exactly 0
    bound = log_ei + np.where(peak.mean[ok] <= log_u, 0.0, log_fit)
    by_bound: tuple[NDArray[np.intp], Array] | None = None  # plans by bound, best first: sorted when first needed
    believe_t, believe_p = _Believer(tok), _Believer(peak)
    taken = np.zeros(len(tok.mean), dtype=bool)
    picks: list[int] = []
    while len(picks) < k:
        if not picks:  # nothing conditioned yet: the exact scores stand
            j = _best(score, tie)
            if j is None:
                break
            i = int(ok[j])
            score[j] = -np.inf
            tie[j] = -np.inf
        else:
            if by_bound is None:
                perm = np.lexsort((-tie, -bound))
                by_bound = ok[perm], bound[perm]
            found = _lazy_round(pred, *by_bound, taken, best, usable_gib, believe_t, believe_p)
            if found is None:
                break
            i = found
        taken[i] = True
        if admit is not None and not admit(i):
            continue
        picks.append(i)
        believe_t.observe(i)
        believe_p.observe(i)
        if peak.mean[i] <= log_u:  # believed to fit at its mean: it becomes the incumbent if faster
            best = max(best, float(math.exp(tok.mean[i])))
    return picks


def _best(score: Array, tie: Array) -> int | None:
    """Index of the highest score (ties and all -inf: the highest `tie`); None when every entry is spent."""
    if len(score) == 0:
        return None
    top = score.max()
    if np.isneginf(top):
        j = int(np.argmax(tie))
        return None if np.isneginf(tie[j]) else j
    among = np.flatnonzero(score == top)
    return int(among[np.argmax(tie[among])])


def _lazy_round(pred: Predictive, order: NDArray[np.intp], bound: Array, taken: NDArray[np.bool_], best: float,
                usable_gib: float, believe_t: _Believer, believe_p: _Believer) -> int | None:
    """The untaken plan with the highest conditioned score: scored in bound order, chunk by chunk, until the
    best score found is at least the next chunk's bound."""
    top, top_score, top_tie = None, -np.inf, -np.inf
    for start in range(0, len(order), _CHUNK):
        if top is not None and top_score >= bound[start]:
            break
        idx = order[start:start + _CHUNK]
        idx = idx[~taken[idx]]
        if len(idx) == 0:
            continue
        log_fit = log_probability_of_fit(pred.log_peak.mean[idx], believe_p.sd(idx), usable_gib)
        score = log_expected_improvement(pred.log_tokens.mean[idx], believe_t.sd(idx), best) + log_fit
        tie = pred.log_tokens.mean[idx] + log_fit
        j = _best(score, tie)
        if j is None:
            continue
        if top is None or score[j] > top_score or (score[j] == top_score and tie[j] > top_tie):
            top, top_score, top_tie = int(idx[j]), float(score[j]), float(tie[j])
    return top
