"""What an evaluator returns: `Evaluation` and its parts. Plain data, frozen, JSON-serialisable."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, model_validator

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
    """Seconds per optimizer step, by part (filled by the analytic time model; the parts and their meanings:
    evaluators.step_parts.STEP_PARTS, whose names these fields are). step_s = compute + recompute +
    exposed_comm + bubble + optimizer + overhead; each `*_comm_s` is exposed, its `*_hidden_s` what overlap hid."""

    model_config = _FROZEN

    compute_s: float
    """Forward + backward matmul and attention time at achieved efficiency."""
    recompute_s: float
    """Extra forward compute for activation recomputation."""
    tp_comm_s: float
    """Tensor-parallel collectives the step waits for (exposed)."""
    ep_comm_s: float = 0.0
    """MoE expert dispatch / combine over the expert-parallel group, and the etp gathers (exposed)."""
    cp_comm_s: float
    """Context-parallel KV exchange (exposed)."""
    pp_comm_s: float
    """Pipeline point-to-point transfers on the critical path (exposed)."""
    dp_comm_s: float
    """Data-parallel gradient all-reduce or ZeRO/FSDP reduce-scatter + all-gather the step waits for (exposed)."""
    bubble_s: float
    """Pipeline bubble."""
    optimizer_s: float
    """Optimizer step (state read/write over HBM bandwidth)."""
    overhead_s: float = 0.0
    """Fixed per-step cost plus time the GPU waits on kernel launches."""
    tp_hidden_s: float = 0.0
    """Tensor-parallel traffic pipelined with its GEMMs (not in the step)."""
    ep_hidden_s: float = 0.0
    """Expert traffic hidden behind another micro-batch's compute (not in the step)."""
    dp_hidden_s: float = 0.0
    """Data-parallel traffic hidden behind compute (not in the step)."""
    exposed_comm_s: float
    """Communication not hidden behind compute: the sum of the exposed parts."""
    step_s: float
    """Wall time of one optimizer step."""

    @model_validator(mode="before")
    @classmethod
    def _dp_traffic_of_older_studies(cls, data: Any) -> Any:
        """Evaluations stored before the parts had one meaning each kept the DP traffic before overlap in
        dp_comm_s and no hidden parts: split it into exposed (exposed_comm_s less the other exposed parts) and
        hidden, so a study written then reads with today's meanings."""
        if isinstance(data, dict) and "dp_comm_s" in data and "dp_hidden_s" not in data and "exposed_comm_s" in data:
            others = sum(float(data.get(k, 0.0)) for k in ("tp_comm_s", "ep_comm_s", "cp_comm_s", "pp_comm_s"))
            exposed = max(0.0, float(data["exposed_comm_s"]) - others)
            data = {**data, "dp_comm_s": exposed, "dp_hidden_s": float(data["dp_comm_s"]) - exposed}
        return data


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
