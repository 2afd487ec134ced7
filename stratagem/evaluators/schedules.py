"""Pipeline schedules as tables: per schedule, how many micro-batch slots a rank idles in warm-up and cool-down,
and whether the schedule's point-to-point transfers sit on the critical path.

One row per schedule name (spaces/plan.py SCHEDULES), read by evaluators.timing through `schedule_columns`; the
rows follow the engines' action lists:
  gpipe        torch.distributed.pipelining ScheduleGPipe: all m forwards, then all m backwards; rank r idles
               (p-1) forward slots before and (p-1) backward slots after: (p-1) full slots [Narayanan sec. 2.2].
  1f1b         Schedule1F1B / Megatron forward_backward_pipelining_without_interleaving: warm-up of p-1-r
               forwards, steady one-forward-one-backward, cool-down of the remaining backwards: the same (p-1)
               idle slots as GPipe, fewer micro-batches in flight.
  interleaved  ScheduleInterleaved1F1B / forward_backward_pipelining_with_interleaving: v model chunks per rank,
               each a 1/v slot: (p-1)/v idle slots [Narayanan sec. 2.2].
  zero_bubble  ScheduleInterleavedZeroBubble (torch): interleaved with the backward split into input and weight
               gradients (I, W); W fills the cool-down: ZB-H1 leaves about a third of the 1F1B idle time [ZB sec.
               3], of the interleaved slot: (p-1)/(3 v).
P2P on the critical path: torch.distributed.pipelining waits each step's batched isend/irecv before the next
compute (schedules.py _wait_batch_p2p); Megatron overlaps them with compute only in the interleaved schedule
(--overlap-p2p-communication; schedules.py forward_backward_pipelining_without_interleaving raises for
overlap_p2p_comm), stacks with `StackRecord.p2p_overlap`.

  [Narayanan] Narayanan et al. 2021 (SC21), sec. 2.2.   [ZB] Qi et al. 2023, Zero Bubble Pipeline Parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns

__all__ = ["ScheduleRow", "SCHEDULE_TABLE", "idle_slots", "p2p_hidden"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule: idle slots of the busiest rank = (p-1) x idle_per_stage (/ v when it divides by chunks)."""

    name: str
    idle_per_stage: float
    """Idle micro-batch slots each extra pipeline stage adds (before dividing by the chunks)."""
    divides_by_chunks: bool
    """Whether the idle time shrinks with the model chunks per rank (v)."""
    overlappable_p2p: bool
    """Whether a stack that overlaps P2P (StackRecord.p2p_overlap) can do it in this schedule."""


SCHEDULE_TABLE: dict[str, ScheduleRow] = {
    "gpipe": ScheduleRow("gpipe", 1.0, False, False),
    "1f1b": ScheduleRow("1f1b", 1.0, False, False),
    "interleaved": ScheduleRow("interleaved", 1.0, True, True),
    "zero_bubble": ScheduleRow("zero_bubble", 1.0 / 3.0, True, True),
}


def idle_slots(pc: PlanColumns) -> Array:
    """Idle micro-batch slots of the busiest rank per step (0 without a pipeline), from SCHEDULE_TABLE."""
    out = np.zeros(len(pc))
    for name, row in SCHEDULE_TABLE.items():
        per = row.idle_per_stage / np.where(row.divides_by_chunks, pc.virtual_stages, 1.0)
        out = np.where(pc.schedule_is(name), (pc.pp - 1) * per, out)  # type: ignore[arg-type]
    return np.where(pc.pp > 1, out, 0.0)


def p2p_hidden(pc: PlanColumns, stack_overlaps: bool) -> NDArray[np.bool_]:
    """Plans whose P2P transfers overlap compute: the stack overlaps them and the schedule lets it."""
    if not stack_overlaps:
        return np.zeros(len(pc), dtype=bool)
    ok = np.zeros(len(pc), dtype=bool)
    for name, row in SCHEDULE_TABLE.items():
        if row.overlappable_p2p:
            ok |= pc.schedule_is(name)  # type: ignore[arg-type]
    return ok
