"""What the analytic model does not know, as distributions: each step-time term and each memory block carries a
multiplier whose log has a Gaussian prior (centred on the calibration in force, as wide as that term's held-out
error) that a study's measured runs update; every plan then has a log-normal predictive distribution of its
tokens/s and of its peak memory instead of a point.

The shapes here are the interface between the calibration (which fits the multipliers) and the run order
(which ranks plans by expected improvement times the probability of fitting): the run order reads only
`Predictive`.

A log-normal column is the linearised (Laplace) posterior of log(value) = log(value at the posterior mean) +
shares . (theta - theta_mean) + noise, theta the log multipliers: its variance per plan is
shares Sigma shares^T + noise_sd^2 (Bishop, Pattern Recognition and Machine Learning, sec. 3.3.2, the predictive
distribution of Bayesian linear regression).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["LogNormalColumns", "Predictive"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class LogNormalColumns:
    """The predictive distribution of log(value) for every plan: Gaussian, linear in the log multipliers."""

    mean: Array
    """(N,) predicted log value at the posterior mean multipliers."""
    shares: Array
    """(N, K) d log value / d log multiplier_k: term k's share of the value (signed; its sum is 1 or -1)."""
    cov: Array
    """(K, K) posterior covariance of the K log multipliers."""
    noise_sd: float
    """Standard deviation of log value from run to run that no multiplier explains (a rerun's spread)."""

    def model_var(self) -> Array:
        """(N,) variance of log value from the multipliers alone: shares Sigma shares^T."""
        out: Array = np.einsum("nk,kl,nl->n", self.shares, self.cov, self.shares)
        return out

    def sd(self) -> Array:
        """(N,) predictive standard deviation of log value (multipliers and run-to-run noise)."""
        return np.sqrt(self.model_var() + self.noise_sd**2)


@dataclass(frozen=True)
class Predictive:
    """The predictive distributions of one set of plans (PlanColumns order) under one calibration."""

    log_tokens: LogNormalColumns
    """log tokens/s of the cluster (evaluate_many's `tokens_per_s`, the study's first objective)."""
    log_peak: LogNormalColumns
    """log peak memory of the worst rank in GiB (evaluate_many's `peak_gib`)."""
