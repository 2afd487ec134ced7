"""`stratagem.launch.harness.support.unsupported`: the harness's refusals, decided without torch, agree with its checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.launch.harness.support import refusals, unsupported
from stratagem.spaces import Scenario, load_scenario, parse_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> Scenario:
    return load_scenario(ROOT / "examples" / "tiny-cpu.yaml")


def test_importing_unsupported_imports_no_torch() -> None:
    code = ("import sys; from stratagem.launch.harness.run import unsupported; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Plans the harness stops on and the field its line names (the same line the harness raises).
REFUSED = [
    ("pp=2,cp=2,schedule=zero_bubble", "plan.cp"),
    ("pp=2,dp=2,schedule=zero_bubble,ac=op", "plan.activation_checkpointing"),
    ("dp=2,dp_replicate=2,cp=2", "plan.cp"),
    ("pp=2,dp=2,mbs=4,schedule=1f1b", "plan.micro_batch_size"),
    ("dp=4,precision=fp8", "plan.precision"),
    ("dp=2,zero=1,offload=cpu", "plan.optimizer_offload"),
]


@pytest.mark.parametrize("text,field", REFUSED)
def test_unsupported_names_the_field_the_harness_stops_on(tiny: Scenario, text: str, field: str) -> None:
    import torch

    from stratagem.launch.harness.train import build_job

    plan = parse_plan(text if "precision" in text else f"{text},precision=fp32")
    reason = unsupported(tiny, plan)
    assert reason is not None and reason.startswith(field), reason
    with pytest.raises(StratagemError) as err:  # the harness stops with the same line (before any collective)
        build_job(tiny, plan, torch.device("cpu"), seed=0)
    assert str(err.value) == reason


@pytest.mark.parametrize("text", ["dp=4", "dp=2,tp=2,zero=3,sp=true", "pp=2,dp=2,schedule=1f1b", "dp=2,cp=2",
                                  "pp=2,cp=2", "cp=2,tp=2,sp=true"])
def test_runnable_plans_have_no_reason(tiny: Scenario, text: str) -> None:
    assert unsupported(tiny, parse_plan(f"{text},precision=fp32")) is None


# The tiny MoE model: TP, etp = tp and cp run; etp must be 1 or tp, ZeRO-1 cannot hold the sharded experts.
MOE_REFUSED = [
    ("dp=2,tp=2,etp=4", "plan.etp"),
    ("dp=2,tp=2,zero=1,sp=true", "plan.tp"),
    # Megatron's module recompute: the torch stack record has none (one rule with the space's validity rules)
    ("dp=2,ep=2,ac=selective,recompute_modules=moe_act", "plan.recompute_modules"),
]


@pytest.mark.parametrize("text,field", MOE_REFUSED)
def test_moe_refusals_name_the_field_the_harness_stops_on(text: str, field: str) -> None:
    import torch

    from stratagem.launch.harness.train import build_job

    moe = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    plan = parse_plan(f"{text},precision=fp32")
    reason = unsupported(moe, plan)
    assert reason is not None and reason.startswith(field), reason
    with pytest.raises(StratagemError) as err:
        build_job(moe, plan, torch.device("cpu"), seed=0)
    assert str(err.value) == reason


def test_moe_token_split_needs_tp_to_divide_the_tokens() -> None:
    import torch

    from stratagem.launch.harness.train import build_job

    moe = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    odd = moe.model_copy(update={"training": moe.training.model_copy(update={"seq_len": 31})})
    for text in ("dp=2,tp=2,ep=2,sp=true", "dp=2,tp=2,ep=2,etp=2,sp=true,zero=3"):
        assert unsupported(moe, parse_plan(f"{text},precision=fp32")) is None
    plan = parse_plan("dp=2,tp=2,ep=2,precision=fp32")
    reason = unsupported(odd, plan)
    assert reason is not None and reason.startswith("plan.micro_batch_size") and "etp=tp" in reason, reason
    assert unsupported(odd, parse_plan("dp=2,tp=2,ep=2,etp=2,precision=fp32")) is None  # no split with etp = tp
    with pytest.raises(StratagemError) as err:
        build_job(odd, plan, torch.device("cpu"), seed=0)
    assert str(err.value) == reason


def test_model_and_optimizer_refusals(tiny: Scenario) -> None:
    gelu = tiny.model_copy(update={"model": tiny.model.model_copy(update={"mlp": "gelu"})})
    assert (unsupported(gelu, parse_plan("dp=4")) or "").startswith("model.mlp/norm")
    adam8 = tiny.model_copy(update={"training": tiny.training.model_copy(update={"optimizer": "adamw8bit"})})
    assert (unsupported(adam8, parse_plan("dp=4")) or "").startswith("training.optimizer")
    assert len(refusals(adam8, parse_plan("pp=2,cp=2,schedule=zero_bubble"))) == 2


def test_fp8_depends_on_the_device(tiny: Scenario) -> None:
    plan = parse_plan("dp=4,precision=fp8")
    assert unsupported(tiny, plan, device_type="cpu") is not None
    assert unsupported(tiny, plan, device_type="cuda") is None


# ---- issue 24 item 6: one rule for what runs ---------------------------------------------------------------------
def test_the_torch_space_never_proposes_a_schedule_its_harness_refuses() -> None:
    """The harness's schedule refusals and the space's enumeration read the same stack-record data
    (spaces/stacks.py ScheduleExclusion): every plan the torch space proposes passes the harness's schedule check,
    and the refused combination is a validity-rule violation too."""
    from stratagem.spaces import (
        SearchConfig,
        SearchSpace,
        TrainingSpec,
        cluster_preset,
        model_preset,
        violations,
    )
    from stratagem.spaces.stacks import stack_record

    rec = stack_record("torch")
    harness_lines = [ex.reason for ex in rec.schedule_exclusions if ex.refused_by == "harness"]
    assert harness_lines  # cp with zero_bubble
    for model, gpus in (("llama3-8b", 16), ("tiny-4l", 8)):
        scn = Scenario(model=model_preset(model), cluster=cluster_preset("h100-sxm-80g", gpus),
                       training=TrainingSpec(seq_len=4096, global_batch_size=32, stack="torch"),
                       search=SearchConfig(cp=[1, 2], pp=[1, 2, 4], activation_checkpointing=["full"]))
        cols = SearchSpace(scn).enumerate()
        plans = [cols.plan(i) for i in range(len(cols))]
        assert any(p.pp > 1 and p.cp > 1 for p in plans) and any(p.pp_schedule == "zero_bubble" for p in plans)
        for p in plans:
            assert not any(line in r for r in refusals(scn, p, "cuda") for line in harness_lines), p.short()
    scn = Scenario(model=model_preset("tiny-4l"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training=TrainingSpec(seq_len=4096, global_batch_size=32, stack="torch"))
    refused = parse_plan("pp=2,cp=2,dp=2,schedule=zero_bubble")
    assert any("zero_bubble" in v for v in violations(scn, refused))
    assert (unsupported(scn, refused) or "").startswith("plan.cp (2)")
