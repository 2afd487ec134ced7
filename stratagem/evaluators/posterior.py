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

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration, LogMultipliers, default_calibration
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.figures import PlanFigures
from stratagem.evaluators.memory import memory_columns, overhead_bytes, rank_memory_columns
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.step_parts import TIME_TERMS, term_seconds
from stratagem.evaluators.timing import time_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["LogNormalColumns", "Predictive", "predictive", "predictive_from_figures", "PredictiveBasis",
           "predictive_basis", "MEMORY_FREE", "time_posterior", "memory_posterior", "expand"]

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
        out: Array = ((self.shares @ self.cov) * self.shares).sum(axis=1)
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


def expand(given: LogMultipliers | None, prior: LogMultipliers) -> LogMultipliers:
    """`given` over all of `prior`'s names (a name it lacks: the prior's mean and variance, uncorrelated; its
    noise and runs stay); `prior` itself when None."""
    if given is None:
        return prior
    if given.names == prior.names:
        return given
    index = {n: i for i, n in enumerate(given.names)}
    mean = tuple(given.mean[index[n]] if n in index else prior.mean[k] for k, n in enumerate(prior.names))
    cov = tuple(tuple(given.cov[index[a]][index[b]] if a in index and b in index else
                      (prior.cov[i][j] if a not in index and b not in index else 0.0)
                      for j, b in enumerate(prior.names)) for i, a in enumerate(prior.names))
    return LogMultipliers(names=prior.names, mean=mean, cov=cov, noise_sd=given.noise_sd, runs=given.runs,
                          study=given.study)


def time_posterior(cal: Calibration, gpu_name: str) -> LogMultipliers:
    """The step-time multipliers in force over every TIME_TERMS term: the calibration's posterior, else the
    device's prior (evaluators.priors): every plan has a distribution before any run."""
    return expand(cal.time_multipliers, prior_for(gpu_name).time())


def memory_posterior(cal: Calibration, gpu_name: str) -> LogMultipliers:
    """The memory-block multipliers in force over every block (the calibration's posterior, else the prior)."""
    return expand(cal.memory_multipliers, prior_for(gpu_name).memory())


def _columns(shares: Array, mean: Array, post: LogMultipliers) -> LogNormalColumns:
    return LogNormalColumns(mean=mean, shares=shares, cov=np.array(post.cov, dtype=np.float64),
                            noise_sd=float(post.noise_sd))


def _from_columns(scn: Scenario, cols: Mapping[str, Array], cal: Calibration) -> Predictive:
    """The Predictive from columns computed with `cal`: step-time terms (TIME_TERMS, step_parts.term_seconds), the worst
    rank's blocks `<block>_gib` and `peak_gib`. Shares are each term's fraction of the step, negated for tokens/s
    (tokens/s = tokens per step / step), and each block's fraction of the peak."""
    tr = scn.training
    step = np.asarray(cols["step_s"], dtype=np.float64)
    peak = np.asarray(cols["peak_gib"], dtype=np.float64)
    t_shares = -term_seconds(cols) / step[:, None]
    m_shares = np.stack([np.asarray(cols[f"{b}_gib"], dtype=np.float64) for b in BLOCKS], axis=1) / peak[:, None]
    gpu = scn.cluster.gpu.name
    return Predictive(
        log_tokens=_columns(t_shares, np.log(tr.global_batch_size * tr.seq_len / step), time_posterior(cal, gpu)),
        log_peak=_columns(m_shares, np.log(peak), memory_posterior(cal, gpu)),
    )


def predictive(scn: Scenario, pc: PlanColumns, cal: Calibration | None = None) -> Predictive:
    """The predictive distributions of log tokens/s and log peak GiB of every plan under `cal` (None: the device's
    defaults), linearised at the posterior mean multipliers (module docstring): the step-time and memory columns
    only (no checkpoint or zone figures), vectorised."""
    cal = cal or default_calibration(scn.cluster.gpu.name)
    cols = time_columns(scn, pc, cal)
    mem = memory_columns(scn, pc, cal)
    cols.update({f"{b}_gib": mem[b] / GIB for b in BLOCKS})
    cols["peak_gib"] = mem["peak"] / GIB
    return _from_columns(scn, cols, cal)


def predictive_from_figures(scn: Scenario, figs: PlanFigures, cal: Calibration | None = None) -> Predictive:
    """`predictive` from evaluate_many's figures of the same plans with the same calibration (no model cost)."""
    cal = cal or default_calibration(scn.cluster.gpu.name)
    names = (*TIME_TERMS, "exposed_comm_s", "step_s", "peak_gib", *(f"{b}_gib" for b in BLOCKS))
    return _from_columns(scn, {n: getattr(figs, n) for n in names}, cal)


def _constants(cal: Calibration) -> Calibration:
    """The calibration without its multipliers (what the formulas' terms depend on)."""
    return cal.model_copy(update={"time_multipliers": None, "memory_multipliers": None})


@dataclass(frozen=True)
class PredictiveBasis:
    """The formulas' part of `predictive` for a set of plans at one calibration's constants: each plan's step-time
    terms and both end stages' memory blocks without multipliers. A new posterior of the multipliers (what the
    loop's refit adopts) then gives the plans' Predictive by `at` in a few array operations, without the model."""

    constants: Calibration
    """The calibration (without multipliers) the terms were computed with."""
    gpu_name: str
    """The device (its prior where a calibration has no multipliers)."""
    tokens_per_step: float
    """global batch x sequence length."""
    terms: Array
    """(N, len(TIME_TERMS)) seconds per step by term (step_parts.term_seconds)."""
    first: Array
    """(N, len(BLOCKS)) bytes of a rank of the first pipeline stage by block."""
    last: Array
    """(N, len(BLOCKS)) bytes of a rank of the last pipeline stage by block."""
    plans: PlanColumns | None = field(default=None, compare=False, repr=False)
    """The plans (predictive_basis's `like` keeps the memory blocks of the same plans only)."""

    def at(self, cal: Calibration) -> Predictive:
        """The Predictive under `cal`, whose constants must be the basis's (ValueError otherwise): terms and blocks
        times the multipliers at the posterior mean, the worst stage as memory_columns picks it."""
        if _constants(cal) != self.constants:
            raise ValueError("the calibration's constants differ from the basis's: compute a new predictive_basis")
        t_post, m_post = time_posterior(cal, self.gpu_name), memory_posterior(cal, self.gpu_name)
        terms = self.terms * _factors(cal.time_multipliers, TIME_TERMS)
        step = terms.sum(axis=1)
        f = _factors(cal.memory_multipliers, BLOCKS)
        first, last = self.first * f, self.last * f
        worst = np.where((last.sum(axis=1) > first.sum(axis=1))[:, None], last, first)
        peak = worst.sum(axis=1)
        return Predictive(
            log_tokens=_columns(-terms / step[:, None], np.log(self.tokens_per_step / step), t_post),
            log_peak=_columns(worst / peak[:, None], np.log(peak / GIB), m_post),
        )


def _factors(post: LogMultipliers | None, names: tuple[str, ...]) -> Array:
    """(K,) multipliers at the posterior mean in `names` order (1 where none)."""
    f = post.factors() if post is not None else {}
    return np.array([f.get(n, 1.0) for n in names], dtype=np.float64)


MEMORY_FREE: tuple[str, ...] = ("matmul_efficiency", "attention_efficiency", "half_efficiency_gflop", "layer_floor_ms",
                                "step_overhead_s")
"""The time constants a study's refit fits (search/calibrate.py), which the memory model does not read (its
blocks read logits_bytes, and fragmentation and context_gib the overhead block only: evaluators.memory
rank_memory_columns)."""


def predictive_basis(scn: Scenario, pc: PlanColumns, cal: Calibration | None = None,
                     like: PredictiveBasis | None = None) -> PredictiveBasis:
    """The formulas' terms of `predictive` for these plans at `cal`'s constants (None: the device's defaults).
    `like`: a basis of the same plans (the same PlanColumns object) at other constants, whose memory blocks are
    kept where the constants differ only in MEMORY_FREE, fragmentation and context_gib (the overhead block
    recomputed: `_overhead_at`); the same figures, bit for bit."""
    constants = _constants(cal or default_calibration(scn.cluster.gpu.name))
    tr = scn.training
    if like is not None and like.plans is pc and _same_memory(like.constants, constants):
        first, last = (_overhead_at(blocks, constants) for blocks in (like.first, like.last))
    else:
        stages = [rank_memory_columns(scn, pc, constants, stage) for stage in ("first", "last")]
        first, last = (np.stack([m[b] for b in BLOCKS], axis=1) for m in stages)
    return PredictiveBasis(constants=constants, gpu_name=scn.cluster.gpu.name,
                           tokens_per_step=float(tr.global_batch_size * tr.seq_len),
                           terms=term_seconds(time_columns(scn, pc, constants)), first=first, last=last, plans=pc)


def _same_memory(a: Calibration, b: Calibration) -> bool:
    """Whether the memory model gives the same blocks but the overhead under `a` and `b` (MEMORY_FREE)."""
    free = {f: getattr(a, f) for f in (*MEMORY_FREE, "fragmentation", "context_gib")}
    return b.model_copy(update=free) == a


def _overhead_at(blocks: Array, cal: Calibration) -> Array:
    """(N, len(BLOCKS)) blocks with the overhead block at `cal`'s fragmentation and context_gib, as
    rank_memory_columns computes it: fragmentation x allocated (the other blocks, summed in its order) + context."""
    i = BLOCKS.index("overhead")
    allocated = blocks[:, 0] + blocks[:, 1] + blocks[:, 2] + blocks[:, 3] + blocks[:, 4]  # BLOCKS order, as the model
    out = blocks.copy()
    out[:, i] = overhead_bytes(allocated, cal)
    return out
