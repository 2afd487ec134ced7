"""Expert layouts (issue 14 item 4): the expert grid folding over tp x dp x cp, dispatch over the right links,
per-expert GEMM size, load imbalance."""

import numpy as np
import pytest

from stratagem.evaluators import DEFAULT_CALIBRATION, evaluate
from stratagem.evaluators.experts import (
    dispatch_s,
    ep_link,
    expert_data_parallel,
    expert_gemm_size,
    load_imbalance,
)
from stratagem.spaces import MODEL_PRESETS, MoESpec, Plan, PlanColumns, Scenario, cluster_preset, violations
from stratagem.spaces.expert_grid import expert_grid_problem, expert_layouts

CAL = DEFAULT_CALIBRATION


def scenario(model: str = "mixtral-8x7b", gpus: int = 16, stack: str = "megatron", **model_update) -> Scenario:
    m = MODEL_PRESETS[model]
    if model_update:
        m = m.model_copy(update=model_update)
    return Scenario(model=m, cluster=cluster_preset("h100-sxm-80g", gpus, 8),
                    training={"seq_len": 4096, "global_batch_size": 64, "stack": stack})


def test_megatron_folding_lets_ep_span_tensor_parallel_ranks() -> None:
    m = MODEL_PRESETS["mixtral-8x7b"]
    # Megatron MoE parallel folding: tp4 x dp2 = 8 ranks; ep8 x etp1 re-partitions them (edp 1)
    assert expert_grid_problem(m, tp=4, dp=2, cp=1, ep=8, etp=1) is None
    assert expert_data_parallel(PlanColumns.from_plans([Plan(tp=4, dp=2, ep=8)]))[0] == 1
    assert "ep*etp (8*2)" in (expert_grid_problem(m, tp=4, dp=2, cp=1, ep=8, etp=2) or "")
    assert "num_experts (8)" in (expert_grid_problem(m, tp=4, dp=2, cp=1, ep=3, etp=1) or "")
    assert (8, 1) in expert_layouts(m, 4, 2, 1) and (2, 4) in expert_layouts(m, 4, 2, 1)
    scn = scenario()
    assert violations(scn, Plan(dp=4, tp=4, ep=8, sequence_parallel=True)) == []


def test_imbalance_shrinks_with_tokens_and_respects_capacity() -> None:
    pcs = PlanColumns.from_plans([Plan(dp=16, ep=1), Plan(dp=16, ep=8), Plan(dp=16, ep=8, micro_batch_size=4)])
    imb = load_imbalance(scenario(), pcs)
    assert imb[0] == 1.0 and imb[1] > imb[2] > 1.0
    # balls into bins: 1 + sqrt(2 ln 8 / (4096 tokens x top-2))
    assert imb[1] == pytest.approx(1 + np.sqrt(2 * np.log(8) / (4096 * 2)))
    capped = load_imbalance(scenario(moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336,
                                                 capacity_factor=1.0)), pcs)
    assert capped[1] == 1.0


def test_ep_inside_a_node_is_cheaper_than_across_nodes() -> None:
    scn = scenario(gpus=16)
    inside, across = Plan(dp=16, ep=8), Plan(dp=16, ep=8, etp=2)  # ep x etp = 16 spans both nodes
    pcs = PlanColumns.from_plans([inside, across])
    link = ep_link(scn, CAL, pcs)
    assert link.per_node[0] == 8 and link.per_node[1] == 4  # ep ranks are etp apart: 4 of the 8 per node
    t = dispatch_s(scn, pcs, CAL, np.full(2, 2.0 * 4096))
    assert t[1] > t[0]


def test_fine_grained_experts_run_smaller_gemms() -> None:
    coarse, fine = scenario("mixtral-8x7b"), scenario("qwen3-30b-a3b")
    pc = PlanColumns.from_plans([Plan(dp=16, ep=8)])
    assert expert_gemm_size(fine, pc, CAL)[0] < expert_gemm_size(coarse, pc, CAL)[0] < 1.0


def test_etp_shrinks_expert_weights_and_moves_the_expert_shard() -> None:
    scn = scenario()
    a = evaluate(scn, Plan(dp=16, ep=4, etp=1, zero_stage=1))
    b = evaluate(scn, Plan(dp=16, ep=4, etp=2, zero_stage=1))
    assert b.memory.weights_gib < a.memory.weights_gib


@pytest.mark.parametrize("stack", ["nanotron"])
def test_stack_without_etp_refuses_it(stack: str) -> None:
    broken = violations(scenario(stack=stack), Plan(dp=16, ep=4, etp=2))
    assert any("etp" in v and stack in v for v in broken), broken
