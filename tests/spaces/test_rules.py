"""Every validity rule: a plan that breaks it gets a message naming the values and the fix."""

from __future__ import annotations

import pytest

from stratagem.errors import StratagemError
from stratagem.spaces import RULES, ClusterSpec, Plan, Scenario, check_plan, divisors, gpu_preset, violations

RULE_NAMES = {r.name for r in RULES}


def scn(model: str = "llama3-8b", gpus: int = 8, gpu: str = "h100-sxm-80g", seq: int = 4096,
        gbs: int = 64, stack: str = "torch") -> Scenario:
    return Scenario(model=model, cluster=ClusterSpec(gpu=gpu_preset(gpu), num_nodes=1, gpus_per_node=gpus),
                    training={"seq_len": seq, "global_batch_size": gbs, "stack": stack})


def broken(scenario: Scenario, plan: Plan, rule: str) -> str:
    """The message of `rule` for this plan (and only that rule must fire)."""
    msgs = {r.name: r.check(scenario, plan) for r in RULES}
    fired = {k for k, v in msgs.items() if v is not None}
    assert fired == {rule}, fired
    msg = msgs[rule]
    assert msg is not None
    return msg


# (rule, scenario, plan, fragments the message must contain: the values and the fix)
CASES = [
    ("world_size", scn(), Plan(dp=4), ["dp*tp*pp*cp", "4*1*1*1 = 4", "8 GPUs", "dp=8"]),
    ("tp_divides_heads", scn(gpus=16), Plan(dp=1, tp=16),
     ["tp (16)", "num_attention_heads (32)", "num_kv_heads (8)", "valid: 1, 2, 4, 8"]),
    ("tp_divides_ffn", Scenario(model={"preset": "tiny", "ffn_hidden_size": 129},
                                cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), gpus_per_node=2),
                                training={"global_batch_size": 8}),
     Plan(dp=1, tp=2), ["tp (2)", "MLP inner size (129)", "valid: 1, 3, 43, 129"]),
    ("pp_divides_layers", Scenario(model="tiny", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"),
                                                                     gpus_per_node=4),
                                   training={"global_batch_size": 8}),
     Plan(dp=1, pp=4), ["pp*virtual_stages (4*1)", "num_layers (2)", "at least one layer"]),
    ("batch_divisible", scn(gbs=60), Plan(dp=8), ["dp*micro_batch_size (8*1)", "global_batch_size (60)",
                                                  "dp (8) does not divide it", "global_batch_size=64"]),
    ("batch_divisible", scn(gbs=64), Plan(dp=8, micro_batch_size=3),
     ["dp*micro_batch_size (8*3)", "global_batch_size (64)", "valid micro_batch_size: 1, 2, 4, 8"]),
    ("cp_divides_seq", scn(seq=4098, gbs=64), Plan(dp=2, cp=4),
     ["cp (4)", "2*cp must divide seq_len (4098)"]),
    ("ep_valid", scn(), Plan(dp=8, ep=2), ["ep (2)", "needs an MoE model", "set ep=1"]),
    ("ep_valid", scn(model="mixtral-8x7b"), Plan(dp=8, ep=3), ["ep (3)", "num_experts (8)", "valid: 1, 2, 4, 8"]),
    # Megatron parallel folding: ep*etp must divide tp*dp*cp (here 4*4 > 8)
    ("ep_valid", scn(model="mixtral-8x7b", stack="megatron"), Plan(dp=8, ep=4, etp=4),
     ["ep*etp (4*4)", "tp*dp*cp (1*8*1 = 8)", "valid ep with etp=4: 1, 2"]),
    ("dp_replicate_divides_dp", scn(), Plan(dp=8, dp_replicate=3), ["dp_replicate (3)", "dp (8)",
                                                                    "valid: 1, 2, 4, 8"]),
    ("sp_needs_tp", scn(), Plan(dp=8, sequence_parallel=True), ["sequence_parallel needs tp > 1",
                                                                "sequence_parallel=false or tp >= 2"]),
    ("virtual_stages", scn(), Plan(dp=4, pp=2, pp_schedule="interleaved"),
     ["interleaved needs pp > 1 and virtual_stages >= 2", "pp=2, virtual_stages=1"]),
    ("virtual_stages", scn(gbs=12), Plan(dp=2, pp=4, pp_schedule="interleaved", virtual_stages=2),
     ["micro-batches per step (6)", "divisible by pp (4)", "change micro_batch_size or dp"]),
    ("virtual_stages", scn(), Plan(dp=4, pp=2, virtual_stages=2), ["virtual_stages (2)",
                                                                  "needs pp_schedule=interleaved"]),
    ("fp8_hardware", scn(gpu="a100-80g"), Plan(dp=8, precision="fp8"), ["precision fp8", "a100-80g",
                                                                         "use bf16"]),
    ("offload_needs_zero", scn(), Plan(dp=8, optimizer_offload="cpu"), ["optimizer_offload=cpu",
                                                                        "zero_stage >= 1"]),
    # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__: assert zero_optimization_stage() < 2
    ("stack_can_run", scn(stack="deepspeed"), Plan(dp=4, pp=2, zero_stage=2),
     ["deepspeed: ZeRO stage 2 with pipeline parallelism is not supported", "deepspeed/runtime/pipe/engine.py",
      "use zero_stage <= 1"]),
    # megatron/core/pipeline_parallel/schedules.py get_forward_backward_func: 1F1B or interleaved only
    ("stack_can_run", scn(stack="megatron"), Plan(dp=4, pp=2, pp_schedule="zero_bubble"),
     ["megatron: pp_schedule zero_bubble is not supported", "schedules.py", "use pp_schedule in 1f1b, interleaved"]),
    # nanotron helpers.py init_optimizer_and_grad_accumulator: ZeRO-1 only
    ("stack_can_run", scn(stack="nanotron"), Plan(dp=8, zero_stage=3),
     ["nanotron: ZeRO stage 3 is not supported", "use zero_stage in 0, 1"]),
    # megatron/core/transformer/transformer_config.py __post_init__: recompute_modules with selective granularity;
    # mla_up_proj only with multi_latent_attention
    ("recompute_modules", scn(stack="megatron"), Plan(dp=8, activation_checkpointing="full",
                                                      recompute_modules="layernorm"),
     ["recompute_modules (layernorm)", "activation_checkpointing=selective", "got full"]),
    ("recompute_modules", scn(stack="megatron"), Plan(dp=8, activation_checkpointing="selective",
                                                      recompute_modules="mla_up_proj+layernorm"),
     ["recompute_modules (mla_up_proj)", "llama3-8b", "needs MLA"]),
    ("stack_can_run", scn(), Plan(dp=8, activation_checkpointing="selective", recompute_modules="layernorm"),
     ["torch: recompute_modules layernorm is not supported", "torchtitan/distributed/activation_checkpoint.py"]),
    # the torch record's PlanExclusions (spaces/stacks.py), the same rules the harness refuses from
    ("stack_combinations", scn(model="mixtral-8x7b"), Plan(dp=4, tp=2, etp=4),
     ["torch: etp (4) with tp (2) is not supported", "parallel_dims.py", "use etp=1 or etp=tp"]),
    ("stack_combinations", scn(model="mixtral-8x7b"), Plan(dp=8, ep=2, zero_stage=1),
     ["zero_stage 1 over dp (8) with the MoE experts under ep (2) / tp (1)", "ZeroRedundancyOptimizer",
      "use zero_stage 0, 2 or 3"]),
    ("stack_combinations", scn(), Plan(dp=4, pp=2, micro_batch_size=16, pp_schedule="1f1b"),
     ["pp_schedule 1f1b with 1 micro-batch(es) per step over pp (2) stages", "pipelining/schedules.py",
      "or use pp_schedule gpipe"]),
]


@pytest.mark.parametrize("rule,scenario,plan,fragments", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_message_names_values_and_fix(rule: str, scenario: Scenario, plan: Plan, fragments: list[str]) -> None:
    msg = broken(scenario, plan, rule)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert "\n" not in msg


def test_every_rule_is_exercised() -> None:
    assert {c[0] for c in CASES} == RULE_NAMES


def test_valid_plan_passes_every_rule() -> None:
    s = scn(model="mixtral-8x7b", gpus=8, gbs=64)
    plan = Plan(dp=2, tp=2, pp=2, ep=2, zero_stage=2, sequence_parallel=True, micro_batch_size=2,
                pp_schedule="interleaved", virtual_stages=2, optimizer_offload="cpu", precision="fp8")
    assert violations(s, plan) == []
    check_plan(s, plan)


def test_check_plan_raises_first_broken_rule_as_one_line() -> None:
    with pytest.raises(StratagemError, match=r"^plan: dp\*tp\*pp\*cp"):
        check_plan(scn(), Plan(dp=3, tp=3))


def test_divisors() -> None:
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]


def test_megatron_moe_with_tp_needs_sequence_parallel() -> None:
    # megatron/core/transformer/moe/moe_layer.py MoELayer.forward raises in training without SP when tp > 1
    s = scn(model="mixtral-8x7b", stack="megatron")
    msg = broken(s, Plan(dp=4, tp=2, ep=4), "ep_valid")
    assert "needs sequence_parallel" in msg and "moe_layer.py" in msg and "sequence_parallel=true" in msg
    assert violations(s, Plan(dp=4, tp=2, ep=4, sequence_parallel=True)) == []
    assert violations(scn(model="mixtral-8x7b", stack="torch"), Plan(dp=4, tp=2, ep=4)) == []
