"""The decision tree on hand-built cases, and `stratagem explain`."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.evaluators import Advice, advise, evaluate
from stratagem.evaluators.calibration_file import resolve_calibration
from stratagem.spaces import Plan, Scenario, cluster_preset, load_scenario, model_preset, violations

EXAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")
                  if not p.stem.endswith("-calibration"))  # calibration files sit beside the scenarios
EFFECT = re.compile(r"^.+ -> .+: .+ -> .+, step ([+-]\d+%|unchanged)$")


def check(scn: Scenario, plan: Plan, advice: list[Advice]) -> None:
    for a in advice:
        assert violations(scn, a.plan) == [], a.change
        assert EFFECT.match(a.effect), a.effect
        assert a.effect.startswith(a.change)
        assert a.rationale.endswith(".")
        if a.checkpoint_policy is None:
            neighbour = evaluate(scn, a.plan)
            assert neighbour.time is not None
            assert a.neighbour.step_s == pytest.approx(neighbour.time.step_s, rel=1e-9)


def test_oom_follows_precision_then_micro_batch_then_sharding() -> None:
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 4096, "global_batch_size": 64})
    plan = Plan(dp=8, zero_stage=0, precision="fp32", micro_batch_size=2)
    ev = evaluate(scn, plan)
    assert ev.status == "oom" and ev.memory is not None
    advice = advise(scn, plan, ev)
    assert {a.zone for a in advice} == {"hbm"}  # memory first: nothing else until the plan fits
    check(scn, plan, advice)
    # A plan that does not fit gets only neighbours that fit (issue 13): no single step fits this one, so the
    # advice is the walk down the tree (precision, micro-batch, recomputation, then sharding), which ends in a fit.
    assert len(advice) == 1
    path = advice[0]
    assert path.neighbour.status == "ok"
    fields = [part.split(" ")[0] for part in path.change.split(", ")]
    assert fields == ["precision", "micro_batch_size", "activation_checkpointing", "zero_stage"]


def test_advice_for_a_plan_that_does_not_fit_lists_only_plans_that_fit() -> None:
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 8192, "global_batch_size": 64})
    for plan in (Plan(dp=8, zero_stage=1), Plan(dp=4, tp=2, zero_stage=3, sequence_parallel=True),
                 Plan(dp=8, zero_stage=3, micro_batch_size=8)):
        ev = evaluate(scn, plan)
        assert ev.status == "oom"
        advice = advise(scn, plan, ev)
        assert advice, plan
        fitting = [a for a in advice if a.neighbour.status == "ok"]
        nearest = [a for a in advice if a.rationale.startswith("No single step fits, nor")]
        assert len(fitting) + len(nearest) == len(advice), [a.effect for a in advice]
        assert not (fitting and nearest)


def test_no_step_fits_names_the_nearest() -> None:
    # seq 16384: at 8192 FSDP2's CPU offload (sharded parameters, gradients and optimizer states on the host) fits
    scn = Scenario(model=model_preset("llama3-405b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 16384, "global_batch_size": 64})
    plan = Plan(dp=8, zero_stage=3, activation_checkpointing="full")
    advice = advise(scn, plan)
    assert len(advice) == 1 and advice[0].neighbour.status == "oom"
    assert advice[0].rationale.startswith("No single step fits, nor the memory branch of the tree; the nearest")
    assert f"{-advice[0].neighbour.headroom_gib:.1f} GiB more" in advice[0].rationale


def test_hsdp_sentence_is_true_for_the_plan() -> None:
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 256),
                   training={"seq_len": 4096, "global_batch_size": 512})
    plan = Plan(dp=256, zero_stage=3)
    hsdp = [a for a in advise(scn, plan) if a.plan.dp_replicate > 1 and "HSDP" in a.rationale]
    assert hsdp
    for a in hsdp:
        shard = a.plan.dp * a.plan.cp // a.plan.dp_replicate * a.plan.tp
        assert ("inside a node" in a.rationale) == (shard <= scn.cluster.gpus_per_node), a.rationale
        assert f"across the {a.plan.dp_replicate} replicas" in a.rationale


def test_zero3_over_many_micro_batches_is_network_bound() -> None:
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 64),
                   training={"seq_len": 8192, "global_batch_size": 256})
    plan = Plan(dp=8, tp=8, zero_stage=3, sequence_parallel=True, activation_checkpointing="selective")
    ev = evaluate(scn, plan)
    assert ev.zones is not None and ev.zones.communication.level == "bad"
    assert ev.zones.bottleneck == "communication"
    advice = advise(scn, plan, ev)
    check(scn, plan, advice)
    comm = [a for a in advice if a.zone == "communication"]
    assert comm and all(a.neighbour.step_s < ev.time.step_s for a in comm)  # type: ignore[union-attr]
    assert all(a.neighbour.status == "ok" for a in comm)
    assert any("micro_batch_size 1 -> 2" in a.change or "zero_stage 3 -> 2" in a.change for a in comm)


def test_tensor_parallel_across_nodes_is_moved_inside() -> None:
    mha_8b = model_preset("llama3-8b").model_copy(update={"num_kv_heads": 32})  # the playbook's 8B: MHA
    scn = Scenario(model=mha_8b, cluster=cluster_preset("h100-sxm-80g", 32),
                   training={"seq_len": 4096, "global_batch_size": 64, "stack": "nanotron"})
    plan = Plan(dp=2, tp=16, zero_stage=1, sequence_parallel=True, micro_batch_size=1)
    ev = evaluate(scn, plan)
    assert ev.zones is not None and ev.zones.communication.level != "ok"
    advice = advise(scn, plan, ev)
    check(scn, plan, advice)
    assert any(a.plan.tp == 8 for a in advice if a.zone == "communication")


def test_bubbles_get_more_micro_batches_or_interleaving() -> None:
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 16),
                   training={"seq_len": 4096, "global_batch_size": 32})
    plan = Plan(dp=2, pp=8, micro_batch_size=2, zero_stage=3)  # zero 1 (DDP + autocast) does not fit; m = pp = 8
    ev = evaluate(scn, plan)
    assert ev.zones is not None and ev.zones.bubbles.level == "bad"
    bubbles = [a for a in advise(scn, plan, ev) if a.zone == "bubbles"]
    check(scn, plan, bubbles)
    assert bubbles
    assert all(a.neighbour.bubble_fraction < ev.zones.bubbles.value for a in bubbles)
    kinds = {k for a in bubbles for k in ("micro_batch_size", "pp_schedule", "pp ") if k in a.change + " "}
    assert kinds & {"micro_batch_size", "pp_schedule"}


def test_checkpoint_risk_gets_async_and_daly_interval() -> None:
    scn = Scenario(model=model_preset("llama3-405b"), cluster=cluster_preset("h100-sxm-80g", 1024),
                   training={"seq_len": 8192, "global_batch_size": 1024, "stack": "megatron",
                             "checkpoint": {"mode": "blocking", "interval_minutes": 15}})
    plan = Plan(dp=8, tp=8, pp=16, zero_stage=1, sequence_parallel=True, activation_checkpointing="full",
                pp_schedule="interleaved", virtual_stages=2)
    ev = evaluate(scn, plan)
    assert ev.zones is not None and ev.zones.checkpoint.level != "ok"
    ck = [a for a in advise(scn, plan, ev) if a.zone == "checkpoint"]
    check(scn, plan, ck)
    assert any(a.checkpoint_policy is not None and a.checkpoint_policy.mode == "async" for a in ck)
    assert all(a.plan == plan for a in ck)
    assert all(a.neighbour.goodput_loss < ev.zones.checkpoint.value for a in ck)
    assert "checkpoint.mode blocking -> async" in [a.change for a in ck]


def test_infeasible_plan_gets_no_advice() -> None:
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8))
    assert advise(scn, Plan(dp=3)) == []


# ---- stratagem explain ---------------------------------------------------------------------------------------
runner = CliRunner()


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_explain_examples(path: Path) -> None:
    result = runner.invoke(app, ["explain", str(path)])
    assert result.exit_code == 0, result.output
    for word in ("Memory per GPU", "Step time", "Zones", "bottleneck:", "tokens/s", "Speed factors", "kernels",
                 "training.kernels", "clock", "TP comm exposed / hidden", "of the dense bf16 peak", "groups:"):
        assert word in result.output
    data = json.loads(runner.invoke(app, ["explain", str(path), "--json"]).stdout)
    # the JSON is the library's evaluation and advice of the example's plan, field for field
    scn = load_scenario(path)
    cal, _ = resolve_calibration(scn)  # cluster.calibration when the scenario names one, as explain does
    ev = evaluate(scn, None, cal)  # no --plan: the scenario's plan (or pure data parallelism), as explain does
    # explain adds where its calibration came from (provenance); the rest is the library's evaluation
    provenance = data["evaluation"].pop("provenance")
    assert provenance["calibration"] == data["calibration"]
    expected = json.loads(ev.model_dump_json())
    expected.pop("provenance")
    assert data["evaluation"] == expected
    assert data["advice"] == [json.loads(a.model_dump_json()) for a in advise(scn, ev.plan, ev, cal)]


def test_explain_bad_plan_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-c", "from stratagem.cli import main; main()", "explain",
                           str(EXAMPLES[0]), "--plan", "tp=3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "tp (3)" in proc.stderr


def test_explain_names_the_missing_stack_capability(tmp_path: Path) -> None:
    path = tmp_path / "ds.yaml"
    path.write_text("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: 1}\n"
                    "training: {stack: deepspeed, global_batch_size: 64}\n")
    proc = subprocess.run([sys.executable, "-c", "from stratagem.cli import main; main()", "explain", str(path),
                           "--plan", "dp=4,pp=2,zero=2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "deepspeed: ZeRO stage 2 with pipeline parallelism is not supported" in proc.stderr
    assert "deepspeed/runtime/pipe/engine.py" in proc.stderr and "use zero_stage <= 1" in proc.stderr


def test_fp32_gradients_alone_point_to_grad_dtype() -> None:
    # Megatron's fp32 main grads (--accumulate-allreduce-grads-in-fp32) are the only reason this plan does not fit:
    # the advice names training.grad_dtype bf16 first (it fits, and frees the most)
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 64),
                   training={"seq_len": 4096, "global_batch_size": 64, "stack": "megatron"})
    plan = Plan(dp=8, tp=4, pp=2, zero_stage=1, sequence_parallel=True, activation_checkpointing="selective")
    ev = evaluate(scn, plan)
    assert ev.status == "oom"
    advice = advise(scn, plan, ev)
    assert advice[0].change == "training.grad_dtype fp32 -> bf16" and advice[0].training == {"grad_dtype": "bf16"}
    assert advice[0].neighbour.status == "ok" and advice[0].plan == plan
    bf16 = scn.model_copy(update={"training": scn.training.model_copy(update={"grad_dtype": "bf16"})})
    assert not any(a.training for a in advise(bf16, plan))  # already bf16: not offered again
