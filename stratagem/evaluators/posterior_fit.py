"""Fit the log multipliers of the model's terms to measured runs: Bayesian regression in log space, linearised.

A run's log value (step time, or peak memory) is f(theta) = log sum_k exp(theta_k) A_k, A_k the term's (block's)
value by the formulas and theta the log multipliers, with a Gaussian prior theta ~ N(mu0, Sigma0) (the calibration
the search started from: its own posterior, else the device's prior widths, evaluators.priors). Observations:
  ok run      log measured = f(theta) + e, e ~ N(0, sigma^2)
  OOM run     log peak > log cap (the run died at the device's memory): a censored observation with likelihood
              Phi((f(theta) - log cap) / sigma) (Tobit: Tobin 1958, "Estimation of relationships for limited
              dependent variables", Econometrica 26(1)).
The maximum a posteriori theta is found by Gauss-Newton on the negative log posterior (the Hessian of f dropped,
the outer product of its gradient kept), each step with a backtracking line search; the posterior covariance is
the inverse of that Hessian at the maximum: the Laplace approximation (MacKay 1992, "Bayesian interpolation",
Neural Computation 4(3); Bishop, Pattern Recognition and Machine Learning, sec. 3.3 and 4.4). The Hessian of
-log Phi(z) is lambda(z)(z + lambda(z)) >= 0, lambda = phi / Phi (the inverse Mills ratio), so each censored run
adds a positive term.

sigma (the spread of a run's log value that no multiplier explains: run-to-run noise and the model's per-plan
misfit) is re-estimated from the residuals at the maximum, alternating with the fit (MacKay's evidence
approximation, Bishop eq. 3.95: sigma^2 = sum r^2 / (N - gamma), gamma = K - trace(Sigma0^-1 Sigma) the number of
well-determined multipliers), with a scaled-inverse-chi^2 prior of NU0 degrees of freedom at the device's noise
(Gelman et al., Bayesian Data Analysis, 3rd ed., sec. 2.6) and never below the study's own run-to-run noise
(search/noise.py) when it is known. Pure numpy, deterministic.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import LogMultipliers

__all__ = ["fit_multipliers", "log_sum", "shares_of", "log_phi", "mills", "NU0"]

Array = NDArray[np.float64]
NU0 = 2.0
"""Prior degrees of freedom of sigma^2 (a weak prior: two runs' worth at the device's noise)."""
_SIGMA_ROUNDS = 6
"""Alternations of the fit and the sigma estimate (sigma settles within a few)."""
_MAX_STEPS = 60
"""Gauss-Newton steps at most per fit."""


def log_sum(a: Array, theta: Array) -> Array:
    """f(theta) per row: log sum_k exp(theta_k) a_k (rows of a: one run's terms, non-negative)."""
    out: Array = np.log(np.maximum(a @ np.exp(theta), 1e-300))
    return out


def shares_of(a: Array, theta: Array) -> Array:
    """df/dtheta per row: each term's share exp(theta_k) a_k / sum (rows sum to 1)."""
    w = a * np.exp(theta)[None, :]
    out: Array = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-300)
    return out


def _phi(z: Array) -> Array:
    out: Array = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return out


def _asymptotic(z: Array) -> Array:
    """1 - 1/z^2 + 3/z^4 - 15/z^6: Phi(z) = phi(z) / (-z) times this as z -> -infinity (Abramowitz and Stegun
    26.2.12); within 0.02 % of the exact ratio for z <= -5."""
    z2 = z * z
    out: Array = 1.0 - 1.0 / z2 + 3.0 / z2**2 - 15.0 / z2**3
    return out


_CUT = -5.0


def log_phi(z: Array) -> Array:
    """log Phi(z), the standard normal's log CDF, stable far in the lower tail."""
    z = np.asarray(z, dtype=np.float64)
    erfc = np.vectorize(math.erfc, otypes=[np.float64])
    upper = np.log(np.maximum(0.5 * erfc(-np.maximum(z, _CUT) / math.sqrt(2.0)), 1e-300))
    low = np.minimum(z, _CUT)
    tail = -0.5 * low * low - 0.5 * math.log(2.0 * math.pi) - np.log(-low) + np.log(_asymptotic(low))
    out: Array = np.where(z >= _CUT, upper, tail)
    return out


def mills(z: Array) -> Array:
    """lambda(z) = phi(z) / Phi(z), stable far in the lower tail (-> -z)."""
    z = np.asarray(z, dtype=np.float64)
    low, high = np.minimum(z, _CUT), np.maximum(z, _CUT)
    out: Array = np.where(z >= _CUT, _phi(high) / np.exp(log_phi(high)), -low / _asymptotic(low))
    return out


class _Problem:
    """The negative log posterior of theta for one sigma: its value, gradient and Gauss-Newton Hessian."""

    def __init__(self, a: Array, y: Array, a_cens: Array, cap: float, mu0: Array, prec0: Array,
                 sigma: float) -> None:
        self.a, self.y, self.a_cens, self.cap = a, y, a_cens, cap
        self.mu0, self.prec0, self.sigma = mu0, prec0, sigma

    def value(self, theta: Array) -> float:
        d = theta - self.mu0
        out = 0.5 * float(d @ self.prec0 @ d)
        if len(self.y):
            out += 0.5 * float(np.sum((self.y - log_sum(self.a, theta)) ** 2)) / self.sigma**2
        if len(self.a_cens):
            out -= float(np.sum(log_phi((log_sum(self.a_cens, theta) - self.cap) / self.sigma)))
        return out

    def gradient_hessian(self, theta: Array) -> tuple[Array, Array]:
        g = self.prec0 @ (theta - self.mu0)
        h = self.prec0.copy()
        s2 = self.sigma**2
        if len(self.y):
            j = shares_of(self.a, theta)
            g = g - j.T @ (self.y - log_sum(self.a, theta)) / s2
            h = h + j.T @ j / s2
        if len(self.a_cens):
            j = shares_of(self.a_cens, theta)
            z = (log_sum(self.a_cens, theta) - self.cap) / self.sigma
            lam = mills(z)
            g = g - j.T @ lam / self.sigma
            h = h + (j * (lam * (z + lam))[:, None]).T @ j / s2
        return g, h


def _map(p: _Problem, start: Array) -> tuple[Array, Array]:
    """(theta at the maximum a posteriori, Gauss-Newton Hessian there): damped Gauss-Newton steps."""
    theta = start.copy()
    value = p.value(theta)
    for _ in range(_MAX_STEPS):
        g, h = p.gradient_hessian(theta)
        step = np.linalg.solve(h, -g)
        t = 1.0
        while t > 1e-6:
            trial = theta + t * step
            v = p.value(trial)
            if v <= value + 1e-4 * t * float(g @ step):  # Armijo's sufficient decrease
                break
            t *= 0.5
        else:
            break
        theta, value = trial, v
        if float(np.max(np.abs(t * step))) < 1e-9:
            break
    return theta, p.gradient_hessian(theta)[1]


def fit_multipliers(a: Array, y: Array, prior: LogMultipliers, a_cens: Array | None = None,
                    log_cap: float = 0.0, noise_floor: float | None = None) -> LogMultipliers:
    """The posterior of the log multipliers named by `prior` (module docstring).

    a: (N, K) each ok run's terms by the formulas (no multipliers), y: (N,) their measured log values;
    a_cens: (M, K) the OOM runs' blocks, log_cap: the log memory they died above; noise_floor: the study's
    run-to-run sd when known (sigma never goes below it). The result carries the estimated sigma as noise_sd and
    N + M as runs."""
    k = len(prior.names)
    a_cens = np.zeros((0, k)) if a_cens is None else a_cens
    mu0 = np.array(prior.mean, dtype=np.float64)
    cov0 = np.array(prior.cov, dtype=np.float64)
    prec0: Array = np.asarray(np.linalg.pinv(cov0, hermitian=True), dtype=np.float64)
    sigma0 = max(prior.noise_sd, noise_floor or 0.0, 1e-6)
    sigma, theta = sigma0, mu0.copy()
    for _ in range(_SIGMA_ROUNDS if len(y) else 0):
        theta, h = _map(_Problem(a, y, a_cens, log_cap, mu0, prec0, sigma), theta)
        gamma = k - float(np.trace(prec0 @ np.linalg.inv(h)))  # well-determined multipliers (Bishop eq. 3.91)
        resid = float(np.sum((y - log_sum(a, theta)) ** 2))
        new = max(math.sqrt((NU0 * sigma0**2 + resid) / max(NU0 + len(y) - gamma, NU0)), noise_floor or 0.0, 1e-6)
        done = abs(new - sigma) <= 1e-3 * sigma
        sigma = new
        if done:
            break
    theta, h = _map(_Problem(a, y, a_cens, log_cap, mu0, prec0, sigma), theta)
    cov = np.linalg.inv(h)
    cov = 0.5 * (cov + cov.T)
    return LogMultipliers(names=prior.names, mean=tuple(float(x) for x in theta),
                          cov=tuple(tuple(float(x) for x in row) for row in cov), noise_sd=float(sigma),
                          runs=len(y) + len(a_cens))
