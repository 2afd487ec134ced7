"""A plan's process groups and the sizes derived from them, each defined once for the model (vectorised over
`PlanColumns`, float64 arrays) and the harness, the canonical form and the advice (one `Plan`, ints), as
torchtitan's ParallelDims (torchtitan/distributed/parallel_dims.py) derives its meshes' sizes from the degrees
once for every user.

Every function takes a Plan or PlanColumns and computes with the same operators on both (integer division for
a Plan, whose degrees divide exactly).

Sources:
  [TT-PD]  torchtitan/distributed/parallel_dims.py: dp_shard = dp / dp_replicate, FSDP over the flattened
           dp_shard x cp mesh; experts over dp_shard_mod_ep (efsdp = dp_shard * cp * tp / ep).
  [MCore-fold] Megatron-Core parallel_state.py initialize_model_parallel: the expert grid etp x ep x edp over
           the tp x cp x dp ranks of a stage, edp = tp*dp*cp / (ep*etp) (Liu et al. 2025, arXiv 2504.14960).
  [TT-PP]  torchtitan parallelize_llama: reshard_after_forward = not pp_enabled (FSDP2 keeps the stage's
           parameters gathered through the step under pipeline parallelism, ZeRO-2/3 alike).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import Plan

if TYPE_CHECKING:
    from stratagem.spaces.scenario import Scenario
    from stratagem.spaces.search_config import SearchConfig
    from stratagem.spaces.stacks import StackRecord

__all__ = ["dp_shard", "shard_group", "expert_data_parallel", "expert_shard_group", "uses_fsdp",
           "kept_gathered_with_pp", "micro_batches", "sp_divisor", "usable_gib"]

Array = NDArray[np.float64]


@overload
def dp_shard(p: Plan) -> int:
    """One plan."""


@overload
def dp_shard(p: PlanColumns) -> Array:
    """Many plans."""


def dp_shard(p: Plan | PlanColumns) -> int | Array:
    """Data-parallel ranks one replica shards over (HSDP: dp / dp_replicate) [TT-PD]."""
    if isinstance(p, Plan):
        return p.dp // p.dp_replicate
    return p.dp / p.dp_replicate


@overload
def shard_group(p: Plan) -> int:
    """One plan."""


@overload
def shard_group(p: PlanColumns) -> Array:
    """Many plans."""


def shard_group(p: Plan | PlanColumns) -> int | Array:
    """The ZeRO / FSDP shard group of the dense parameters: dp x cp / dp_replicate ranks [TT-PD]."""
    if isinstance(p, Plan):
        return p.dp * p.cp // p.dp_replicate
    return p.dp * p.cp / p.dp_replicate


@overload
def expert_data_parallel(p: Plan) -> int:
    """One plan."""


@overload
def expert_data_parallel(p: PlanColumns) -> Array:
    """Many plans."""


def expert_data_parallel(p: Plan | PlanColumns) -> int | Array:
    """edp: the ranks of a pipeline stage holding the same expert shard, tp*dp*cp / (ep*etp) [MCore-fold]."""
    if isinstance(p, Plan):
        return p.tp * p.dp * p.cp // (p.ep * p.etp)
    return p.tp * p.dp * p.cp / (p.ep * p.etp)


def expert_shard_group(p: PlanColumns) -> Array:
    """The ZeRO shard group of the expert parameters: max(1, edp / dp_replicate) (each replica shards its
    experts over its own edp ranks) [TT-PD]."""
    return np.maximum(1.0, expert_data_parallel(p) / p.dp_replicate)


@overload
def uses_fsdp(p: Plan) -> bool:
    """One plan: a bool."""


@overload
def uses_fsdp(p: PlanColumns) -> NDArray[np.bool_]:
    """Many plans: one bool per plan."""


def uses_fsdp(p: Plan | PlanColumns) -> bool | NDArray[np.bool_]:
    """Whether the plan shards parameters with FSDP2 / ZeRO-2-3: more than one rank over dp x cp (torchtitan's
    flattened dp_cp mesh) and ZeRO stage 2 or 3; else DDP or no data parallelism."""
    if isinstance(p, Plan):
        return p.dp * p.cp > 1 and p.zero_stage >= 2
    return np.asarray((p.dp * p.cp > 1) & (p.zero_stage >= 2))


def kept_gathered_with_pp(p: PlanColumns, rec: StackRecord) -> NDArray[np.bool_]:
    """Whether the stage's parameters stay gathered through the step: FSDP with pipeline parallelism on a stack
    that does not reshard after forward under PP [TT-PP] (StackRecord.reshard_after_forward_with_pp)."""
    return np.asarray(uses_fsdp(p) & (p.pp > 1) & (not rec.reshard_after_forward_with_pp))


@overload
def micro_batches(p: Plan, global_batch_size: int) -> int:
    """One plan."""


@overload
def micro_batches(p: PlanColumns, global_batch_size: int) -> Array:
    """Many plans."""


def micro_batches(p: Plan | PlanColumns, global_batch_size: int) -> int | Array:
    """Micro-batches per optimizer step per pipeline (gradient accumulation): global batch / (dp x micro-batch
    size)."""
    if isinstance(p, Plan):
        return global_batch_size // (p.dp * p.micro_batch_size)
    return global_batch_size / (p.dp * p.micro_batch_size)


def sp_divisor(p: PlanColumns) -> Array:
    """What sequence-sharded activations are divided by: tp with sequence parallelism, else 1."""
    return np.where(p.sequence_parallel > 0, p.tp, 1.0)


def usable_gib(scn: Scenario, config: SearchConfig) -> float:
    """Memory a plan may use per GPU: HBM less the search's safety margin (search.memory_margin_gib)."""
    return scn.cluster.gpu.hbm_gib - config.memory_margin_gib
