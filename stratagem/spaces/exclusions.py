"""What a stack cannot honour, as data: schedule and plan-value combinations its real runs or its exports refuse.

One rule, stated once: the search space leaves out every exclusion of its stack (spaces/space.py),
the validity rules and the training harness refuse those whose `refused_by` is "harness" (spaces/rules.py,
launch/harness/support.py), and the torchtitan exporter writes a converted setting, with a note, exactly where an
"export" exclusion covers an explicitly given plan (launch/export/torchtitan.py). An "export" exclusion is a plan
the harness runs as planned but torchtitan v0.2.2 has no exact setting for: the torch stack's space is what
torchtitan can express (torchtitan/distributed/parallel_dims.py ParallelDims, torchtitan/models/llama3/infra/
parallelize.py parallelize_llama, torchtitan/distributed/pipeline_parallel.py, torchtitan/config/job_config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["ScheduleExclusion", "PlanFacts", "PlanExclusion", "ExclusionName", "RefusedBy", "ReadList",
           "TORCH_SCHEDULE_EXCLUSIONS", "TORCH_PLAN_EXCLUSIONS", "AUTOMODEL_PLAN_EXCLUSIONS"]

RefusedBy = Literal["harness", "export"]
ReadList = Literal["layout", "sharding", "sequence_parallel", "pipelining"]


class ScheduleExclusion(BaseModel):
    """One pipeline schedule the stack cannot honour in some combination: the search space does not propose it,
    and where `refused_by` is "harness" the training harness refuses it too (launch/harness/support.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schedule: str
    """Plan.pp_schedule value."""
    when: Literal["cp>1", "one_chunk", "op_recompute"]
    """The combination: with context parallelism, with one model chunk per rank (virtual_stages = 1), or with
    op-level selective activation checkpointing (activation_checkpointing = op)."""
    refused_by: RefusedBy
    """harness: stratagem's own real runs refuse it; export: the stack's shipped trainer has no such schedule,
    so an export would have to convert it (the harness may still run it when given explicitly)."""
    reason: str
    """Why, in words, with the fix."""
    source: str
    """The engine code (or measurement) behind it."""

    def applies(self, schedule: str, cp: int, virtual_stages: int, recompute: str = "none") -> bool:
        """Whether this exclusion covers a plan with this schedule, cp, chunks per rank and recompute (pp > 1)."""
        if schedule != self.schedule:
            return False
        if self.when == "op_recompute":
            return recompute == "op"
        return cp > 1 if self.when == "cp>1" else virtual_stages == 1


@dataclass(frozen=True)
class PlanFacts:
    """The plan values a PlanExclusion looks at: ints/bools for one plan, or numpy arrays (one entry per plan) for
    columns of plans (spaces/columns.PlanColumns); every predicate is elementwise."""

    moe: bool
    tp: Any
    dp: Any
    cp: Any
    ep: Any
    etp: Any
    pp: Any
    zero_stage: Any
    dp_replicate: Any
    offload: Any
    """optimizer_offload == "cpu" (bool or bool array)."""
    sequence_parallel: Any
    one_f_one_b: Any
    """pp_schedule == "1f1b" (bool or bool array)."""
    selective: Any
    """activation_checkpointing == "selective" (stratagem's selective recompute; bool or bool array)."""
    microbatches: Any
    """Micro-batches per step per pipeline: global_batch_size / (dp * micro_batch_size)."""
    seq_len: int = 0
    """training.seq_len (0: unknown, rules on it do not apply)."""


Predicate = Callable[[PlanFacts], Any]

# Per exclusion: the per-layout choice list its predicate reads besides the layout's degrees (tp, pp, cp, dp, ep,
# etp): spaces/space.py filters exactly that list with it, so a predicate must read no other list's values.
_RULES: dict[str, tuple[ReadList, Predicate]] = {
    "etp_1_or_tp": ("layout", lambda f: f.moe & (f.etp > 1) & (f.etp != f.tp)),
    "zero1_moe_expert_mesh": ("sharding",
                              lambda f: f.moe & ((f.ep > 1) | (f.tp > 1)) & (f.dp > 1) & (f.zero_stage == 1)),
    "1f1b_microbatches": ("pipelining", lambda f: (f.pp > 1) & f.one_f_one_b & (f.microbatches < f.pp)),
    "tp_without_sp": ("sequence_parallel", lambda f: (f.tp > 1) & (f.sequence_parallel == 0)),
    "zero0_with_cp": ("sharding", lambda f: (f.zero_stage == 0) & (f.cp > 1)),
    "zero0_with_ep": ("sharding", lambda f: (f.zero_stage == 0) & (f.ep > 1)),
    "ddp_beside_other_parallelism": ("sharding", lambda f: ((f.zero_stage == 0) | (f.dp_replicate == f.dp))
                                     & (f.dp > 1) & (f.cp == 1) & ((f.tp > 1) | (f.pp > 1))),
    "zero1_optimizer_only": ("sharding", lambda f: (f.zero_stage == 1) & ((f.dp_replicate < f.dp) | (f.cp > 1))),
    "optimizer_offload_cpu": ("sharding", lambda f: f.offload & (f.zero_stage > 0)),
    "selective_recompute": ("pipelining", lambda f: f.selective),
    "seq_len_divisor": ("layout", lambda f: (f.seq_len > 0) & (f.seq_len % (2 * f.tp * f.cp) != 0)),
    "etp_without_ep": ("layout", lambda f: f.moe & (f.ep == 1) & (f.tp > 1) & (f.etp == 1)),
    "ddp_data_parallel_only": ("sharding", lambda f: (f.zero_stage == 0) & (f.dp > 1)
                               & ((f.tp > 1) | (f.pp > 1) | (f.cp > 1) | (f.ep > 1))),
    "hsdp_full_replication": ("sharding", lambda f: (f.dp_replicate > 1) & (f.dp_replicate >= f.dp)),
}
ExclusionName = Literal["etp_1_or_tp", "zero1_moe_expert_mesh", "1f1b_microbatches", "tp_without_sp",
                        "zero0_with_cp", "zero0_with_ep", "ddp_beside_other_parallelism", "zero1_optimizer_only",
                        "optimizer_offload_cpu", "selective_recompute", "seq_len_divisor", "etp_without_ep",
                        "ddp_data_parallel_only", "hsdp_full_replication"]


class PlanExclusion(BaseModel):
    """A combination of plan values (other than a schedule's, see ScheduleExclusion) the stack cannot honour: the
    search space does not propose it (spaces/space.py); where `refused_by` is "harness" the validity rules
    (spaces/rules.py) and the training harness (launch/harness/support.py) refuse it with `reason` too; where it is
    "export" the harness runs it as planned and the stack's exporter converts it, with a note."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ExclusionName
    """The combination (its predicate, elementwise over PlanFacts, is `_RULES[name]`)."""
    refused_by: RefusedBy
    """harness: stratagem's own real runs refuse it; export: the stack's shipped trainer has no exact setting, so an
    export would convert it (the harness still runs it when given explicitly)."""
    field: str
    """The plan field the refusal or the exporter's note names (with its value)."""
    what: str
    """The combination with its values, a str.format template over PlanFacts' fields (validity messages)."""
    reason: str
    """Why, in words, with the fix."""
    source: str
    """The engine code (or measurement) behind it."""

    @property
    def reads(self) -> ReadList:
        """The per-layout choice list (spaces/layout_lists.py Layout) whose values the predicate reads."""
        return _RULES[self.name][0]

    def describe(self, f: PlanFacts) -> str:
        """`what` filled in with one plan's values."""
        return self.what.format(**{k: getattr(f, k) for k in f.__dataclass_fields__})

    def applies(self, f: PlanFacts) -> Any:
        """Whether the exclusion covers the plan(s) `f` describes: a bool, or a bool array for columns."""
        return _RULES[self.name][1](f)


_V022 = "torchtitan v0.2.2 (pytorch/torchtitan@73a0e6979dd1)"

TORCH_SCHEDULE_EXCLUSIONS: tuple[ScheduleExclusion, ...] = (
    ScheduleExclusion(
        schedule="zero_bubble", when="cp>1", refused_by="harness",
        reason="with the zero_bubble schedule's split input/weight backward, ring attention's gradients differ "
               "from the single-process reference (torch 2.13); use pp_schedule 1f1b, gpipe or interleaved "
               "with cp > 1, or cp=1",
        source="measured in stratagem's harness: parameter rel. error 1e-2 (launch/harness/support.py)"),
    ScheduleExclusion(
        schedule="zero_bubble", when="op_recompute", refused_by="harness",
        reason="op-level selective activation checkpointing under zero_bubble's split input/weight backward "
               "runs the checkpointed region's backward twice ('Trying to backward an extra time', "
               "torch/utils/checkpoint.py selective checkpoint context); use activation_checkpointing full or "
               "none, or pp_schedule 1f1b / interleaved",
        source="measured in stratagem's harness on tiny-moe dp=2,pp=2,ep=2,ac=op,schedule=zero_bubble "
               "(torch 2.13, ScheduleInterleavedZeroBubble backward_input / backward_weight)"),
    ScheduleExclusion(
        schedule="zero_bubble", when="one_chunk", refused_by="export",
        reason="torchtitan's zero-bubble schedules are ZBVZeroBubble and DualPipeV (two chunks per rank in a V) and "
               "InterleavedZeroBubble (looped chunks); stratagem's zero_bubble is ZB-H1 with one chunk per rank, "
               "which torchtitan does not ship; use pp_schedule interleaved, 1f1b or gpipe",
        source=f"{_V022} torchtitan/distributed/pipeline_parallel.py pipeline_llm: a multi-stage schedule needs >= 2 "
               "stages per rank; torch/distributed/pipelining/schedules.py get_schedule_class: ScheduleZBVZeroBubble, "
               "ScheduleDualPipeV, ScheduleInterleavedZeroBubble are PipelineScheduleMulti"),
)

# What torchtitan / torch.distributed run beyond the schedules. harness: the space leaves these out and the harness
# refuses them with `reason` (launch/harness/support.py plan_refusals, microbatch_refusal). export: the space leaves
# these out; the harness runs them as planned; torchtitan v0.2.2 has no exact setting (the exporter's notes).
TORCH_PLAN_EXCLUSIONS: tuple[PlanExclusion, ...] = (
    PlanExclusion(
        name="etp_1_or_tp", refused_by="harness", field="plan.etp", what="etp ({etp}) with tp ({tp})",
        reason="the harness splits experts' matmuls over the TP ranks only (torchtitan ExpertTensorParallel: "
               "etp = tp) or not at all (etp = 1); use etp=1 or etp=tp",
        source="torchtitan/distributed/parallel_dims.py ParallelDims._validate ('Currently we only support "
               "ETP=TP or ETP=1'); with ep = 1 torchtitan/models/llama4/infra/parallelize.py apply_moe_ep_tp "
               "puts the experts on the tp mesh (TensorParallel): no other expert TP degree exists"),
    PlanExclusion(
        name="zero1_moe_expert_mesh", refused_by="harness", field="plan.ep",
        what="zero_stage 1 over dp ({dp}) with the MoE experts under ep ({ep}) / tp ({tp})",
        reason="ZeroRedundancyOptimizer broadcasts whole parameters over the dp ranks, and the MoE experts are "
               "DTensors on the expert mesh (measured: c10d.broadcast_ has no DTensor sharding strategy); use "
               "zero_stage 0, 2 or 3",
        source="torch/distributed/optim/zero_redundancy_optimizer.py ZeroRedundancyOptimizer (broadcasts each "
               "rank's parameters after its step), measured in stratagem's harness (launch/harness/"
               "parallelize.py build_optimizer); torchtitan has no ZeRO-1 at all (FSDP2 only: "
               "torchtitan/models/llama4/infra/parallelize.py apply_fsdp shards the experts over edp)"),
    PlanExclusion(
        name="1f1b_microbatches", refused_by="harness", field="plan.micro_batch_size",
        what="pp_schedule 1f1b with {microbatches} micro-batch(es) per step over pp ({pp}) stages",
        reason="the 1f1b schedule needs at least pp micro-batches per step; lower micro_batch_size or dp "
               "(micro-batches per step = global_batch_size / (dp * micro_batch_size)), or use pp_schedule "
               "gpipe",
        source="torch/distributed/pipelining/schedules.py PipelineScheduleSingle subclasses (Schedule1F1B): "
               "ValueError 'Number of microbatches (m) must be greater than or equal to the number of "
               "stages (pp)'"),
    PlanExclusion(
        name="tp_without_sp", refused_by="export", field="plan.sequence_parallel",
        what="tp ({tp}) without sequence_parallel",
        reason="torchtitan's TP plan always shards the norms along the sequence (SequenceParallel) and uses loss "
               "parallel; use sequence_parallel=true with tp > 1",
        source=f"{_V022} torchtitan/models/llama3/infra/parallelize.py apply_tp: attention_norm / ffn_norm / norm "
               "SequenceParallel(), no setting turns it off"),
    PlanExclusion(
        name="zero0_with_cp", refused_by="export", field="plan.zero_stage",
        what="zero_stage 0 with cp ({cp})",
        reason="torchtitan applies FSDP over dp_shard x cp whenever cp > 1, so gradients and optimizer states are "
               "sharded over the cp ranks; use zero_stage 2 or 3 with cp > 1",
        source=f"{_V022} torchtitan/distributed/parallel_dims.py ParallelDims.fsdp_enabled (dp_shard > 1 or cp > 1); "
               "parallelize.py parallelize_llama applies apply_fsdp when fsdp_enabled"),
    PlanExclusion(
        name="zero0_with_ep", refused_by="export", field="plan.zero_stage",
        what="zero_stage 0 with the MoE experts under ep ({ep})",
        reason="torchtitan wraps the model in FSDP whenever ep > 1 (the experts shard over the efsdp mesh, for "
               "mixed precision), so gradients and optimizer states are sharded; use zero_stage 2 or 3 with ep > 1",
        source=f"{_V022} torchtitan/models/llama4/infra/parallelize.py parallelize_llama ('if "
               "parallel_dims.fsdp_enabled or parallel_dims.ep_enabled: apply_fsdp'); parallel_dims.py "
               "ParallelDims._mesh_exist keeps efsdp when ep > 1"),
    PlanExclusion(
        name="ddp_beside_other_parallelism", refused_by="export", field="plan.zero_stage",
        what="unsharded data parallelism over dp ({dp}) with tp ({tp}) / pp ({pp})",
        reason="torchtitan runs DDP only as the sole parallelism; use zero_stage 2 or 3 (FSDP), or tp=1 and pp=1",
        source=f"{_V022} torchtitan/models/llama3/infra/parallelize.py parallelize_llama: RuntimeError 'DDP has not "
               "supported > 1D parallelism' when the dp_replicate mesh is not the whole world"),
    PlanExclusion(
        name="zero1_optimizer_only", refused_by="export", field="plan.zero_stage",
        what="zero_stage 1 over dp ({dp}) x cp ({cp})",
        reason="torchtitan has no optimizer-only sharding (FSDP2 always shards gradients too); use zero_stage 2 "
               "(fsdp_reshard_after_forward never) or 3",
        source=f"{_V022} torchtitan/models/llama3/infra/parallelize.py apply_fsdp (fully_shard) / apply_ddp are its "
               "only data-parallel wrappers; torchtitan/config/job_config.py Parallelism has no ZeRO-1 option"),
    PlanExclusion(
        name="optimizer_offload_cpu", refused_by="export", field="plan.optimizer_offload",
        what="optimizer_offload cpu (zero_stage {zero_stage})",
        reason="torchtitan's training.enable_cpu_offload is FSDP2's CPUOffloadPolicy, which keeps the sharded "
               "parameters and gradients on the host too and steps the optimizer there, while stratagem's "
               "optimizer_offload puts the optimizer states only on the host; use optimizer_offload=none",
        source=f"{_V022} torchtitan/models/llama3/infra/parallelize.py apply_fsdp(cpu_offload: "
               "offload_policy=CPUOffloadPolicy()); torch/distributed/fsdp/_fully_shard/_fsdp_api.py "
               "CPUOffloadPolicy"),
    PlanExclusion(
        name="selective_recompute", refused_by="export", field="plan.activation_checkpointing",
        what="activation_checkpointing selective",
        reason="torchtitan's selective AC is per layer or per op (an op save list), and stratagem's selective "
               "(recompute the MLP activation, keep every matmul output) is neither; use activation_checkpointing "
               "op (torchtitan's op policy), full or none",
        source=f"{_V022} torchtitan/distributed/activation_checkpoint.py apply_ac (selective_ac_option 'op' or an "
               "int: every k-th layer in full); torchtitan/config/job_config.py ActivationCheckpoint.mode"),
    PlanExclusion(
        name="seq_len_divisor", refused_by="export", field="plan.tp",
        what="seq_len ({seq_len}) not a multiple of 2 x tp ({tp}) x cp ({cp})",
        reason="torchtitan asserts seq_len % (tp * 2 * cp) == 0 (sequence parallel shards the sequence over tp, "
               "load-balanced ring attention over 2 * cp); use a tp and cp whose 2 * tp * cp divides seq_len",
        source=f"{_V022} torchtitan/models/llama3/infra/parallelize.py parallelize_llama (assert on "
               "parallel_dims.seq_len_divisor); torchtitan/distributed/parallel_dims.py ParallelDims.seq_len_divisor"),
    PlanExclusion(
        name="etp_without_ep", refused_by="export", field="plan.etp",
        what="etp 1 with tp ({tp}) and ep 1",
        reason="with expert parallelism off torchtitan splits every routed expert's matmuls over the TP ranks, so "
               "experts whole on each TP rank have no setting (and export as the etp = tp job); use etp = tp, or "
               "ep > 1",
        source=f"{_V022} torchtitan/models/llama4/infra/parallelize.py apply_moe_ep_tp: without an ep mesh, "
               "experts_mesh = tp_mesh with TensorParallel()"),
)


# NeMo Automodel 0.7.0 builds its pipeline schedules with torch.distributed.pipelining (nemo_automodel/components/
# distributed/pipelining/functional.py build_pipeline_schedule -> get_schedule_class): torch's own refusal applies.
_AM_MESH = "nemo_automodel/components/distributed/mesh_utils.py"
AUTOMODEL_PLAN_EXCLUSIONS: tuple[PlanExclusion, ...] = (
    PlanExclusion(
        name="ddp_data_parallel_only", refused_by="harness", field="plan.zero_stage",
        what="zero_stage 0 over dp ({dp}) with tp ({tp}) / pp ({pp}) / cp ({cp}) / ep ({ep})",
        reason="Automodel's unsharded data parallelism is its DDP strategy, which runs data parallelism alone; use "
               "zero_stage 3 (FSDP2), or tp=pp=cp=ep=1",
        source=f"{_AM_MESH} _create_device_meshes: DDPConfig raises 'ddp does not support tensor / pipeline / "
               "context / expert parallelism'"),
    PlanExclusion(
        name="zero0_with_cp", refused_by="harness", field="plan.zero_stage",
        what="zero_stage 0 with cp ({cp})",
        reason="Automodel's FSDP2 shards the model states over dp_shard x cp whenever cp > 1; use zero_stage 3 with "
               "cp > 1",
        source=f"{_AM_MESH} _create_fsdp2_device_mesh: the dp_shard_cp axis FSDP2 shards over"),
    PlanExclusion(
        name="hsdp_full_replication", refused_by="harness", field="plan.dp_replicate",
        what="dp_replicate ({dp_replicate}) equal to dp ({dp})",
        reason="FSDP2 in Automodel needs a shard group of more than one rank; use dp_replicate below dp, or "
               "zero_stage 0 (DDP) for pure replication",
        source=f"{_AM_MESH} _create_fsdp2_device_mesh: ValueError 'dp_replicate_size must be less than dp_size "
               "since DDP usecase is not supported by FSDP2'"),
    PlanExclusion(
        name="1f1b_microbatches", refused_by="harness", field="plan.micro_batch_size",
        what="pp_schedule 1f1b with {microbatches} micro-batch(es) per step over pp ({pp}) stages",
        reason="the 1f1b schedule needs at least pp micro-batches per pipeline step; lower micro_batch_size or dp "
               "(micro-batches per step = global_batch_size / (dp * micro_batch_size)), or use pp_schedule gpipe",
        source="nemo_automodel/components/distributed/pipelining/functional.py build_pipeline_schedule "
               "(n_microbatches = local_batch_size // pp_microbatch_size) -> torch/distributed/pipelining/"
               "schedules.py Schedule1F1B: ValueError when microbatches < stages"),
)
