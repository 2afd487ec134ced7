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
