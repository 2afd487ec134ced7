"""What an evaluator returns: `Evaluation` and its parts. Plain data, frozen, JSON-serialisable."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict

from stratagem.spaces.plan import Plan

__all__ = [
    "Block",
    "BLOCKS",
    "Status",
    "Fidelity",
    "Level",
    "ZoneName",
    "LEVELS",
    "ZONE_NAMES",
    "MemoryBreakdown",
    "TimeBreakdown",
    "Throughput",
    "CheckpointRisk",
    "Zone",
    "Zones",
    "Evaluation",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

Block = Literal["weights", "gradients", "optimizer", "activations", "transient", "overhead"]
BLOCKS: tuple[Block, ...] = ("weights", "gradients", "optimizer", "activations", "transient", "overhead")
# infra: a real run that failed for the cluster's sake (actor/node lost, resources never came); not the plan's
# verdict: never stored as a measured trial (search/claims.py releases the plan for a retry).
Status = Literal["ok", "oom", "infeasible", "failed", "timeout", "infra"]
Fidelity = Literal["analytic", "traced", "measured"]
Level = Literal["ok", "warn", "bad"]
LEVELS: tuple[Level, ...] = get_args(Level)
"""Zone levels, best first (a level's code in the columns is its index here)."""
ZoneName = Literal["hbm", "communication", "bubbles", "checkpoint"]
ZONE_NAMES: tuple[ZoneName, ...] = get_args(ZoneName)
"""The four zones (a zone's code in the columns, e.g. the bottleneck, is its index here)."""


class MemoryBreakdown(BaseModel):
    """Peak memory of the worst rank, by block, GiB."""

    model_config = _FROZEN

    weights_gib: float
    """Parameters resident on the rank (sharded share + unsharded compute copies held through the step)."""
    gradients_gib: float
    """Gradient buffers (low-precision and fp32 accumulation buffers, per the stack)."""
    optimizer_gib: float
    """Optimizer states and fp32 master weights (0 when offloaded)."""
    activations_gib: float
    """Saved activations of all in-flight micro-batches, plus logits/loss buffers on the last stage."""
    transient_gib: float
    """Communication buffers (FSDP all-gather/reduce-scatter, P2P) and the backward working set."""
    overhead_gib: float
    """Allocator fragmentation and runtime context (calibrated constants)."""
    peak_gib: float
    """Sum of the blocks: predicted peak."""
    hbm_gib: float
    """Device memory."""
    headroom_gib: float
    """hbm - peak (negative when it does not fit)."""
    first_block_to_break: Block | None
    """The block whose addition (in the order above) first crosses HBM; None when the plan fits."""
    worst_stage: int
    """Pipeline stage of the worst rank (0 = first)."""

    @property
    def headroom_fraction(self) -> float:
        """Headroom as a fraction of HBM (the HBM zone's figure)."""
        return self.headroom_gib / self.hbm_gib

    def block_gib(self, block: Block) -> float:
        """One block's GiB by name (BLOCKS)."""
        return float(getattr(self, f"{block}_gib"))


class TimeBreakdown(BaseModel):
    """Seconds per optimizer step, by part (filled by the analytic time model)."""

    model_config = _FROZEN

    compute_s: float
    """Forward + backward matmul and attention time at achieved efficiency."""
    recompute_s: float
    """Extra forward compute for activation recomputation."""
    tp_comm_s: float
    """Tensor-parallel collectives (exposed)."""
    ep_comm_s: float = 0.0
    """MoE expert dispatch / combine over the expert-parallel group, and the etp gathers (exposed)."""
    dp_comm_s: float
    """Data-parallel gradient all-reduce or ZeRO/FSDP reduce-scatter + all-gather (total, before overlap)."""
    pp_comm_s: float
    """Pipeline point-to-point transfers."""
    cp_comm_s: float
    """Context-parallel KV exchange."""
    bubble_s: float
    """Pipeline bubble."""
    optimizer_s: float
    """Optimizer step (state read/write over HBM bandwidth)."""
    exposed_comm_s: float
    """Communication not hidden behind compute."""
    overhead_s: float = 0.0
    """Fixed per-step cost plus time the GPU waits on kernel launches;
    step_s = compute + recompute + exposed_comm + bubble + optimizer + overhead."""
    step_s: float
    """Wall time of one optimizer step."""


class Throughput(BaseModel):
    """Tokens per second and model FLOP utilisation."""

    model_config = _FROZEN

    tokens_per_s: float
    """Cluster-wide tokens per second."""
    tokens_per_s_per_gpu: float
    """Per GPU."""
    mfu: float
    """Model FLOPs (6N + attention, no recompute) / (step time x GPUs x peak)."""


class CheckpointRisk(BaseModel):
    """Checkpoint I/O cost and failure exposure."""

    model_config = _FROZEN

    state_gib: float
    """Full training state written per checkpoint (weights + optimizer, per the stack)."""
    shard_gib: float
    """Largest per-rank shard."""
    save_s: float
    """Time to write one checkpoint."""
    stall_s: float
    """Training time lost per checkpoint (whole save when blocking, staging copy when async)."""
    load_s: float
    """Time to read one checkpoint back."""
    job_mtbf_h: float
    """Mean time between failures of the whole job."""
    interval_s: float
    """Checkpoint interval (Young/Daly optimum unless fixed by the policy)."""
    goodput_loss: float
    """Expected fraction of time lost: stall/T + (T/2 + restart)/MTBF."""


class Zone(BaseModel):
    """One of the four zones a plan is judged on."""

    model_config = _FROZEN

    name: ZoneName
    """hbm, communication, bubbles or checkpoint."""
    value: float
    """The zone's figure (headroom fraction, exposed-comm fraction, bubble fraction, goodput loss)."""
    level: Level
    """ok, warn or bad (thresholds in evaluators.zones)."""
    sentence: str
    """One sentence of diagnosis."""


class Zones(BaseModel):
    """The four zones and the bottleneck among them."""

    model_config = _FROZEN

    hbm: Zone
    communication: Zone
    bubbles: Zone
    checkpoint: Zone
    bottleneck: ZoneName
    """The zone that limits this plan most."""


class Evaluation(BaseModel):
    """How one plan fares in one scenario."""

    model_config = _FROZEN

    plan: Plan
    """The plan judged."""
    status: Status
    """ok, oom (predicted or measured), infeasible (breaks a rule), failed or timeout (real runs)."""
    reason: str = ""
    """Why the status is not ok (the rule, the block that broke, the crash)."""
    fidelity: Fidelity = "analytic"
    """analytic (formulas), traced (a fake-tensor trace of the real code) or measured (a real run)."""
    memory: MemoryBreakdown | None = None
    """Memory of the worst rank (None when infeasible)."""
    time: TimeBreakdown | None = None
    """Step time by part."""
    throughput: Throughput | None = None
    """Tokens/s and MFU."""
    checkpoint: CheckpointRisk | None = None
    """Checkpoint cost and risk."""
    zones: Zones | None = None
    """The four zones."""
    prediction: Evaluation | None = None
    """For measured evaluations: the analytic prediction of the same plan."""
    measurements: dict[str, Any] | None = None
    """For measured evaluations: the raw harness result."""
    provenance: dict[str, Any] | None = None
    """Versions, seed, hardware, command (measured evaluations)."""
