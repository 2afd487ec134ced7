"""One plan per job: canonical plans (spaces/canonical.py), their keys and labels, and the search space's
enumeration of distinct jobs."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratagem.evaluators import evaluate_many
from stratagem.launch.export.bundle import layout
from stratagem.launch.export.torchtitan import export_torchtitan
from stratagem.search.records import plan_key
from stratagem.spaces import (
    IntRange,
    Plan,
    Scenario,
    SearchConfig,
    SearchSpace,
    cluster_preset,
    load_scenario,
    model_preset,
    parse_plan,
    resolve_plan,
    violations,
)
from stratagem.spaces.canonical import canonical_plan, job_description
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.pipeline_split import chunk_layers
from stratagem.spaces.plan import PIPELINE_SPLITS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEMO_SPLITS = ["1f1b", "1f1b emb+loss", "1f1b split-/2", "1f1b split2/-", "1f1b split2/2"]


def test_the_five_demo_splits_are_one_plan() -> None:
    # 4 layers, pp = 2: every one of these puts 2 layers on each stage (chunk_layers -> (2, 2))
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")
    plans = [parse_plan(f"dp2 pp2 z2 mb2 bf16 {split}") for split in DEMO_SPLITS]
    assert len(set(plans)) == 5
    assert {chunk_layers(4, 2, 1, p.first_stage_layers, p.last_stage_layers, p.pp_split) for p in plans} == {(2, 2)}
    assert {plan_key(p, s) for p in plans} == {"dp=2,pp=2,zero_stage=2,micro_batch_size=2"}
    assert {canonical_plan(s, p).short() for p in plans} == {"dp2 pp2 z2 mb2 bf16 1f1b"}
    assert len({job_description(s, p) for p in plans}) == 1
    # the space holds the job once
    pc = SearchSpace(s).enumerate()
    same = [i for i in range(len(pc)) if job_description(s, pc.plan(i)) == job_description(s, plans[0])]
    assert len(same) == 1 and pc.plan(same[0]) == canonical_plan(s, plans[0])


def test_gpipe_and_1f1b_with_one_micro_batch_are_one_plan() -> None:
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")  # global batch 16
    one = parse_plan("dp2 pp2 z0 mb8 bf16 1f1b")  # 16 / (2 * 8) = 1 micro-batch: forward, then backward
    assert canonical_plan(s, one) == one.model_copy(update={"pp_schedule": "gpipe"})
    two = parse_plan("dp2 pp2 z0 mb4 bf16 1f1b")  # 2 micro-batches: the schedules differ
    assert canonical_plan(s, two) == two


def test_zero3_with_pp_is_zero2_where_the_stack_keeps_params_gathered() -> None:
    # torchtitan apply_fsdp: reshard_after_forward = not pp_enabled; the harness builds fully_shard(
    # reshard_after_forward=False) for both (StackRecord.reshard_after_forward_with_pp False on torch)
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")
    z2, z3 = parse_plan("dp2 pp2 z2 mb2 bf16 1f1b"), parse_plan("dp2 pp2 z3 mb2 bf16 1f1b")
    assert s.training.stack == "torch" and job_description(s, z2) == job_description(s, z3)
    assert canonical_plan(s, z3) == z2 and plan_key(z3, s) == plan_key(z2) == "dp=2,pp=2,zero_stage=2,micro_batch_size=2"
    assert resolve_plan(s, canonical_plan(s, z3).short()) == z2
    assert _torchtitan_job(s, z2) == _torchtitan_job(s, z3)  # the exporter writes one setting for the one job
    assert '"fsdp_reshard_after_forward": "never"' in _torchtitan_job(s, z3)
    pc = SearchSpace(s).enumerate()
    assert not [i for i in range(len(pc)) if pc.plan(i).pp > 1 and pc.plan(i).zero_stage == 3]
    # without pp, or on a stack that reshards with pp (megatron/deepspeed/nanotron), zero 3 is its own job
    assert canonical_plan(s, parse_plan("dp4 z3 mb2 bf16")).zero_stage == 3
    for stack in ("megatron", "deepspeed", "nanotron"):
        other = s.model_copy(update={"training": s.training.model_copy(update={"stack": stack})})
        assert canonical_plan(other, z3).zero_stage == 3


def test_recompute_layers_covering_every_layer_is_full_recompute() -> None:
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")
    plan = parse_plan("dp2 pp2 z0 mb2 bf16 full-ac2L 1f1b")  # 2 layers per chunk: all of them
    assert canonical_plan(s, plan).recompute_layers == 0
    assert canonical_plan(s, parse_plan("dp2 pp2 z0 mb2 bf16 full-ac1L 1f1b")).recompute_layers == 1
    assert canonical_plan(s, parse_plan("dp4 z1 mb2 bf16 full-ac3L")).recompute_layers == 3  # 4 layers, one stage


def test_every_label_of_the_examples_parses_back_with_the_cli_parser() -> None:
    for name, limit in (("demo-cpu", None), ("tiny-moe-cpu", None), ("llama3-70b-64xh100", 3000)):
        s = load_scenario(EXAMPLES / f"{name}.yaml")
        space = SearchSpace(s)
        pc = space.decode(space.sample_numbers(limit or space.count(), seed=2))
        for i in range(len(pc)):
            plan = pc.plan(i)
            assert resolve_plan(s, plan.short()) == plan, plan.short()  # the CLI's --plan
            assert parse_plan(plan_key(plan)) == plan
            assert plan_key(plan) == plan_key(plan, s)  # enumerated plans are canonical already


# ---- the property: random scenarios, no two enumerated plans build the same job -------------------------------------
STACKS = ["torch", "megatron", "deepspeed", "nanotron", "automodel"]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A small scenario (2-13 layers, 1-8 GPUs, any stack) with every split open, so the space is small but holds
    every pipeline split, uneven stage count and schedule the stack has."""
    model = model_preset(draw(st.sampled_from(["tiny-4l", "tiny-moe"])))
    model = model.model_copy(update={"num_layers": draw(st.integers(2, 13))})
    gpus = draw(st.sampled_from([1, 2, 4, 8]))
    stack = draw(st.sampled_from(STACKS))
    # torch: ZeRO-1, and ZeRO-0 beside other parallelism, are not in its space (torchtitan has neither exactly:
    # spaces/exclusions.py); its FSDP without reshard (zero 2) and with it (zero 3: kept gathered with pp) stand in
    search = SearchConfig(precision="bf16", activation_checkpointing=["none", "full"],
                          zero_stage=[0, 2, 3] if stack == "torch" else [0, 1, 3],
                          first_stage_layers=IntRange(), last_stage_layers=IntRange(), max_stage_imbalance=100.0,
                          virtual_stages=IntRange(min=1, max=3), cp=1)
    return Scenario(model=model, cluster=cluster_preset("h100-sxm-80g", gpus, gpus),
                    training={"seq_len": 128, "global_batch_size": draw(st.sampled_from([4, 8, 16])),
                              "stack": stack},
                    search=search)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_no_two_enumerated_plans_build_the_same_job(s: Scenario) -> None:
    space = SearchSpace(s)
    pc = space.enumerate()
    plans = [pc.plan(i) for i in range(len(pc))]
    jobs = [job_description(s, p) for p in plans]
    assert len(set(jobs)) == len(plans) == space.count()
    for p in plans:
        assert canonical_plan(s, p) == p and violations(s, p) == []
    # an oracle independent of job_description: the model reads every field that changes the job, so two
    # enumerated plans with every figure equal (bit for bit) name one job twice (e.g. torch's zero 2 and 3 with pp)
    if plans:
        figures = evaluate_many(s, plans)
        rows = np.column_stack([np.asarray(getattr(figures, f.name), dtype=np.float64).reshape(len(plans), -1)
                                for f in fields(figures)])
        twins: dict[bytes, Plan] = {}
        for p, row in zip(plans, rows, strict=True):
            other = twins.setdefault(np.nan_to_num(row, nan=-1.0).tobytes(), p)
            assert other is p or _known_tie(other, p), f"{other.short()} and {p.short()}: every figure equal"
    if s.training.stack == "torch":  # a second oracle: the torchtitan job each plan exports to, as torchtitan reads it
        seen: dict[str, Plan] = {}
        for p in plans:
            other = seen.setdefault(_torchtitan_job(s, p), p)
            assert other is p, f"{other.short()} and {p.short()}: one torchtitan job"


def _torchtitan_job(s: Scenario, plan: Plan) -> str:
    """The torchtitan config `plan` exports to, without comments or the free-text description, with
    fsdp_reshard_after_forward resolved as torchtitan v0.2.2 resolves it (torchtitan/models/llama3/infra/
    parallelize.py apply_fsdp: "default" -> reshard_after_forward = not pp_enabled)."""
    doc = tomllib.loads(export_torchtitan(layout(s, plan)).files["torchtitan.toml"])
    del doc["job"]["description"]
    par = doc.get("parallelism", {})
    policy = par.get("fsdp_reshard_after_forward", "default")
    if policy == "default":
        policy = "never" if par.get("pipeline_parallel_degree", 1) > 1 else "always"
    par["fsdp_reshard_after_forward"] = policy
    return json.dumps(doc, sort_keys=True)


def _known_tie(a: Plan, b: Plan) -> bool:
    """Two distinct jobs the model may give equal figures: they differ only in how the pipeline is laid out
    (schedule, chunks, split). The figures are maxima over stages, and two layouts can share their heaviest
    stage: e.g. gpipe and 1f1b with as many micro-batches as stages run the same order on the first stage (1F1B's
    warm-up is pp - 1 forwards, then one more: torch/distributed/pipelining/schedules.py Schedule1F1B) and
    differ on the later ones. Any other tie (sharding, mesh, recompute, micro-batch, dtype) is one job twice."""
    layout = {"pp_schedule", "virtual_stages", "pp_split", "first_stage_layers", "last_stage_layers"}
    return {k for k in Plan.model_fields if getattr(a, k) != getattr(b, k)} <= layout


def _variants(s: Scenario, plan: Plan) -> list[Plan]:
    """Other valid plans the stack runs that build the same job as `plan`: every split encoding, the other of
    gpipe/1f1b, recompute_layers past the largest chunk, pipeline fields without a pipeline, ZeRO-3 for ZeRO-2
    where the stack keeps parameters gathered under pp."""
    layers, out = s.model.num_layers, []
    if plan.pp == 1:
        out += [plan.model_copy(update={"pp_schedule": x}) for x in ("gpipe", "zero_bubble")]
        out.append(plan.model_copy(update={"pp_split": "embedding_loss"}))
    if plan.pp > 1:
        for split, first, last in itertools.product(PIPELINE_SPLITS, range(layers + 1), range(layers + 1)):
            out.append(plan.model_copy(update={"pp_split": split, "first_stage_layers": first,
                                               "last_stage_layers": last}))
        if plan.pp_schedule in ("gpipe", "1f1b"):
            out.append(plan.model_copy(update={"pp_schedule": "1f1b" if plan.pp_schedule == "gpipe" else "gpipe"}))
    if plan.activation_checkpointing != "none":
        out.append(plan.model_copy(update={"recompute_layers": layers}))
    if plan.zero_stage == 2:  # torch with pp: FSDP2 kept gathered either way (the figures must agree too)
        out.append(plan.model_copy(update={"zero_stage": 3}))
    job = job_description(s, plan)
    return [v for v in out if v != plan and job_description(s, v) == job and violations(s, v) == []]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, 10**6))
def test_plans_of_one_job_have_one_canonical_plan_and_the_same_figures(s: Scenario, seed: int) -> None:
    space = SearchSpace(s)
    pc = space.decode(space.sample_numbers(min(space.count(), 40), seed=seed))
    groups: list[list[Plan]] = []
    for i in range(len(pc)):
        plan = pc.plan(i)
        variants = _variants(s, plan)
        if not variants:
            continue
        assert {canonical_plan(s, v) for v in variants} == {plan}
        assert {plan_key(v, s) for v in variants} == {plan_key(plan)}
        groups.append([plan, *variants])
    if not groups:
        return
    # the model gives one job one set of figures: nothing it reads differs (one batch, then group by group)
    figures = evaluate_many(s, [p for g in groups for p in g])
    start = 0
    for g in groups:
        for f in fields(figures):
            column = np.asarray(getattr(figures, f.name))[start:start + len(g)]
            assert np.allclose(column, column[0], equal_nan=True), (f.name, g[0].short(), column)
        start += len(g)


def test_params_store_the_canonical_plan() -> None:
    # a user's plan that names an enumerated job (a candidates file, --plan) is stored as that job's plan
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")
    space = SearchSpace(s)
    for split in DEMO_SPLITS:
        params, dists = space.params(parse_plan(f"dp2 pp2 z2 mb2 bf16 {split}"))
        assert Plan(**params) == parse_plan("dp2 pp2 z2 mb2 bf16 1f1b")
        assert all(dists[k].to_internal_repr(v) is not None for k, v in params.items())


def test_canonical_columns_keep_one_row_per_job() -> None:
    s = load_scenario(EXAMPLES / "demo-cpu.yaml")
    plans = [parse_plan(f"dp2 pp2 z1 mb2 bf16 {split}") for split in DEMO_SPLITS] + [parse_plan("dp4 z1 mb2 bf16")]
    out = SearchSpace(s).canonical_columns(PlanColumns.from_plans(plans))
    assert [out.plan(i) for i in range(len(out))] == [parse_plan("dp2 pp2 z1 mb2 bf16 1f1b"),
                                                      parse_plan("dp4 z1 mb2 bf16")]
