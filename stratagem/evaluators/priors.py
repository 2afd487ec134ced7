"""Prior widths of the log multipliers (evaluators.posterior): how far each step-time term and memory block may be
off before any run on the user's cluster, as the standard deviation of its log multiplier, and the run-to-run
noise of one run's log step time and log peak.

Each width comes from the error of the term's mechanism where bench/ measures it: a median absolute relative
error e over a source whose error is that term's (the regime where the term dominates) gives the width
log(1 + e) / 0.6745 (the median of |N(0, w^2)| is 0.6745 w); a 90th percentile p gives log(1 + p) / 1.6449.
Where bench/ has no figure for a term, the width is log 2 (a factor 2 at one sd: the bound on |log error| that
`bench/throughput_accuracy.py --fit` caps its loss at), wide on purpose: the model is not known to be right there.

GPU figures (published defaults): `python bench/throughput_accuracy.py` and `python bench/memory_accuracy.py` at
commit 4b28d89 (2026-12-06). They are in-sample errors of the shipped constants per regime; the out-of-sample
step-time error of the whole model is wider (median 32-47 % per held-out model size, bench/data/regret-folds.json),
which the per-term widths together cover (a plan's predictive sd adds its terms' widths by their shares).
CPU figures: the cpu device's defaults predict the 18 measured CPU harness runs to a median 28 % (step) and 10 %
(peak) (tests/evaluators/test_calibration.py, evaluators/calibration.py DEVICE_CALIBRATIONS): no per-term figure
on this device, so every term has the step-time width and every block the peak width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stratagem.evaluators.calibration import LogMultipliers
from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.step_parts import TIME_TERMS

__all__ = ["Prior", "PRIORS", "prior_for", "width_from_median", "width_from_p90", "FACTOR_TWO"]


def width_from_median(error: float) -> float:
    """Log-sd whose median absolute relative error is `error` (median |N(0, w^2)| = 0.6745 w)."""
    return math.log1p(error) / 0.6745


def width_from_p90(error: float) -> float:
    """Log-sd whose 90th percentile absolute relative error is `error` (90th percentile of |N(0, w^2)| = 1.6449 w)."""
    return math.log1p(error) / 1.6449


FACTOR_TWO = math.log(2.0)
"""A factor 2 at one sd: the width of a term bench/ does not measure."""


@dataclass(frozen=True)
class Prior:
    """The prior of one device kind: widths per term and block, run-to-run noise."""

    time_widths: dict[str, float]
    """TIME_TERMS name -> prior sd of its log multiplier."""
    memory_widths: dict[str, float]
    """BLOCKS name -> prior sd of its log multiplier."""
    time_noise_sd: float
    """Prior sd of a run's log step time that no multiplier explains: run-to-run noise and the model's per-plan
    misfit (posterior_fit re-estimates it from the study's residuals)."""
    memory_noise_sd: float
    """Prior sd of a run's log peak that no multiplier explains (the same for memory)."""
    source: str
    """Where the widths come from, in words."""

    def time(self) -> LogMultipliers:
        """The prior of the step-time multipliers: mean 0 (the calibration in force), diagonal covariance."""
        return _diagonal(TIME_TERMS, self.time_widths, self.time_noise_sd)

    def memory(self) -> LogMultipliers:
        """The prior of the memory-block multipliers."""
        return _diagonal(BLOCKS, self.memory_widths, self.memory_noise_sd)


def _diagonal(names: tuple[str, ...], widths: dict[str, float], noise: float) -> LogMultipliers:
    k = len(names)
    cov = tuple(tuple(widths[n] ** 2 if i == j else 0.0 for j in range(k)) for i, n in enumerate(names))
    return LogMultipliers(names=names, mean=(0.0,) * k, cov=cov, noise_sd=noise, runs=0)


# What no multiplier explains is mostly the model's per-plan misfit, not run-to-run noise: peaks of one plan over 3
# separate launches (bench/data/cpu-table.json, 79 plans that fit, 158 degrees of freedom) have a pooled sd of log
# peak of 0.0003 (one-way random effects as search/noise.py: a peak is deterministic given the plan), yet a
# multiplier fitted to one peak exactly (that noise) predicts the next plan worse than no fit (replaying that table
# through search/multiplier_refit.py: held-out memory error 10 % vs 6 % after 2 runs). So the noise priors are the
# model's per-plan error where its mechanisms are priced best, and the study's residuals update them.

_GPU = Prior(
    time_widths={
        # sweep regime "no pp, tp <= node, <= 16 nodes" (compute-bound dense runs): median APE 11.0 %
        "compute_s": width_from_median(0.110),
        "recompute_s": width_from_median(0.110),  # recomputed forwards run at the compute rate: compute's figure
        "tp_comm_s": width_from_median(0.374),  # sweep regime "tp > gpus/node": median APE 37.4 %
        "ep_comm_s": width_from_median(0.408),  # published MoE runs (source "moe"): median APE 40.8 %
        "cp_comm_s": FACTOR_TWO,  # no context-parallel source in bench/reference
        "pp_comm_s": width_from_median(0.595),  # sweep regime "pp > 1 across nodes": median APE 59.5 %
        "bubble_s": width_from_median(0.595),  # the same pipelined runs
        "dp_comm_s": width_from_median(0.370),  # sweep regime "64 nodes" (data-parallel sync at scale): 37.0 %
        "optimizer_s": FACTOR_TWO,  # no source isolates the optimizer step
        "overhead_s": width_from_median(0.762),  # sweep regime "one node" (launch-bound small work): 76.2 %
    },
    memory_widths={
        # bench/memory_accuracy.py over 515 published runs: median 6.7 % (model states are exact formulas),
        # p90 26.5 % (the tail: activations and transients, what the saved-tensor inventory can miss)
        "weights": width_from_median(0.067),
        "gradients": width_from_median(0.067),
        "optimizer": width_from_median(0.067),
        "activations": width_from_p90(0.265),
        "transient": width_from_p90(0.265),
        "overhead": FACTOR_TWO,  # allocator fragmentation and context: one fraction and one constant, no source
    },
    # per-plan misfit: the compute-bound dense regime's median APE 11.0 % (time), the peaks' median 6.7 % (memory)
    time_noise_sd=width_from_median(0.110),
    memory_noise_sd=width_from_median(0.067),
    source="per-term errors of the published defaults (bench/throughput_accuracy.py, bench/memory_accuracy.py)",
)

_CPU = Prior(
    time_widths=dict.fromkeys(TIME_TERMS, width_from_median(0.28)),
    memory_widths=dict.fromkeys(BLOCKS, width_from_median(0.10)),
    # bench/data/cpu-table.json: 79 plans that fit, 3 launches each, load 6-34: pooled sd of log run median
    # step 0.31 (158 degrees of freedom; one-way random effects as search/noise.py), above the misfit; memory: the
    # cpu defaults' median peak error 10 %
    time_noise_sd=0.31,
    memory_noise_sd=width_from_median(0.10),
    source="the cpu defaults' errors on 18 measured CPU runs (tests/evaluators/test_calibration.py)",
)

PRIORS: dict[str, Prior] = {"cpu": _CPU}
"""Device (GPU preset name) -> its prior where it is not the published defaults' (as DEVICE_CALIBRATIONS)."""


def prior_for(gpu_name: str) -> Prior:
    """The prior of a device: its own (PRIORS), else the published defaults' widths."""
    return PRIORS.get(gpu_name, _GPU)
