"""Plan parsing and formatting: `key=value` strings, aliases, round trips, one-line errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stratagem.errors import StratagemError
from stratagem.spaces import PRECISIONS, RECOMPUTES, SCHEDULES, Plan, format_plan, parse_plan
from stratagem.spaces.groups import micro_batches

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
    assert micro_batches(Plan(dp=8), 64) == 8
    assert plan.world_size == 16


@pytest.mark.parametrize("text,fragment", [
    ("dq8", "plan ('dq8'): write key=value pairs"),
    ("tp2 pp2", "plan ('tp2'): write key=value pairs"),  # a label begins with dp<N>, as format_plan writes it
    ("dp8 tp2 fancy", "plan label ('fancy'): not a label part"),
    ("dp8 tp2 tp4", "plan label ('tp4'): tp given twice"),
    ("dp8 z5", "plan.zero_stage (5)"),
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


every_field_plans = st.builds(
    Plan,
    dp=st.integers(1, 512), tp=st.integers(1, 64), pp=st.integers(1, 64), cp=st.integers(1, 16),
    ep=st.integers(1, 16), etp=st.integers(1, 8), dp_replicate=st.integers(1, 8),
    zero_stage=st.sampled_from([0, 1, 2, 3]), sequence_parallel=st.booleans(), micro_batch_size=st.integers(1, 64),
    precision=st.sampled_from(PRECISIONS), activation_checkpointing=st.sampled_from(RECOMPUTES),
    recompute_layers=st.integers(0, 9), pp_schedule=st.sampled_from(SCHEDULES), virtual_stages=st.integers(1, 8),
    first_stage_layers=st.integers(0, 9), last_stage_layers=st.integers(0, 9),
    pp_split=st.sampled_from(["layers", "embedding_loss"]), optimizer_offload=st.sampled_from(["none", "cpu"]),
)


@settings(max_examples=300, deadline=None)
@given(every_field_plans)
def test_every_label_parses_back(plan: Plan) -> None:
    # the compact label is valid --plan input: the canonical plan for short(), the plan itself for format_plan
    assert parse_plan(plan.short()) == plan.canonical()
    assert parse_plan(format_plan(plan, compact=True)) == plan
    assert plan.canonical().canonical() == plan.canonical()


def test_label_is_a_whole_plan_not_merged_over_a_base() -> None:
    label = "dp2 pp2 z1 mb4 bf16 sel-ac3L 1f1b split3/- emb+loss offload"
    plan = Plan(dp=2, pp=2, zero_stage=1, micro_batch_size=4, activation_checkpointing="selective",
                recompute_layers=3, first_stage_layers=3, pp_split="embedding_loss", optimizer_offload="cpu")
    assert parse_plan(label) == plan
    assert parse_plan(label, base=Plan(tp=4, cp=2)) == plan  # a label names every field
    assert parse_plan("dp8 tp2 z1 mb2 bf16 sp cp=2") == Plan(dp=8, tp=2, cp=2, zero_stage=1, micro_batch_size=2,
                                                             sequence_parallel=True)


@pytest.mark.parametrize("plan,canonical", [
    (Plan(tp=1, sequence_parallel=True), Plan()),
    (Plan(pp=1, pp_schedule="gpipe", pp_split="embedding_loss"), Plan()),
    (Plan(pp=1, pp_schedule="interleaved", virtual_stages=2, first_stage_layers=3), Plan()),
    (Plan(recompute_layers=2), Plan()),
    # kept: each has an effect
    (Plan(tp=2, sequence_parallel=True), Plan(tp=2, sequence_parallel=True)),
    (Plan(pp=2, pp_schedule="gpipe", pp_split="embedding_loss"), Plan(pp=2, pp_schedule="gpipe",
                                                                      pp_split="embedding_loss")),
    (Plan(activation_checkpointing="full", recompute_layers=2), Plan(activation_checkpointing="full",
                                                                     recompute_layers=2)),
    (Plan(dp=1, zero_stage=3), Plan(dp=1, zero_stage=3)),  # FSDP over one rank: other wrappers, other memory
])
def test_plan_canonical_resets_only_inert_fields(plan: Plan, canonical: Plan) -> None:
    assert plan.canonical() == canonical
