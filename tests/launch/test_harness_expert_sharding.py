"""MoE experts under ZeRO-2/3 are FSDP2-sharded over their expert-data-parallel ranks, as torchtitan shards them
and as the analytic model counts them (issue 24 item 3): traced on fake tensors (stratagem.launch.trace), the per-rank
weight, gradient and optimizer bytes equal stratagem.evaluators.memory's, with edp = dp*cp*tp / (ep*etp) and under
HSDP edp / dp_replicate (expert_grid). Before, the harness kept the experts whole on each edp rank: Mixtral-8x7B at
dp32 x tp2 x ep8 ZeRO-3 traced 21.1 GiB of weights where the model counts 2.7 GiB. Real runs of the same layouts
against the single-process reference: tests/launch/test_harness_coverage.py (integration)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from stratagem.launch.harness.expert_grid import expert_replicas, shards_experts
from stratagem.launch.trace.run import trace_plan
from stratagem.spaces import Scenario, load_scenario, parse_plan

ROOT = Path(__file__).resolve().parents[2]

# The tiny MoE model (4 experts): each layout shards the experts another way.
LAYOUTS = [
    "dp=4,ep=2,zero=3",  # edp 2: FSDP Shard(0) over the 2 local experts
    "dp=4,tp=2,ep=2,sp=true,zero=3",  # etp = 1: edp 4 spans the TP ranks; edp x ep = 8 > 4 experts: FSDP Shard(1)
    "dp=8,ep=2,dp_replicate=2,zero=3",  # HSDP: experts sharded over edp / dp_replicate = 2 inside a replica
    "dp=4,tp=2,ep=2,etp=2,sp=true,zero=3",  # FSDP over experts already split on (ep, etp)
    "pp=2,dp=2,tp=2,ep=2,sp=true,zero=2,schedule=gpipe",  # ZeRO-2 under a pipeline: optimizer states sharded
    "dp=2,cp=2,ep=2,zero=3",  # context parallelism: edp 2 spans the cp ranks
]


def _tiny(world: int) -> Scenario:
    scn = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    return scn.model_copy(update={"cluster": scn.cluster.model_copy(update={"gpus_per_node": world})})


@pytest.mark.parametrize("text", LAYOUTS)
def test_traced_expert_states_equal_the_analytic_model(text: str) -> None:
    plan = parse_plan(f"{text},precision=fp32")
    scn = _tiny(plan.world_size)
    assert shards_experts(plan, scn.model)
    for role in trace_plan(scn, plan):
        # fp32: the gradient shards are the parameter shards' size; the optimizer holds two (AdamW)
        assert role.states["grad_bytes"] == role.states["param_bytes"], role.role
        assert role.states["optimizer_bytes"] == pytest.approx(role.analytic["optimizer"], abs=0.5), role.role
        if plan.zero_stage == 3:  # (ZeRO-2's analytic weights include the unsharded copy held to backward)
            assert role.states["param_bytes"] == pytest.approx(role.analytic["weights"], abs=0.5), role.role


def test_experts_stay_whole_where_edp_has_one_shard() -> None:
    """edp = 1, ZeRO-0/1, or replicas that leave one expert shard each: no FSDP unit for the experts (their
    gradients are all-reduced over edp), as memory.py's expert shard max(1, edp / dp_replicate) = 1 says."""
    moe = _tiny(4).model
    for text in ("dp=4,ep=4,zero=3", "dp=4,ep=2,zero=0", "dp=4,ep=2,dp_replicate=2,zero=3"):
        assert not shards_experts(parse_plan(text), moe), text
    uneven = parse_plan("dp=8,ep=4,dp_replicate=4,zero=3")  # edp 2 does not split into 4 replicas
    assert expert_replicas(uneven) == 1 and not shards_experts(uneven, moe)


def test_mixtral_layout_traces_as_the_model_counts() -> None:
    """Mixtral-8x7B (2 of its 32 layers) on 64 ranks, dp32 x tp2 x ep8 ZeRO-3 bf16: experts over edp = 8 (FSDP
    Shard(1), 8 x 8 > 8 experts). The traced rank holds the analytic states but for the router's [8, 4096]
    weight, which FSDP2 pads over dp = 32 > 8 rows: rank 0 holds one whole row per layer, the model 8/32 of one."""
    scn = load_scenario(ROOT / "examples" / "mixtral-8x7b-64xh200.yaml")
    model = scn.model.model_copy(update={"num_layers": 2})
    scn = scn.model_copy(update={"model": model, "training": scn.training.model_copy(update={"stack": "torch"})})
    plan = parse_plan("dp=32,tp=2,ep=8,zero=3,sp=true,mbs=1,precision=bf16")
    assert model.moe is not None
    rows = math.ceil(model.moe.num_experts / plan.dp) - model.moe.num_experts / plan.dp
    padding = rows * model.hidden_size * 4 * model.num_layers  # fp32 shards
    (role,) = trace_plan(scn, plan)
    assert role.states["param_bytes"] == pytest.approx(role.analytic["weights"] + padding, abs=0.5)
    assert role.states["grad_bytes"] == pytest.approx(role.analytic["gradients"] + padding, abs=0.5)
    assert role.states["optimizer_bytes"] == pytest.approx(role.analytic["optimizer"] + 2 * padding, abs=0.5)
