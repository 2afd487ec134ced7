"""Plan parsing and formatting: `key=value` strings, aliases, round trips, one-line errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.errors import StratagemError
from stratagem.spaces import PRECISIONS, RECOMPUTES, SCHEDULES, Plan, format_plan, parse_plan

plans = st.builds(
    Plan,
    dp=st.integers(1, 512), tp=st.integers(1, 64), pp=st.integers(1, 64), cp=st.integers(1, 16),
    ep=st.integers(1, 16), dp_replicate=st.integers(1, 8), zero_stage=st.sampled_from([0, 1, 2, 3]),
    sequence_parallel=st.booleans(), micro_batch_size=st.integers(1, 64),
    precision=st.sampled_from(PRECISIONS), activation_checkpointing=st.sampled_from(RECOMPUTES),
    pp_schedule=st.sampled_from(SCHEDULES), virtual_stages=st.integers(1, 8),
    optimizer_offload=st.sampled_from(["none", "cpu"]),
)


@settings(max_examples=200, deadline=None)
@given(plans)
def test_format_parse_round_trip(plan: Plan) -> None:
    assert parse_plan(format_plan(plan)) == plan


def test_defaults_and_aliases() -> None:
    assert Plan() == Plan(dp=1, tp=1, pp=1, cp=1, zero_stage=0, micro_batch_size=1, precision="bf16",
                          activation_checkpointing="none", pp_schedule="1f1b")
    plan = parse_plan("dp=8 tp=2, zero=1,mbs=2,sp=yes,ac=selective,schedule=interleaved,vpp=2,pp=2,offload=cpu")
    assert plan == Plan(dp=8, tp=2, pp=2, zero_stage=1, micro_batch_size=2, sequence_parallel=True,
                        activation_checkpointing="selective", pp_schedule="interleaved", virtual_stages=2,
                        optimizer_offload="cpu")
    assert parse_plan("dp = 8, tp= 2") == Plan(dp=8, tp=2)
    assert parse_plan({"dp": 4, "zero_stage": 3}) == Plan(dp=4, zero_stage=3)
    assert parse_plan("tp=4", base=Plan(dp=2, zero_stage=1)) == Plan(dp=2, tp=4, zero_stage=1)
    assert format_plan(Plan()) == "dp=1"


def test_compact_label() -> None:
    plan = Plan(dp=4, tp=2, pp=2, zero_stage=1, micro_batch_size=2, sequence_parallel=True,
                activation_checkpointing="full", pp_schedule="interleaved", virtual_stages=2)
    assert plan.short() == "dp4 tp2 pp2 z1 mb2 bf16 sp full-ac interleavedx2"
    assert Plan(dp=8).grad_accumulation(64) == 8
    assert plan.world_size == 16


@pytest.mark.parametrize("text,fragment", [
    ("dp8", "plan ('dp8'): write key=value pairs"),
    ("foo=1", "plan.foo: unknown field; valid: dp, tp"),
    ("tp=two", "plan.tp ('two'):"),
    ("dp=0", "plan.dp (0): Input should be greater than or equal to 1"),
    ("zero=4", "plan.zero_stage (4): Input should be 0, 1, 2 or 3"),
    ("sp=maybe", "plan.sequence_parallel ('maybe'): use true or false"),
    ("ac=partial", "plan.activation_checkpointing ('partial'): Input should be 'none', 'selective', 'full' or 'op'"),
    ("precision=fp16", "plan.precision ('fp16')"),
    ("dp=8,dp=4", "plan.dp: given twice"),
    ("=3", "plan ('=3'): write key=value pairs"),
])
def test_bad_plan_is_one_line_naming_the_field(text: str, fragment: str) -> None:
    with pytest.raises(StratagemError) as info:
        parse_plan(text)
    msg = str(info.value)
    assert fragment in msg
    assert "\n" not in msg
