"""Pipeline schedules as tables (issue 24 item 4, time side): idle slots per schedule and where P2P hides."""

import numpy as np
import pytest

from stratagem.evaluators.schedules import SCHEDULE_TABLE, idle_slots, p2p_hidden
from stratagem.spaces import Plan
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import SCHEDULES


def test_every_schedule_has_a_row() -> None:
    assert set(SCHEDULE_TABLE) == set(SCHEDULES)


def test_idle_slots_follow_the_action_lists() -> None:
    plans = [Plan(dp=1, pp=8, pp_schedule="gpipe"), Plan(dp=1, pp=8, pp_schedule="1f1b"),
             Plan(dp=1, pp=8, pp_schedule="interleaved", virtual_stages=4),
             Plan(dp=1, pp=8, pp_schedule="zero_bubble", virtual_stages=2), Plan(dp=8)]
    # [Narayanan sec. 2.2] p-1 slots for GPipe and 1F1B, (p-1)/v interleaved; [ZB] a third of that, per chunk
    assert list(idle_slots(PlanColumns.from_plans(plans))) == pytest.approx([7, 7, 7 / 4, 7 / 6, 0])


def test_p2p_hides_only_in_schedules_that_let_the_stack_overlap() -> None:
    # Megatron overlaps P2P only with interleaving (schedules.py: the non-interleaved schedule refuses overlap_p2p_comm)
    pcs = PlanColumns.from_plans([Plan(dp=1, pp=4), Plan(dp=1, pp=4, pp_schedule="interleaved", virtual_stages=2)])
    assert list(p2p_hidden(pcs, True)) == [False, True]
    assert not np.any(p2p_hidden(pcs, False))


# ---- the table against torch.distributed.pipelining's own action lists -----------------------------------------
def _torch_order(p: int, v: int, m: int) -> dict[int, list]:  # type: ignore[type-arg]
    """ScheduleInterleaved1F1B's pipeline_order (per rank: actions, None = idle step), built without stages or
    a process group: the attributes its _calculate_single_rank_operations reads."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    sch = object.__new__(schedules.ScheduleInterleaved1F1B)
    sch.pp_group_size, sch.n_local_stages, sch._n_microbatches = p, v, m
    sch.number_of_rounds = max(1, m // p)
    sch.microbatches_per_round = m // sch.number_of_rounds
    return {r: sch._calculate_single_rank_operations(r) for r in range(p)}


def _makespan(order: dict[int, list], p: int, v: int, f: float = 1.0, b: float = 2.0) -> float:  # type: ignore[type-arg]
    """Run every rank's actions in order with their data dependencies (forward of a micro-batch after the previous
    stage's forward; backward after the next stage's backward and its own forward), chunk F = f / v, B = b / v."""
    acts = {r: [a for a in order[r] if a is not None] for r in range(p)}
    done: dict[tuple[str, int, int], float] = {}
    clock, ptr = [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while ptr[r] < len(acts[r]):
                a = acts[r][ptr[r]]
                kind, s, mb = a.computation_type.value, a.stage_index, a.microbatch_index
                deps = ([("F", mb, s - 1)] if s > 0 else []) if kind == "F" else (
                    [("F", mb, s)] + ([("B", mb, s + 1)] if s < p * v - 1 else []))
                if not all(d in done for d in deps):
                    break
                clock[r] = max([clock[r]] + [done[d] for d in deps]) + (f if kind == "F" else b) / v
                done[(kind, mb, s)] = clock[r]
                ptr[r] += 1
                moved = True
    assert all(ptr[r] == len(acts[r]) for r in range(p))
    return max(clock)


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (8, 2, 16), (8, 4, 32)])
def test_interleaved_table_matches_torchs_action_lists(p: int, v: int, m: int) -> None:
    idle = (_makespan(_torch_order(p, v, m), p, v) - 3.0 * m) / 3.0  # idle slots of one F + B
    plan = Plan(dp=1, pp=p, pp_schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v)
    assert idle == pytest.approx(idle_slots(PlanColumns.from_plans([plan]))[0])
