"""The analytic model's few fitted constants, in one frozen object.

What scales compute per stack (kernels, torch.compile) lives in the stack records (spaces/stacks.py), the power cap
in the cluster, fp8's GEMM speed-up in evaluators.speed: explicit terms `explain` prints,
not hidden factors here.

Defaults are fitted on `bench/reference/` only (bench/memory_accuracy.py, bench/throughput_accuracy.py);
a search may refit them on its own measured trials (real runs) and pass the result to the evaluator.

Beside the constants, a calibration may carry what a study's runs taught about each mechanism: a multiplier per
step-time term (evaluators.step_parts.TIME_TERMS) and per memory block (evaluation.BLOCKS), as the Gaussian posterior
of their logs (`LogMultipliers`, fitted by evaluators.posterior_fit). None (the default): every multiplier is 1 and
the model is exactly the formulas.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratagem.evaluators.evaluation import BLOCKS
from stratagem.evaluators.rate_tables import RateTables

__all__ = ["LogMultipliers", "Calibration", "DEFAULT_CALIBRATION", "DEVICE_CALIBRATIONS", "default_calibration", "default_label"]


class LogMultipliers(BaseModel):
    """The posterior of the log multipliers of named model terms (step-time terms or memory blocks): Gaussian with
    this mean and covariance (the Laplace approximation at the fit's maximum a posteriori, evaluators.posterior_fit).
    A term's prediction is its formula's times exp(mean); a term not named keeps multiplier 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    names: tuple[str, ...]
    """The terms (evaluators.step_parts.TIME_TERMS) or blocks (evaluation.BLOCKS), one per multiplier."""
    mean: tuple[float, ...]
    """Posterior mean of each log multiplier (0: the formula as it is)."""
    cov: tuple[tuple[float, ...], ...]
    """Posterior covariance of the log multipliers (K x K, symmetric)."""
    noise_sd: float = Field(ge=0, allow_inf_nan=False)
    """Standard deviation of a run's log value that no multiplier explains (run-to-run noise and the model's
    per-plan misfit)."""
    runs: int = Field(ge=0)
    """Measured runs the posterior was fitted on (0: the prior)."""
    study: str = ""
    """The study whose runs it was fitted on ('' when none): a search of the same study that starts from it fits
    its runs from the device's prior again instead of counting them twice."""

    @model_validator(mode="after")
    def _shapes(self) -> LogMultipliers:
        """One mean and one covariance row per name, names distinct, a finite symmetric covariance with a
        non-negative diagonal."""
        k = len(self.names)
        if len(set(self.names)) != k:
            raise ValueError(f"names {list(self.names)} repeat a term")
        if len(self.mean) != k or len(self.cov) != k or any(len(row) != k for row in self.cov):
            raise ValueError(f"mean and cov must have one entry per name ({k}): got {len(self.mean)} and "
                             f"{[len(row) for row in self.cov]}")
        values = [*self.mean, *(v for row in self.cov for v in row)]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("mean and cov must be finite")
        for i in range(k):
            if self.cov[i][i] < 0:
                raise ValueError(f"cov[{i}][{i}] ({self.cov[i][i]}) is a variance: it must be >= 0")
            for j in range(i):
                if abs(self.cov[i][j] - self.cov[j][i]) > 1e-9 * (1.0 + abs(self.cov[i][j])):
                    raise ValueError(f"cov is not symmetric at [{i}][{j}]")
        return self

    def factors(self) -> dict[str, float]:
        """Each named term's multiplier at the posterior mean, exp(mean)."""
        return {n: math.exp(m) for n, m in zip(self.names, self.mean, strict=True)}

    def sd(self, name: str) -> float:
        """Posterior standard deviation of one term's log multiplier."""
        i = self.names.index(name)
        return math.sqrt(self.cov[i][i])


class Calibration(BaseModel):
    """Constants the formulas cannot derive: allocator behaviour, runtime overheads, kernel efficiency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fragmentation: float = Field(default=0.044, ge=0, le=1)
    """Allocator fragmentation/caching as a fraction of the allocated peak (reserved vs allocated)."""
    context_gib: float = Field(default=0.28, ge=0)
    """Per-rank runtime memory outside the allocator's statistics (CUDA context, NCCL), GiB."""
    logits_bytes: float = Field(default=12.2, ge=0)
    """Bytes per logit element alive at the loss: bf16 logits (2) + fp32 upcast (4) + fp32 gradient (4)."""

    # ---- time model (evaluators.timing, evaluators.comm) ------------------------------------------------------
    # link_efficiency and collective_step_us: fitted on the playbook's nccl-tests bus bandwidths (all-gather and
    # reduce-scatter, 1-64 nodes, within 25%: tests/evaluators/test_comm.py). The others: fitted by
    # `bench/throughput_accuracy.py --fit` on the sweep, torchtitan and Megatron throughputs (|log error| capped
    # at log 2, each source weighted equally), then rounded.
    matmul_efficiency: float = Field(default=0.62, gt=0, le=1)
    """Achieved fraction of the dense peak on large matmuls (the GEMM efficiency ceiling)."""
    attention_efficiency: float = Field(default=0.26, gt=0, le=1)
    """Achieved fraction of the dense peak in the fused (flash) attention kernels, forward and backward
    (FlashAttention-2 reaches well under the GEMM ceiling on Hopper)."""
    half_efficiency_gflop: float = Field(default=16.0, ge=0)
    """Per-GPU forward GFLOP of one layer on one micro-batch at which efficiency falls to half the ceiling:
    efficiency = ceiling x F / (F + this): small GEMMs fill fewer tiles and waves of the GPU."""
    layer_floor_ms: float = Field(default=3.1, ge=0)
    """Host-side time to launch one layer's forward + backward kernels for one micro-batch, ms: a layer takes at
    least this long however little GPU work it has (eager PyTorch is launch-bound on small per-GPU work)."""
    overlap: float = Field(default=1.0, ge=0, le=1)
    """Fraction of compute that can hide overlappable traffic: data-parallel sync behind one micro-batch's
    compute (once per step) or behind every micro-batch (ZeRO-2/3 per-micro-batch traffic); with the megatron
    stack also TP collectives behind their layer and pipeline sends behind the micro-batch."""
    link_efficiency: float = Field(default=0.70, gt=0, le=1)
    """Achieved fraction of the nominal per-GPU link bandwidth (NVLink and network) for large messages."""
    collective_step_us: float = Field(default=25.0, ge=0)
    """Software cost of one ring step in NCCL (protocol, proxy thread), microseconds, added to link latency."""
    step_overhead_s: float = Field(default=0.11, ge=0)
    """Fixed cost of one optimizer step outside the model (data loading, logging, synchronisation), s."""
    kernel_path: Literal["eager", "compiled", "fused"] | None = None
    """The kernel path (training.kernels) on which matmul_efficiency and attention_efficiency were measured: `stratagem
    calibrate` writes the path its harness runs (eager: launch/harness has no torch.compile), so a plan on that path
    runs at the measured efficiency and other paths scale by the stack records' ratios (evaluators.speed
    kernel_efficiency); None = the published constants, whose reference is Transformer Engine's fused kernels."""
    p2p_poll_s: float = Field(default=0.0, ge=0)
    """Host polling quantum of blocking pipeline point-to-point metadata messages, s (0: the stack waits on the
    GPU, no polling). Not fitted: it is read from the training code. Released stacks have none; nanotron's
    benchmark branch that ran the Ultra-Scale Playbook sweep (huggingface/nanotron nouamane/bench2 from commit
    67c5ebb6, 2024-12-27, src/nanotron/parallel/pipeline_parallel/p2p.py `_send_meta` / `_recv_meta`) sends two
    metadata tensors before every activation or gradient and waits for each with
    `while not work.is_completed(): time.sleep(0.1)`, i.e. 0.1 (evaluators.timing: pipeline polling)."""
    time_multipliers: LogMultipliers | None = None
    """What measured step times taught about each step-time term (evaluators.step_parts.TIME_TERMS); None: all 1."""
    memory_multipliers: LogMultipliers | None = None
    """What measured peaks (and OOMs) taught about each memory block (evaluation.BLOCKS); None: all 1."""
    rate_tables: RateTables | None = None
    """Measured collective bus bandwidths and GEMM efficiencies (evaluators.rate_tables, written by `stratagem
    calibrate`): the comm terms read a collective's time from them and the compute terms a GEMM's efficiency,
    where they cover it; None: the formulas only."""

    @model_validator(mode="after")
    def _multiplier_names(self) -> Calibration:
        """Memory multipliers name memory blocks (the time terms are checked where they are applied: the list
        lives in evaluators.timing, which imports this module)."""
        if self.memory_multipliers is not None:
            unknown = [n for n in self.memory_multipliers.names if n not in BLOCKS]
            if unknown:
                raise ValueError(f"memory_multipliers.names: {unknown} are not memory blocks {list(BLOCKS)}")
        return self


DEFAULT_CALIBRATION = Calibration()

# Per-device defaults where the published (H100-fitted) constants do not describe the device. cpu: this machine's
# gloo workers, fitted by evaluators.fit_hardware.fit_hardware (compute, memory, then communication constants, from
# the published defaults) on the 18 measured CPU harness runs in tests/evaluators/data/cpu_harness_runs.json (11 of
# `stratagem calibrate` on the tiny model, 1-2 ranks; 7 of examples/demo-cpu.yaml on 4 ranks, among them the demo
# search's predicted best plan), rounded to 3 digits: median step-time error 61x -> 28%, peak-memory error
# 69x -> 10% (tests/evaluators/test_calibration.py). The machine is shared, so single runs vary up to ~3x.
DEVICE_CALIBRATIONS: dict[str, Calibration] = {
    "cpu": Calibration(
        fragmentation=0.0688, context_gib=0.0, matmul_efficiency=0.0448, attention_efficiency=0.0188,
        half_efficiency_gflop=0.0, layer_floor_ms=20.9, overlap=0.0, link_efficiency=0.00129,
        collective_step_us=5090.0, step_overhead_s=0.0881,
    ),
}


def default_calibration(gpu_name: str) -> Calibration:
    """The calibration a prediction uses when none is given: the device's own defaults (DEVICE_CALIBRATIONS), else
    the published ones fitted on bench/reference (H100)."""
    return DEVICE_CALIBRATIONS.get(gpu_name, DEFAULT_CALIBRATION)


def default_label(gpu_name: str) -> str:
    """Where `default_calibration(gpu_name)` comes from, for the line commands print."""
    if gpu_name in DEVICE_CALIBRATIONS:
        return f"{gpu_name} defaults (fitted on measured CPU harness runs, tests/evaluators/data/cpu_harness_runs.json)"
    return "published defaults (fitted on bench/reference, H100)"
