"""The scenario's `search:` section (SearchConfig, IntRange) and how one axis spec resolves to values
(`axis_values`): unset takes the derived default, a range filters the axis' universe, a value or list is kept.
The search space (spaces/space.py, spaces/layouts.py) reads them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stratagem.errors import StratagemError
from stratagem.spaces.plan import PipelineSplit, Precision, Recompute, Schedule

__all__ = ["IntRange", "IntAxis", "SearchConfig", "axis_values"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class IntRange(BaseModel):
    """An inclusive range of an integer axis: `{min: 2, max: 16}`."""

    model_config = _FROZEN

    min: int = Field(default=0, ge=0)
    """Smallest value allowed."""
    max: int | None = Field(default=None, ge=0)
    """Largest value allowed (None = no bound)."""


IntAxis = int | list[int] | IntRange


class SearchConfig(BaseModel):
    """The scenario's `search:` section. Every axis is optional: unset, it takes defaults derived from the
    scenario; an int or value fixes it; a list narrows it to those values; `{min, max}` to a range."""

    model_config = _FROZEN

    dp: IntAxis | None = None
    """Data-parallel degree (derived: world / (tp*pp*cp)); a value or list filters the layouts."""
    tp: IntAxis | None = None
    """Tensor-parallel degree. Default: divisors of the world that divide the heads, KV heads and MLP size."""
    pp: IntAxis | None = None
    """Pipeline degree. Default: divisors of the world whose layer split is within max_stage_imbalance."""
    cp: IntAxis | None = None
    """Context-parallel degree. Default: divisors of the world with 2*cp | seq_len and >= 1024 tokens per rank."""
    ep: IntAxis | None = None
    """Expert-parallel degree (MoE). Default: divisors of num_experts with ep*etp dividing tp*dp*cp."""
    etp: IntAxis | None = None
    """Expert tensor-parallel degree (MoE, stacks with ETP). Default: divisors of the node size that divide the
    expert MLP, with ep*etp dividing tp*dp*cp (Megatron MoE parallel folding)."""
    pp_split: PipelineSplit | list[PipelineSplit] | None = None
    """Pipeline split (pp > 1): layers, or embedding_loss (embedding and loss counted as layers). Default: every
    split the stack has that divides evenly."""
    first_stage_layers: IntAxis | None = None
    """Layers on the first pipeline stage (0: even split). Default, where the stack has uneven stages: 0 and up to
    MAX_UNEVEN_SPLITS balanced first/last pairs whose ends are no heavier than the middle stages."""
    last_stage_layers: IntAxis | None = None
    """Layers on the last pipeline stage (0: even split); default as first_stage_layers."""
    dp_replicate: IntAxis | None = None
    """HSDP replicas (zero_stage >= 1). Default 1 (plain ZeRO/FSDP); give a list or range to explore HSDP."""
    zero_stage: IntAxis | None = None
    """ZeRO/FSDP stage. Default 0-3 (stages > 0 only where the sharding group dp*cp > 1)."""
    sequence_parallel: bool | list[bool] | None = None
    """Sequence parallelism (applies to tp > 1). Default: both."""
    micro_batch_size: IntAxis | None = None
    """Sequences per micro-batch. Default: every divisor of the per-replica batch global_batch_size / dp."""
    precision: Precision | list[Precision] | None = None
    """Compute precision. Default: fp32, bf16 and fp8 where the GPU has FP8 tensor cores."""
    activation_checkpointing: Recompute | list[Recompute] | None = None
    """Recomputation. Default: none, selective, full."""
    recompute_modules: list[str] | None = None
    """Module sets to try with selective recompute, each written `a+b` (Megatron --recompute-modules: core_attn,
    moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts); "" is stratagem's own selective. Default (unset):
    no module sets, only ""; stacks without module recompute (StackRecord.recompute_modules) refuse a list."""
    pp_schedule: Schedule | list[Schedule] | None = None
    """Pipeline schedule (applies to pp > 1). Default: all four."""
    virtual_stages: IntAxis | None = None
    """Model chunks per rank (applies to the interleaved schedule). Default: 2-8, within max_stage_imbalance."""
    optimizer_offload: Literal["none", "cpu"] | list[Literal["none", "cpu"]] | None = None
    """Optimizer states in host memory (applies to zero_stage >= 1). Default: none only; list cpu to try it."""
    cross_node_tp: Literal["forbid", "allow"] = "forbid"
    """forbid: a TP group stays inside one node (tp divides gpus_per_node); allow: TP may span nodes."""
    memory_margin_gib: float = Field(default=2.0, ge=0)
    """GiB kept free per GPU: plans whose predicted peak exceeds HBM minus this are pruned. Covers what the
    analytic model leaves out (CUDA context, NCCL buffers: ~1-2 GiB on H100)."""
    max_stage_imbalance: float = Field(default=1.25, ge=1.0)
    """Default pp/virtual_stages values keep the most loaded pipeline rank within this factor of the mean."""
    exhaustive_limit: int = Field(default=2_000_000, ge=1)
    """Spaces up to this many valid plans are screened exhaustively; larger ones are sampled and explored."""
    stored_sample: int = Field(default=32, ge=0)
    """Plans off the front stored as trials besides the front: half pruned ones nearest the memory limit,
    half a random sample of the rest."""
    seed: int = 0
    """Seed of every random choice (samples, samplers), so a rerun makes the same choices and resumes."""


def axis_values(spec: Any, universe: Sequence[Any], default: Sequence[Any], field: str) -> list[Any]:
    """Values of one axis: the default list when unset; a range filters the universe; a value/list is kept."""
    if spec is None:
        return list(default)
    if isinstance(spec, IntRange):
        hi = spec.max if spec.max is not None else math.inf
        if hi < spec.min:
            raise StratagemError(f"search.{field} ({{min: {spec.min}, max: {spec.max}}}): max is below min")
        return [v for v in universe if spec.min <= v <= hi]
    values = spec if isinstance(spec, list) else [spec]
    if not values:
        raise StratagemError(f"search.{field} ([]): give at least one value or leave the axis out")
    return list(dict.fromkeys(values))
