"""Expert layouts (issue 14 item 4): the expert grid folding over tp x dp x cp, dispatch over the right links,
per-expert GEMM size, load imbalance."""

import numpy as np
import pytest

from stratagem.evaluators import DEFAULT_CALIBRATION, evaluate, evaluate_many
from stratagem.evaluators.comm import group_link
from stratagem.evaluators.experts import (
    dispatch_s,
    ep_link,
    expert_gemm_size,
    load_imbalance,
)
from stratagem.evaluators.step_terms import mlp_tp_share, step_context, tp_traffic_s
from stratagem.spaces import MODEL_PRESETS, MoESpec, Plan, PlanColumns, Scenario, cluster_preset, violations
from stratagem.spaces.expert_grid import expert_grid_problem, expert_layouts
from stratagem.spaces.groups import expert_data_parallel

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


# ---- issue 24 item 1: the expert all-to-all as the engines run it ----------------------------------------------
def moe_scenario(model: str, gpus: int, dispatcher: str = "alltoall", **training) -> Scenario:
    tr = {"seq_len": 4096, "global_batch_size": gpus, "stack": "megatron", "moe_dispatcher": dispatcher, **training}
    return Scenario(model=MODEL_PRESETS[model], cluster=cluster_preset("h100-sxm-80g", gpus, 8), training=tr)


def test_all_peers_are_posted_at_once() -> None:
    # NCCL all-to-all = one group of send/recv to every peer: one latency, not (n-1); a tiny message costs ~alpha
    from stratagem.evaluators.experts import exchange_s
    scn = moe_scenario("mixtral-8x7b", 8)
    pc = PlanColumns.from_plans([Plan(dp=8, ep=8)])
    link = ep_link(scn, CAL, pc)
    tiny = exchange_s(scn, pc, CAL, np.full(1, 1e-9))
    assert tiny[0] == pytest.approx(link.alpha[0], rel=1e-6)


def test_deepep_sends_each_token_once_per_node_and_deepseek_caps_the_nodes() -> None:
    from stratagem.evaluators.experts import remote_nodes_per_token
    pc = PlanColumns.from_plans([Plan(dp=64, ep=64)])
    free = moe_scenario("qwen3-235b-a22b", 64)  # 128 experts, top-8, over 8 nodes
    # hypergeometric: P(a node holds none of the 8) = C(112, 8) / C(128, 8)
    miss = np.prod([(112 - i) / (128 - i) for i in range(8)])
    assert remote_nodes_per_token(free, CAL, pc)[0] == pytest.approx(7 * (1 - miss))
    assert remote_nodes_per_token(free, CAL, pc)[0] < 8 * 56 / 64  # fewer than the copies NCCL sends off-node
    dsv3 = moe_scenario("deepseek-v3", 64)  # n_group 8, topk_group 4: at most 4 nodes, 3.5 of them remote on average
    assert 3.40 < remote_nodes_per_token(dsv3, CAL, pc)[0] < 3.5
    a2a = dispatch_s(moe_scenario("deepseek-v3", 64), pc, CAL)[0]
    deepep = dispatch_s(moe_scenario("deepseek-v3", 64, "deepep"), pc, CAL)[0]
    assert deepep < 0.6 * a2a  # node de-duplication: 3 RDMA copies per token instead of 7 of 8


def test_fp8_dispatch_only_where_the_recipe_quantises_before_dispatch() -> None:
    from stratagem.evaluators.experts import dispatch_bytes_per_token
    pc = PlanColumns.from_plans([Plan(dp=64, ep=64, precision="fp8")])
    blockwise = moe_scenario("deepseek-v3", 64, "deepep", fp8_recipe="blockwise")
    tensorwise = moe_scenario("deepseek-v3", 64, "deepep", fp8_recipe="tensorwise")
    assert dispatch_bytes_per_token(blockwise, pc)[0][0] == pytest.approx(7168 * (1 + 4 / 128))
    assert dispatch_bytes_per_token(tensorwise, pc)[0][0] == 7168 * 2
    assert dispatch_bytes_per_token(blockwise, pc)[1][0] == 7168 * 2  # combine stays bf16


def test_ep_comm_is_its_own_line_and_overlap_hides_it() -> None:
    pc = [Plan(dp=64, ep=32, pp=1, micro_batch_size=1)]
    scn = moe_scenario("qwen3-30b-a3b", 64, "deepep", global_batch_size=512)  # 8 micro-batches: 7 paired
    base = evaluate_many(scn, pc)
    assert base.tp_comm_s[0] == 0 and base.ep_comm_s[0] > 0 and base.ep_hidden_s[0] == 0
    over = evaluate_many(moe_scenario("qwen3-30b-a3b", 64, "deepep", ep_comm_overlap=True, global_batch_size=512), pc)
    # one micro-batch alone has no partner to hide behind (combined_1f1b pairs a forward with another's backward)
    alone = evaluate_many(moe_scenario("qwen3-30b-a3b", 64, "deepep", ep_comm_overlap=True), pc)
    assert alone.ep_hidden_s[0] == 0
    assert over.ep_comm_s[0] < base.ep_comm_s[0] and over.ep_hidden_s[0] > 0
    dense = evaluate_many(Scenario(model=MODEL_PRESETS["llama3-8b"], cluster=cluster_preset("h100-sxm-80g", 8),
                                   training={"seq_len": 4096, "global_batch_size": 8}), [Plan(dp=8)])
    assert dense.ep_comm_s[0] == 0


def test_grouped_gemm_pads_each_expert_to_whole_tiles() -> None:
    scn = moe_scenario("qwen3-30b-a3b", 8)
    # ep8: n = 8 x 4096 x 8 / 128 = 2048 rows per expert: whole tiles; mbs 1 with cp... fewer rows pad more
    full = expert_gemm_size(scn, PlanColumns.from_plans([Plan(dp=8, ep=8)]), CAL)[0]
    padded = expert_gemm_size(moe_scenario("qwen3-30b-a3b", 8, seq_len=100),
                              PlanColumns.from_plans([Plan(dp=8, ep=8)]), CAL)[0]
    rows = 8 * 100 * 8 / 128  # 50 rows in a 128-row tile
    assert padded < full * rows / 128 * 1.0001


def test_deepep_overlap_costs_the_sms_its_kernels_hold() -> None:
    # DeepEP's kernels hold 20 of the H100's 132 SMs while they run beside compute (deep_ep Buffer.num_sms)
    from stratagem.evaluators.step_terms import comm_sm_share
    assert comm_sm_share(moe_scenario("qwen3-30b-a3b", 64, "deepep")) == pytest.approx(20 / 132)
    assert comm_sm_share(moe_scenario("qwen3-30b-a3b", 64, "alltoall")) == 0.0
    pc = [Plan(dp=64, ep=32, micro_batch_size=1)]
    over = evaluate_many(moe_scenario("qwen3-30b-a3b", 64, "deepep", ep_comm_overlap=True, global_batch_size=512), pc)
    assert over.ep_comm_s[0] > 0  # never hidden for free


def _megatron_token_nodes(experts: int, top_k: int, groups: int, groups_per_token: int, nodes: int) -> float:
    """Distinct nodes per token under megatron/core/transformer/moe/moe_utils.py group_limited_topk (its code, on
    torch), the nodes counted as DeepEP's tests/test_internode.py counts them (rdma_idx, inplace_unique)."""
    import torch
    torch.manual_seed(1)
    tokens = 8192
    scores = torch.rand(tokens, experts)
    group_scores = scores.view(tokens, groups, -1).topk(top_k // groups_per_token, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=groups_per_token, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, groups, experts // groups).reshape(tokens, -1)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    topk_idx = torch.topk(masked, k=top_k, dim=-1)[1]
    node = topk_idx // (experts // nodes)
    reached = torch.zeros(tokens, nodes).scatter_(1, node, 1.0)
    return float(reached.sum(dim=1).mean())


def test_node_limited_routing_reaches_the_nodes_megatrons_router_picks() -> None:
    # DeepSeek-V3 on EP64 over 8 nodes: 4 groups (nodes) a token, 8 experts among them; not every chosen group gets
    # one of the 8, and the token's own node is one of the 8 as often as any other
    from stratagem.evaluators.experts import remote_nodes_per_token, token_nodes
    pc = PlanColumns.from_plans([Plan(dp=64, ep=64)])
    dsv3 = moe_scenario("deepseek-v3", 64)
    engine = _megatron_token_nodes(256, 8, 8, 4, 8)
    assert token_nodes(dsv3, CAL, pc)[0] == pytest.approx(engine, abs=0.02)
    assert remote_nodes_per_token(dsv3, CAL, pc)[0] == pytest.approx(engine * 7 / 8, abs=0.02)
    # 2 nodes (EP16): both groups are chosen; the 8 experts miss one of them only rarely
    pc16 = PlanColumns.from_plans([Plan(dp=16, ep=16)])
    dsv3_16 = moe_scenario("deepseek-v3", 16)
    assert token_nodes(dsv3_16, CAL, pc16)[0] == pytest.approx(_megatron_token_nodes(256, 8, 8, 4, 2), abs=0.02)


def test_deepep_internode_runs_at_its_published_rate() -> None:
    # DeepEP README (normal kernels, H800 + CX7 400 Gb/s): EP32 dispatch 58 / combine 57 GB/s "bottleneck
    # bandwidth", counted as its tests/test_internode.py counts bytes: tokens x distinct nodes (own included) x hidden
    from stratagem.evaluators.comm import DEEPEP_INTERNODE_GBPS
    from stratagem.evaluators.experts import exchange_s, moe_tokens_per_rank, token_nodes
    scn = moe_scenario("deepseek-v3", 32, "deepep")
    pc = PlanColumns.from_plans([Plan(dp=32, ep=32)])
    hidden = 2.0 * scn.model.hidden_size
    seconds = exchange_s(scn, pc, CAL, np.full(1, hidden))[0] - ep_link(scn, CAL, pc).alpha[0]
    tokens = moe_tokens_per_rank(scn, pc)[0] * load_imbalance(scn, pc)[0]
    logical = tokens * token_nodes(scn, CAL, pc)[0] * hidden / seconds
    assert logical == pytest.approx(DEEPEP_INTERNODE_GBPS[32] * 1e9)  # the H100's NIC is CX7's 50 GB/s
    # faster than the same bytes at NCCL's achieved fraction of the line rate (link_efficiency 0.7)
    assert DEEPEP_INTERNODE_GBPS[32] / 50.0 > CAL.link_efficiency


def test_megatron_moe_layers_run_tp_collectives_around_attention_only() -> None:
    """Megatron's dispatcher takes the routed tokens out of their sequence shard itself (all-to-all over ep, then
    all-gather over etp: none at etp 1; moe/token_dispatcher.py), so an MoE layer without shared experts runs TP
    collectives around its attention only; shared experts are a TP MLP (moe/shared_experts.py); torchtitan gathers
    the MoE block's input and reduce-scatters its output as a dense MLP's (parallelize.py apply_moe_ep_tp)."""
    pc = PlanColumns.from_plans([Plan(tp=4, dp=4, ep=8, sequence_parallel=True)])

    def traffic(scn: Scenario) -> float:
        ctx = step_context(scn, pc, CAL)
        return float(tp_traffic_s(ctx, group_link(scn.cluster, CAL, pc.tp, 1.0))[0])

    mixtral = MODEL_PRESETS["mixtral-8x7b"]
    assert mixtral.moe is not None and mixtral.num_moe_layers() == mixtral.num_layers
    megatron, torch = traffic(scenario()), traffic(scenario(stack="torch"))
    assert megatron == pytest.approx(torch / 2)  # attention's all-gather + reduce-scatter of the layer's four
    shared = mixtral.moe.model_copy(update={"shared_experts": 1, "shared_ffn": mixtral.moe.expert_ffn_hidden_size})
    assert traffic(scenario(moe=shared)) == pytest.approx(torch)
    dense = Scenario(model=MODEL_PRESETS["llama3-8b"], cluster=cluster_preset("h100-sxm-80g", 16, 8),
                     training={"seq_len": 4096, "global_batch_size": 64, "stack": "megatron"})
    assert mlp_tp_share(dense) == 1.0 and mlp_tp_share(scenario()) == 0.0
