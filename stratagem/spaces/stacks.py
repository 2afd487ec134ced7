"""One record per training stack: memory conventions, speed terms and capabilities, as data.

Every stack-dependent choice of the analytic model (evaluators/) and of the validity rules (spaces/rules.py) reads
a `StackRecord` from `STACKS`; a new stack is one new record plus its tests (tests/spaces/test_stacks.py). Each
capability cites, in `StackRecord.sources`, the engine code that enforces it.

Engines (file and function of the code each record follows):
  torch      FSDP2 (torch/distributed/fsdp/_fully_shard), DDP, torch.distributed.pipelining, torchtitan
             (torchtitan/models/llama3/infra/parallelize.py parallelize_llama, torchtitan/distributed/
             pipeline_parallel.py, torchtitan/config/job_config.py)
  megatron   Megatron-Core (megatron/core/distributed, megatron/core/pipeline_parallel/schedules.py,
             megatron/core/optimizer/distrib_optimizer.py, megatron/training/arguments.py validate_args)
  deepspeed  DeepSpeed (deepspeed/runtime/engine.py, deepspeed/runtime/pipe/engine.py PipelineEngine,
             deepspeed/runtime/pipe/schedule.py TrainSchedule, deepspeed/runtime/zero/)
  nanotron   huggingface/nanotron (src/nanotron/parallel/pipeline_parallel/engine.py, src/nanotron/optim/,
             src/nanotron/helpers.py init_optimizer_and_grad_accumulator, src/nanotron/config/parallelism_config.py)
  automodel  NVIDIA NeMo Automodel 0.7.0 (the nemo-automodel wheel; NVIDIA-NeMo/Automodel: nemo_automodel/
             components/distributed/config.py FSDP2Config, mesh_utils.py _create_fsdp2_device_mesh, pipelining/
             functional.py, components/models/common/utils.py BackendConfig, recipes/_dist_utils.py
             parse_distributed_section, docs/guides/mixed-precision-training.mdx)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratagem.errors import StratagemError
from stratagem.spaces.exclusions import (
    AUTOMODEL_PLAN_EXCLUSIONS,
    TORCH_PLAN_EXCLUSIONS,
    TORCH_SCHEDULE_EXCLUSIONS,
    PlanExclusion,
    PlanFacts,
    RefusedBy,
    ScheduleExclusion,
)

__all__ = [
    "StateTerm",
    "OPTIMIZER",
    "StackRecord",
    "STACKS",
    "stack_record",
    "CAPABILITY_FIELDS",
    "Fp8Recipe",
    "FP8_RECIPES",
    "DtypeName",
    "KernelPath",
    "KERNEL_PATHS",
    "Dispatcher",
]

Fp8Recipe = Literal["tensorwise", "rowwise", "blockwise", "mxfp8"]
FP8_RECIPES: tuple[Fp8Recipe, ...] = ("tensorwise", "rowwise", "blockwise", "mxfp8")
DtypeName = Literal["fp32", "bf16"]
KernelPath = Literal["eager", "compiled", "fused"]
KERNEL_PATHS: tuple[KernelPath, ...] = ("eager", "compiled", "fused")
Dispatcher = Literal["alltoall", "deepep"]
OPTIMIZER = -1.0  # StateTerm.bytes_per_param placeholder: the optimizer's state bytes per parameter


@dataclass(frozen=True)
class StateTerm:
    """One per-parameter buffer: its block, bytes per parameter, from which ZeRO stage it is sharded over
    the data-parallel ranks (4 = never), the range of stages in which it exists at all (exists_from ..
    exists_until), and whether it exists only under data parallelism (dp > 1: DDP's gradient buckets).
    `grad` marks gradient buffers whose width follows `TrainingSpec.grad_dtype` (bytes_per_param is the
    stack's default width); `master` marks the fp32 master copy kept beside low-precision weights; `state_dtype`,
    when set, limits the term to runs whose optimizer states are in that dtype (TrainingSpec.optimizer_state_dtype:
    Transformer Engine FusedAdam's master remainders exist with its fp32 moments, not with torch.optim.Adam's
    bf16 ones)."""

    block: str
    bytes_per_param: float  # OPTIMIZER = the optimizer's state bytes (see evaluators.memory.optimizer_state_bytes)
    sharded_from: int
    exists_until: int = 3
    needs_dp: bool = False
    exists_from: int = 0
    grad: bool = False
    master: bool = False
    state_dtype: DtypeName | None = None


_FROZEN = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class StackRecord(BaseModel):
    """What one training stack keeps in memory, what scales its speed, and what it can run."""

    model_config = _FROZEN

    name: str
    """The stack's name (TrainingSpec.stack)."""
    summary: str
    """One line: which engine and APIs the record describes."""
    # ---- memory conventions --------------------------------------------------------------------------------
    states: tuple[StateTerm, ...]
    """Per-parameter buffers under mixed precision (bf16/fp8 compute)."""
    fp32_states: tuple[StateTerm, ...]
    """Per-parameter buffers under fp32 training."""
    master_weights: bool
    """True when the weights are kept in low precision and `states` are the whole story: a separate fp32 master
    copy in the optimizer (Megatron, DeepSpeed, nanotron), or bf16 resident parameters stepped with fp32 moments
    and master remainders (NeMo Automodel). False: the fp32 parameters are the master weights and torch's engine
    makes the compute copies, as with FSDP2's MixedPrecisionPolicy over fp32 parameters."""
    grad_dtype: DtypeName
    """Shipped default width of the gradient buffers the backward accumulates into (mixed precision)."""
    grad_reduce_dtype: DtypeName
    """Shipped default dtype of the data-parallel gradient reduction (mixed precision)."""
    zero3_gather: Literal["fsdp_units", "largest_layer"]
    """ZeRO-3 transient: FSDP gathers (current + prefetched unit, and one unit's unsharded gradients), or
    DeepSpeed's 4 bytes x the largest layer kept gathered (estimate_zero3_model_states_mem_needs)."""
    pipeline_split: Literal["even", "cost"]
    """How layers go to pipeline stages by default: evenly (remainder on the first stages) or by cumulative
    compute cost (nanotron build_model)."""
    mha_packed_qkv: bool
    """True when multi-head attention keeps a packed [3, b, s, a, d] QKV copy alive (nanotron models/llama.py)."""
    sp_saves_gathered_inputs: bool = False
    """With sequence parallelism, the column-parallel linears save the all-gathered full-sequence input (sbh per
    TP rank) rather than their sequence shard: DTensor SP's PrepareModuleInput(desired Replicate) before attention
    and MLP (torch.distributed.tensor.parallel; torchtitan parallelize_llama), seen by `stratagem trace`."""
    reshard_after_forward_with_pp: bool
    """ZeRO-3 with pipeline parallelism: does the stack reshard parameters after forward? torchtitan does not
    (`reshard_after_forward = not pp_enabled`); without PP every FSDP stack reshards at ZeRO-3."""
    fp8_activation_store: Literal["high", "fp8"] = "high"
    """fp8 plans: the dtype a linear saves its input in for backward. fp8: Transformer Engine keeps the quantized
    input, row-wise data dropped (transformer_engine/pytorch/module/linear.py _Linear.forward, update_usage
    (rowwise_usage=False, columnwise_usage=True)); high: torchao Float8Linear saves input_hp (torchao/float8/
    float8_linear.py matmul_with_hp_or_float8_args.forward) and casts again in backward."""
    fp8_weight_cache_bytes: float = 0.0
    """fp8 plans: bytes per linear weight element of the fp8 copies the engine caches across micro-batches
    (Megatron passes is_first_microbatch to TE, which keeps the quantized weight, row- and column-wise, in
    `_fp8_workspaces["weight"]`: megatron/core/extensions/transformer_engine.py TELinear.forward,
    transformer_engine/pytorch/module/linear.py Linear.forward cache_name); 0 where no copy outlives the GEMM."""
    fused_glu: bool = False
    """The gated activation saves only its input (Megatron's fused SwiGLU: megatron/core/fusions/
    fused_bias_swiglu.py SwiGLUFunction.forward save_for_backward(input)); False: eager silu(g) * u also keeps
    silu(g) for the product's backward."""
    optimizer_step: Literal["foreach", "fused"] = "fused"
    """How the optimizer's step runs on the GPU. foreach: torch.optim.AdamW's default on CUDA (torch/optim/
    optimizer.py _default_to_fused_or_foreach), _multi_tensor_adam materialises exp_avg_sq_sqrt, one list as large
    as the second moments (torch/optim/adam.py); fused: one in-place kernel per tensor list, no intermediates
    (torch._fused_adamw_, Transformer Engine / apex FusedAdam multi_tensor_apply, DeepSpeed FusedAdam)."""
    recompute_modules: tuple[str, ...] = ()
    """Modules the stack can recompute one by one (Plan.recompute_modules; Megatron --recompute-modules with
    --recompute-granularity selective: megatron/core/transformer/transformer_config.py recompute_modules)."""
    # ---- speed terms ----------------------------------------------------------------------------------------
    kernels: Literal["transformer_engine", "eager"]
    """Kernels of the linear/attention/norm layers: Transformer Engine's fused kernels or eager PyTorch ops."""
    kernel_efficiency: float = Field(gt=0, le=1)
    """Speed of the stack's kernels relative to Transformer Engine (1.0) without torch.compile."""
    compile_default: bool
    """Whether the stack's shipped configuration runs torch.compile."""
    compile_gain: float = Field(ge=1)
    """Speed-up of torch.compile on the kernels (fused elementwise ops around the GEMMs); 1 where the stack
    cannot compile or its kernels are already fused."""
    tp_comm_overlap_default: bool
    """Whether TP collectives overlap their GEMMs in the shipped default (Megatron --tp-comm-overlap,
    torchtitan async TP)."""
    tp_comm_overlap_needs_compile: bool = False
    """Whether the TP overlap runs only under torch.compile (torchtitan's async TP is inductor's
    micro_pipeline_tp pass; cited with tp_comm_overlap_default)."""
    p2p_overlap: bool
    """Whether pipeline sends/receives overlap compute (Megatron's --overlap-p2p-communication)."""
    kernel_paths: tuple[KernelPath, ...] = ("eager",)
    """Kernel paths the stack can run (TrainingSpec.kernels): eager ops, torch.compile'd ops, or Transformer
    Engine's fused kernels; the first is the shipped default (compiled when training.compile is on)."""
    schedule_exclusions: tuple[ScheduleExclusion, ...] = ()
    """Schedules the stack cannot honour in some combination (ScheduleExclusion): one rule for the search space,
    the harness and the exporters."""
    plan_exclusions: tuple[PlanExclusion, ...] = ()
    """Other value combinations the stack cannot honour (PlanExclusion): one rule for the search space, the harness
    (refused_by harness) and the exporters (refused_by export)."""
    moe_dispatchers: tuple[Dispatcher, ...] = ("alltoall",)
    """MoE token dispatchers the stack ships (TrainingSpec.moe_dispatcher); the first is the default."""
    loss_bytes: float | None = None
    """Bytes per logit element the loss keeps for its backward (vocabulary-parallel: per TP shard), where the
    engine's code fixes it: Megatron's cross-entropy saves the fp32 softmax (megatron/core/tensor_parallel/
    cross_entropy.py and fusions/fused_cross_entropy.py: save_for_backward(exp_logits, ...), 4 bytes; Transformer
    Engine's fused one, --cross-entropy-fusion-impl te, an fp32 gradient, transformer_engine/pytorch/triton/
    cross_entropy.py cross_entropy_forward). None: Calibration.logits_bytes, fitted or traced."""
    mtp: bool = False
    """Whether the stack builds multi-token-prediction modules (ModelSpec.mtp_layers: Megatron --mtp-num-layers,
    megatron/core/transformer/multi_token_prediction.py); without them its job trains the main model alone
    (torchtitan v0.2.2 and NeMo Automodel 0.7.0's DeepSeek-V3 have none), and stratagem evaluates that job."""
    moe_probs_applied: Literal["activation", "combine"] = "combine"
    """Where the routing probabilities weight the routed experts, which decides what an MoE layer keeps for their
    gradient. activation: inside the experts' activation, which saves only its input and the permuted probs
    (megatron/core/transformer/moe/experts.py TEGroupedMLP.forward bias_act_func -> megatron/core/fusions/
    fused_bias_swiglu.py WeightedSwiGLUFunction.forward save_for_backward(input, weights)); the tokens are then
    unpermuted without probs (moe/token_dispatcher.py combine_postprocess -> moe/moe_utils.py unpermute) and the
    combine keeps no token tensor (all_to_all; DeepEP's moe/fused_a2a.py FusedCombine keeps only its handle).
    combine: the experts' outputs are multiplied by the gate weights after the experts, and that product keeps
    the outputs, k s b h per rank (the harness's MoE.forward `routed * weights`; torchtitan models/moe/moe.py
    MoE.forward with score_before_experts=False, its DeepSeek-V3 and Qwen3 setting, bmm over
    routed_output_unsorted.float(); DeepSpeed deepspeed/moe/sharded_moe.py MOELayer.forward einsum over
    expert_output)."""
    ep_comm_overlap: bool = False
    """Whether the stack can overlap the expert all-to-all with another micro-batch's compute (Megatron
    --overlap-moe-expert-parallel-comm)."""
    grouped_gemm: bool = False
    """Whether the local experts run as one grouped GEMM (Megatron TEGroupedMLP, torchtitan torch._grouped_mm)
    rather than one GEMM per expert."""
    # ---- capabilities ---------------------------------------------------------------------------------------
    schedules: tuple[str, ...]
    """Pipeline schedules the stack has (Plan.pp_schedule values)."""
    zero_stages: tuple[int, ...]
    """ZeRO stages the stack has (0 = plain DDP)."""
    max_zero_with_pp: int
    """Highest ZeRO stage allowed together with pipeline parallelism."""
    sequence_parallel: bool
    """Megatron-style sequence parallelism (norm/dropout regions sharded over TP)."""
    context_parallel: bool
    """Ring-attention context parallelism (cp > 1)."""
    expert_parallel: bool
    """Expert parallelism (ep > 1)."""
    expert_tensor_parallel: bool
    """Expert tensor parallelism separate from tp (etp > 1)."""
    optimizer_offload: bool
    """Optimizer states on the host (ZeRO-Offload / CPU offload)."""
    hsdp: bool
    """Hybrid sharding: shard inside dp_shard groups, replicate across dp_replicate."""
    pp_splits: tuple[str, ...]
    """Pipeline split modes (Plan.pp_split): layers only, or embedding and loss counted as layers."""
    fp8_routed_experts: bool = False
    """Whether the stack's fp8 plans run the routed experts' grouped GEMMs in fp8 (Megatron-Core TEGroupedMLP
    under --fp8-format); False: they stay bf16 (evaluators.speed [fp8-experts])."""
    expert_zero3: str = "ZeRO-3 over the expert dp group"
    """How the stack shards the routed experts under ZeRO-3, in words (explain's expert-shards row)."""
    expert_grid: Literal["folding", "etp_1_or_tp", "data_parallel"] = "folding"
    """How ep x etp may cover the tp x dp x cp ranks (spaces/expert_grid.py): folding = any ep*etp dividing
    tp*dp*cp (Megatron-Core MoE parallel folding); etp_1_or_tp = etp is 1 or tp, ep takes cp whole (and tp whole
    when etp = 1) plus part of dp (torchtitan ParallelDims); data_parallel = ep divides dp*cp, etp is 1 or tp."""
    moe_tp_requires_sp: bool = False
    """True when MoE layers with tp > 1 train only with sequence parallelism (Megatron-Core raises otherwise)."""
    moe_tp_collectives: Literal["shared_experts", "whole_block"] = "whole_block"
    """The TP collectives on an MoE layer's MLP side (with sequence parallelism an all-gather before it and a
    reduce-scatter after it; without, one all-reduce). whole_block: the MoE block's input is gathered over TP and
    its output reduce-scattered as a dense MLP's are (torchtitan parallelize.py apply_moe_ep_tp:
    PrepareModuleInputOutput Shard(1) -> Replicate, Partial -> Shard(1)). shared_experts: only the shared experts'
    MLP runs them; the routed tokens leave their sequence shard through the dispatcher alone (permute, all-to-all
    over ep, all-gather over etp: evaluators.experts.dispatch_s)."""
    uneven_stages: bool
    """Explicit first/last stage layer counts (Plan.first_stage_layers / last_stage_layers)."""
    fp8_recipes: tuple[str, ...]
    """fp8 recipes the stack ships (empty: no fp8 training)."""
    recompute_modes: tuple[str, ...]
    """Activation checkpointing modes (Plan.activation_checkpointing values)."""
    sources: dict[str, str]
    """Per capability and speed-term field: the engine code that enforces or defines it (file: function)."""

    def states_for(self, optimizer_state_dtype: DtypeName) -> tuple[StateTerm, ...]:
        """The mixed-precision state terms of a run whose optimizer states are in `optimizer_state_dtype`
        (StateTerm.state_dtype)."""
        return tuple(t for t in self.states if t.state_dtype in (None, optimizer_state_dtype))

    def schedule_exclusion(self, schedule: str, cp: int, virtual_stages: int, refused_by: RefusedBy | None = None,
                           recompute: str = "none") -> ScheduleExclusion | None:
        """The first exclusion covering (schedule, cp, virtual_stages, recompute), of `refused_by` when given;
        None if the stack honours the combination."""
        for ex in self.schedule_exclusions:
            if ((refused_by is None or ex.refused_by == refused_by)
                    and ex.applies(schedule, cp, virtual_stages, recompute)):
                return ex
        return None

    def plan_exclusion(self, f: PlanFacts, refused_by: RefusedBy | None = None) -> PlanExclusion | None:
        """The first PlanExclusion (of `refused_by` when given) covering the one plan `f` describes, or None."""
        return next((ex for ex in self.plan_exclusions
                     if (refused_by is None or ex.refused_by == refused_by) and bool(ex.applies(f))), None)

    def excluded(self, f: PlanFacts, refused_by: RefusedBy | None = None) -> Any:
        """Whether any PlanExclusion (of `refused_by` when given) covers each plan `f` describes (bool array for
        columns)."""
        out: Any = False
        for ex in self.plan_exclusions:
            if refused_by is None or ex.refused_by == refused_by:
                out = out | ex.applies(f)
        return out

    def cite(self, field: str) -> str:
        """The engine code behind `field`, for messages."""
        return self.sources.get(field, "")


CAPABILITY_FIELDS: tuple[str, ...] = (
    "schedules", "zero_stages", "max_zero_with_pp", "sequence_parallel", "context_parallel", "expert_parallel",
    "expert_tensor_parallel", "optimizer_offload", "hsdp", "pp_splits", "uneven_stages", "fp8_recipes",
    "recompute_modes", "recompute_modules",
)

# fp32 training: params 4, grads 4, optimizer states; no master copy (any stack except torch's zero 2).
_FP32_STATES: tuple[StateTerm, ...] = (
    StateTerm("weights", 4, 3),
    StateTerm("gradients", 4, 2, grad=True),
    StateTerm("optimizer", OPTIMIZER, 1),
)

_TORCH = StackRecord(
    tp_comm_overlap_needs_compile=True,
    expert_zero3="torchtitan fully_shard on the experts over the dp_shard_mod_ep mesh",
    name="torch",
    summary="PyTorch FSDP2 / DDP / torch.distributed.pipelining as torchtitan composes them",
    # FSDP2/DDP with fp32 params: fp32 params are the master weights; a bf16 compute copy is held through
    # forward+backward unless FSDP reshards after forward (zero 3): autocast's saved casts (zero 0/1) or
    # FSDP2's unsharded params with reshard_after_forward=False (zero 2).
    states=(
        StateTerm("weights", 4, 2),
        StateTerm("weights", 2, 4, exists_until=2),
        StateTerm("gradients", 4, 2, grad=True),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    # zero 2 is FSDP2 without reshard after forward: the sharded fp32 params (4/d) and the unsharded fp32 copy
    # gathered for forward (4) coexist until backward ends (measured in the harness).
    fp32_states=(
        StateTerm("weights", 4, 2),
        StateTerm("weights", 4, 4, exists_until=2, needs_dp=True, exists_from=2),
        StateTerm("gradients", 4, 2, grad=True),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    master_weights=False,
    grad_dtype="fp32",
    grad_reduce_dtype="fp32",
    zero3_gather="fsdp_units",
    pipeline_split="even",
    mha_packed_qkv=False,
    sp_saves_gathered_inputs=True,
    reshard_after_forward_with_pp=False,
    # AdamW's fused kernel on CUDA: torchtitan's default (job_config.py Optimizer.implementation = "fused"; the
    # exporter leaves it) and the harness's (launch/harness/parallelize.py build_optimizer)
    optimizer_step="fused",
    kernels="eager",
    kernel_efficiency=0.70,
    compile_default=False,
    compile_gain=1.16,
    tp_comm_overlap_default=False,
    p2p_overlap=False,
    kernel_paths=("eager", "compiled"),
    # one rule for what runs (spaces/exclusions.py): what the harness refuses and what torchtitan v0.2.2 cannot
    # express exactly, which the space leaves out
    schedule_exclusions=TORCH_SCHEDULE_EXCLUSIONS,
    plan_exclusions=TORCH_PLAN_EXCLUSIONS,
    moe_dispatchers=("alltoall",),
    grouped_gemm=True,
    schedules=("gpipe", "1f1b", "interleaved", "zero_bubble"),
    zero_stages=(0, 1, 2, 3),
    max_zero_with_pp=3,
    sequence_parallel=True,
    context_parallel=True,
    expert_parallel=True,
    expert_tensor_parallel=True,
    optimizer_offload=True,
    hsdp=True,
    pp_splits=("layers", "embedding_loss"),
    expert_grid="etp_1_or_tp",
    uneven_stages=True,
    fp8_recipes=("tensorwise", "rowwise", "mxfp8"),
    recompute_modes=("none", "selective", "full", "op"),
    sources={
        "schedules": "torch/distributed/pipelining/schedules.py: ScheduleGPipe, Schedule1F1B, "
                     "ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble",
        "zero_stages": "torch DDP, ZeroRedundancyOptimizer, fully_shard(reshard_after_forward=False|True)",
        "max_zero_with_pp": "torchtitan/models/llama3/infra/parallelize.py parallelize_llama: FSDP applied per "
                            "pipeline stage (reshard_after_forward = not pp_enabled)",
        "sequence_parallel": "torchtitan parallelize_llama apply_tp: SequenceParallel on the norms",
        "context_parallel": "torch/distributed/tensor/experimental/_attention.py context_parallel",
        "expert_parallel": "torchtitan/distributed/expert_parallel.py ExpertParallel",
        "expert_tensor_parallel": "torchtitan/config/job_config.py Parallelism.expert_tensor_parallel_degree",
        "expert_grid": "torchtitan/distributed/parallel_dims.py ParallelDims._validate: etp == tp or etp == 1; "
                       "etp = tp: ep % cp == 0 and dp_shard*cp % ep == 0; etp = 1: ep % (cp*tp) == 0",
        "optimizer_offload": "torch/distributed/fsdp/_fully_shard/_fsdp_api.py CPUOffloadPolicy",
        "hsdp": "torchtitan/config/job_config.py Parallelism.data_parallel_replicate_degree (2-D mesh fully_shard)",
        "pp_splits": "torchtitan/distributed/pipeline_parallel.py generate_llm_fqn_per_model_part "
                     "(input_weight / output_weight count the embedding and the output as layers)",
        "uneven_stages": "torchtitan/config/job_config.py Parallelism.module_fqns_per_model_stage",
        "fp8_recipes": "torchao/float8/config.py Float8LinearRecipeName (TENSORWISE, ROWWISE); "
                       "torchao/prototype/mx_formats (MXFP8, Blackwell)",
        "recompute_modes": "torchtitan/distributed/activation_checkpoint.py apply_ac (full, selective op/layer)",
        "recompute_modules": "torchtitan/distributed/activation_checkpoint.py apply_ac: whole layers or an op "
                             "save list, no per-module recompute",
        "kernel_efficiency": "eager torch.nn ops vs Transformer Engine's fused kernels; the value with the least "
                             "error on torchtitan's 12 published runs, compile and 500 W cap as separate terms "
                             "(bench/throughput_accuracy.py)",
        "compile_gain": "measured: torchtitan Llama-3-8B eager -> compiled, 8 GPUs 5,762 -> 6,667 tok/s (x1.157), "
                        "128 GPUs 5,605 -> 6,514 (x1.162) (bench/reference published cases)",
        "kernel_paths": "torchtitan job_config Compile.enable (torch.compile per TransformerBlock, "
                        "parallelize_llama apply_compile); no Transformer Engine path",
        "moe_dispatchers": "torchtitan/distributed/expert_parallel.py ExpertParallel._token_dispatch: "
                           "all_to_all_single_autograd over the ep group (NCCL all-to-all)",
        "grouped_gemm": "torchtitan/models/moe/moe.py GroupedExperts: torch._grouped_mm over the local experts",
        "tp_comm_overlap_default": "torchtitan job_config Parallelism.enable_async_tensor_parallel (needs "
                                   "compile), default False",
    },
)

_MEGATRON = StackRecord(
    fp8_routed_experts=True,
    expert_zero3="Megatron-FSDP over the expert data-parallel group",
    name="megatron",
    summary="Megatron-Core with Transformer Engine and the distributed optimizer",
    # megatron/training/theoretical_memory_usage.py: bf16 params 2 + fp32 main grads 4 + fp32 master 4 +
    # Adam 8 = 18; distributed optimizer 6 + 12/d.
    states=(
        StateTerm("weights", 2, 3),
        StateTerm("gradients", 4, 2, grad=True),
        StateTerm("optimizer", 4, 1, master=True),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    fp32_states=_FP32_STATES,
    master_weights=True,
    grad_dtype="fp32",
    grad_reduce_dtype="fp32",
    zero3_gather="fsdp_units",
    pipeline_split="even",
    mha_packed_qkv=False,
    reshard_after_forward_with_pp=True,
    fp8_activation_store="fp8",
    fp8_weight_cache_bytes=2.0,
    fused_glu=True,
    recompute_modules=("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"),
    kernels="transformer_engine",
    kernel_efficiency=1.0,
    compile_default=False,
    compile_gain=1.0,
    tp_comm_overlap_default=True,
    p2p_overlap=True,
    kernel_paths=("fused",),
    moe_dispatchers=("alltoall", "deepep"),
    loss_bytes=4.0,
    mtp=True,
    moe_probs_applied="activation",
    ep_comm_overlap=True,
    grouped_gemm=True,
    schedules=("1f1b", "interleaved"),
    zero_stages=(0, 1, 3),
    max_zero_with_pp=1,
    sequence_parallel=True,
    context_parallel=True,
    expert_parallel=True,
    expert_tensor_parallel=True,
    moe_tp_requires_sp=True,
    moe_tp_collectives="shared_experts",
    optimizer_offload=True,
    hsdp=False,
    pp_splits=("layers", "embedding_loss"),
    uneven_stages=True,
    fp8_recipes=("tensorwise", "blockwise", "mxfp8"),
    recompute_modes=("none", "selective", "full"),
    sources={
        "schedules": "megatron/core/pipeline_parallel/schedules.py get_forward_backward_func: "
                     "forward_backward_pipelining_without_interleaving (1F1B) / _with_interleaving",
        "zero_stages": "megatron/training/arguments.py: --use-distributed-optimizer (ZeRO-1), "
                       "--use-torch-fsdp2 / Megatron-FSDP (ZeRO-3)",
        "max_zero_with_pp": "megatron/training/arguments.py validate_args: torch FSDP2 is not supported with "
                            "pipeline parallelism; the distributed optimizer (ZeRO-1) is",
        "sequence_parallel": "megatron/core/tensor_parallel/layers.py sequence_parallel",
        "context_parallel": "megatron/core/parallel_state.py initialize_model_parallel(context_parallel_size)",
        "expert_parallel": "megatron/core/parallel_state.py expert_model_parallel_size",
        "expert_tensor_parallel": "megatron/core/parallel_state.py expert_tensor_parallel_size (MoE folding)",
        "expert_grid": "megatron/core/parallel_state.py initialize_model_parallel: tp*cp*dp % (etp*ep) == 0 "
                       "(expert grid order tp-ep-dp-pp)",
        "moe_tp_requires_sp": "megatron/core/transformer/moe/moe_layer.py MoELayer.forward: raises ValueError in "
                              "training when the attention TP group > 1 without sequence_parallel",
        "moe_tp_collectives": "megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher "
                              "(permute -> A2A(EP) -> AG(TP) over expt_tp_group, none at etp 1; the flex/DeepEP "
                              "dispatcher likewise) and moe/shared_experts.py SharedExpertMLP (a TP MLP)",
        "optimizer_offload": "megatron/core/optimizer/cpu_offloading (--optimizer-cpu-offload)",
        "hsdp": "Megatron-Core's distributed optimizer shards over the whole dp x cp group (no replicate dim)",
        "pp_splits": "megatron/training/arguments.py --account-for-embedding-in-pipeline-split / "
                     "--account-for-loss-in-pipeline-split",
        "uneven_stages": "megatron/training/arguments.py --decoder-first-pipeline-num-layers / "
                         "--decoder-last-pipeline-num-layers",
        "fp8_recipes": "megatron/core/fp8_utils.py --fp8-recipe delayed|tensorwise|blockwise|mxfp8 "
                       "(Transformer Engine recipes)",
        "recompute_modes": "megatron/training/arguments.py --recompute-granularity full|selective",
        "recompute_modules": "megatron/core/transformer/transformer_config.py recompute_modules (with "
                             "--recompute-granularity selective)",
        "kernel_efficiency": "Transformer Engine fused kernels: the reference (1.0) of the efficiency ceilings",
        "kernel_paths": "megatron/training/arguments.py --transformer-impl transformer_engine (the default)",
        "moe_dispatchers": "megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher "
                           "(--moe-token-dispatcher-type alltoall), MoEFlexTokenDispatcher with DeepEP "
                           "(flex, --moe-enable-deepep)",
        "ep_comm_overlap": "megatron/training/arguments.py --overlap-moe-expert-parallel-comm "
                           "(megatron/core/pipeline_parallel/combined_1f1b.py: one micro-batch's all-to-all "
                           "behind another's compute)",
        "grouped_gemm": "megatron/core/transformer/moe/experts.py TEGroupedMLP (--moe-grouped-gemm)",
        "tp_comm_overlap_default": "megatron/training/arguments.py --tp-comm-overlap (TE userbuffers); the "
                                   "published Megatron throughput table runs with it",
    },
)

_DEEPSPEED = StackRecord(
    name="deepspeed",
    summary="DeepSpeed ZeRO 0-3 with its PipelineEngine",
    # estimate_zero{2,3}_model_states_mem_needs: bf16 grads kept whole at stage <= 2 (reduce buckets), freed into
    # an fp32 partition at stage 3.
    states=(
        StateTerm("weights", 2, 3),
        StateTerm("gradients", 2, 4, exists_until=2, grad=True),
        StateTerm("gradients", 4, 1),
        StateTerm("optimizer", 4, 1, master=True),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    fp32_states=_FP32_STATES,
    master_weights=True,
    grad_dtype="bf16",
    grad_reduce_dtype="bf16",
    zero3_gather="largest_layer",
    pipeline_split="even",
    mha_packed_qkv=False,
    reshard_after_forward_with_pp=True,
    kernels="eager",
    kernel_efficiency=1.0,
    compile_default=False,
    compile_gain=1.0,
    tp_comm_overlap_default=False,
    p2p_overlap=False,
    schedules=("1f1b",),
    zero_stages=(0, 1, 2, 3),
    max_zero_with_pp=1,
    sequence_parallel=False,
    context_parallel=False,
    expert_parallel=True,
    expert_tensor_parallel=True,
    optimizer_offload=True,
    hsdp=False,
    pp_splits=("layers",),
    expert_grid="data_parallel",
    uneven_stages=False,
    fp8_recipes=(),
    recompute_modes=("none", "full"),
    sources={
        "schedules": "deepspeed/runtime/pipe/schedule.py TrainSchedule (1F1B) is the only training schedule",
        "zero_stages": "deepspeed/runtime/zero/config.py ZeroStageEnum (disabled, optimizer_states, gradients, "
                       "weights)",
        "max_zero_with_pp": "deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ asserts "
                            "zero_optimization_stage() < 2 ('ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                            "parallelism')",
        "sequence_parallel": "DeepSpeed has no Megatron-style TP sequence parallelism (Ulysses is all-to-all CP, "
                             "deepspeed/sequence/layer.py)",
        "context_parallel": "DeepSpeed has no ring-attention CP (deepspeed/sequence/layer.py is Ulysses)",
        "expert_parallel": "deepspeed/moe/layer.py MoE(ep_size)",
        "expert_tensor_parallel": "deepspeed/moe/layer.py MoE(enable_expert_tensor_parallelism)",
        "expert_grid": "deepspeed/utils/groups.py _create_expert_and_data_parallel: expert groups of ep_size taken "
                       "from the data-parallel ranks; expert TP reuses the model-parallel group",
        "optimizer_offload": "deepspeed/runtime/zero/offload_config.py offload_optimizer",
        "hsdp": "DeepSpeed 0.19: MiCS was removed and ZeRO++ hpZ only adds a secondary weight copy: ZeRO shards "
                "over all data-parallel ranks (launch/export/deepspeed.py)",
        "pp_splits": "deepspeed/runtime/pipe/module.py PipelineModule partition_method (layers only)",
        "uneven_stages": "deepspeed/runtime/pipe/module.py _partition_layers: no per-stage layer counts",
        "fp8_recipes": "deepspeed/runtime/engine.py: no fp8 training recipe (fp16/bf16 only)",
        "recompute_modes": "deepspeed/runtime/activation_checkpointing/checkpointing.py checkpoint (full layers)",
        "recompute_modules": "deepspeed/runtime/activation_checkpointing/checkpointing.py: whole layers only",
        "kernel_efficiency": "no reference data for DeepSpeed: counted as the reference (1.0)",
        "tp_comm_overlap_default": "DeepSpeed does not overlap TP collectives with GEMMs",
    },
)

_NANOTRON = StackRecord(
    name="nanotron",
    summary="huggingface/nanotron (the Ultra-Scale Playbook's benchmark code)",
    # bf16 params; bf16 grads in DDP's bucket buffers when dp > 1; FP32GradientAccumulator's fp32 grad buffers
    # for every parameter (ZeRO-1 keeps them whole); fp32 master weights and Adam states for this rank's shard.
    states=(
        StateTerm("weights", 2, 3),
        StateTerm("gradients", 2, 2, needs_dp=True),
        StateTerm("gradients", 4, 2, grad=True),
        StateTerm("optimizer", 4, 1, master=True),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    fp32_states=_FP32_STATES,
    master_weights=True,
    grad_dtype="fp32",
    grad_reduce_dtype="fp32",
    zero3_gather="fsdp_units",
    pipeline_split="cost",
    mha_packed_qkv=True,
    reshard_after_forward_with_pp=True,
    kernels="eager",
    kernel_efficiency=0.80,
    compile_default=False,
    compile_gain=1.0,
    tp_comm_overlap_default=False,
    p2p_overlap=False,
    schedules=("gpipe", "1f1b"),
    zero_stages=(0, 1),
    max_zero_with_pp=1,
    sequence_parallel=True,
    context_parallel=False,
    expert_parallel=True,
    expert_tensor_parallel=False,
    optimizer_offload=False,
    hsdp=False,
    pp_splits=("layers",),
    expert_grid="data_parallel",
    uneven_stages=False,
    fp8_recipes=(),
    recompute_modes=("none", "full"),
    sources={
        "schedules": "src/nanotron/parallel/pipeline_parallel/engine.py AllForwardAllBackwardPipelineEngine, "
                     "OneForwardOneBackwardPipelineEngine",
        "zero_stages": "src/nanotron/helpers.py init_optimizer_and_grad_accumulator: ZeroDistributedOptimizer "
                       "when zero_stage > 0 (ZeRO-1 only)",
        "max_zero_with_pp": "src/nanotron/optim/zero.py ZeroDistributedOptimizer (ZeRO-1) composes with PP",
        "sequence_parallel": "src/nanotron/parallel/tensor_parallel/enum.py TensorParallelLinearMode.REDUCE_SCATTER",
        "context_parallel": "src/nanotron/config/parallelism_config.py: dp, pp, tp, expert_parallel_size; no cp",
        "expert_parallel": "src/nanotron/config/parallelism_config.py expert_parallel_size",
        "expert_tensor_parallel": "src/nanotron/config/parallelism_config.py: no expert tensor parallel degree",
        "expert_grid": "src/nanotron/parallel/context.py ParallelContext: expert_parallel_size groups inside the "
                       "data-parallel ranks",
        "optimizer_offload": "src/nanotron/optim: no CPU offload",
        "hsdp": "src/nanotron/optim/zero.py shards over the whole dp group",
        "pp_splits": "src/nanotron/models/base.py build_model (split by compute cost)",
        "uneven_stages": "src/nanotron/models/base.py build_model: no per-stage layer counts",
        "fp8_recipes": "nanotron main: fp8 training is not in the released trainer",
        "recompute_modes": "src/nanotron/config/models_config.py recompute_layer (full layers)",
        "recompute_modules": "src/nanotron/config/models_config.py recompute_layer: whole layers only",
        "kernel_efficiency": "fitted on the Ultra-Scale Playbook sweep (bench/throughput_accuracy.py --fit)",
        "tp_comm_overlap_default": "nanotron's TP linears run their collectives in line",
    },
)


_AM = "NeMo Automodel 0.7.0 nemo_automodel/"

_AUTOMODEL = StackRecord(
    name="automodel",
    summary="NVIDIA NeMo Automodel: FSDP2 (HSDP), torch.distributed.pipelining, DeepEP, Transformer Engine "
            "kernels, bf16 parameters with TE FusedAdam's fp32 moments",
    # docs/guides/mixed-precision-training.mdx Pattern A (model.torch_dtype bfloat16 + Transformer Engine FusedAdam
    # master_weights, store_param_remainders, exp_avg(_sq)_dtype float32): the resident FSDP2 shards are bf16 (2),
    # their gradients bf16 (2: FSDP2 reduces in fp32, mp_policy reduce_dtype, and casts back to the parameter's
    # dtype), no fp32 master copy: TE keeps the 16 low bits that rebuild it (2, transformer_engine/pytorch/optimizers/
    # fused_adam.py store_param_remainders) and the fp32 Adam moments (8). torch.optim.Adam on bf16 parameters (the
    # published benchmark configs, examples/llm_benchmark/) keeps bf16 moments and no remainder (it initialises its
    # states from the parameter dtype): training.optimizer_state_dtype bf16.
    states=(
        StateTerm("weights", 2, 3),
        StateTerm("gradients", 2, 2, grad=True),
        StateTerm("optimizer", 2, 1, master=True, state_dtype="fp32"),
        StateTerm("optimizer", OPTIMIZER, 1),
    ),
    fp32_states=_FP32_STATES,  # model.torch_dtype float32 with torch AdamW (the guide's Pattern B)
    master_weights=True,  # the states above are the whole story: no fp32 parameters, no autocast copies
    grad_dtype="bf16",
    grad_reduce_dtype="fp32",
    zero3_gather="fsdp_units",
    pipeline_split="even",
    mha_packed_qkv=False,
    sp_saves_gathered_inputs=True,
    reshard_after_forward_with_pp=False,
    fp8_activation_store="fp8",
    fp8_weight_cache_bytes=2.0,
    optimizer_step="fused",
    kernels="transformer_engine",
    kernel_efficiency=1.0,
    compile_default=False,
    compile_gain=1.0,
    tp_comm_overlap_default=False,
    p2p_overlap=False,
    kernel_paths=("fused",),
    plan_exclusions=AUTOMODEL_PLAN_EXCLUSIONS,
    moe_dispatchers=("deepep",),
    # GroupedExpertsDeepEP weights the experts in their activation (components/moe/experts.py
    # get_expert_activation_for_deepep: Megatron's weighted_bias_swiglu_impl; MoEConfig
    # apply_router_weight_after_down = False)
    moe_probs_applied="activation",
    grouped_gemm=True,
    schedules=("gpipe", "1f1b", "interleaved"),
    zero_stages=(0, 3),
    max_zero_with_pp=3,
    sequence_parallel=True,
    context_parallel=True,
    expert_parallel=True,
    expert_tensor_parallel=False,
    optimizer_offload=False,
    hsdp=True,
    pp_splits=("layers",),
    expert_grid="folding",
    uneven_stages=False,
    fp8_recipes=("tensorwise", "blockwise", "mxfp8"),
    recompute_modes=("none", "full", "op"),
    sources={
        "states": f"{_AM}components/distributed/config.py FSDP2Config.mp_policy (param bf16, reduce fp32); "
                  "docs/guides/mixed-precision-training.mdx Pattern A (TE FusedAdam, store_param_remainders)",
        "schedules": f"{_AM}components/distributed/pipelining/functional.py build_pipeline_schedule: torch "
                     "get_schedule_class (pp_schedule 1f1b, gpipe, interleaved1f1b)",
        "zero_stages": f"{_AM}components/distributed/mesh_utils.py _create_device_meshes: FSDP2 shards over "
                       "dp_shard x cp (fully_shard, ZeRO-3); DDPConfig (ZeRO-0) runs data parallelism alone; no "
                       "optimizer-only or gradient-only sharding",
        "max_zero_with_pp": f"{_AM}components/distributed/config.py FSDP2Config.reshard_after_forward: FSDP2 "
                            "with PP (pipeline layers do not reshard after forward)",
        "reshard_after_forward_with_pp": f"{_AM}components/distributed/config.py FSDP2Config.reshard_after_forward "
                                         "(None: pipeline-parallel layers do not reshard after forward)",
        "sequence_parallel": f"{_AM}components/distributed/config.py FSDP2Config.sequence_parallel (DTensor TP plan)",
        "context_parallel": f"{_AM}components/distributed/mesh.py MeshAxisName.CP (cp_size)",
        "expert_parallel": f"{_AM}components/distributed/mesh_utils.py _create_moe_mesh (ep_size)",
        "expert_tensor_parallel": f"{_AM}components/distributed/mesh_utils.py _create_moe_mesh: the MoE mesh is "
                                  "(ep_shard, ep) over dp x cp x tp, experts whole on each ep rank",
        "expert_grid": f"{_AM}components/distributed/mesh_utils.py _create_fsdp2_device_mesh: dp*cp*tp % ep == 0",
        "optimizer_offload": f"{_AM}components/distributed/config.py FSDP2Config.offload_policy is FSDP2's "
                             "CPUOffloadPolicy (parameters and gradients too), not optimizer-only offload",
        "hsdp": f"{_AM}components/distributed/config.py: dp_replicate_size (FSDP2 only)",
        "pp_splits": f"{_AM}components/distributed/pipelining/functional.py generate_hf_model_fqn_per_model_part: "
                     "layers split evenly, embedding on the first stage, norm and lm_head on the last",
        "uneven_stages": f"{_AM}components/distributed/pipelining/config.py PipelineConfig.layers_per_stage (one "
                         "count for every stage; module_fqns_per_model_part is not written by stratagem)",
        "fp8_recipes": f"{_AM}components/models/common/utils.py TEFp8Config.recipe current | block | mxfp8 "
                       "(Transformer Engine Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)",
        "fp8_weight_cache_bytes": f"{_AM}components/training/utils.py set_is_first_microbatch, passed to TE's "
                                  "Linear (components/models/common/utils.py), which caches its fp8 weights",
        "recompute_modes": f"{_AM}recipes/_dist_utils.py _normalize_activation_checkpointing: true/full (whole "
                           "blocks) or selective (components/distributed/activation_checkpointing.py: "
                           "TorchTitan-style op policy)",
        "recompute_modules": f"{_AM}components/distributed/activation_checkpointing.py: whole blocks or an op "
                             "policy, no per-module recompute",
        "kernel_efficiency": "Transformer Engine's fused kernels (BackendConfig attn/linear/rms_norm te): the "
                             "reference (1.0) of the efficiency ceilings",
        "kernel_paths": f"{_AM}components/models/common/utils.py BackendConfig linear / attn / rms_norm 'te'",
        "moe_dispatchers": f"{_AM}components/models/common/utils.py BackendConfig.dispatcher deepep (its 'torch' "
                           "dispatcher is a DTensor all-gather / reduce-scatter, not an all-to-all)",
        "grouped_gemm": f"{_AM}components/models/common/utils.py BackendConfig.experts te (GroupedLinear) or "
                        "torch_mm (torch._grouped_mm)",
        "optimizer_step": "transformer_engine/pytorch/optimizers/fused_adam.py FusedAdam (multi_tensor_apply)",
        "tp_comm_overlap_default": f"{_AM}components/distributed/config.py FSDP2Config.enable_async_tensor_parallel "
                                   "(needs compile), default False",
    },
)

STACKS: dict[str, StackRecord] = {r.name: r for r in (_TORCH, _MEGATRON, _DEEPSPEED, _NANOTRON, _AUTOMODEL)}


def stack_record(name: str) -> StackRecord:
    """The record of stack `name`, or an error listing the stacks."""
    try:
        return STACKS[name]
    except KeyError:
        raise StratagemError(f"training.stack ({name!r}): unknown stack; use one of {', '.join(STACKS)}") from None
