"""Per-stage layer accounting (issue 14 item 3): the split the stacks build, the worst stage's memory and the
slowest stage's time."""

import numpy as np
import pytest

from stratagem.evaluators import evaluate
from stratagem.evaluators.stages import distinct_rows, stage_columns
from stratagem.spaces import MODEL_PRESETS, Plan, PlanColumns, Scenario, cluster_preset, violations
from stratagem.spaces.pipeline_split import chunk_layers, rank_layers, split_problem


def scenario(model: str, gpus: int, stack: str = "megatron", gbs: int = 256, seq: int = 4096) -> Scenario:
    return Scenario(model=MODEL_PRESETS[model], cluster=cluster_preset("h100-sxm-80g", gpus, 8),
                    training={"seq_len": seq, "global_batch_size": gbs, "stack": stack})


def test_llama3_405b_pp16_vpp8_counts_embedding_and_loss() -> None:
    # Megatron: 126 layers + embedding + loss = 128 units, one per chunk of pp16 x vpp8
    chunks = chunk_layers(126, 16, 8, split="embedding_loss")
    assert len(chunks) == 128 and sum(chunks) == 126 and chunks[0] == chunks[-1] == 0
    assert set(chunks[1:-1]) == {1}
    assert split_problem(126, 16, 8, 0, 0, "layers") is not None  # 128 chunks > 126 layers without it
    scn = scenario("llama3-405b", 1024, gbs=1024)
    plan = Plan(dp=8, tp=8, pp=16, pp_schedule="interleaved", virtual_stages=8, pp_split="embedding_loss",
                sequence_parallel=True, zero_stage=1, activation_checkpointing="full")
    assert violations(scn, plan) == []
    ev = evaluate(scn, plan)
    assert ev.status != "infeasible" and ev.time is not None and ev.time.step_s > 0
    # the same plan split by layers only is refused with the fix
    assert any("pp_split=embedding_loss" in v for v in violations(scn, plan.model_copy(update={"pp_split": "layers"})))


def test_uneven_split_rules_follow_megatron() -> None:
    assert split_problem(61, 16, 1, 1, 0, "layers") is None  # DeepSeek-V3: 1 + 15 x 4
    assert chunk_layers(61, 16, 1, 1, 0) == (1,) + (4,) * 15
    assert "split evenly" in (split_problem(61, 16, 1, 2, 0, "layers") or "")  # 59 over 15 stages
    assert "multiple of virtual_stages" in (split_problem(32, 4, 2, 7, 9, "layers") or "")
    assert "cannot be combined" in (split_problem(32, 4, 1, 7, 9, "embedding_loss") or "")
    assert "need pp > 1" in (split_problem(32, 1, 1, 7, 0, "layers") or "")
    # interleaved uneven: rank 0's chunks hold first / v layers each
    chunks = chunk_layers(32, 4, 2, 6, 10)
    assert rank_layers(chunks, 4) == (6, 8, 8, 10) and chunks[0] == 3 and chunks[3] == 5


def test_deepseek_dense_layers_sit_on_the_first_stage() -> None:
    m = MODEL_PRESETS["deepseek-v3"]
    st = stage_columns(m, PlanColumns.from_plans([Plan(pp=16, first_stage_layers=1), Plan(pp=8, last_stage_layers=5)]))
    # the last rank also holds the multi-token-prediction module (one more MoE layer)
    assert list(st.first_layers) == [1, 8] and list(st.last_layers) == [4 + 1, 5 + 1]
    assert st.first_expert[0] == 0  # layer 0 is dense: no routed experts on rank 0
    assert st.first_expert[1] == 5 * m.moe.num_experts * m.expert_params()  # layers 0-7: three are dense
    assert st.middle_layers[1] == 8


def test_mtp_modules_sit_on_the_last_stage_and_run_the_head_again() -> None:
    """Megatron places the multi-token-prediction modules on the last pipeline stage (multi_token_prediction.py
    mtp_on_this_rank): its layers, parameters and output-head runs grow by one module each; pp = 1: the one rank."""
    m = MODEL_PRESETS["deepseek-v3"]
    bare = m.model_copy(update={"mtp_layers": 0})
    plans = PlanColumns.from_plans([Plan(pp=16), Plan(pp=1)])
    st, st0 = stage_columns(m, plans), stage_columns(bare, plans)
    dense, routed = m.mtp_module_params()
    assert list(st.last_layers - st0.last_layers) == [1, 1] and list(st.first_layers - st0.first_layers) == [0, 1]
    assert list(st.last_dense - st0.last_dense) == [dense, dense]
    assert list(st.last_expert - st0.last_expert) == [routed, routed]
    assert list(st.last_heads) == [2, 2] and list(st0.last_heads) == [1, 1]


def test_slowest_stage_decides_time_and_worst_stage_memory() -> None:
    scn = scenario("llama3-8b", 16, stack="megatron", gbs=64, seq=4096)
    base = dict(dp=4, pp=4, zero_stage=1, micro_batch_size=1)
    even, heavy_last = Plan(**base), Plan(**base, first_stage_layers=6, last_stage_layers=10)
    assert violations(scn, heavy_last) == []
    e, h = evaluate(scn, even), evaluate(scn, heavy_last)
    # the last rank runs 10 layers + the head instead of 8 + the head: compute grows by 2 layers' worth
    st = stage_columns(scn.model, PlanColumns.from_plans([even, heavy_last]))
    assert list(st.last_layers) == [8, 10]
    layer = (h.time.compute_s - e.time.compute_s) / 2
    assert layer > 0 and e.time.compute_s / layer > 8  # 8 layers + head on the slowest rank of the even split
    # memory: rank 0 holds the most in-flight micro-batches; fewer layers there -> smaller worst stage
    light_first = Plan(**base, first_stage_layers=6, last_stage_layers=6)
    assert evaluate(scn, light_first).memory.peak_gib < e.memory.peak_gib


@pytest.mark.parametrize("stack", ["deepspeed", "nanotron"])
def test_stacks_without_the_split_refuse_it(stack: str) -> None:
    scn = scenario("llama3-8b", 16, stack=stack, gbs=64)
    broken = violations(scn, Plan(dp=4, pp=4, first_stage_layers=6, last_stage_layers=10))
    assert any(stack in v and "first/last" in v for v in broken), broken


def test_distinct_rows_is_numpys_unique_over_rows() -> None:
    """stages.distinct_rows (one int64 code per row, a 1-D sort) gives np.unique(axis=0)'s distinct rows, first
    occurrences and inverse, on random rows with the ranges plan columns have."""
    rng = np.random.default_rng(7)
    n = 5000
    cols = [rng.integers(0, hi, n).astype(np.int64) for hi in (127, 9, 3, 513, 17)]
    rows = np.stack(cols, axis=1)
    first, inverse = distinct_rows(cols)
    uniq, np_first, np_inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    assert np.array_equal(rows[first], uniq) and np.array_equal(first, np_first)
    assert np.array_equal(inverse, np.asarray(np_inverse).reshape(-1))
    assert np.array_equal(rows[first][inverse], rows)


def test_stage_columns_are_kept_per_plan_set_and_equal_a_fresh_split() -> None:
    """One evaluation asks for the same plans' stage columns from its memory and time terms alike: they are
    computed once per PlanColumns object (read-only, so no caller can change another's), and equal those of an
    equal but new object."""
    scn = scenario("llama3-70b", 64)
    plans = [Plan(dp=8, tp=8), Plan(dp=4, tp=8, pp=2), Plan(dp=2, tp=8, pp=4, pp_schedule="interleaved",
                                                          virtual_stages=2)]
    pc = PlanColumns.from_plans(plans)
    first = stage_columns(scn.model, pc)
    assert stage_columns(scn.model, pc) is first
    again = stage_columns(scn.model, PlanColumns.from_plans(plans))
    assert again is not first
    for name in first.__dataclass_fields__:
        assert np.array_equal(getattr(first, name), getattr(again, name))
        with pytest.raises(ValueError):
            getattr(first, name)[0] = 1.0


def test_stage_columns_kept_go_with_their_plans() -> None:
    import gc

    from stratagem.evaluators import stages

    scn = scenario("llama3-70b", 64)
    pc = PlanColumns.from_plans([Plan(dp=8, tp=8)])
    stage_columns(scn.model, pc)
    key = (id(pc), scn.model)
    assert key in stages._KEPT
    del pc
    gc.collect()
    assert key not in stages._KEPT
