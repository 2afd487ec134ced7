"""The automodel exporter against NeMo Automodel 0.7.0's own config code.

Always: every section and key of the exported YAML is a field of the dataclass Automodel builds from it, every
recipe and `_target_` names a class that exists (golden/automodel_schema.json, extracted from the 0.7.0 wheel by
golden/refresh_tables.py automodel). With the wheel installed (`make test` installs it without its dependencies):
Automodel's own parse_distributed_section, device-mesh builder (FSDP2's on a fake process group at the plan's world size,
DDP's refusals), pipeline stage split and step scheduler read each export back to the plan.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from stratagem.errors import StratagemError
from stratagem.launch.export import export_plan, layout
from stratagem.launch.export.automodel import pipeline_settings
from stratagem.spaces import ClusterSpec, Plan, Scenario, gpu_preset, parse_plan, scenario_from_dict
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.rules import capability_violations, plan_facts
from stratagem.spaces.stacks import stack_record

GOLDEN = Path(__file__).parent / "golden"
SCHEMA: dict[str, Any] = json.loads((GOLDEN / "automodel_schema.json").read_text())
_DATA = yaml.safe_load((GOLDEN / "cases.yaml").read_text())
_SCNS = {k: scenario_from_dict(v, source=k) for k, v in _DATA["scenarios"].items()}


def _runs(scn: Scenario, plan: Plan) -> bool:
    """Whether Automodel runs the plan (FSDP2 ZeRO-3 or DDP alone, no expert TP, no offload, ...)."""
    rec = stack_record("automodel")
    facts = plan_facts(plan, scn.model.moe is not None, micro_batches(plan, scn.training.global_batch_size))
    return not capability_violations(rec, plan) and rec.plan_exclusion(facts, "harness") is None


CASES: dict[str, tuple[Scenario, Plan]] = {  # the shared cases Automodel runs
    n: (_SCNS[c["scenario"]], parse_plan(c["plan"])) for n, c in _DATA["cases"].items()
    if _runs(_SCNS[c["scenario"]], parse_plan(c["plan"]))}


def _am(model: str, nodes: int, gbs: int, **training: Any) -> Scenario:
    return Scenario(model=model, cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=nodes, gpus_per_node=8),
                    training={"seq_len": 4096, "global_batch_size": gbs, "stack": "automodel", **training})


CASES |= {  # Automodel's published layouts (docs/performance-summary.mdx) and the settings it expresses
    "am-deepseek-v3-pp4-vpp8-ep64": (_am("deepseek-v3", 32, 512, optimizer_state_dtype="bf16"), Plan(
        dp=64, pp=4, ep=64, zero_stage=3, pp_schedule="interleaved", virtual_stages=8, activation_checkpointing="full")),
    "am-qwen3-30b-ep8": (_am("qwen3-30b-a3b", 1, 512, optimizer_state_dtype="bf16"), Plan(
        dp=8, ep=8, zero_stage=3, micro_batch_size=4, activation_checkpointing="full")),
    "am-llama70b-hsdp-tp-cp": (_am("llama3-70b", 8, 128), Plan(
        dp=16, tp=2, cp=2, dp_replicate=2, zero_stage=3, sequence_parallel=True, activation_checkpointing="op")),
    "am-mixtral-fp8-gpipe": (_am("mixtral-8x7b", 4, 256, precision="fp8", fp8_recipe="blockwise"), Plan(
        dp=8, pp=4, ep=8, zero_stage=3, pp_schedule="gpipe", precision="fp8", micro_batch_size=2)),
    "am-llama8b-fp32-1f1b": (_am("llama3-8b", 2, 64, precision="fp32"), Plan(
        dp=8, pp=2, zero_stage=3, precision="fp32")),
    "am-llama8b-ddp": (_am("llama3-8b", 1, 64), Plan(dp=8, zero_stage=0, micro_batch_size=2)),
    "am-llama8b-tp8": (_am("llama3-8b", 1, 64), Plan(tp=8, zero_stage=0, sequence_parallel=True)),
}


def _doc(name: str, **kw: Any) -> tuple[Scenario, Plan, dict[str, Any], str]:
    scn, plan = CASES[name]
    text = export_plan(scn, plan, "automodel", **kw).files["automodel.yaml"]
    return scn, plan, yaml.safe_load(text), text


def _keys_are_fields(section: str, value: dict[str, Any]) -> None:
    fields = set(SCHEMA["sections"][section]) | {"_target_"}
    for key, sub in value.items():
        child = f"{section}.{key}"
        if child in SCHEMA["sections"]:
            _keys_are_fields(child, sub)
        else:
            assert key in fields, f"{section}: {key} is not a field of Automodel's {section} config"


_DIST_KEYS = {"strategy", "tp_size", "pp_size", "cp_size", "ep_size", "dp_size", "dp_replicate_size",
              "activation_checkpointing"}  # recipes/_dist_utils.py parse_distributed_section pops these


@pytest.mark.parametrize("name", list(CASES))
def test_every_key_is_a_field_automodel_reads(name: str) -> None:
    _, plan, doc, _ = _doc(name)
    assert doc["recipe"] in SCHEMA["recipes"]
    section = "distributed" if doc["distributed"]["strategy"] == "fsdp2" else "distributed(ddp)"
    _keys_are_fields(section, {k: v for k, v in doc["distributed"].items() if k not in _DIST_KEYS})
    _keys_are_fields("step_scheduler", {k: v for k, v in doc["step_scheduler"].items() if k != "local_batch_size"})
    _keys_are_fields("checkpoint", doc["checkpoint"])
    _keys_are_fields("model.backend", doc["model"]["backend"])
    assert set(doc["benchmark"]) <= set(SCHEMA["benchmark"])
    targets = [doc[s]["_target_"] for s in ("loss_fn", "dataset", "model")]
    targets += [doc["model"]["backend"]["_target_"]] + ([doc["model"]["backend"]["te_fp8"]["_target_"]]
                                                         if plan.precision == "fp8" else [])
    for t in targets:  # the longest module prefix (the loader's own lookup), then a class or function in it
        parts = t.split(".")
        mods = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in SCHEMA["modules"]]
        if parts[0] == "nemo_automodel":
            assert mods and parts[len(mods[0].split("."))] in SCHEMA["modules"][mods[0]], t


@pytest.mark.parametrize("name", list(CASES))
def test_the_export_is_the_plan(name: str) -> None:
    scn, plan, doc, text = _doc(name)
    d, st = doc["distributed"], doc["step_scheduler"]
    assert d["strategy"] == ("ddp" if plan.zero_stage == 0 and plan.dp > 1 else "fsdp2")
    if d["strategy"] == "fsdp2":
        assert (d["tp_size"], d["cp_size"], d["pp_size"], d["ep_size"], d.get("dp_replicate_size", 1)) == (
            plan.tp, plan.cp, plan.pp, plan.ep, plan.dp_replicate)
        assert d["sequence_parallel"] == plan.sequence_parallel
    assert d["activation_checkpointing"] == {"none": False, "full": True, "op": "selective"}[plan.activation_checkpointing]
    # step_scheduler.py: accumulation = global / (local * dp); with PP local = all micro-batches of the step
    assert st["global_batch_size"] == scn.training.global_batch_size
    micro = st["local_batch_size"] // (d["pipeline"]["pp_microbatch_size"] if plan.pp > 1 else st["local_batch_size"])
    assert st["global_batch_size"] // (st["local_batch_size"] * plan.dp) * micro == \
        micro_batches(plan, scn.training.global_batch_size)
    assert doc["model"]["torch_dtype"] == ("float32" if plan.precision == "fp32" else "bfloat16")
    assert ("te_fp8" in doc["model"]["backend"]) == (plan.precision == "fp8")
    opt = doc["optimizer"]["_target_"]  # the optimizer whose states the memory model counts
    if plan.precision != "fp32" and scn.training.optimizer == "adamw":
        assert ("FusedAdam" in opt) == (scn.training.optimizer_state_dtype == "fp32")
    # a throughput check: the benchmarking recipe, no checkpoint, the full run's settings in a comment
    assert doc["recipe"] == "BenchmarkingRecipeForNextTokenPrediction" and doc["checkpoint"] == {"enabled": False}
    assert doc["benchmark"]["warmup_steps"] == 10 and st["max_steps"] == 50
    assert "the full run (TrainFinetuneRecipeForNextTokenPrediction) sets enabled True" in text


def test_the_full_run_trains_and_saves() -> None:
    scn, plan = CASES["am-qwen3-30b-ep8"]
    full = layout(scn, plan).train_steps
    doc = yaml.safe_load(export_plan(scn, plan, "automodel", steps=full).files["automodel.yaml"])
    assert doc["recipe"] == "TrainFinetuneRecipeForNextTokenPrediction" and "benchmark" not in doc
    assert doc["checkpoint"]["enabled"] is True and doc["step_scheduler"]["max_steps"] == full


def test_plans_automodel_cannot_run_are_refused_with_the_capability() -> None:
    scn, _ = CASES["am-qwen3-30b-ep8"]
    torch_scn = scn.model_copy(update={"training": scn.training.model_copy(update={"stack": "torch"})})
    with pytest.raises(StratagemError, match=r"--to automodel: automodel: ZeRO stage 2 is not supported"):
        export_plan(torch_scn, Plan(dp=8, ep=8, zero_stage=2), "automodel")
    with pytest.raises(StratagemError, match=r"--to automodel: automodel: zero_stage 0 over dp \(2\) with tp \(4\)"):
        export_plan(torch_scn, Plan(dp=2, tp=4, zero_stage=0), "automodel")


def test_pipeline_settings_reach_the_planned_chunks() -> None:
    # nemo_automodel/components/distributed/pipelining/functional.py calculate_virtual_stages, by hand:
    # ceil(61 / 2) = 31 stages, rounded up to a multiple of 4 = 32 = 4 x 8
    assert pipeline_settings(61, 4, 8) == {"layers_per_stage": 2, "round_virtual_stages_to_pp_multiple": "up"}
    assert pipeline_settings(32, 4, 2) == {} and pipeline_settings(32, 4, 4) == {"layers_per_stage": 2}


_CHECK = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from nemo_automodel.cli.utils import resolve_recipe_name
    from nemo_automodel.recipes._dist_utils import parse_distributed_section
    from nemo_automodel.components.distributed.mesh_utils import _create_device_meshes
    from nemo_automodel.components.distributed.pipelining.functional import (
        calculate_virtual_stages, generate_hf_model_fqn_per_model_part)
    from nemo_automodel.components.training.step_scheduler import StepSchedulerConfig

    out = {}
    for name, (doc, world, layers) in json.load(sys.stdin).items():
        try:
            resolve_recipe_name(doc["recipe"])
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
            parsed = parse_distributed_section(doc["distributed"])
            mesh, moe = _create_device_meshes(parsed["strategy_config"], parsed["parallelism_sizes"],
                                              world_size=world)
            # DDP builds no mesh: data parallelism over the whole world
            dims = (dict(zip(mesh.mesh_dim_names, mesh.shape)) if mesh is not None else
                    {"pp": 1, "dp_replicate": 1, "dp_shard": world, "cp": 1, "tp": 1})
            st = dict(doc["step_scheduler"])
            lbs = st.pop("local_batch_size")
            dp = dims["dp_replicate"] * dims["dp_shard"]
            sched = StepSchedulerConfig(**st).build(None, dp, lbs)
            chunks = [layers]
            pipe = parsed["pipeline_config"]
            if pipe is not None:
                cls = get_schedule_class(pipe.pp_schedule)
                n, _ = calculate_virtual_stages(layers, pipe.layers_per_stage, dims["pp"],
                                                issubclass(cls, PipelineScheduleSingle),
                                                pipe.round_virtual_stages_to_pp_multiple)
                parts = generate_hf_model_fqn_per_model_part(n, layers)
                chunks = [sum(1 for m in p if ".layers." in m) for p in parts]
                micro = lbs // pipe.pp_microbatch_size
            else:
                micro = 1
            out[name] = {"dims": {k: int(v) for k, v in dims.items()}, "moe": list(moe.shape) if moe else None,
                         "accum": sched.grad_acc_steps * micro, "chunks": chunks,
                         "ac": parsed["activation_checkpointing"]}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                    reason="nemo_automodel is not installed (make test installs nemo-automodel==0.7.0 --no-deps)")
def test_automodel_own_parsers_read_back_every_case() -> None:
    """Automodel's parse_distributed_section, _create_device_meshes (fake process group), pipeline split and
    StepSchedulerConfig accept each export and give back the plan's mesh, experts, accumulation and chunks."""
    docs = {}
    for name in CASES:
        scn, plan, doc, _ = _doc(name)
        docs[name] = (doc, plan.world_size, scn.model.num_layers)
    proc = subprocess.run([sys.executable, "-c", _CHECK], input=json.dumps(docs), capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    for name, (scn, plan) in CASES.items():
        r = got[name]
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["dims"] == {"pp": plan.pp, "dp_replicate": plan.dp_replicate,
                             "dp_shard": plan.dp // plan.dp_replicate, "cp": plan.cp, "tp": plan.tp}, name
        assert r["moe"] == ([plan.dp * plan.cp * plan.tp // plan.ep, plan.ep] if plan.ep > 1 else None), name
        assert r["accum"] == micro_batches(plan, scn.training.global_batch_size), name
        assert tuple(r["chunks"]) == layout(scn, plan).stage_layers, name
