import itertools
from pathlib import Path

import numpy as np
import optuna
import pytest

from stratagem.errors import StratagemError
from stratagem.search.records import trial_plan
from stratagem.search.samplers import ProjectingSampler
from stratagem.spaces import (
    RULES,
    IntRange,
    Plan,
    Scenario,
    SearchConfig,
    SearchSpace,
    cluster_preset,
    divisors,
    load_scenario,
    model_preset,
    scenario_from_dict,
    violations,
)
from stratagem.spaces.canonical import canonical_plan
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.pipeline_split import chunk_layers
from stratagem.spaces.plan import PIPELINE_SPLITS
from stratagem.spaces.rules import plan_facts

optuna.logging.set_verbosity(optuna.logging.WARNING)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# Everything open: no default heuristics, so the space must be exactly "every plan the rules allow, once".
OPEN = dict(cp=IntRange(min=1), micro_batch_size=IntRange(min=1), dp_replicate=IntRange(min=1),
            virtual_stages=IntRange(min=1), optimizer_offload=["none", "cpu"], cross_node_tp="allow",
            max_stage_imbalance=100.0, etp=IntRange(min=1), first_stage_layers=IntRange(), last_stage_layers=IntRange())


def tiny(model: str = "tiny-4l", gpus: int = 4, per_node: int = 4, gbs: int = 8, seq: int = 64, **search) -> Scenario:
    return Scenario(model=model_preset(model), cluster=cluster_preset("h100-sxm-80g", gpus, per_node),
                    training={"seq_len": seq, "global_batch_size": gbs},
                    search=SearchConfig(**search) if search else None)


def rows(space: SearchSpace) -> set[Plan]:
    pc = space.enumerate()
    return {pc.plan(i) for i in range(len(pc))}


NOT_SPLIT = tuple(r for r in RULES if r.name != "pp_divides_layers")


def brute_force(s: Scenario, precisions, recomputes) -> set[Plan]:
    """Every Plan over a superset product that the validity rules accept, in canonical form (an axis that
    does not apply keeps its default; `canonical_plan` merges the plans that build one job)."""
    n, m = s.cluster.num_gpus, s.model
    out = set()
    experts = list(itertools.product(divisors(m.moe.num_experts), divisors(n))) if m.moe else [(1, 1)]
    layer_counts = range(0, m.num_layers + 1)
    for dp, tp, pp, cp in itertools.product(divisors(n), repeat=4):
        if dp * tp * pp * cp != n:
            continue
        # pipeline splits the rules accept for this pp (any virtual_stages, schedule 1f1b/interleaved), canonical:
        # with pp = 1 the split fields keep their defaults
        splits = [("layers", 0, 0)] if pp == 1 else [
            x for x in itertools.product(("layers", "embedding_loss"), layer_counts, layer_counts)]
        for (ep, etp), rep, zero, sp, mbs, prec, ac, sched, v, off in itertools.product(
                experts, divisors(dp), (0, 1, 2, 3), (False, True), divisors(s.training.global_batch_size),
                precisions, recomputes, ("gpipe", "1f1b", "interleaved", "zero_bubble"),
                range(1, m.num_layers + 3), ("none", "cpu")):
            if pp == 1 and sched != "1f1b":
                continue  # canonical: the schedule does not apply
            if zero == 0 and (rep > 1 or off == "cpu"):
                continue
            if zero > 0 and dp * cp // rep == 1:
                continue  # sharding over one rank is zero_stage 0
            plan = Plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp_replicate=rep, zero_stage=zero,
                        sequence_parallel=sp, micro_batch_size=mbs, precision=prec, activation_checkpointing=ac,
                        pp_schedule=sched, virtual_stages=v, optimizer_offload=off)
            if violations(s, plan, NOT_SPLIT):
                continue
            for split, first, last in splits:
                full = plan.model_copy(update={"pp_split": split, "first_stage_layers": first,
                                               "last_stage_layers": last})
                if not violations(s, full) and not _excluded(s, full):
                    out.add(canonical_plan(s, full))  # one plan per job (spaces/canonical.py)
    return out


def _excluded(s: Scenario, plan: Plan) -> bool:
    """Whether an exclusion of the stack's record covers the plan (spaces/exclusions.py): the "export" ones are no
    validity rule (the harness runs them), but the space leaves them out with the "harness" ones."""
    rec = s.training.record
    facts = plan_facts(plan, s.model.moe is not None, micro_batches(plan, s.training.global_batch_size),
                       s.training.seq_len)
    return (rec.plan_exclusion(facts) is not None or plan.pp > 1 and rec.schedule_exclusion(
        plan.pp_schedule, plan.cp, plan.virtual_stages, recompute=plan.activation_checkpointing) is not None)


@pytest.mark.parametrize("model,gpus", [("tiny-4l", 4), ("tiny-moe", 4)])
def test_open_space_is_exactly_the_valid_plans(model, gpus) -> None:
    s = tiny(model, gpus, precision=["bf16"], activation_checkpointing=["none", "full"], **OPEN)
    space = SearchSpace(s)
    got = rows(space)
    assert space.count() == len(space.enumerate()) == len(got)  # no duplicates
    assert got == brute_force(s, ["bf16"], ["none", "full"])


@pytest.mark.parametrize("name", ["llama3-8b-8xh100", "llama3-70b-64xh100", "llama3-405b-1024xh100",
                                  "mixtral-8x7b-64xh200"])
def test_example_spaces_are_valid_and_distinct(name) -> None:
    s = load_scenario(EXAMPLES / f"{name}.yaml")
    space = SearchSpace(s)
    pc = space.enumerate()
    assert len(pc) == space.count() > 1000
    cols = np.stack([pc.dp, pc.tp, pc.pp, pc.cp, pc.ep, pc.dp_replicate, pc.zero_stage, pc.sequence_parallel,
                     pc.micro_batch_size, pc.precision, pc.activation_checkpointing, pc.pp_schedule,
                     pc.virtual_stages, pc.optimizer_offload, pc.etp, pc.pp_split, pc.first_stage_layers,
                     pc.last_stage_layers], axis=1)
    assert len(np.unique(cols, axis=0)) == len(pc)
    for i in np.random.default_rng(0).choice(len(pc), 300, replace=False):
        plan = pc.plan(int(i))
        assert violations(s, plan) == [], plan
        assert s.cluster.gpus_per_node % plan.tp == 0  # cross-node TP forbidden by default
        assert plan.tp > 1 or not plan.sequence_parallel
        assert plan.pp > 1 or plan.pp_schedule == "1f1b"
        assert plan.zero_stage == 0 or plan.dp * plan.cp > 1


def test_default_axes() -> None:
    s = load_scenario(EXAMPLES / "llama3-405b-1024xh100.yaml")  # 126 layers, 128 heads, 8 KV heads
    space = SearchSpace(s, SearchConfig())  # the defaults, not the example's search section
    assert space.choices("tp") == (1, 2, 4, 8)
    # 126 layers: pp 16 (8 layers on the fullest rank, 126/16 = 7.9 mean) is an uneven but balanced split.
    assert 16 in space.choices("pp") and 64 in space.choices("pp")
    assert space.choices("cp") == (1, 2, 4, 8)  # seq 8192: >= 1024 tokens per rank
    assert space.choices("precision") == ("bf16",)  # training.precision's default; fp8 only when listed
    assert space.choices("dp_replicate") == (1,) and space.choices("optimizer_offload") == ("none",)
    a100 = scenario_from_dict({**s.model_dump(exclude={"cluster", "plan"}),
                               "cluster": {"gpu": "a100-80g", "num_nodes": 128}})
    assert "fp8" not in SearchSpace(a100, SearchConfig()).choices("precision")


def test_balance_limits_default_pipeline_degrees() -> None:
    s = load_scenario(EXAMPLES / "llama3-70b-64xh100.yaml")  # 80 layers
    pps = SearchSpace(s).choices("pp")
    assert 32 in pps  # ceil(80/32) * 32 / 80 = 1.2 <= 1.25: uneven but balanced enough
    assert 64 not in pps  # ceil(80/64) * 64 / 80 = 1.6
    loose = SearchSpace(s, SearchConfig(max_stage_imbalance=2.0)).choices("pp")
    assert 64 in loose


def test_search_section_narrows_and_fixes() -> None:
    s = load_scenario(EXAMPLES / "llama3-70b-64xh100.yaml")
    full = SearchSpace(s).count()
    fixed = SearchSpace(s, SearchConfig(tp=8, precision="bf16", zero_stage=[1, 3],
                                        micro_batch_size=IntRange(max=2)))
    assert fixed.count() < full
    pc = fixed.enumerate()
    assert set(pc.tp) == {8} and set(pc.precision) == {1} and set(pc.zero_stage[pc.pp == 1]) <= {0, 1, 3}
    assert set(pc.zero_stage[pc.pp > 1]) <= {0, 1, 2}  # torch: zero 3 with pp is the job zero 2 builds (canonical.py)
    assert pc.micro_batch_size.max() <= 2
    gpt3 = scenario_from_dict({"model": "gpt3-175b", "cluster": {"gpu": "h100-sxm-80g", "num_nodes": 8},
                               "training": {"seq_len": 2048, "global_batch_size": 512}})  # 96 heads
    assert max(SearchSpace(gpt3).choices("tp")) == 8
    assert 32 in SearchSpace(gpt3, SearchConfig(cross_node_tp="allow")).choices("tp")


@pytest.mark.parametrize("search,field", [
    ({"tp": 3}, "search.tp"),
    ({"tp": 16}, "search.tp"),  # cross-node TP is forbidden by default
    ({"precision": "fp8"}, None),
    ({"ep": 2}, "search.ep"),
    ({"memory_margin_gib": 100}, "search.memory_margin_gib"),
    ({"pp": [3]}, "search"),
    ({"micro_batch_size": []}, "search.micro_batch_size"),
    ({"cp": {"min": 8, "max": 2}}, "search.cp"),
])
def test_bad_search_section_is_one_line(search, field) -> None:
    gpu = "a100-80g" if search.get("precision") == "fp8" else "h100-sxm-80g"
    s = scenario_from_dict({"model": "llama3-70b", "cluster": {"gpu": gpu, "num_nodes": 8},
                            "training": {"seq_len": 8192, "global_batch_size": 256}, "search": search})
    with pytest.raises(StratagemError) as e:
        SearchSpace(s)
    msg = str(e.value)
    assert "\n" not in msg
    assert (field or "search.precision") in msg


def test_partly_impossible_list_is_a_note() -> None:
    s = load_scenario(EXAMPLES / "llama3-70b-64xh100.yaml")  # search.dp_replicate: [1, 2, 4, 8]
    assert SearchSpace(s).notes == []
    one_node = s.model_copy(update={"cluster": s.cluster.model_copy(update={"num_nodes": 1})})
    space = SearchSpace(one_node)  # dp <= 8: a replica group of 8 would shard over one rank
    assert space.count() > 0 and space.choices("dp_replicate") == (1, 2, 4)
    assert len(space.notes) == 1 and "search.dp_replicate (8)" in space.notes[0]


def test_unknown_search_key_is_rejected() -> None:
    with pytest.raises(StratagemError, match="search.tensor"):
        scenario_from_dict({"model": "llama3-8b", "cluster": {"gpu": "h100-sxm-80g"}, "search": {"tensor": 2}})


def test_problem_hash_ignores_the_search_section() -> None:
    a = tiny()
    b = tiny(tp=2)
    assert a.problem_hash() == b.problem_hash()
    assert SearchSpace(a).digest() != SearchSpace(b).digest()


def test_decode_and_sample() -> None:
    space = SearchSpace(load_scenario(EXAMPLES / "mixtral-8x7b-64xh200.yaml"))
    idx = space.sample_numbers(5000, seed=3)
    assert len(np.unique(idx)) == 5000
    sub, full = space.decode(idx), space.enumerate()
    for k in range(0, 5000, 250):
        assert sub.plan(k) == full.plan(int(idx[k]))
    with pytest.raises(IndexError):
        space.decode(np.array([space.count()]))


@pytest.mark.parametrize("sampler", ["random", "nsga2"])
def test_suggest_yields_valid_plans_of_the_space(sampler) -> None:
    s = tiny("tiny-moe", 8, 4, gbs=16, seq=128)
    space = SearchSpace(s)
    members = rows(space)
    base = (optuna.samplers.RandomSampler(seed=1) if sampler == "random"
            else optuna.samplers.NSGAIISampler(seed=1, population_size=20))
    study = optuna.create_study(directions=["maximize", "maximize", "minimize"],
                                sampler=ProjectingSampler(base, space))
    seen = set()
    for _ in range(150):
        t = study.ask()
        plan = space.suggest(t)
        assert plan in members, plan
        assert trial_plan(study._storage.get_trial(t._trial_id)) == plan
        # conditional axes are suggested only where they apply
        assert ("sequence_parallel" in t.params) == (plan.tp > 1)
        assert ("virtual_stages" in t.params) == (plan.pp_schedule == "interleaved" and plan.pp > 1)
        seen.add(plan)
        study.tell(t, [float(plan.dp), float(plan.micro_batch_size), float(plan.pp)])
    assert len(seen) > 30


def test_params_round_trip_through_a_stored_trial() -> None:
    s = load_scenario(EXAMPLES / "llama3-405b-1024xh100.yaml")
    space = SearchSpace(s)
    pc = space.decode(space.sample_numbers(200, seed=1))
    study = optuna.create_study(directions=["maximize", "maximize", "minimize"])
    for i in range(len(pc)):
        params, dists = space.params(pc.plan(i))
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, values=[1, 2, 3]))
    assert [trial_plan(t) for t in study.trials] == [pc.plan(i) for i in range(len(pc))]


# ---- issue 14: expert layouts and pipeline splits in the search --------------------------------------------------
@pytest.mark.parametrize("stack", ["megatron", "torch", "deepspeed", "nanotron"])
def test_moe_search_proposes_only_layouts_the_stack_runs(stack) -> None:
    s = Scenario(model=model_preset("mixtral-8x7b"), cluster=cluster_preset("h100-sxm-80g", 32, 8),
                 training={"seq_len": 4096, "global_batch_size": 64, "stack": stack},
                 search=SearchConfig(precision="bf16", activation_checkpointing=["full"], micro_batch_size=[1]))
    space = SearchSpace(s)
    pc = space.enumerate()
    rec = s.training.record
    assert set(space.choices("etp")) == ({1, 2, 4, 8} if rec.expert_tensor_parallel else {1})
    assert max(space.choices("ep")) == 8
    # an ep x etp layout that spans the tensor-parallel ranks exists where the stack folds experts over tp
    # (Megatron any; torchtitan etp=1 with ep taking tp whole), e.g. tp 4 x dp 2 -> ep 8
    spans = any(pc.tp[i] * pc.dp[i] * pc.cp[i] == pc.ep[i] and pc.tp[i] > 1 and pc.etp[i] == 1 for i in range(len(pc)))
    assert spans == (rec.expert_grid in ("folding", "etp_1_or_tp"))
    for i in np.random.default_rng(1).choice(len(pc), min(len(pc), 400), replace=False):
        plan = pc.plan(int(i))
        assert violations(s, plan) == [], (plan, violations(s, plan))


def test_405b_space_reaches_pp16_vpp8_with_embedding_and_loss() -> None:
    s = Scenario(model=model_preset("llama3-405b"), cluster=cluster_preset("h100-sxm-80g", 1024, 8),
                 training={"seq_len": 8192, "global_batch_size": 1024, "stack": "megatron"},
                 search=SearchConfig(tp=8, pp=16, cp=1, virtual_stages=8, pp_schedule="interleaved",
                                     precision="bf16", activation_checkpointing=["full"], micro_batch_size=[1]))
    space = SearchSpace(s)
    assert space.choices("pp_split") == ("embedding_loss",)
    pc = space.enumerate()
    assert len(pc) > 0 and set(pc.virtual_stages) == {8.0}
    assert violations(s, pc.plan(0)) == []


def test_default_uneven_splits_are_balanced() -> None:
    s = Scenario(model=model_preset("llama3-405b"), cluster=cluster_preset("h100-sxm-80g", 1024, 8),
                 training={"seq_len": 8192, "global_batch_size": 1024, "stack": "megatron"},
                 search=SearchConfig(tp=8, pp=16, cp=1, pp_schedule="1f1b", precision="bf16",
                                     activation_checkpointing=["full"], micro_batch_size=[1]))
    pc = SearchSpace(s).enumerate()
    pairs = {(int(f), int(la)) for f, la in zip(pc.first_stage_layers, pc.last_stage_layers, strict=True)}
    # 126 = 6 + 15 x 8, 8 x 15 + 6; plus the even split
    assert {(0, 0), (6, 0), (0, 6)} <= pairs
    assert all(f <= 8 and la <= 8 for f, la in pairs)
    assert set(pc.pp_split) == {0.0, 1.0}  # 126 + 2 = 128 = 16 x 8: the embedding/loss split too
    # 7 + 14 x 8 + 7 (the Llama 3 recipe's lighter ends) is the embedding/loss split's job: enumerated once, as it
    chunks = {tuple(chunk_layers(126, 16, 1, int(f), int(la), PIPELINE_SPLITS[int(x)]))
              for f, la, x in zip(pc.first_stage_layers, pc.last_stage_layers, pc.pp_split, strict=True)}
    assert (7, *[8] * 14, 7) in chunks and (7, 7) not in pairs
    assert len(chunks) == len({(f, la, x) for f, la, x in zip(pc.first_stage_layers, pc.last_stage_layers,
                                                               pc.pp_split, strict=True)})


def test_suggest_covers_splits_and_expert_layouts() -> None:
    # a 12-layer MoE on the megatron stack: uneven first/last, embedding_loss and ep x etp all suggested, all valid
    m = model_preset("tiny-moe").model_copy(update={"num_layers": 12})
    s = Scenario(model=m, cluster=cluster_preset("h100-sxm-80g", 8, 8),
                 training={"seq_len": 128, "global_batch_size": 16, "stack": "megatron"},
                 search=SearchConfig(precision="bf16", activation_checkpointing=["none"]))
    space = SearchSpace(s)
    members = rows(space)
    study = optuna.create_study(directions=["maximize", "maximize"],
                                sampler=ProjectingSampler(optuna.samplers.RandomSampler(seed=3), space))
    seen: set[tuple] = set()
    for _ in range(200):
        t = study.ask()
        plan = space.suggest(t)
        assert plan in members and violations(s, plan) == [], plan
        assert trial_plan(study._storage.get_trial(t._trial_id)) == plan
        seen.add((plan.pp_split, plan.first_stage_layers > 0 or plan.last_stage_layers > 0, plan.etp > 1))
        study.tell(t, [float(plan.dp), float(plan.pp)])
    assert ("embedding_loss", False, False) in {(a, b, False) for a, b, _ in seen}
    assert any(b for _, b, _ in seen) and any(c for _, _, c in seen)


def test_schedules_the_stack_cannot_honour_are_not_enumerated() -> None:
    # torch: one-chunk zero_bubble (ZB-H1) is an export exclusion (torchtitan ships V / looped zero-bubble schedules
    # only), so the space leaves it out whatever the recompute; zero_bubble with op-level recompute is also refused
    # by the harness (it runs the checkpointed backward twice): a validity rule for an explicit plan, the one-chunk
    # rule is not (the harness runs it as planned). Optuna's suggestions follow the space.
    s = tiny(gbs=16, pp_schedule=["1f1b", "zero_bubble"], activation_checkpointing=["none", "full", "op"],
             precision="bf16")
    space = SearchSpace(s)
    pc = space.enumerate()
    pairs = {(pc.plan(i).pp_schedule, pc.plan(i).activation_checkpointing) for i in range(len(pc)) if pc.pp[i] > 1}
    assert {("1f1b", "none"), ("1f1b", "full"), ("1f1b", "op")} <= pairs
    assert not any(x == "zero_bubble" for x, _ in pairs)
    assert all(violations(s, pc.plan(i)) == [] for i in range(0, len(pc), 7))
    zb = Plan(dp=2, pp=2, zero_stage=3, micro_batch_size=4, pp_schedule="zero_bubble", precision="bf16")
    assert violations(s, zb.model_copy(update={"activation_checkpointing": "full"})) == []
    assert any("zero_bubble with op_recompute" in v
               for v in violations(s, zb.model_copy(update={"activation_checkpointing": "op"})))
    study = optuna.create_study(directions=["maximize"],
                                sampler=ProjectingSampler(optuna.samplers.RandomSampler(seed=5), space))
    for _ in range(150):
        t = study.ask()
        plan = space.suggest(t)
        assert not (plan.pp > 1 and plan.pp_schedule == "zero_bubble")
        assert violations(s, plan) == [], plan
        study.tell(t, [float(plan.dp)])


def test_a_plan_outside_the_space_cannot_be_stored_and_says_which_field() -> None:
    """A study holds the plans of its space (Optuna's distributions are the axis choices): params() of a plan with a
    value no plan of the space has is one line naming the field and the stack's exclusions, not Optuna's
    ValueError (torch: TP without sequence parallelism is left out, spaces/exclusions.py tp_without_sp)."""
    space = SearchSpace(load_scenario(EXAMPLES / "tiny-cpu.yaml"))
    with pytest.raises(StratagemError) as e:
        space.params(Plan(dp=2, tp=2, zero_stage=2))
    line = str(e.value)
    assert "\n" not in line and line.startswith("plan.sequence_parallel (False)") and "tp_without_sp" in line
    assert "outside the scenario's search space" in line
    params, _ = space.params(Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2))
    assert params["sequence_parallel"] is True
