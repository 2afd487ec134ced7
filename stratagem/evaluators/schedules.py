"""Pipeline schedules as tables generated from the engines' action lists.

Each schedule's per-rank action list is written here as torch.distributed.pipelining builds it (`rank_actions`),
and `simulate` runs those lists with their data dependencies. The vectorised model reads closed forms (one
`ScheduleRow` per schedule) that tests/evaluators/test_schedules.py checks against both: the lists against torch's
own, the closed forms against the simulation, over grids of (p, v, m) and forward / backward durations.

  gpipe        ScheduleGPipe._step_microbatches: every forward, then every backward.
  1f1b         Schedule1F1B._step_microbatches: min(m, p - rank) warm-up forwards, then backward-before-forward
               ("1B1F"), the remaining backwards to cool down. (Its _get_pipeline_order, a visualisation aid, shifts
               the last rank's micro-batch indices; the runtime loop is what runs.) Megatron's
               forward_backward_pipelining_without_interleaving has the same order.
  interleaved  ScheduleInterleaved1F1B._calculate_single_rank_operations: _get_warmup_ops = (v - 1) x the
               micro-batches per round + 2 (p - 1 - rank), capped at v m; then _get_1f1b_rank_ops (one forward, one
               backward), chunks looped (stage = local index x p + rank), rounds of max(1, m // p).
  zero_bubble  ScheduleInterleavedZeroBubble: the same with warm-up factor 1 and the backward split into input
               (I) and weight (W) gradients, W deferred by `rank` micro-batches.

Closed forms (idle micro-batch slots of one F + B per stage, derived from the simulation of those lists):
  gpipe, 1f1b   p - 1;
  interleaved   (p - 1) / v + max(0, p - m) (v - 1) / v (torch's flex rounds when m < p);
  zero_bubble   (p - 1) (max(F, I) + max(0, F - W)) / (v (F + B)) for m >= p (ZB-H1: the W's fill the cool-down,
                Qi et al. 2023 sec. 3); m < p is simulated (`simulate`), those rows are few.
P2P transfers on the critical path (hops of one boundary send each, small-latency regime of the simulation): gpipe
2 (p - 1); 1f1b 2 (p - 2) + 2 (p - 1) m / p (the lock-step steady state adds hops in a staircase; exact when p
divides m, within 2 otherwise); interleaved 2 (p v - 1) (p | m; fewer otherwise); zero_bubble p v + 3 p - 4
(m >= 2 p). torch waits on a step's batched P2P before the
next compute (schedules.py _wait_batch_p2p); Megatron overlaps it only in the interleaved schedule
(--overlap-p2p-communication), stacks with `StackRecord.p2p_overlap`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns

__all__ = ["Action", "rank_actions", "phases", "simulate", "ScheduleRow", "SCHEDULE_TABLE", "idle_slots",
           "critical_hops", "warmup_forwards", "p2p_hidden"]

Array = NDArray[np.float64]


class Action(NamedTuple):
    """One compute action of a rank: its global stage, F (forward), B (full backward), I / W (input / weight
    gradient), and the micro-batch."""

    stage: int
    kind: str
    mb: int


def _rounds(p: int, m: int) -> int:
    """Micro-batches per round of torch's looped schedules: m // max(1, m // p)."""
    return m // max(1, m // p)


def _looped(p: int, v: int, m: int, rank: int, factor: int, zero_bubble: bool) -> list[Action]:
    """torch's _get_warmup_ops + _get_1f1b_rank_ops for a looped schedule, without the idle (None) steps."""
    per_round = _rounds(p, m)
    warm = min((v - 1) * per_round + factor * (p - 1 - rank), v * m)
    ops = v * m

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * p + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warm) // per_round) % v) * p + rank

    count: dict[tuple[str, int], int] = {}

    def take(kind: str, stage: int) -> Action:
        i = count.get((kind, stage), 0)
        count[(kind, stage)] = i + 1
        return Action(stage, kind, i)

    out: list[Action] = []
    backs: list[int] = []
    weights = 0
    for step in range(warm + ops):
        if step < ops:
            out.append(take("F", fwd_stage(step)))
        if step >= warm:
            out.append(take("I" if zero_bubble else "B", bwd_stage(step)))
            backs.append(step)
            if zero_bubble and step - warm >= rank:  # W deferred by `rank` micro-batches (num_1f1b_microbatches)
                out.append(take("W", bwd_stage(backs[weights])))
                weights += 1
    while zero_bubble and weights < len(backs):
        out.append(take("W", bwd_stage(backs[weights])))
        weights += 1
    return out


def rank_actions(schedule: str, p: int, v: int, m: int, rank: int) -> tuple[Action, ...]:
    """The compute actions of pipeline rank `rank` in the order the engine runs them (see the module docstring)."""
    if schedule == "gpipe":
        return tuple([Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)])
    if schedule == "1f1b":
        warm = min(m, p - rank)
        out = [Action(rank, "F", i) for i in range(warm)]
        for j in range(m):
            out.append(Action(rank, "B", j))
            if warm + j < m:
                out.append(Action(rank, "F", warm + j))
        return tuple(out)
    if schedule in ("interleaved", "zero_bubble"):
        zb = schedule == "zero_bubble"
        return tuple(_looped(p, v, m, rank, 1 if zb else 2, zb))
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def phases(actions: tuple[Action, ...]) -> tuple[int, int, int]:
    """(warm-up, steady, cool-down) of one rank's list: forwards before its first backward, forward-backward pairs,
    backwards after its last forward."""
    kinds = [a.kind for a in actions if a.kind != "W"]
    first_b = kinds.index("B") if "B" in kinds else kinds.index("I")
    last_f = len(kinds) - 1 - kinds[::-1].index("F")
    return first_b, kinds[first_b:last_f + 1].count("F"), kinds[last_f + 1:].count("B") + kinds[last_f + 1:].count("I")


@lru_cache(maxsize=256)
def simulate(schedule: str, p: int, v: int, m: int, f: float = 1.0, i: float = 1.0, w: float = 1.0,
             hop: float = 0.0) -> float:
    """Idle slots of one F + B (F = f, B = i + w per stage) when every rank runs its `rank_actions` as soon as its
    inputs are there: a forward after the previous stage's forward of that micro-batch, an input gradient after
    the next stage's, a weight gradient after its own input gradient; `hop` per transfer between ranks."""
    stages = p * v
    dur = {"F": f / v, "B": (i + w) / v, "I": i / v, "W": w / v}
    lists = [rank_actions(schedule, p, v, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                back = "B" if a.kind in ("B", "I") else a.kind
                if a.kind == "F":
                    deps = [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
                elif back == "B":
                    deps = [("B", a.stage + 1, a.mb)] if a.stage < stages - 1 else [("F", a.stage, a.mb)]
                else:
                    deps = [("B", a.stage, a.mb)]
                if any(d not in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] + (hop if d[1] % p != r else 0.0) for d in deps])
                clock[r] = start + dur[a.kind]
                done[(back, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                moved = True
    if pos != [len(x) for x in lists]:
        raise RuntimeError(f"{schedule} p={p} v={v} m={m}: the action lists deadlock")
    return max(clock) / (f + i + w) - m


@dataclass(frozen=True)
class ScheduleRow:
    """One schedule as closed forms over columns (p, v, m) and per-stage durations F, I, W (B = I + W)."""

    name: str
    idle: Callable[[Array, Array, Array, Array, Array, Array], Array]
    """Idle micro-batch slots of one F + B of the busiest rank."""
    hops: Callable[[Array, Array, Array], Array]
    """P2P transfers on the critical path of one step."""
    warmup: Callable[[Array, Array, Array, Array], Array]
    """Forwards a rank runs before its first backward (p, v, m, rank): torch's warm-up ops, + 1 in the looped
    schedules (their first 1F1B step runs its forward before its backward)."""
    overlappable_p2p: bool
    """Whether a stack that overlaps P2P (StackRecord.p2p_overlap) can do it in this schedule."""


def _zb_idle(p: Array, v: Array, m: Array, f: Array, i: Array, w: Array) -> Array:
    return np.asarray((p - 1) * (np.maximum(f, i) + np.maximum(0.0, f - w)) / (v * (f + i + w)), dtype=np.float64)


def _per_round(p: Array, m: Array) -> Array:
    return np.floor(m / np.maximum(1.0, np.floor(m / p)))


SCHEDULE_TABLE: dict[str, ScheduleRow] = {
    "gpipe": ScheduleRow("gpipe", lambda p, v, m, f, i, w: p - 1, lambda p, v, m: 2 * (p - 1),
                         lambda p, v, m, r: m, False),
    "1f1b": ScheduleRow("1f1b", lambda p, v, m, f, i, w: p - 1,
                        # never below one micro-batch's round trip, 2 (p - 1): at m = 1 1F1B is GPipe (spaces/canonical.py)
                        lambda p, v, m: np.maximum(2 * (p - 1), 2 * (p - 2) + 2 * (p - 1) * m / p),
                        lambda p, v, m, r: np.minimum(m, p - r), False),
    "interleaved": ScheduleRow("interleaved",
                               lambda p, v, m, f, i, w: (p - 1) / v + np.maximum(0.0, p - m) * (v - 1) / v,
                               lambda p, v, m: 2 * (p * v - 1),
                               lambda p, v, m, r: np.minimum(v * m, (v - 1) * _per_round(p, m) + 2 * (p - 1 - r) + 1),
                               True),
    "zero_bubble": ScheduleRow("zero_bubble", _zb_idle, lambda p, v, m: p * v + 3 * p - 4,
                               lambda p, v, m, r: np.minimum(v * m, (v - 1) * _per_round(p, m) + (p - 1 - r) + 1), True),
}


def _simulated_zb(pc: PlanColumns, m: Array, f: Array, i: Array, w: Array, rows: NDArray[np.bool_]) -> Array:
    """Zero-bubble rows with m < p, simulated once per distinct (p, v, m) at the rows' durations rounded to 2
    figures of F (few rows: a zero-bubble plan usually has m >= p)."""
    out = np.zeros(len(pc))
    for k in np.flatnonzero(rows):
        ratio = (round(float(i[k] / f[k]), 2), round(float(w[k] / f[k]), 2))
        out[k] = simulate("zero_bubble", int(pc.pp[k]), int(pc.virtual_stages[k]), int(m[k]), 1.0, *ratio)
    return out


def idle_slots(pc: PlanColumns, micro: Array | float = np.inf, f: Array | float = 1.0, i: Array | float = 1.0,
               w: Array | float = 1.0) -> Array:
    """Idle micro-batch slots of the busiest rank per step (0 without a pipeline), from SCHEDULE_TABLE: `micro`
    micro-batches (default: at least p), per-stage forward `f`, input-gradient `i` and weight-gradient `w` times."""
    n = len(pc)
    p, v = pc.pp, pc.virtual_stages
    m = np.broadcast_to(np.asarray(micro, dtype=np.float64), (n,))
    m = np.where(np.isfinite(m), m, p)
    f_, i_, w_ = (np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)) for x in (f, i, w))
    out = np.zeros(n)
    for name, row in SCHEDULE_TABLE.items():
        out = np.where(pc.schedule_is(name), row.idle(p, v, m, f_, i_, w_), out)  # type: ignore[arg-type]
    few = pc.schedule_is("zero_bubble") & (m < p) & (p > 1)
    if few.any():
        out = np.where(few, _simulated_zb(pc, m, f_, i_, w_, few), out)
    return np.where(p > 1, out, 0.0)


def critical_hops(pc: PlanColumns, micro: Array) -> Array:
    """P2P transfers on the critical path of one step (0 without a pipeline), from SCHEDULE_TABLE."""
    p, v = pc.pp, pc.virtual_stages
    out = np.zeros(len(pc))
    for name, row in SCHEDULE_TABLE.items():
        out = np.where(pc.schedule_is(name), row.hops(p, v, micro), out)  # type: ignore[arg-type]
    return np.where(p > 1, out, 0.0)


def warmup_forwards(schedule: str, p: int, v: int, m: int, rank: int) -> int:
    """Warm-up forwards of one rank from SCHEDULE_TABLE (equal to `phases(rank_actions(...))[0]`)."""
    p_, v_, m_, r_ = (np.array([float(x)]) for x in (p, v, m, rank))
    return int(SCHEDULE_TABLE[schedule].warmup(p_, v_, m_, r_)[0])


def p2p_hidden(pc: PlanColumns, stack_overlaps: bool) -> NDArray[np.bool_]:
    """Plans whose P2P transfers overlap compute: the stack overlaps them and the schedule lets it."""
    if not stack_overlaps:
        return np.zeros(len(pc), dtype=bool)
    ok = np.zeros(len(pc), dtype=bool)
    for name, row in SCHEDULE_TABLE.items():
        if row.overlappable_p2p:
            ok |= pc.schedule_is(name)  # type: ignore[arg-type]
    return ok
