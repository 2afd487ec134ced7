"""The training job: sequence length, batch, optimizer, the stack's memory conventions, checkpoint policy."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratagem.errors import StratagemError
from stratagem.spaces import bounds as B
from stratagem.spaces.plan import Precision
from stratagem.spaces.stacks import (
    FP8_RECIPES,
    Dispatcher,
    DtypeName,
    Fp8Recipe,
    KernelPath,
    StackRecord,
    stack_record,
)

__all__ = ["CheckpointPolicy", "TrainingSpec", "Optimizer", "Stack"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

Optimizer = Literal["adamw", "sgd", "adafactor", "adamw8bit"]
Stack = Literal["torch", "megatron", "deepspeed", "nanotron", "automodel"]


class CheckpointPolicy(BaseModel):
    """How and how often training state is saved."""

    model_config = _FROZEN

    mode: Literal["blocking", "async"] = "async"
    """blocking: training waits for the whole write; async: it waits only for a staging copy to host memory."""
    interval_minutes: float | None = Field(default=None, gt=0, le=B.MAX_MINUTES)
    """Minutes between checkpoints; None = the Young/Daly optimum for this job's MTBF."""
    restart_minutes: float = Field(default=10.0, ge=0, le=B.MAX_MINUTES)
    """Time to reschedule and warm up after a failure, minutes; the model adds the checkpoint load time."""


class TrainingSpec(BaseModel):
    """What is trained and how, independent of the parallel plan.

    `stack` selects whose memory conventions apply (mixed precision, bf16 compute):
      - torch: FSDP2 / DDP with fp32 parameters and MixedPrecisionPolicy: fp32 params (4 B) are the master
        weights, fp32 grads (4 B), optimizer states; bf16 copies exist only while gathered for compute.
      - megatron: bf16 params (2 B), fp32 main-grad buffer (4 B), fp32 master weights in the optimizer (4 B)
        + states: 18 B/param, or 6 + 12/d with the distributed optimizer (Megatron-LM docs, distrib_optimizer).
      - deepspeed: bf16/fp16 params (2 B) and grads (2 B), fp32 master + states in the optimizer; ZeRO
        partitions them (Rajbhandari et al. 2019) and keeps an fp32 gradient partition (DeepSpeed's estimator).
      - nanotron: bf16 params (2 B), bf16 grads in DDP buckets (2 B, only when dp > 1), an fp32 gradient
        accumulation buffer for every parameter (4 B, accumulate_grad_in_fp32; ZeRO-1 keeps it whole), fp32
        master weights + optimizer states for this rank's ZeRO-1 shard; pipeline layers assigned by compute
        cost (the LM head counts as V h), so the first stage can hold one layer more than an even split.
      - automodel: NeMo Automodel's FSDP2 with bf16 resident parameters (2 B) and bf16 gradients (2 B), no fp32
        master copy: Transformer Engine FusedAdam keeps 16-bit remainders (2 B) and fp32 moments (8 B); all
        sharded over dp_shard x cp. With torch.optim.Adam (its benchmark configs) set optimizer_state_dtype bf16.
    """

    model_config = _FROZEN

    seq_len: int = Field(default=4096, ge=1)
    """Tokens per sequence."""
    global_batch_size: int = Field(default=256, ge=1)
    """Sequences per optimizer step (across all data-parallel ranks and accumulation steps)."""
    optimizer: Optimizer = "adamw"
    """adamw (2 fp32 states), sgd (momentum, 1 state), adafactor (factored second moment), adamw8bit."""
    stack: Stack = "torch"
    """Whose memory conventions apply (see the class docstring)."""
    training_tokens: float = Field(default=1e12, gt=0, le=B.MAX_TOKENS)
    """Tokens in the whole training run (capacity planning)."""
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    """Checkpoint policy."""
    precision: Precision = "bf16"
    """The training precision the user chose; the search's precision axis defaults to it (fp8 changes numerics:
    it is searched only when listed here or in search.precision)."""
    compile: bool | None = None
    """torch.compile on (true) or off (false); None = the stack's shipped default (StackRecord.compile_default)."""
    grad_dtype: DtypeName | None = None
    """Width of the gradient buffers backward accumulates into (fp32 main grads or bf16); None = the stack's
    default (Megatron --accumulate-allreduce-grads-in-fp32, on with bf16; nanotron accumulate_grad_in_fp32;
    FSDP2 fp32 params give fp32 grads; DeepSpeed bf16 grads)."""
    grad_reduce_dtype: DtypeName | None = None
    """Dtype of the data-parallel gradient reduction; None = the stack's default (Megatron grad_reduce_in_fp32,
    torchtitan mixed_precision_reduce = float32, DeepSpeed communication_data_type = the model dtype, nanotron
    fp32 accumulation buffers)."""
    optimizer_state_dtype: DtypeName = "fp32"
    """Dtype of the optimizer's states (Adam moments): fp32 (every stack's default) or bf16 (Megatron
    --exp-avg-dtype / --exp-avg-sq-dtype, torchao low-precision optimizers)."""
    tp_comm_overlap: bool | None = None
    """Overlap TP collectives with their GEMMs (Megatron --tp-comm-overlap, torchtitan async TP, which needs
    compile); None = the stack's default (StackRecord.tp_comm_overlap_default)."""
    fp8_recipe: Fp8Recipe | None = None
    """fp8 scaling recipe for plans in fp8: tensorwise, rowwise, blockwise, mxfp8 (Blackwell); None = the
    stack's first recipe (StackRecord.fp8_recipes)."""
    activation_func_fp8_input_store: bool = False
    """Save the MLP activation's input (SwiGLU's gate and up) in fp8 for backward: Megatron
    --activation-func-fp8-input-store (megatron/core/fusions/fused_bias_swiglu.py: input.to(float8_e4m3fn)),
    DeepSeek-V3's fp8 caching of the SwiGLU inputs (tech report sec. 3.3.2). Stacks with a fused GLU only."""
    kernels: KernelPath | None = None
    """Kernel path of the layers: eager (PyTorch ops one by one), compiled (torch.compile fuses the elementwise
    ops around the GEMMs) or fused (Transformer Engine); None = the stack's default (compiled when compile is on,
    else StackRecord.kernel_paths[0]). Scales compute (evaluators.timing.compute_factors) and is printed by
    `explain`."""
    moe_dispatcher: Dispatcher | None = None
    """MoE token dispatcher: alltoall (NCCL all-to-all over the ep group) or deepep (DeepEP: one RDMA copy per
    destination node, forwarded over NVLink); None = the stack's default (StackRecord.moe_dispatchers[0])."""
    ep_comm_overlap: bool | None = None
    """Overlap the expert all-to-all with another micro-batch's compute (Megatron
    --overlap-moe-expert-parallel-comm); None = off."""

    @model_validator(mode="after")
    def _settings_the_stack_has(self) -> TrainingSpec:
        rec = self.record
        if self.activation_func_fp8_input_store and not rec.fused_glu:
            raise StratagemError(
                f"training.activation_func_fp8_input_store (true): {rec.name} has no fused activation that stores "
                "its input in fp8 (Megatron's fused_bias_swiglu.py does); set it false")
        if self.fp8_recipe is not None and self.fp8_recipe not in rec.fp8_recipes:
            raise StratagemError(
                f"fp8_recipe ({self.fp8_recipe}): {rec.name} does not ship it ({rec.cite('fp8_recipes')}); "
                f"use one of {', '.join(rec.fp8_recipes) or 'none (train in bf16)'}")
        if self.kernels is not None and self.kernels not in rec.kernel_paths:
            raise StratagemError(
                f"training.kernels ({self.kernels}): {rec.name} runs {', '.join(rec.kernel_paths)} "
                f"({rec.cite('kernel_paths') or rec.summary}); use one of them")
        if self.kernels == "compiled" and self.compile is False:
            raise StratagemError("training.kernels (compiled) needs torch.compile; set training.compile: true "
                                 "or kernels: eager")
        if self.moe_dispatcher is not None and self.moe_dispatcher not in rec.moe_dispatchers:
            raise StratagemError(
                f"training.moe_dispatcher ({self.moe_dispatcher}): {rec.name} ships "
                f"{', '.join(rec.moe_dispatchers)} ({rec.cite('moe_dispatchers') or rec.summary})")
        if self.ep_comm_overlap and not rec.ep_comm_overlap:
            raise StratagemError(
                f"training.ep_comm_overlap (true): {rec.name} does not overlap the expert all-to-all with "
                "compute (Megatron's --overlap-moe-expert-parallel-comm has no counterpart); set it to false")
        if rec.tp_comm_overlap_needs_compile and self.tp_comm_overlap and self.compile is False:
            raise StratagemError("tp_comm_overlap (true): torchtitan's async TP needs torch.compile "
                                 f"({rec.cite('tp_comm_overlap_default')}); set training.compile: true")
        return self

    @property
    def record(self) -> StackRecord:
        """The stack's record (spaces/stacks.py)."""
        return stack_record(self.stack)

    @property
    def compile_on(self) -> bool:
        """Whether torch.compile runs (the setting, else the stack's default)."""
        if self.compile is None and self.kernels == "compiled":
            return True
        return self.record.compile_default if self.compile is None else self.compile

    @property
    def kernel_path(self) -> KernelPath:
        """The kernel path that runs: the setting, else compiled when torch.compile is on and the stack has that
        path, else the stack's first path."""
        if self.kernels is not None:
            return self.kernels
        rec = self.record
        return "compiled" if self.compile_on and "compiled" in rec.kernel_paths else rec.kernel_paths[0]

    @property
    def dispatcher(self) -> Dispatcher:
        """The MoE token dispatcher (the setting, else the stack's default)."""
        return self.moe_dispatcher or self.record.moe_dispatchers[0]

    @property
    def ep_overlap(self) -> bool:
        """Whether the expert all-to-all overlaps another micro-batch's compute."""
        return bool(self.ep_comm_overlap)

    @property
    def grad_bytes(self) -> float:
        """Bytes per gradient element of the accumulation buffers (mixed precision)."""
        return 4.0 if (self.grad_dtype or self.record.grad_dtype) == "fp32" else 2.0

    @property
    def grad_reduce_bytes(self) -> float:
        """Bytes per gradient element on the wire of the data-parallel reduction (mixed precision)."""
        return 4.0 if (self.grad_reduce_dtype or self.record.grad_reduce_dtype) == "fp32" else 2.0

    @property
    def tp_overlap(self) -> bool:
        """Whether TP collectives overlap their GEMMs (the setting, else the stack's default)."""
        return self.record.tp_comm_overlap_default if self.tp_comm_overlap is None else self.tp_comm_overlap

    @property
    def fp8_recipe_used(self) -> Fp8Recipe:
        """The fp8 recipe fp8 plans use (the setting, else the stack's first recipe, else tensorwise)."""
        if self.fp8_recipe is not None:
            return self.fp8_recipe
        shipped = [r for r in FP8_RECIPES if r in self.record.fp8_recipes]
        return shipped[0] if shipped else "tensorwise"

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: seq_len x global_batch_size."""
        return self.seq_len * self.global_batch_size
