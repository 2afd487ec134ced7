"""A plan's process groups and the sizes derived from them, defined once for the model (vectorised over
`PlanColumns`) and the harness (one `Plan`), as torchtitan's ParallelDims (torchtitan/distributed/
parallel_dims.py) derives its meshes' sizes from the degrees once for every user.

Every function takes a Plan (ints, bools) or PlanColumns (float64 / bool arrays) and computes with the same
operators on both."""

from __future__ import annotations

from typing import overload

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import Plan

__all__ = ["uses_fsdp"]


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
