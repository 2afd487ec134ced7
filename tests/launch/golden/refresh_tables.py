"""Rebuild the checked-in tables of the export tests from the targets' own sources, and check every case of
cases.yaml with the targets' real parsers. Run by hand when moving to another target version (not by pytest).

    # Megatron-LM: a source tree of the tag (git archive core_v0.19.0 megatron | tar -x -C /tmp/mlm)
    .venv/bin/python tests/launch/golden/refresh_tables.py megatron /tmp/mlm
    # torchtitan: a source tree of the tag, and tyro importable (pip install --target /tmp/ttdeps tyro)
    PYTHONPATH=/tmp/ttdeps .venv/bin/python tests/launch/golden/refresh_tables.py torchtitan /tmp/tt
    # NeMo Automodel: the unpacked wheel (pip download nemo-automodel==0.7.0 --no-deps; unzip -d /tmp/am)
    .venv/bin/python tests/launch/golden/refresh_tables.py automodel /tmp/am

megatron: builds Megatron-LM's real parser (megatron/training/arguments.py add_megatron_arguments) on CPU, writes
megatron_options.json for the options the exporter emits, then runs validate_args and
core_transformer_config_from_args on each case's arguments. CPU stand-ins, for this check only: the triton-only
module megatron.core.transformer.moe.ops.paged_stash is replaced by an empty module, typing.override (3.12) by
typing_extensions', the GPU is reported as sm90, and --no-rope-fusion is added (Transformer Engine is absent).
torchtitan: extracts the JobConfig dataclass tree from torchtitan/config/job_config.py with ast into
torchtitan_job_config.json, then loads each case's TOML with torchtitan's ConfigManager and ParallelDims.
automodel: extracts, with ast, the fields of the dataclasses the exported YAML's sections become, the benchmark keys
its benchmarking recipe reads, the recipe classes its CLI finds and the classes and functions of each nemo_automodel
module a `_target_` names, into automodel_schema.json (the sections that need transformers or Transformer Engine to
import are checked against it; test_export_automodel.py runs the parsers that import here).
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[2]))

import yaml  # noqa: E402

from stratagem.launch.export import export_plan, layout  # noqa: E402
from stratagem.launch.export.megatron import megatron_args  # noqa: E402
from stratagem.launch.export.megatron_model import MEGATRON_COMMIT, MEGATRON_VERSION  # noqa: E402
from stratagem.launch.export.torchtitan import TORCHTITAN_COMMIT, TORCHTITAN_VERSION  # noqa: E402
from stratagem.spaces import parse_plan, scenario_from_dict  # noqa: E402


def _cases() -> dict[str, Any]:
    data = yaml.safe_load((HERE / "cases.yaml").read_text())
    scns = {k: scenario_from_dict(v, source=k) for k, v in data["scenarios"].items()}
    return {name: (scns[c["scenario"]], parse_plan(c["plan"])) for name, c in data["cases"].items()}


class _Empty(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import the named modules as empty modules."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in self.names else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = types.ModuleType(spec.name)
        mod.__getattr__ = lambda attr: (lambda *a, **k: None)  # type: ignore[method-assign]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def megatron(tree: Path) -> int:
    import typing

    import torch
    import typing_extensions

    typing.override = typing_extensions.override  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _Empty({"megatron.core.transformer.moe.ops.paged_stash"}))
    sys.path.insert(0, str(tree))
    import megatron.training.arguments as margs
    import megatron.training.utils.common_utils as cu

    cu.get_device_arch_version = lambda: 9
    margs.get_device_arch_version = lambda: 9
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)

    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(allow_abbrev=False)
        return margs.add_megatron_arguments(p)

    actions = {s: a for a in parser()._actions for s in a.option_strings}
    used: set[str] = set()
    failures = 0
    # each case as the throughput check (no checkpoint, every step logged) and as the full run (saving)
    runs = [(f"{name}{'' if full is None else ' (full run)'}", scn, plan, full)
            for name, (scn, plan) in _cases().items() for full in (None, True)]
    for name, scn, plan, full in runs:
        lay = layout(scn, plan)
        if full:
            lay = layout(scn, plan, steps=lay.train_steps)
        groups, env, _, _ = megatron_args(lay, checkpoint_interval=100)
        argv = [a.replace("$CHECKPOINT_DIR", "/tmp/checkpoints") for g in groups.values() for a in g]
        used |= {a for a in argv if a.startswith("--")}
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update({k: v for k, v in env.items() if v is not None})  # None: unset
        try:
            args = parser().parse_args([*argv, "--no-rope-fusion"])
            args._is_global_batch_size_explicitly_specified = True
            args.rank, args.world_size = 0, plan.world_size
            margs.validate_args(args, {})
            margs.core_transformer_config_from_args(args)
            print(f"ok    {name}")
        except Exception as e:  # report every case
            failures += 1
            print(f"FAIL  {name}: {type(e).__name__}: {e}")
    kinds = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false"}
    table: dict[str, dict[str, Any]] = {}
    for opt in sorted(used):
        a = actions[opt]
        entry: dict[str, Any] = {"action": kinds[type(a).__name__]}
        if a.dest != opt[2:].replace("-", "_"):
            entry["dest"] = a.dest
        if entry["action"] == "store":
            if a.nargs is not None:
                entry["nargs"] = a.nargs
            entry["type"] = {int: "int", float: "float"}.get(a.type, "str")  # type: ignore[call-overload]
            if a.choices:
                entry["choices"] = [str(c) for c in a.choices]
        table[opt] = entry
    doc = {"source": f"NVIDIA/Megatron-LM tag {MEGATRON_VERSION}, commit {MEGATRON_COMMIT}: the argparse actions "
                     "that megatron/training/arguments.py add_megatron_arguments() builds, read off the real parser "
                     "(it also generates options from TransformerConfig and the megatron/training/config dataclasses)",
           "options": table}
    (HERE / "megatron_options.json").write_text(json.dumps(doc, indent=1) + "\n")
    return failures


def torchtitan(tree: Path) -> int:
    src = (tree / "torchtitan/config/job_config.py").read_text()
    classes: dict[str, dict[str, str]] = {}
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {st.target.id: ast.unparse(st.annotation) for st in node.body
                                  if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    sections: dict[str, dict[str, str]] = {}

    def walk(cls: str, path: str) -> None:
        keys = {}
        for key, ann in classes[cls].items():
            if ann in classes:
                walk(ann, f"{path}.{key}" if path else key)
            else:
                keys[key] = ann
        if path:
            sections[path] = keys

    walk("JobConfig", "")
    doc = {"source": f"pytorch/torchtitan tag {TORCHTITAN_VERSION}, commit {TORCHTITAN_COMMIT}: "
                     "torchtitan/config/job_config.py, the JobConfig dataclass tree (section path -> key -> "
                     "annotation), extracted with ast", "sections": sections}
    (HERE / "torchtitan_job_config.json").write_text(json.dumps(doc, indent=1) + "\n")

    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = [str(tree / "torchtitan")]  # skip torchtitan/__init__ (it imports torchao)
    sys.modules["torchtitan"] = pkg
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    failures = 0
    for name, (scn, plan) in _cases().items():
        text = export_plan(scn, plan, "torchtitan").files["torchtitan.toml"]
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(text)
        try:
            cfg = ConfigManager().parse_args(["--job.config_file", f.name])
            pa = cfg.parallelism
            ParallelDims(dp_shard=pa.data_parallel_shard_degree, dp_replicate=pa.data_parallel_replicate_degree,
                         cp=pa.context_parallel_degree, tp=pa.tensor_parallel_degree, pp=pa.pipeline_parallel_degree,
                         ep=pa.expert_parallel_degree, etp=pa.expert_tensor_parallel_degree, world_size=plan.world_size)
            print(f"ok    {name}")
        except Exception as e:
            failures += 1
            print(f"FAIL  {name}: {type(e).__name__}: {e}")
        finally:
            os.unlink(f.name)
    return failures


# section of the exported YAML -> (file under nemo_automodel/, dataclass whose fields it may hold)
_AM_CLASSES = {
    "distributed": ("components/distributed/config.py", "FSDP2Config"),
    "distributed(ddp)": ("components/distributed/config.py", "DDPConfig"),
    "distributed.pipeline": ("components/distributed/pipelining/config.py", "PipelineConfig"),
    "distributed.moe": ("components/distributed/config.py", "MoEParallelizerConfig"),
    "step_scheduler": ("components/training/step_scheduler.py", "StepSchedulerConfig"),
    "checkpoint": ("components/checkpoint/config.py", "CheckpointingConfig"),
    "model.backend": ("components/models/common/utils.py", "BackendConfig"),
    "model.backend.te_fp8": ("components/models/common/utils.py", "TEFp8Config"),
}


# the nemo_automodel modules whose classes the exporter's `_target_`s name (launch/export/automodel.py)
_AM_MODULES = ("nemo_automodel", "nemo_automodel.components.models.common",
               "nemo_automodel.components.models.common.utils", "nemo_automodel.components.loss.masked_ce",
               "nemo_automodel.components.datasets.llm.mock_iterable_dataset")


def automodel(tree: Path) -> int:
    import re

    pkg = tree / "nemo_automodel"
    version = (tree / next(p.name for p in tree.iterdir() if p.name.endswith(".dist-info"))).name
    sections: dict[str, list[str]] = {}
    for section, (rel, cls) in _AM_CLASSES.items():
        node = next(n for n in ast.parse((pkg / rel).read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
        sections[section] = [st.target.id for st in node.body
                             if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)]
    bench = sorted(set(re.findall(r"bench_cfg\.(\w+)", (pkg / "recipes/llm/benchmark.py").read_text())))
    # nemo_automodel/cli/utils.py _discover_recipe_classes: the same scan
    recipes = sorted({m for f in (pkg / "recipes").rglob("*.py") if not f.name.startswith("_")
                      for m in re.findall(r"^class\s+(\w*Recipe\w*)\s*[\(:]", f.read_text(), re.M)} - {"BaseRecipe"})
    modules: dict[str, list[str]] = {}
    for f in sorted(pkg.rglob("*.py")):
        mod = ".".join(f.relative_to(tree).with_suffix("").parts).removesuffix(".__init__")
        if mod not in _AM_MODULES:
            continue
        body = ast.parse(f.read_text()).body
        names = {n.name for n in body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
        names |= {a.asname or a.name for n in body if isinstance(n, ast.ImportFrom) for a in n.names}
        if mod == "nemo_automodel":  # the lazy attributes its __init__ resolves (_LAZY_ATTRS)
            names |= set(re.findall(r'^\s+"(\w+)": \(', f.read_text(), re.M))
        modules[mod] = sorted(names)
    doc = {"source": f"{version}: dataclass fields (ast), benchmark keys, recipe classes and module symbols",
           "sections": sections, "benchmark": bench, "recipes": recipes, "modules": modules}
    (HERE / "automodel_schema.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", choices=["megatron", "torchtitan", "automodel"])
    ap.add_argument("tree", type=Path, help="source tree of the target at the pinned tag (automodel: the wheel)")
    ns = ap.parse_args()
    sys.exit(1 if {"megatron": megatron, "torchtitan": torchtitan, "automodel": automodel}[ns.target](ns.tree) else 0)
