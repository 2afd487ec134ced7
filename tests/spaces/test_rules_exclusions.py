"""The stack record's PlanExclusions (spaces/stacks.py, issue 24 item 6): the torch space never proposes them,
checked vectorised over every plan of its space; other stacks whose engine runs the combination keep it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stratagem.errors import StratagemError
from stratagem.spaces import SearchConfig, SearchSpace, load_scenario
from stratagem.spaces.rules import column_facts
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

ROOT = Path(__file__).resolve().parents[2]


def _with_stack(scn: Scenario, stack: str, search: SearchConfig | None = None) -> Scenario:
    update: dict[str, object] = {"training": scn.training.model_copy(update={"stack": stack})}
    if search is not None:
        update["search"] = search
    return scn.model_copy(update=update)


@pytest.fixture(scope="module")
def mixtral() -> Scenario:
    return load_scenario(ROOT / "examples" / "mixtral-8x7b-64xh200.yaml")


def _excluded(scn: Scenario) -> tuple[int, int]:
    """(plans in the space, plans a PlanExclusion of the torch record covers), over every plan."""
    space = SearchSpace(scn)
    cols = space.enumerate()
    facts = column_facts(cols, scn.model.moe is not None, scn.training.global_batch_size, scn.training.seq_len)
    return space.count(), int(np.count_nonzero(stack_record("torch").excluded(facts)))


def test_the_torch_space_proposes_no_excluded_combination(mixtral: Scenario) -> None:
    tiny = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    for scn in (tiny, _with_stack(mixtral, "torch")):  # mixtral: every one of its ~465k plans
        count, excluded = _excluded(scn)
        assert count > 0 and excluded == 0, (scn.name, excluded)


def test_each_rule_is_one_the_engine_states(mixtral: Scenario) -> None:
    rec = stack_record("torch")
    assert [(ex.name, ex.refused_by) for ex in rec.plan_exclusions] == [
        ("etp_1_or_tp", "harness"), ("zero1_moe_expert_mesh", "harness"), ("1f1b_microbatches", "harness"),
        # what torchtitan v0.2.2 cannot express exactly (the harness runs them as planned)
        ("tp_without_sp", "export"), ("zero0_with_cp", "export"), ("zero0_with_ep", "export"),
        ("ddp_beside_other_parallelism", "export"), ("zero1_optimizer_only", "export"),
        ("optimizer_offload_cpu", "export"), ("selective_recompute", "export"), ("seq_len_divisor", "export"),
        ("etp_without_ep", "export")]
    for ex in [*rec.plan_exclusions, *rec.schedule_exclusions]:  # each names the engine code (or measurement)
        assert (".py" in ex.source or "measured" in ex.source) and ex.reason.count("use") >= 1, ex  # and a fix
    for ex in rec.plan_exclusions + rec.schedule_exclusions:
        if ex.refused_by == "export":  # torchtitan's own code, at the version the exporter writes for
            assert "torchtitan v0.2.2" in ex.source and "torchtitan/" in ex.source, ex
    for name in ("megatron", "deepspeed", "nanotron"):  # their engines run these (or have their own rules)
        assert stack_record(name).plan_exclusions == ()


def test_megatron_keeps_what_only_the_torch_stack_excludes(mixtral: Scenario) -> None:
    # Megatron's distributed optimizer shards expert parameters over edp (megatron/core/optimizer/
    # distrib_optimizer.py), and its 1F1B runs with fewer micro-batches than stages (warm-up = min(pp - rank - 1, m))
    small = SearchConfig(precision=["bf16"], pp=[1, 4], cp=[1], micro_batch_size=[1, 8], memory_margin_gib=2.0)
    count, excluded = _excluded(_with_stack(mixtral, "megatron", small))
    assert count > 0 and excluded > 0
    assert _excluded(_with_stack(mixtral, "torch", small))[1] == 0


def test_a_search_section_left_empty_by_the_exclusions_says_which_and_the_fix() -> None:
    tiny = load_scenario(ROOT / "examples" / "tiny-cpu.yaml")
    for search, said in ((SearchConfig(tp=2, sequence_parallel=False), "tp_without_sp (use sequence_parallel=true"),
                         (SearchConfig(pp=2, pp_schedule=["zero_bubble"]), "zero_bubble with one_chunk (use pp_schedule"),
                         (SearchConfig(activation_checkpointing=["selective"], tp=1, pp=1, cp=1),
                          "selective_recompute (use activation_checkpointing op")):
        with pytest.raises(StratagemError, match="no valid plan") as err:
            SearchSpace(tiny.model_copy(update={"search": search}))
        assert said in str(err.value) and "spaces/exclusions.py" in str(err.value), str(err.value)
