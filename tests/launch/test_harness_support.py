"""`stratagem.launch.harness.support.unsupported`: the harness's refusals, decided without torch, agree with its checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stratagem.errors import StratagemError
from stratagem.launch.harness.support import refusals, unsupported
from stratagem.spaces import Scenario, load_scenario, parse_plan
from stratagem.spaces.groups import micro_batches

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> Scenario:
    return load_scenario(ROOT / "examples" / "tiny-cpu.yaml")


def test_importing_unsupported_imports_no_torch() -> None:
    code = ("import sys; from stratagem.launch.harness.support import unsupported; "
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
        assert any(p.pp > 1 and p.cp > 1 for p in plans)
        # one-chunk zero_bubble (ZB-H1) is an export exclusion (torchtitan ships V / looped zero-bubble schedules
        # only): never proposed, although the harness runs it when given
        assert not any(p.pp > 1 and p.pp_schedule == "zero_bubble" for p in plans)
        for p in plans:
            assert not any(line in r for r in refusals(scn, p, "cuda") for line in harness_lines), p.short()
    scn = Scenario(model=model_preset("tiny-4l"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training=TrainingSpec(seq_len=4096, global_batch_size=32, stack="torch"))
    refused = parse_plan("pp=2,cp=2,dp=2,schedule=zero_bubble")
    assert any("zero_bubble" in v for v in violations(scn, refused))
    assert (unsupported(scn, refused) or "").startswith("plan.cp (2)")


def _torch_scenarios() -> list[tuple[Scenario, int | None]]:
    """(scenario, sample size or None for every plan): the tiny MoE model, Mixtral-8x7B on 64 H200 as the torch
    stack with a reduced search section (every plan), and its full default space (a sample)."""
    from stratagem.spaces import SearchConfig

    moe = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    mix = load_scenario(ROOT / "examples" / "mixtral-8x7b-64xh200.yaml")
    mix = mix.model_copy(update={"training": mix.training.model_copy(update={"stack": "torch"})})
    small = mix.model_copy(update={"search": SearchConfig(precision=["bf16"], pp=[1, 2, 4], cp=[1, 2],
                                                          micro_batch_size=[1, 2, 8], memory_margin_gib=2.0)})
    return [(moe, None), (small, None), (mix, 20_000)]


def test_the_torch_space_proposes_nothing_its_harness_refuses() -> None:
    """Issue 24 item 6: the harness refuses from the torch stack record's ScheduleExclusions and PlanExclusions
    (spaces/stacks.py), which the space's enumeration reads too: `unsupported` (CUDA semantics; the tiny model on
    its own CPUs) finds nothing in any plan the torch space proposes."""
    from stratagem.spaces import SearchSpace

    for scn, sample in _torch_scenarios():
        space = SearchSpace(scn)
        cols = space.decode(space.sample_numbers(sample, seed=0) if sample else np.arange(space.count()))
        assert len(cols) > 80, scn.name
        refused = {}
        for i in range(len(cols)):
            plan = cols.plan(i)
            reason = unsupported(scn, plan)
            if reason is not None:
                refused[plan.short()] = reason
        assert not refused, (scn.name, len(refused), next(iter(refused.items())))


# What the torchtitan export still converts in torch-space plans: nothing (issue 24 item 6). The torch space is what
# torchtitan v0.2.2 expresses exactly: the record's export exclusions (spaces/exclusions.py) leave out the rest.
OPEN_CONVERSIONS: dict[str, tuple[str, ...]] = {}


def test_the_torchtitan_export_converts_nothing_in_a_torch_space_plan() -> None:
    """A sample of every torch space above exported to torchtitan: no `plan.*` field is converted or left out."""
    from stratagem.launch.export import export_plan
    from stratagem.spaces import SearchSpace

    for scn, _ in _torch_scenarios():
        space = SearchSpace(scn)
        cols = space.decode(space.sample_numbers(150, seed=1))
        for i in range(len(cols)):
            plan = cols.plan(i)
            notes = [n for n in export_plan(scn, plan, "torchtitan").notes if n.field.startswith("plan.")]
            assert all(n.why.startswith(OPEN_CONVERSIONS.get(n.field, ("(none)",))) for n in notes), \
                (scn.name, plan.short(), notes)


# Explicit plans each covered by one export exclusion of the torch record (spaces/exclusions.py): the harness runs
# them as planned, the torchtitan exporter converts exactly that field with a note.
EXPORT_ONLY = [
    ("dp=2,tp=2,zero=3", "tp_without_sp", "plan.sequence_parallel"),
    ("dp=2,cp=2", "zero0_with_cp", "plan.zero_stage"),
    ("dp=2,pp=2,schedule=gpipe", "ddp_beside_other_parallelism", "plan.zero_stage"),
    ("dp=4,zero=1", "zero1_optimizer_only", "plan.zero_stage"),
    ("dp=4,zero=3,offload=cpu", "optimizer_offload_cpu", "plan.optimizer_offload"),
    ("dp=4,ac=selective", "selective_recompute", "plan.activation_checkpointing"),
    ("dp=2,pp=2,zero=3,schedule=zero_bubble", "zero_bubble one_chunk", "plan.pp_schedule"),
]


@pytest.mark.parametrize("text,rule,field", [*EXPORT_ONLY, ("dp=2,tp=2,sp=true,zero=2,seq_len=34", "seq_len_divisor", "plan.tp")])
def test_an_export_exclusion_is_run_by_the_harness_and_converted_by_the_exporter(
        tiny: Scenario, text: str, rule: str, field: str) -> None:
    from stratagem.launch.export import export_plan
    from stratagem.spaces import violations
    from stratagem.spaces.rules import plan_facts
    from stratagem.spaces.stacks import stack_record

    if "seq_len=" in text:  # torchtitan: seq_len % (2 * tp * cp) == 0; 34 is not a multiple of 4
        text, seq = text.split(",seq_len=")
        tiny = tiny.model_copy(update={"training": tiny.training.model_copy(update={"seq_len": int(seq)})})
    plan = parse_plan(f"{text},precision=fp32")
    rec = stack_record("torch")
    facts = plan_facts(plan, False, micro_batches(plan, tiny.training.global_batch_size), tiny.training.seq_len)
    found = [ex.name for ex in rec.plan_exclusions if ex.applies(facts)]
    sched = rec.schedule_exclusion(plan.pp_schedule, plan.cp, plan.virtual_stages) if plan.pp > 1 else None
    found += [f"{sched.schedule} {sched.when}"] if sched is not None else []
    assert found == [rule]  # one rule covers it, an export one
    assert unsupported(tiny, plan) is None and violations(tiny, plan) == []  # the harness runs it as planned
    notes = [n.field for n in export_plan(tiny, plan, "torchtitan").notes if n.field.startswith("plan.")]
    assert notes == [field]


def test_the_torch_space_leaves_out_every_export_exclusion(tiny: Scenario) -> None:
    """The space's enumeration reads the export exclusions too: none of the plans above is in the tiny space."""
    from stratagem.spaces import SearchSpace

    space = SearchSpace(tiny)
    cols = space.enumerate()
    members = {cols.plan(i) for i in range(len(cols))}
    for text, _, _ in EXPORT_ONLY:
        assert space.canonical(parse_plan(f"{text},precision=fp32")) not in members, text
