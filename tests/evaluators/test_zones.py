"""Zone levels, thresholds, the bottleneck rule and the sentences, on hand-built cases."""

import numpy as np
import pytest

from stratagem.evaluators import THRESHOLDS, ZONE_NAMES, evaluate
from stratagem.evaluators.zones import zone_columns
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset


def columns(headroom: list[float], exposed: list[float], bubble: list[float], loss: list[float]) -> dict:
    n = len(headroom)
    return {
        "headroom_gib": np.array(headroom) * 80.0, "hbm_gib": np.full(n, 80.0), "step_s": np.ones(n),
        "exposed_comm_s": np.array(exposed), "bubble_s": np.array(bubble), "goodput_loss": np.array(loss),
    }


def test_levels_at_the_documented_thresholds() -> None:
    assert THRESHOLDS["hbm"].warn == 0.10 and THRESHOLDS["hbm"].bad == 0.05
    z = zone_columns(columns([0.5, 0.10, 0.0999, 0.05, 0.0499, -0.2], [0.0, 0.15, 0.1499, 0.30, 0.2999, 0.9],
                             [0.0, 0.10, 0.0999, 0.25, 0.2499, 0.5], [0.0, 0.03, 0.0299, 0.10, 0.0999, 1.0]))
    assert list(z["zone_hbm_level"]) == [0, 0, 1, 1, 2, 2]
    assert list(z["zone_communication_level"]) == [0, 1, 0, 2, 1, 2]
    assert list(z["zone_bubbles_level"]) == [0, 1, 0, 2, 1, 2]
    assert list(z["zone_checkpoint_level"]) == [0, 1, 0, 2, 1, 2]
    assert z["zone_hbm_value"][0] == pytest.approx(0.5)


def test_bottleneck_rule() -> None:
    z = zone_columns(columns(
        headroom=[0.01, 0.5, 0.5, 0.08, 0.5, 0.12, 0.5],
        exposed=[0.9, 0.35, 0.16, 0.20, 0.05, 0.01, 0.0],
        bubble=[0.9, 0.12, 0.20, 0.0, 0.08, 0.0, 0.0],
        loss=[0.5, 0.0, 0.0, 0.0, 0.001, 0.0, 0.0001],
    ))
    names = [ZONE_NAMES[int(i)] for i in z["bottleneck"]]
    assert names == [
        "hbm",            # not fitting beats everything, even bad communication
        "communication",  # bad beats warn
        "bubbles",        # both warn: the larger fraction of time lost
        "communication",  # hbm warn yields to a time zone at warn
        "bubbles",        # all ok: closest to its warn threshold (0.08/0.10 vs 0.05/0.15)
        "hbm",            # all ok: 12% headroom is close to the 10% warn line
        "hbm",            # all ok: 0.1/0.5 of the way to warn beats a 0.01% checkpoint loss
    ]


def test_evaluation_zones_and_sentences() -> None:
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 4096, "global_batch_size": 32})
    oom = evaluate(scn, Plan(dp=8, zero_stage=0))
    assert oom.status == "oom" and oom.zones is not None
    assert oom.zones.hbm.level == "bad" and oom.zones.bottleneck == "hbm"
    assert oom.zones.hbm.sentence.startswith("Does not fit")
    fits = evaluate(scn, Plan(dp=1, tp=8, pp=1, zero_stage=1, micro_batch_size=1, activation_checkpointing="full"))
    assert fits.zones is not None and fits.time is not None
    comm = fits.zones.communication
    assert comm.value == pytest.approx(fits.time.exposed_comm_s / fits.time.step_s)
    assert "TP 8 inside a node" in comm.sentence
    assert "No pipeline parallelism" in fits.zones.bubbles.sentence
    assert "goodput loss" in fits.zones.checkpoint.sentence
    piped = evaluate(scn, Plan(dp=1, tp=2, pp=4, sequence_parallel=True, activation_checkpointing="full"))
    assert piped.zones is not None and "4 stages (1f1b) over 32 micro-batches" in piped.zones.bubbles.sentence


def test_measured_zones_take_hbm_from_the_measurement() -> None:
    from stratagem import evaluate
    from stratagem.evaluators.zones import measured_zones
    from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset

    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 4096, "global_batch_size": 64})
    pred = evaluate(scn, Plan(dp=8, zero_stage=3, activation_checkpointing="full"))
    assert pred.zones is not None and pred.zones.hbm.level == "ok"
    tight = pred.memory.model_copy(update={"peak_gib": 78.0, "headroom_gib": pred.memory.hbm_gib - 78.0})
    zones = measured_zones(pred.zones, tight, pred.time, pred.checkpoint)
    assert zones.hbm.level == "bad" and zones.bottleneck == "hbm"
    assert zones.hbm.sentence.startswith("Measured:") and zones.communication.sentence.startswith("Predicted:")
    assert zones.communication.value == pred.zones.communication.value
