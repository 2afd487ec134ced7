"""`evaluate_many` (screening columns) and `evaluate` (one Evaluation) agree; the column contract holds."""

import random
from dataclasses import fields

import numpy as np
import pytest

from stratagem.evaluators import ZONE_NAMES, evaluate, evaluate_many
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset, violations
from stratagem.spaces.columns import PlanColumns

CONTRACT = (
    "compute_s", "recompute_s", "tp_comm_s", "dp_comm_s", "pp_comm_s", "cp_comm_s", "bubble_s", "optimizer_s",
    "exposed_comm_s", "step_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "state_gib", "shard_gib", "save_s",
    "stall_s", "load_s", "job_mtbf_h", "interval_s", "goodput_loss", "bottleneck",
    "peak_gib", "hbm_gib", "headroom_gib", "first_block_to_break", "worst_stage",
) + tuple(f"zone_{z}_{k}" for z in ZONE_NAMES for k in ("value", "level"))

SCENARIOS = {
    "llama3-70b-64": Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 64),
                              training={"seq_len": 8192, "global_batch_size": 256, "stack": "megatron"}),
    "mixtral-32": Scenario(model=model_preset("mixtral-8x7b"), cluster=cluster_preset("h200", 32),
                           training={"seq_len": 4096, "global_batch_size": 128, "stack": "deepspeed",
                                     "checkpoint": {"mode": "blocking"}}),
    "tiny-cpu": Scenario(model=model_preset("tiny-4l"), cluster={"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 8},
                         training={"seq_len": 64, "global_batch_size": 16, "stack": "torch"}),
}


def random_valid_plans(scn: Scenario, n: int, seed: int = 0) -> list[Plan]:
    rng = random.Random(seed)
    world = scn.cluster.num_gpus
    plans: list[Plan] = []
    while len(plans) < n:
        tp, pp, cp = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2])
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zero_bubble"])
        plan = Plan(
            dp=dp, tp=tp, pp=pp, cp=cp, ep=rng.choice([1, 2, 4, 8]) if scn.model.moe else 1,
            dp_replicate=rng.choice([1, 2]), zero_stage=rng.choice([0, 1, 2, 3]),
            sequence_parallel=tp > 1 and rng.random() < 0.5, micro_batch_size=rng.choice([1, 2, 4]),
            precision=rng.choice(["fp32", "bf16", "fp8"]),
            activation_checkpointing=rng.choice(["none", "selective", "full"]),
            pp_schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1,
            optimizer_offload=rng.choice(["none", "cpu"]),
        )
        if not violations(scn, plan):
            plans.append(plan)
    return plans


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_evaluate_agrees_with_evaluate_many(name: str) -> None:
    scn = SCENARIOS[name]
    plans = random_valid_plans(scn, 40, seed=list(SCENARIOS).index(name))
    cols = evaluate_many(scn, PlanColumns.from_plans(plans))
    for key in CONTRACT:
        assert getattr(cols, key).shape == (len(plans),), key
        assert np.all(np.isfinite(getattr(cols, key))), key
    for i, plan in enumerate(plans):
        ev = evaluate(scn, plan)
        assert ev.time is not None and ev.throughput is not None and ev.checkpoint is not None
        assert ev.zones is not None and ev.memory is not None
        pairs = {**ev.time.model_dump(), **ev.throughput.model_dump(), **ev.checkpoint.model_dump(),
                 "peak_gib": ev.memory.peak_gib}
        for key, value in pairs.items():
            assert value == pytest.approx(float(getattr(cols, key)[i]), rel=1e-9, abs=1e-12), (plan.short(), key)
        for z in ZONE_NAMES:
            zone = getattr(ev.zones, z)
            assert zone.value == pytest.approx(float(cols.zone_value(z)[i]), rel=1e-9, abs=1e-12)
            assert zone.level == cols.level(z, i) and cols.zone_is(z, zone.level)[i]
        assert ev.zones.bottleneck == cols.bottleneck_name(i)
        assert (ev.status == "oom") == (not cols.fits[i])
        assert ev.memory.first_block_to_break == cols.broken_block(i)


def test_rows_do_not_interact() -> None:
    scn = SCENARIOS["llama3-70b-64"]
    plans = random_valid_plans(scn, 30, seed=7)
    together = evaluate_many(scn, PlanColumns.from_plans(plans))
    alone = evaluate_many(scn, PlanColumns.from_plans(plans[5:6]))
    for f in fields(alone):
        col = getattr(alone, f.name)
        assert col[0] == pytest.approx(getattr(together, f.name)[5], rel=1e-12, abs=1e-15), f.name


def test_physical_sanity_on_random_plans() -> None:
    scn = SCENARIOS["llama3-70b-64"]
    cols = evaluate_many(scn, PlanColumns.from_plans(random_valid_plans(scn, 200, seed=3)))
    assert np.all(cols.step_s > 0) and np.all(cols.mfu > 0) and np.all(cols.mfu < 1)
    assert np.all(cols.exposed_comm_s <= cols.tp_comm_s + cols.ep_comm_s + cols.pp_comm_s + cols.cp_comm_s
                  + cols.dp_comm_s + 1e-12)
    assert np.all((cols.goodput_loss > 0) & (cols.goodput_loss <= 1))
    assert set(np.unique(cols.bottleneck)) <= {0.0, 1.0, 2.0, 3.0}
