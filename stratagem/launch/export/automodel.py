"""automodel target: a YAML recipe config for NVIDIA NeMo Automodel 0.7.0 (the nemo-automodel wheel on PyPI).

Verified against nemo-automodel 0.7.0's own code (tests/launch/test_export_automodel.py runs it when the wheel is
installed, `make test` installs it without its dependencies):
  recipes/_dist_utils.py parse_distributed_section   the `distributed:` section: strategy fsdp2, sizes, pipeline,
                                         moe and activation_checkpointing; the rest goes to FSDP2Config (unknown
                                         keys raise)
  components/distributed/mesh_utils.py _create_fsdp2_device_mesh   dp = world / (tp cp pp); dp_replicate < dp;
                                         dp cp tp divisible by ep (the MoE mesh (ep_shard, ep))
  components/distributed/pipelining/functional.py   calculate_virtual_stages (layers_per_stage, rounding),
                                         generate_hf_model_fqn_per_model_part (even split, extra layers first),
                                         build_pipeline_schedule (torch get_schedule_class)
  components/training/step_scheduler.py StepScheduler   grad accumulation = global / (local_batch_size * dp)
  components/models/common/utils.py BackendConfig, TEFp8Config   kernels, DeepEP dispatcher, fp8 recipe
  recipes/llm/benchmark.py BenchmarkingRecipeForNextTokenPrediction   a throughput check: warm-up steps left out
                                         of its per-step time, TFLOP/s and MFU; no checkpoint, no validation
  docs/guides/mixed-precision-training.mdx   bf16 resident parameters with TE FusedAdam's fp32 moments
"""

from __future__ import annotations

from typing import Any

import yaml

from stratagem.errors import StratagemError
from stratagem.launch.export.bundle import (
    RDZV_PORT,
    ExportBundle,
    FieldNote,
    Layout,
    comment_safe,
    header_lines,
    note_lines,
    refuse_unrunnable,
)
from stratagem.launch.export.model_fields import THROUGHPUT_WARMUP, model_constants
from stratagem.spaces.rules import plan_facts
from stratagem.spaces.stacks import stack_record

__all__ = ["AUTOMODEL_VERSION", "export_automodel", "pipeline_settings", "hf_model_id"]

AUTOMODEL_VERSION = "0.7.0"
CONFIG_FILE = "automodel.yaml"
_PKG = "nemo_automodel"
BENCHMARK_RECIPE = "BenchmarkingRecipeForNextTokenPrediction"
TRAIN_RECIPE = "TrainFinetuneRecipeForNextTokenPrediction"
# torch.distributed.pipelining get_schedule_class names (Automodel passes pp_schedule through)
_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved1f1b"}
# stratagem fp8 recipe -> TEFp8Config.recipe (Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)
_FP8 = {"tensorwise": "current", "blockwise": "block", "mxfp8": "mxfp8"}


def hf_model_id(lay: Layout) -> str | None:
    """The Hugging Face repository whose config.json the model preset follows (model_fields.PUBLISHED), or None."""
    source = model_constants(lay.scenario.model).source
    first = source.split(" ")[0] if source else ""
    return first if "/" in first else None


def pipeline_settings(num_layers: int, pp: int, virtual: int) -> dict[str, Any] | None:
    """`layers_per_stage` and `round_virtual_stages_to_pp_multiple` that give pp * virtual stages in Automodel's
    calculate_virtual_stages (ceil(layers / layers_per_stage), rounded up or down to a multiple of pp); {} when the
    default (1 stage per rank for a one-chunk schedule, 2 for a looped one) already gives it; None when no setting
    does."""
    if virtual == 1 or virtual == 2:
        return {}
    want = pp * virtual
    for per in range(1, num_layers + 1):
        n = -(-num_layers // per)
        if n == want:
            return {"layers_per_stage": per}
        for how, rounded in (("up", n + (-n) % pp), ("down", n - n % pp)):
            if rounded == want and n % pp:
                return {"layers_per_stage": per, "round_virtual_stages_to_pp_multiple": how}
    return None


class _Draft:
    """The YAML sections, per-section comments and field notes of one export."""

    def __init__(self) -> None:
        self.sections: dict[str, Any] = {}
        self.comments: dict[str, list[str]] = {}
        self.un: list[FieldNote] = []
        self.ap: list[FieldNote] = []


def _pipeline(d: _Draft, lay: Layout, dist: dict[str, Any]) -> None:
    p, m = lay.plan, lay.scenario.model
    if p.pp == 1:
        return
    pipe: dict[str, Any] = {"pp_schedule": _SCHEDULES[p.pp_schedule], "pp_microbatch_size": p.micro_batch_size}
    found = pipeline_settings(m.num_layers, p.pp, p.virtual_stages)
    if found is None:
        d.ap.append(FieldNote("plan.virtual_stages", f"{p.virtual_stages}: no layers_per_stage gives "
                              f"{p.pp * p.virtual_stages} stages of {m.num_layers} layers in Automodel's "
                              "calculate_virtual_stages; its default of 2 chunks per rank runs instead"))
        found = {}
    pipe.update(found)
    dist["pipeline"] = pipe


def _distributed(d: _Draft, lay: Layout) -> None:
    """distributed: FSDP2 over dp_shard x cp (HSDP replicas), TP/SP, CP, EP, pipeline, activation checkpointing."""
    p, tr, m = lay.plan, lay.scenario.training, lay.scenario.model
    ac = {"none": False, "full": True, "op": "selective"}[p.activation_checkpointing]
    if p.recompute_layers:
        d.un.append(FieldNote("plan.recompute_layers", f"{p.recompute_layers}: Automodel checkpoints every block "
                              "(components/distributed/activation_checkpointing.py); no per-layer count"))
    if p.zero_stage == 0 and p.dp > 1:  # unsharded data parallelism alone (spaces/exclusions.py): DDPConfig
        d.sections["distributed"] = {"strategy": "ddp", "activation_checkpointing": ac}
        d.comments["distributed"] = [f"DDP over all {p.dp} ranks: unsharded model states (ZeRO-0)"]
        return
    dist: dict[str, Any] = {"strategy": "fsdp2", "tp_size": p.tp, "cp_size": p.cp, "pp_size": p.pp, "ep_size": p.ep}
    if p.dp_replicate > 1:
        dist["dp_replicate_size"] = p.dp_replicate
    dist["sequence_parallel"] = p.sequence_parallel
    dist["activation_checkpointing"] = ac
    if p.precision == "fp32":
        dist["mp_policy"] = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy", "param_dtype": "float32",
                             "reduce_dtype": "float32", "output_dtype": None}
    if tr.compile is True:
        dist["enable_compile"] = True
    if tr.tp_overlap and p.tp > 1 and p.sequence_parallel:
        dist["enable_async_tensor_parallel"] = True
    _pipeline(d, lay, dist)
    if m.moe is not None and p.ep > 1:
        # MoEParallelizerConfig.reshard_after_forward defaults to false (experts kept gathered, ZeRO-2-like); the
        # plan's ZeRO-3 reshards them without PP, and with PP Automodel keeps layers gathered anyway
        dist["moe"] = {"reshard_after_forward": p.pp == 1}
    d.sections["distributed"] = dist
    d.comments["distributed"] = [
        "FSDP2 shards over dp_shard x cp (ZeRO-3; with one rank there it shards nothing, the ZeRO-0 job); dp = "
        f"world / (tp x cp x pp) is inferred (here {p.dp}); experts over the MoE mesh (ep_shard, ep) of dp x cp x tp"]


def _batches(d: _Draft, lay: Layout) -> None:
    """step_scheduler and benchmark: batch sizes, steps, warm-up; the full run's checkpoint interval."""
    p, tr = lay.plan, lay.scenario.training
    local = p.micro_batch_size * lay.grad_accum if p.pp > 1 else p.micro_batch_size
    steps: dict[str, Any] = {"global_batch_size": tr.global_batch_size, "local_batch_size": local,
                             "max_steps": lay.run_steps, "num_epochs": 1, "val_every_steps": None}
    d.comments["step_scheduler"] = [
        comment_safe(lay.steps_comment()),
        f"local_batch_size: {'all micro-batches of a step through the pipeline' if p.pp > 1 else 'one micro-batch'}"
        f"; gradient accumulation = global / (local x dp {p.dp}) = "
        f"{tr.global_batch_size // (local * p.dp)}"]
    d.sections["step_scheduler"] = steps
    if lay.throughput_check:
        d.sections["benchmark"] = {"warmup_steps": THROUGHPUT_WARMUP,
                                   "peak_tflops": lay.scenario.cluster.gpu.peak_tflops_bf16,
                                   "nsys_start": -1, "nsys_end": -1, "nsys_ranks": []}
        d.comments["benchmark"] = [
            f"the recipe leaves out the first {THROUGHPUT_WARMUP} steps and logs each step's time, TFLOP/s per GPU "
            "and MFU against peak_tflops (dense bf16 peak of the cluster's GPU)"]


def _checkpoint(d: _Draft, lay: Layout, interval: int | None) -> None:
    """checkpoint: none inside a throughput check (its recipe saves none); the full run's settings."""
    tr = lay.scenario.training
    full: dict[str, Any] = {"enabled": True, "checkpoint_dir": "checkpoints/", "is_async": tr.checkpoint.mode == "async"}
    if interval is None:
        d.un.append(FieldNote("training.checkpoint.interval_minutes", "Automodel counts ckpt_every_steps in steps; no "
                              "step time was given to convert it (export from a study, or pass an evaluation)"))
    if lay.throughput_check:
        d.sections["checkpoint"] = {"enabled": False}
        every = f", step_scheduler.ckpt_every_steps {interval}" if interval is not None else ""
        d.comments["checkpoint"] = [
            f"no checkpoint inside this throughput check; the full run ({TRAIN_RECIPE}) sets "
            + ", ".join(f"{k} {v}" for k, v in full.items()) + every]
        return
    d.sections["checkpoint"] = full
    if interval is not None:
        d.sections["step_scheduler"]["ckpt_every_steps"] = interval


def _backend(d: _Draft, lay: Layout) -> dict[str, Any]:
    """model.backend: Transformer Engine kernels, DeepEP and grouped experts for MoE, the TE fp8 recipe."""
    p, tr, m = lay.plan, lay.scenario.training, lay.scenario.model
    rec = stack_record("automodel")
    be: dict[str, Any] = {"_target_": f"{_PKG}.components.models.common.BackendConfig", "attn": "te", "linear": "te",
                          "rms_norm": "te", "rope_fusion": True}
    if m.moe is not None:
        be.update({"experts": "te", "dispatcher": "deepep"})
        if tr.dispatcher != "deepep":
            d.ap.append(FieldNote("training.moe_dispatcher", f"{tr.dispatcher}: Automodel's other dispatcher "
                                  f"('torch') is an all-gather / reduce-scatter, not an all-to-all ({rec.cite('moe_dispatchers')}); "
                                  "DeepEP is written"))
    if tr.kernels not in (None, "fused"):
        d.ap.append(FieldNote("training.kernels", f"{tr.kernels}: written as Transformer Engine's kernels (te), "
                              "Automodel's fused path"))
    if p.precision == "fp8":
        recipe = tr.fp8_recipe_used if tr.fp8_recipe_used in rec.fp8_recipes else rec.fp8_recipes[0]
        if recipe != tr.fp8_recipe_used:
            d.ap.append(FieldNote("training.fp8_recipe", f"{tr.fp8_recipe_used}: Transformer Engine in Automodel has "
                                  f"current, block and mxfp8 scaling; {recipe} ({_FP8[recipe]}) is written"))
        be["te_fp8"] = {"_target_": f"{_PKG}.components.models.common.utils.TEFp8Config", "recipe": _FP8[recipe]}
    return be


def _model(d: _Draft, lay: Layout) -> None:
    """model: the Hugging Face config the preset follows (or a placeholder), resident dtype, backend."""
    p, m = lay.plan, lay.scenario.model
    repo = hf_model_id(lay)
    if repo is None:
        repo = "REPLACE-ME/your-model"
        d.un.append(FieldNote("model", f"Automodel builds models from a Hugging Face config; {m.name} has none known "
                              "to stratagem: set pretrained_model_name_or_path to a config with this architecture"))
    d.sections["model"] = {
        "_target_": f"{_PKG}.NeMoAutoModelForCausalLM.from_config",
        "config": {"_target_": "transformers.AutoConfig.from_pretrained", "pretrained_model_name_or_path": repo},
        "torch_dtype": "float32" if p.precision == "fp32" else "bfloat16",
        "trust_remote_code": True,
        "backend": _backend(d, lay),
    }
    d.comments["model"] = ["torch_dtype: the resident (FSDP2-sharded) parameters; FSDP2's mp_policy computes in bf16"]


def _optimizer(d: _Draft, lay: Layout) -> None:
    """optimizer: TE FusedAdam (fp32 moments, 16-bit master remainders) or torch Adam (bf16 moments), as the
    memory model counts them (spaces/stacks.py automodel states)."""
    p, tr = lay.plan, lay.scenario.training
    if tr.optimizer not in ("adamw", "sgd"):
        d.un.append(FieldNote("training.optimizer", f"{tr.optimizer}: not written; set an optimizer _target_ "
                              "(Automodel instantiates any torch.optim-style class)"))
        return
    if tr.optimizer == "sgd":
        d.sections["optimizer"] = {"_target_": "torch.optim.SGD", "lr": 1e-4, "momentum": 0.9}
    elif p.precision == "fp32":  # the guide's Pattern B: fp32 resident parameters, torch AdamW
        d.sections["optimizer"] = {"_target_": "torch.optim.AdamW", "lr": 1e-4, "betas": [0.9, 0.95]}
    elif tr.optimizer_state_dtype == "fp32":  # Pattern A
        d.sections["optimizer"] = {
            "_target_": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "lr": 1e-4, "adam_w_mode": True,
            "bias_correction": True, "master_weights": True, "store_param_remainders": True,
            "exp_avg_dtype": "torch.float32", "exp_avg_sq_dtype": "torch.float32"}
    else:  # torch Adam keeps its moments in the parameters' bf16 (examples/llm_benchmark)
        d.sections["optimizer"] = {"_target_": "torch.optim.Adam", "lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                   "weight_decay": 0, "foreach": False}
    d.comments["optimizer"] = ["PLACEHOLDER learning rate; the optimizer and its state dtype are what the memory "
                               "figures assume (docs/guides/mixed-precision-training.mdx)"]


def _data(d: _Draft, lay: Layout) -> None:
    """dataset, dataloader, loss: Automodel's mock token stream (a throughput check)."""
    tr = lay.scenario.training
    d.sections["loss_fn"] = {"_target_": f"{_PKG}.components.loss.masked_ce.MaskedCrossEntropy"}
    d.sections["dataset"] = {"_target_": f"{_PKG}.components.datasets.llm.mock_iterable_dataset.MockIterableDataset",
                             "seq_len": tr.seq_len, "num_samples": tr.global_batch_size * (lay.run_steps + 1)}
    d.comments["dataset"] = ["PLACEHOLDER: random tokens for a throughput check; set your dataset to train"]
    d.sections["dataloader"] = {"_target_": "torch.utils.data.DataLoader", "batch_size": None, "num_workers": 0}
    d.sections["dist_env"] = {"backend": "nccl", "timeout_minutes": 10}


def _render(d: _Draft, lay: Layout) -> ExportBundle:
    head = header_lines(lay, f"NeMo Automodel {AUTOMODEL_VERSION} (nemo-automodel), YAML recipe config "
                             "(nemo_automodel/recipes/_dist_utils.py parse_distributed_section)")
    module = "benchmark" if lay.throughput_check else "train_ft"
    run = (f"Run on each node: torchrun --nnodes {lay.nodes} --nproc-per-node {lay.procs_per_node} "
           f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{RDZV_PORT} -m {_PKG}.recipes.llm.{module} "
           f"--config {CONFIG_FILE}")
    notes = note_lines(d.un, d.ap, f"NeMo Automodel {AUTOMODEL_VERSION}")
    out = [*[f"# {x}" for x in head], f"# {run}", *[f"# {x}" for x in notes], ""]
    for name, value in d.sections.items():
        out += [f"# {comment_safe(c)}" for c in d.comments.get(name, [])]
        out.append(yaml.safe_dump({name: value}, sort_keys=False, default_flow_style=False).rstrip())
        out.append("")
    return ExportBundle(target="automodel", main=CONFIG_FILE, files={CONFIG_FILE: "\n".join(out)},
                        unexpressed=d.un, approximated=d.ap)


def _refuse_excluded(lay: Layout) -> None:
    """Raise StratagemError for a combination Automodel refuses (spaces/exclusions.py AUTOMODEL_PLAN_EXCLUSIONS:
    DDP beside other parallelism, HSDP without a shard group, 1F1B with fewer micro-batches than stages)."""
    s, p = lay.scenario, lay.plan
    facts = plan_facts(p, s.model.moe is not None, lay.grad_accum, s.training.seq_len)
    ex = stack_record("automodel").plan_exclusion(facts, "harness")
    if ex is not None:
        raise StratagemError(f"--to automodel: automodel: {ex.describe(facts)} is not supported ({ex.source}): "
                             f"{ex.reason}")


def export_automodel(lay: Layout, checkpoint_interval: int | None = None) -> ExportBundle:
    """automodel.yaml: a throughput check with Automodel's benchmarking recipe (the full run, --steps at the full
    run's count, with its training recipe and checkpoints); what it cannot express is listed in the file."""
    refuse_unrunnable(lay, "automodel")
    _refuse_excluded(lay)
    d = _Draft()
    d.sections["recipe"] = BENCHMARK_RECIPE if lay.throughput_check else TRAIN_RECIPE
    _batches(d, lay)
    _distributed(d, lay)
    _model(d, lay)
    _optimizer(d, lay)
    _data(d, lay)
    _checkpoint(d, lay, checkpoint_interval)
    return _render(d, lay)
