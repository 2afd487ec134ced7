"""Stack records: every capability cites its engine code; plans each engine refuses are refused here with the
engine's reason; plans each engine runs are valid; the search space holds only plans the stack can run; the
evaluators branch on records, never on stack names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.spaces import (
    ClusterSpec,
    Plan,
    Scenario,
    SearchConfig,
    SearchSpace,
    gpu_preset,
    scenario_from_dict,
    violations,
)
from stratagem.spaces.stacks import CAPABILITY_FIELDS, STACKS, stack_record
from stratagem.spaces.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]


def scn(stack: str, gpus: int = 8, model: str = "llama3-8b", gbs: int = 64, **training: object) -> Scenario:
    return Scenario(model=model, cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=1,
                                                     gpus_per_node=gpus),
                    training={"seq_len": 4096, "global_batch_size": gbs, "stack": stack, **training})


@pytest.mark.parametrize("name", list(STACKS))
def test_every_capability_cites_its_engine_code(name: str) -> None:
    rec = STACKS[name]
    for field in (*CAPABILITY_FIELDS, "kernel_efficiency", "tp_comm_overlap_default"):
        assert rec.cite(field), (name, field)


# (stack, plan, fragment of the refusal): plans each engine refuses, with the engine code that refuses them.
REFUSED = [
    # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__: assert self.zero_optimization_stage() < 2
    ("deepspeed", Plan(dp=4, pp=2, zero_stage=2), "ZeRO stage 2 with pipeline parallelism"),
    ("deepspeed", Plan(dp=4, pp=2, zero_stage=3), "ZeRO stage 3 with pipeline parallelism"),
    # deepspeed/runtime/pipe/schedule.py: TrainSchedule (1F1B) is the only training schedule
    ("deepspeed", Plan(dp=4, pp=2, pp_schedule="zero_bubble"), "pp_schedule zero_bubble"),
    ("deepspeed", Plan(dp=4, tp=2, sequence_parallel=True), "sequence_parallel"),
    # megatron/core/pipeline_parallel/schedules.py get_forward_backward_func: 1F1B / interleaved
    ("megatron", Plan(dp=4, pp=2, pp_schedule="gpipe"), "pp_schedule gpipe"),
    ("megatron", Plan(dp=8, zero_stage=2), "ZeRO stage 2"),
    ("megatron", Plan(dp=4, pp=2, zero_stage=3), "ZeRO stage 3 with pipeline parallelism"),
    # nanotron: ZeRO-1 only, no interleaved schedule, no CP
    ("nanotron", Plan(dp=8, zero_stage=2), "ZeRO stage 2"),
    ("nanotron", Plan(dp=2, pp=4, pp_schedule="interleaved", virtual_stages=2), "pp_schedule interleaved"),
    ("nanotron", Plan(dp=4, cp=2), "context parallelism"),
    # NeMo Automodel 0.7.0: FSDP2 always shards (mesh_utils.py _create_fsdp2_device_mesh); experts whole on each
    # ep rank (_create_moe_mesh); torch pipelining's 1F1B (Schedule1F1B) needs pp micro-batches per step
    ("automodel", Plan(dp=8, zero_stage=1), "ZeRO stage 1"),
    ("automodel", Plan(dp=8, zero_stage=3, optimizer_offload="cpu"), "optimizer_offload=cpu"),
    ("automodel", Plan(dp=2, pp=4, zero_stage=3, micro_batch_size=16), "pp_schedule 1f1b with 2 micro-batch"),
    ("automodel", Plan(dp=4, pp=2, zero_stage=3, pp_schedule="zero_bubble"), "pp_schedule zero_bubble"),
    ("automodel", Plan(dp=4, tp=2, zero_stage=0), "zero_stage 0 over dp (4) with tp (2)"),  # DDPConfig: dp only
    ("automodel", Plan(dp=4, cp=2, dp_replicate=4, zero_stage=3), "dp_replicate (4) equal to dp (4)"),
]


@pytest.mark.parametrize("stack,plan,fragment", REFUSED)
def test_plans_the_engine_refuses_are_refused_with_its_reason(stack: str, plan: Plan, fragment: str) -> None:
    msgs = violations(scn(stack), plan)
    hit = [m for m in msgs if m.startswith(f"{stack}: ") and fragment in m]
    assert hit, msgs
    assert "not supported (" in hit[0] and "; " in hit[0]  # the engine code and the fix


# Plans each engine runs (its shipped examples / recipes).
RUN = [
    ("deepspeed", Plan(dp=4, pp=2, zero_stage=1)),  # Megatron-DeepSpeed recipes: ZeRO-1 + PP
    ("deepspeed", Plan(dp=8, zero_stage=3, optimizer_offload="cpu")),  # ZeRO-Infinity/Offload
    ("megatron", Plan(dp=2, tp=2, pp=2, zero_stage=1, sequence_parallel=True, pp_schedule="interleaved",
                      virtual_stages=2)),
    ("torch", Plan(dp=2, tp=2, pp=2, zero_stage=3, sequence_parallel=True)),  # torchtitan FSDP + TP + PP
    ("torch", Plan(dp=4, pp=2, zero_stage=3, pp_schedule="zero_bubble")),
    ("nanotron", Plan(dp=2, tp=2, pp=2, zero_stage=1, sequence_parallel=True)),
    # NeMo Automodel's published layouts (docs/performance-summary.mdx: FSDP + EP; PP with interleaved 1F1B)
    ("automodel", Plan(dp=8, zero_stage=3, activation_checkpointing="full")),
    ("automodel", Plan(dp=4, pp=2, zero_stage=3, pp_schedule="interleaved", virtual_stages=2, dp_replicate=2)),
    ("automodel", Plan(dp=4, cp=2, zero_stage=3, activation_checkpointing="op")),
    ("automodel", Plan(dp=8, zero_stage=0)),  # its DDP strategy
    ("automodel", Plan(tp=8, zero_stage=0)),  # FSDP2 over a one-rank shard group: nothing sharded
]


@pytest.mark.parametrize("stack,plan", RUN)
def test_plans_the_engine_runs_are_valid(stack: str, plan: Plan) -> None:
    assert violations(scn(stack), plan) == []


@pytest.mark.parametrize("stack", list(STACKS))
def test_search_space_holds_only_plans_the_stack_can_run(stack: str) -> None:
    s = scn(stack, gpus=8, gbs=64, **({"precision": "bf16"}))
    space = SearchSpace(s, SearchConfig(micro_batch_size=[1, 2]))
    rec = stack_record(stack)
    cols = space.enumerate()
    plans = [cols.plan(i) for i in range(0, len(cols), max(1, len(cols) // 400))]
    assert plans
    for p in plans:
        assert violations(s, p) == [], (p, violations(s, p))
    assert set(space.choices("zero_stage")) <= set(rec.zero_stages)


def test_precision_defaults_to_the_training_precision_and_fp8_is_opt_in() -> None:
    assert SearchSpace(scn("torch")).choices("precision") == ("bf16",)
    assert SearchSpace(scn("torch", precision="fp8")).choices("precision") == ("fp8",)
    with pytest.raises(StratagemError, match="deepspeed has no fp8 training recipe"):
        SearchSpace(scn("deepspeed"), SearchConfig(precision=["bf16", "fp8"]))


def test_settings_the_stack_lacks_are_refused_in_one_line() -> None:
    base = {"model": "llama3-8b", "cluster": {"gpu": "h100-sxm-80g"}}
    with pytest.raises(StratagemError, match=r"training.*fp8_recipe \(rowwise\): deepspeed does not ship it"):
        scenario_from_dict({**base, "training": {"stack": "deepspeed", "fp8_recipe": "rowwise"}})
    with pytest.raises(StratagemError, match="async TP needs torch.compile"):
        scenario_from_dict({**base, "training": {"stack": "torch", "tp_comm_overlap": True, "compile": False}})


def test_stack_defaults_follow_the_engines() -> None:
    assert TrainingSpec(stack="megatron").grad_reduce_bytes == 4.0  # grads reduced in fp32 with bf16
    assert TrainingSpec(stack="deepspeed").grad_reduce_bytes == 2.0  # communication_data_type = model dtype
    assert TrainingSpec(stack="torch").grad_reduce_bytes == 4.0  # torchtitan mixed_precision_reduce float32
    assert TrainingSpec(stack="megatron").tp_overlap and not TrainingSpec(stack="torch").tp_overlap
    assert TrainingSpec(stack="megatron", grad_reduce_dtype="bf16").grad_reduce_bytes == 2.0


def test_unknown_stack_names_the_stacks() -> None:
    with pytest.raises(StratagemError, match="use one of torch, megatron, deepspeed, nanotron, automodel"):
        stack_record("jax")


def _stack_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each branch on the stack's name: a comparison with `stack` / `.stack`, a lookup keyed by
    it (`table[stack]`, `{"torch": ..}.get(stack)`), a `match` on it."""
    def is_stack(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "stack") or (isinstance(n, ast.Name) and n.id == "stack")

    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare) and any(is_stack(x) for x in [n.left, *n.comparators]):
            found.append((n.lineno, "compares the stack"))
        elif isinstance(n, ast.Subscript) and is_stack(n.slice):
            found.append((n.lineno, "indexes by the stack"))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
              and is_stack(n.args[0])):
            found.append((n.lineno, "looks the stack up"))
        elif isinstance(n, ast.Match) and is_stack(n.subject):
            found.append((n.lineno, "matches on the stack"))
    return found


def test_the_model_branches_on_records_not_stack_names() -> None:
    """spaces (but the records), evaluators, search, reports and cli read the stack record's fields."""
    parts = ("spaces", "evaluators", "search", "reports", "cli")
    found = [f"{path.relative_to(ROOT)}:{line}: {what}" for part in parts
             for path in sorted((ROOT / "stratagem" / part).rglob("*.py")) if path.name != "stacks.py"
             for line, what in _stack_branches(ast.parse(path.read_text()))]
    assert not found, "\n".join(found)


def test_the_branch_check_sees_a_table_looked_up_by_the_stack() -> None:
    src = ('how = {"torch": "a", "megatron": "b"}.get(scn.training.stack, "c")\n'
           'x = T[tr.stack]\nif stack in ("torch",):\n    pass\n')
    assert [w for _, w in _stack_branches(ast.parse(src))] == ["looks the stack up", "indexes by the stack",
                                                              "compares the stack"]


def test_export_refuses_what_the_stack_cannot_run_with_the_capability_line() -> None:
    from stratagem.launch.export import export_plan
    from stratagem.launch.export.bundle import layout, refuse_unrunnable

    plan = Plan(dp=4, pp=2, zero_stage=2)
    with pytest.raises(StratagemError, match=r"deepspeed: ZeRO stage 2 with pipeline parallelism is not supported "
                                             r"\(deepspeed/runtime/pipe/engine.py"):
        export_plan(scn("deepspeed"), plan, "deepspeed")
    # the same plan in a torch scenario, checked against the deepspeed target's record
    with pytest.raises(StratagemError, match=r"--to deepspeed: deepspeed: ZeRO stage 2 with pipeline"):
        refuse_unrunnable(layout(scn("torch"), plan), "deepspeed")
    refuse_unrunnable(layout(scn("torch"), plan), "torchtitan")  # torchtitan runs it
