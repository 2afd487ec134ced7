"""Plans as columns of numpy arrays, so one formula evaluates one plan or a million."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.plan import PRECISIONS, RECOMPUTES, SCHEDULES, Plan

__all__ = ["PlanColumns", "PRECISION_CODE", "RECOMPUTE_CODE", "SCHEDULE_CODE"]

Array = NDArray[np.float64]

PRECISION_CODE = {p: i for i, p in enumerate(PRECISIONS)}  # fp32 0, bf16 1, fp8 2
RECOMPUTE_CODE = {r: i for i, r in enumerate(RECOMPUTES)}  # none 0, selective 1, full 2
SCHEDULE_CODE = {s: i for i, s in enumerate(SCHEDULES)}  # gpipe 0, 1f1b 1, interleaved 2, zero_bubble 3


@dataclass(frozen=True)
class PlanColumns:
    """One float64 array per Plan field; enums as codes (see the *_CODE maps), booleans as 0/1."""

    dp: Array
    tp: Array
    pp: Array
    cp: Array
    ep: Array
    dp_replicate: Array
    zero_stage: Array
    sequence_parallel: Array
    micro_batch_size: Array
    precision: Array
    activation_checkpointing: Array
    pp_schedule: Array
    virtual_stages: Array
    optimizer_offload: Array

    @classmethod
    def from_plans(cls, plans: Sequence[Plan]) -> PlanColumns:
        def col(values: list[float]) -> Array:
            return np.asarray(values, dtype=np.float64)

        return cls(
            dp=col([p.dp for p in plans]),
            tp=col([p.tp for p in plans]),
            pp=col([p.pp for p in plans]),
            cp=col([p.cp for p in plans]),
            ep=col([p.ep for p in plans]),
            dp_replicate=col([p.dp_replicate for p in plans]),
            zero_stage=col([p.zero_stage for p in plans]),
            sequence_parallel=col([float(p.sequence_parallel) for p in plans]),
            micro_batch_size=col([p.micro_batch_size for p in plans]),
            precision=col([PRECISION_CODE[p.precision] for p in plans]),
            activation_checkpointing=col([RECOMPUTE_CODE[p.activation_checkpointing] for p in plans]),
            pp_schedule=col([SCHEDULE_CODE[p.pp_schedule] for p in plans]),
            virtual_stages=col([p.virtual_stages for p in plans]),
            optimizer_offload=col([float(p.optimizer_offload == "cpu") for p in plans]),
        )

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    def take(self, index: NDArray[np.intp] | slice) -> PlanColumns:
        """The rows at `index`."""
        return PlanColumns(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def plan(self, i: int) -> Plan:
        """Row i back as a Plan."""
        return Plan(
            dp=int(self.dp[i]), tp=int(self.tp[i]), pp=int(self.pp[i]), cp=int(self.cp[i]),
            ep=int(self.ep[i]), dp_replicate=int(self.dp_replicate[i]),
            zero_stage=int(self.zero_stage[i]),  # type: ignore[arg-type]
            sequence_parallel=bool(self.sequence_parallel[i]),
            micro_batch_size=int(self.micro_batch_size[i]),
            precision=PRECISIONS[int(self.precision[i])],
            activation_checkpointing=RECOMPUTES[int(self.activation_checkpointing[i])],
            pp_schedule=SCHEDULES[int(self.pp_schedule[i])],
            virtual_stages=int(self.virtual_stages[i]),
            optimizer_offload="cpu" if self.optimizer_offload[i] else "none",
        )
