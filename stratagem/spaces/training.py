"""The training job: sequence length, batch, optimizer, the stack's memory conventions, checkpoint policy."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CheckpointPolicy", "TrainingSpec", "Optimizer", "Stack"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

Optimizer = Literal["adamw", "sgd", "adafactor", "adamw8bit"]
Stack = Literal["torch", "megatron", "deepspeed", "nanotron"]


class CheckpointPolicy(BaseModel):
    """How and how often training state is saved."""

    model_config = _FROZEN

    mode: Literal["blocking", "async"] = "async"
    """blocking: training waits for the whole write; async: it waits only for a staging copy to host memory."""
    interval_minutes: float | None = Field(default=None, gt=0)
    """Minutes between checkpoints; None = the Young/Daly optimum for this job's MTBF."""
    restart_minutes: float = Field(default=10.0, ge=0)
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
    training_tokens: float = Field(default=1e12, gt=0)
    """Tokens in the whole training run (capacity planning)."""
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    """Checkpoint policy."""

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size
