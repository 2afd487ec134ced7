"""Pipeline schedules as tables (issue 24 item 4, time side): idle slots per schedule and where P2P hides."""

import numpy as np
import pytest

from stratagem.evaluators.memory_pipeline import IN_FLIGHT
from stratagem.evaluators.schedules import (
    SCHEDULE_TABLE,
    critical_hops,
    idle_slots,
    p2p_hidden,
    phases,
    rank_actions,
    simulate,
    warmup_forwards,
)
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


# ---- the tables against torch.distributed.pipelining's own action lists -----------------------------------------
GRID = [(p, v, m) for p in (2, 3, 4, 8) for v in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12, 16, 24)
        if m % max(1, m // p) == 0]  # torch's looped schedules need m to be a multiple of its rounds


def _torch_lists(schedule: str, p: int, v: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """torch's own per-rank compute actions, built without stages or a process group: the attributes the
    schedule's list builder reads (ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble
    _calculate_single_rank_operations, ScheduleGPipe / Schedule1F1B _get_pipeline_order)."""
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"gpipe": sched.ScheduleGPipe, "1f1b": sched.Schedule1F1B, "interleaved": sched.ScheduleInterleaved1F1B,
           "zero_bubble": sched.ScheduleInterleavedZeroBubble}[schedule]
    obj = object.__new__(cls)
    if schedule in ("gpipe", "1f1b"):
        obj._num_stages, obj._n_microbatches = p, m
        order = obj._get_pipeline_order()
    else:
        obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
        obj.number_of_rounds = max(1, m // p)
        obj.microbatches_per_round = m // obj.number_of_rounds
        order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    return {r: [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for r, acts in order.items()}


@pytest.mark.parametrize("schedule", ["interleaved", "zero_bubble"])
def test_looped_lists_are_torchs(schedule: str) -> None:
    for p, v, m in GRID:
        theirs = _torch_lists(schedule, p, v, m)
        assert all([tuple(a) for a in rank_actions(schedule, p, v, m, r)] == theirs[r] for r in range(p)), (p, v, m)


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 4, 8), ("gpipe", 8, 3), ("1f1b", 4, 8), ("1f1b", 8, 16)])
def test_single_stage_lists_are_torchs(schedule: str, p: int, m: int) -> None:
    theirs = _torch_lists(schedule, p, 1, m)
    # Schedule1F1B._get_pipeline_order (a drawing aid) shifts the last rank's micro-batch indices by one; the
    # runtime loop (_step_microbatches: min(m, p - rank) warm-ups, then backward before forward) is what runs
    ranks = range(p) if schedule == "gpipe" else range(p - 1)
    assert all([tuple(a) for a in rank_actions(schedule, p, 1, m, r)] == theirs[r] for r in ranks)
    last = rank_actions("1f1b", p, 1, m, p - 1)
    assert [a.kind for a in last[:4]] == ["F", "B", "F", "B"] and sorted(a.mb for a in last if a.kind == "F") == list(
        range(m))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_idle_closed_forms_follow_the_lists(schedule: str) -> None:
    """The table's idle slots equal the simulated run of the engine's lists, for backward / forward ratios with
    and without full recompute (the input gradient carries the recomputed forward)."""
    for p, v, m in GRID:
        v = 1 if schedule in ("gpipe", "1f1b") else v
        if schedule == "1f1b" and m < p:
            continue  # Schedule1F1B refuses m < p
        for f, i, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (1.0, 0.6, 1.6)):
            plan = Plan(dp=1, pp=p, pp_schedule=schedule, virtual_stages=v)  # type: ignore[arg-type]
            got = idle_slots(PlanColumns.from_plans([plan]), m, f, i, w)[0]
            assert got == pytest.approx(simulate(schedule, p, v, m, f, i, w), abs=1e-9), (p, v, m, f, i, w)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_critical_hops_follow_the_lists(schedule: str) -> None:
    """P2P transfers on the critical path: the simulated step grows by hops x the transfer time."""
    hop = 1e-4
    for p, v, m in GRID:
        v = 1 if schedule in ("gpipe", "1f1b") else v
        if m < p or (schedule == "zero_bubble" and m < 2 * p):
            continue
        plan = Plan(dp=1, pp=p, pp_schedule=schedule, virtual_stages=v)  # type: ignore[arg-type]
        grown = (simulate(schedule, p, v, m, hop=hop) - simulate(schedule, p, v, m)) * 3.0 / hop
        # 1F1B's steady state adds 2 (p - 1) / p hops per micro-batch as a staircase: exact when p divides m
        table = critical_hops(PlanColumns.from_plans([plan]), np.array([float(m)]))[0]
        if m % p == 0:
            assert table == pytest.approx(grown, abs=1e-6), (p, v, m)
        elif schedule == "1f1b":
            assert table == pytest.approx(grown, abs=2.0), (p, v, m)
        else:  # torch's flex rounds (m not a multiple of p) leave slack: the table is an upper bound
            assert table >= grown - 1e-6, (p, v, m)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_warmup_and_in_flight_follow_the_lists(schedule: str) -> None:
    """(warm-up, steady, cool-down) per rank from the lists; the memory model's in-flight table
    (memory_pipeline.IN_FLIGHT) is the lists' peak of forwards not yet backwarded, in stage units."""
    for p, v, m in GRID:
        v = 1 if schedule in ("gpipe", "1f1b") else v
        if schedule == "1f1b" and m < p:
            continue
        for r in range(p):
            acts = rank_actions(schedule, p, v, m, r)
            warm, steady, cool = phases(acts)
            assert warm == warmup_forwards(schedule, p, v, m, r)
            assert warm + steady == v * m and cool + steady == v * m
        now = peak_first = peak_last = 0
        for r, store in ((0, "first"), (p - 1, "last")):
            now = peak = 0
            for a in rank_actions(schedule, p, v, m, r):
                now += {"F": 1, "W": -1, "B": -1, "I": 0}[a.kind] if schedule == "zero_bubble" else (
                    1 if a.kind == "F" else -1)
                peak = max(peak, now)
            if store == "first":
                peak_first = peak
            else:
                peak_last = peak
        first, last = IN_FLIGHT[schedule](np.float64(p), np.float64(v), np.float64(m))  # type: ignore[index]
        if schedule != "zero_bubble":  # ZB keeps a micro-batch's inputs until its W: the table keeps 1F1B's peak
            assert (float(first), float(last)) == pytest.approx((peak_first / v, peak_last / v)), (p, v, m)


def test_one_micro_batch_of_1f1b_is_gpipe_on_the_critical_path() -> None:
    """With one micro-batch 1F1B runs GPipe's actions (spaces/canonical.py merges them): one round trip of
    2 (p - 1) transfers, as the simulation says (the steady-state closed form alone would give less)."""
    for p in (2, 4, 8):
        hops = [critical_hops(PlanColumns.from_plans([Plan(dp=1, pp=p, pp_schedule=s)]), np.array([1.0]))[0]
                for s in ("1f1b", "gpipe")]
        grown = (simulate("1f1b", p, 1, 1, hop=1e-4) - simulate("1f1b", p, 1, 1)) * 3.0 / 1e-4
        assert hops[0] == hops[1] == 2 * (p - 1) == pytest.approx(grown)
