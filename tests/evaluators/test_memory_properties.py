"""Properties of the memory model over random valid plans (hypothesis).

More sharding never raises model-state memory; recompute never raises activations; memory never falls as
the micro-batch grows; dp has no effect on model states at zero stage 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stratagem.evaluators.calibration import DEFAULT_CALIBRATION
from stratagem.evaluators.experts import load_imbalance
from stratagem.evaluators.memory import memory_columns, rank_memory_columns
from stratagem.spaces import ClusterSpec, Plan, Scenario, divisors, gpu_preset, model_preset, violations
from stratagem.spaces.columns import PlanColumns

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])

# (model preset, gpu preset, seq_len, global batch)
SCENARIOS = [
    ("llama3-8b", "h100-sxm-80g", 4096, 512),
    ("mixtral-8x7b", "h200", 4096, 256),
    ("gpt3-175b", "a100-80g", 2048, 1536),
    ("tiny-4l", "h100-sxm-80g", 256, 64),
]
STACKS = ["torch", "megatron", "deepspeed", "nanotron", "automodel"]
OPTIMIZERS = ["adamw", "sgd", "adafactor", "adamw8bit"]


def scenario(name: str, gpu: str, seq: int, gbs: int, gpus: int, stack: str, optimizer: str) -> Scenario:
    return Scenario(model=model_preset(name), cluster=ClusterSpec(gpu=gpu_preset(gpu), num_nodes=1,
                                                                  gpus_per_node=gpus),
                    training={"seq_len": seq, "global_batch_size": gbs, "stack": stack, "optimizer": optimizer})


@st.composite
def cases(draw: st.DrawFn) -> tuple[Scenario, Plan]:
    """A scenario and a plan that satisfies every validity rule."""
    name, gpu, seq, gbs = draw(st.sampled_from(SCENARIOS))
    m = model_preset(name)
    heads = [d for d in divisors(m.num_attention_heads) if m.kv_heads % d == 0 and d <= 8]
    tp = draw(st.sampled_from(heads))
    pp = draw(st.sampled_from([d for d in divisors(m.num_layers) if d <= 8]))
    cp = draw(st.sampled_from([1, 2]))
    dp = draw(st.sampled_from([d for d in divisors(gbs) if d <= 16]))
    mbs = draw(st.sampled_from([d for d in divisors(gbs // dp) if d <= 8]))
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zero_bubble"]))
    fields: dict[str, Any] = dict(
        dp=dp, tp=tp, pp=pp, cp=cp, micro_batch_size=mbs,
        zero_stage=draw(st.integers(0, 3)),
        sequence_parallel=tp > 1 and draw(st.booleans()),
        precision=draw(st.sampled_from(["fp32", "bf16", "fp8"])),
        activation_checkpointing=draw(st.sampled_from(["none", "selective", "full"])),
        pp_schedule=schedule if pp > 1 else "1f1b",
        virtual_stages=2 if (pp > 1 and schedule == "interleaved") else 1,
        ep=draw(st.sampled_from([d for d in (1, 2, 4) if m.moe and dp % d == 0] or [1])),
    )
    if fields["zero_stage"] >= 1:
        fields["optimizer_offload"] = draw(st.sampled_from(["none", "cpu"]))
    plan = Plan(**fields)
    scn = scenario(name, gpu, seq, gbs, plan.world_size, draw(st.sampled_from(STACKS)),
                   draw(st.sampled_from(OPTIMIZERS)))
    assume(not violations(scn, plan))
    return scn, plan


def blocks(scn: Scenario, plans: list[Plan]) -> dict[str, np.ndarray]:
    return memory_columns(scn, PlanColumns.from_plans(plans), DEFAULT_CALIBRATION)


def states(cols: dict[str, np.ndarray]) -> np.ndarray:
    return cols["weights"] + cols["gradients"] + cols["optimizer"]


@SETTINGS
@given(cases())
def test_more_sharding_never_raises_model_states(case: tuple[Scenario, Plan]) -> None:
    scn, plan = case
    plans = [plan.model_copy(update={"zero_stage": z}) for z in range(4)]
    plans = [p for p in plans if not violations(scn, p)]
    pc = PlanColumns.from_plans(plans)
    zs = [p.zero_stage for p in plans]
    # Pairs (fewer, more sharding) whose model states must not rise. On a stack without a separate master copy
    # (torch: FSDP2), zero 2 is fully_shard(reshard_after_forward=False): the unsharded parameters gathered for
    # forward stay beside the sharded ones through backward, so zero 2 may hold more than zero 1 (measured in the
    # harness); every other pair, and zero 3 against every stage below it, must not rise.
    fsdp_keeps = not scn.training.record.master_weights
    # With pipeline parallelism such a stack also keeps zero 3's parameters gathered through the step
    # (torchtitan: reshard_after_forward = not pp_enabled), so zero 3 is compared with nothing there.
    keeps_with_pp = not scn.training.record.reshard_after_forward_with_pp and plan.pp > 1
    pairs = [(a, b) for a in range(len(zs)) for b in range(a + 1, len(zs))
             if not (fsdp_keeps and zs[b] == 2 and zs[a] in (0, 1)) and not (keeps_with_pp and 3 in (zs[a], zs[b]))]
    for stage in ("first", "last"):
        s = states(rank_memory_columns(scn, pc, DEFAULT_CALIBRATION, stage))  # type: ignore[arg-type]
        for a, b in pairs:
            assert s[b] <= s[a] * (1 + 1e-6), (stage, zs[a], zs[b], s)


@SETTINGS
@given(cases())
def test_recompute_never_raises_activations(case: tuple[Scenario, Plan]) -> None:
    scn, plan = case
    plans = [plan.model_copy(update={"activation_checkpointing": r}) for r in ("none", "selective", "full")]
    pc = PlanColumns.from_plans(plans)
    for stage in ("first", "last"):
        act = rank_memory_columns(scn, pc, DEFAULT_CALIBRATION, stage)["activations"]  # type: ignore[arg-type]
        assert act[0] >= act[1] >= act[2], (stage, act)


@SETTINGS
@given(cases(), st.sampled_from([2, 3, 4]))
def test_memory_never_falls_as_micro_batch_grows(case: tuple[Scenario, Plan], factor: int) -> None:
    scn, plan = case
    bigger = plan.model_copy(update={"micro_batch_size": plan.micro_batch_size * factor})
    assume(not violations(scn, bigger))
    cols = blocks(scn, [plan, bigger])
    # With PP and fewer micro-batches than stages the tokens in flight stay the same (m * b is fixed); then only
    # MoE's load-imbalance allowance moves, and it shrinks as the routed tokens grow (balls into bins,
    # evaluators/experts.py load_imbalance): the held activations may fall by at most that ratio.
    imb = load_imbalance(scn, PlanColumns.from_plans([plan, bigger]))
    allowed = min(1.0, float(imb[1] / imb[0])) * (1 - 1e-12)
    # GPipe, 1F1B with m <= pp, or one micro-batch: the gradients made in backward overlap a freed micro-batch's
    # activations (memory.py: peak m A + max(0, G - A)), so a larger micro-batch (A) with the same m A may lower
    # the peak: activations only
    def overlaps(p: Plan) -> bool:
        m = scn.training.global_batch_size // (p.dp * p.micro_batch_size)
        # any schedule with m <= pp: every micro-batch is in flight, and each holds its own bf16 weight casts
        # under autocast (memory_engine: one saved cast per in-flight micro-batch), so halving m halves them
        return m <= 1 or (p.pp > 1 and (p.pp_schedule == "gpipe" or m <= p.pp))

    if not (overlaps(plan) or overlaps(bigger)):
        assert cols["peak"][1] >= cols["peak"][0] * allowed, cols["peak"]
    # per stage: the worst rank may switch between the first and the last stage as the micro-batch grows
    pc = PlanColumns.from_plans([plan, bigger])
    for stage in ("first", "last"):
        act = rank_memory_columns(scn, pc, DEFAULT_CALIBRATION, stage)["activations"]  # type: ignore[arg-type]
        assert act[1] >= act[0] * allowed, (stage, act)


@SETTINGS
@given(cases(), st.sampled_from([2, 4, 8]))
def test_dp_has_no_effect_on_model_states_at_zero_0(case: tuple[Scenario, Plan], factor: int) -> None:
    scn, plan = case
    plan = plan.model_copy(update={"zero_stage": 0, "optimizer_offload": "none", "dp_replicate": 1})
    assume(plan.dp >= 2)  # nanotron: DDP's bf16 grad buckets exist only once dp > 1 (tested separately)
    wider = plan.model_copy(update={"dp": plan.dp * factor})
    training = scn.training.model_copy(update={"global_batch_size": scn.training.global_batch_size * factor})
    wide_scn = scn.model_copy(update={
        "cluster": scn.cluster.model_copy(update={"gpus_per_node": wider.world_size}), "training": training})
    assume(not violations(scn, plan) and not violations(wide_scn, wider))
    a = states(rank_memory_columns(scn, PlanColumns.from_plans([plan]), DEFAULT_CALIBRATION, "first"))
    b = states(rank_memory_columns(wide_scn, PlanColumns.from_plans([wider]), DEFAULT_CALIBRATION, "first"))
    assert np.allclose(a, b, rtol=1e-12)
