"""torchtitan target: a TOML job config for torchtitan v0.2.2.

Verified against pytorch/torchtitan tag v0.2.2, commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce (2026-02-20):
  torchtitan/config/job_config.py        the JobConfig dataclasses: every section and key written here
  torchtitan/config/manager.py           TOML loading: unknown keys are rejected (`_dict_to_dataclass`)
  torchtitan/models/llama3/__init__.py   the llama3 flavors (debugmodel, 8B, 70B, 405B)
  torchtitan/models/llama3/infra/parallelize.py   TP always with SequenceParallel norms; DDP only as the sole
                                         parallelism; FSDP whenever dp_shard > 1 or cp > 1
  torchtitan/distributed/pipeline_parallel.py     schedules, microbatches = local_batch / microbatch size
  torchtitan/distributed/activation_checkpoint.py  selective "op" policy: saves matmul outputs except every
                                         second one, and attention outputs; recomputes the rest
  torchtitan/train.py                    grad accumulation = global_batch / (local_batch * dp degree)
Later torchtitan (main after v0.2.2) replaced the TOML job config by Python config registries; run this file
with v0.2.2: `torchrun ... -m torchtitan.train --job.config_file torchtitan.toml`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stratagem.launch.export.bundle import (
    RDZV_PORT,
    ExportBundle,
    FieldNote,
    Layout,
    header_lines,
    note_lines,
)
from stratagem.launch.export.model_fields import THROUGHPUT_WARMUP, model_constants
from stratagem.launch.export.rope import torchtitan_rope_comment
from stratagem.spaces.canonical import sharding_stage
from stratagem.spaces.groups import dp_shard
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.pipeline_split import chunk_layers
from stratagem.spaces.rules import plan_facts
from stratagem.spaces.stacks import stack_record

__all__ = ["TORCHTITAN_VERSION", "TORCHTITAN_COMMIT", "LLAMA3_FLAVORS", "export_torchtitan", "to_toml",
           "llama3_flavor"]

TORCHTITAN_VERSION = "v0.2.2"
TORCHTITAN_COMMIT = "73a0e6979dd10b6b1904098eb3c8f62c18ab87ce"
CONFIG_FILE = "torchtitan.toml"

# torchtitan/models/llama3/__init__.py @ v0.2.2: flavor -> (dim, n_layers, n_heads, n_kv_heads or None,
# vocab_size, ffn_dim_multiplier, multiple_of). TransformerModelArgs defaults: vocab_size 128256,
# multiple_of 256; RMSNorm, SwiGLU, RoPE, no biases, untied output projection.
_LLAMA3_ARGS: dict[str, tuple[int, int, int, int | None, int, float | None, int]] = {
    "debugmodel": (256, 6, 16, None, 2048, None, 256),
    "8B": (4096, 32, 32, 8, 128256, 1.3, 1024),
    "70B": (8192, 80, 64, 8, 128256, 1.3, 4096),
    "405B": (16384, 126, 128, 8, 128256, 1.2, 4096),
}


def _ffn(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan FeedForward: int(2 * 4dim / 3), times the multiplier, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


LLAMA3_FLAVORS: dict[str, dict[str, int]] = {
    name: {"num_layers": layers, "hidden_size": dim, "num_attention_heads": heads,
           "num_kv_heads": kv or heads, "ffn_hidden_size": _ffn(dim, mult, mult_of), "vocab_size": vocab}
    for name, (dim, layers, heads, kv, vocab, mult, mult_of) in _LLAMA3_ARGS.items()
}
"""The model dimensions of each torchtitan llama3 flavor, derived as torchtitan derives them."""

_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zero_bubble": "ZBVZeroBubble"}
# the TOML tables in the order they are written (torchtitan/config/job_config.py JobConfig sections)
_TABLE_ORDER = ("job", "metrics", "model", "optimizer", "lr_scheduler", "training", "parallelism", "activation_checkpoint",
                "checkpoint", "compile", "quantize.linear.float8")


def llama3_flavor(model: ModelSpec) -> str | None:
    """The torchtitan llama3 flavor with exactly this architecture, or None."""
    if (model.mlp, model.norm, model.bias, model.position_embedding) != ("swiglu", "rmsnorm", "none", "rope"):
        return None
    if model.tied_embeddings or model.moe is not None:
        return None
    if model.dim_head * model.num_attention_heads != model.hidden_size:
        return None
    dims = {"num_layers": model.num_layers, "hidden_size": model.hidden_size,
            "num_attention_heads": model.num_attention_heads, "num_kv_heads": model.kv_heads,
            "ffn_hidden_size": model.ffn_hidden_size, "vocab_size": model.vocab_size}
    for name, flavor in LLAMA3_FLAVORS.items():
        if flavor == dims:
            return name
    return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_") or "model"


# ---- a small TOML writer: tables of str / int / float / bool / lists of them --------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML cannot hold {v}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, Sequence):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(tables: dict[str, dict[str, Any]], comments: dict[str, list[str]] | None = None) -> str:
    """`{"a.b": {"key": value}}` as TOML tables `[a.b]`, with optional `# comment` lines per key."""
    comments = comments or {}
    out: list[str] = []
    for table, items in tables.items():
        if not items:
            continue
        out.append(f"[{table}]")
        for key, value in items.items():
            out += [f"# {c}" for c in comments.get(f"{table}.{key}", [])]
            out.append(f"{key} = {_toml_value(value)}")
        out.append("")
    return "\n".join(out)


def _stage_fqns(stage_layers: tuple[int, ...]) -> list[list[str]]:
    """Module names per model chunk for torchtitan's llama3 (tok_embeddings, layers.i, norm, output)."""
    parts: list[list[str]] = []
    start = 0
    for i, n in enumerate(stage_layers):
        names = [f"layers.{j}" for j in range(start, start + n)]
        start += n
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == len(stage_layers) - 1:
            names += ["norm", "output"]
        parts.append(names)
    return parts


@dataclass
class _Draft:
    """The TOML tables, per-key comments and field notes of one export, filled in section by section."""

    tables: dict[str, dict[str, Any]]
    comments: dict[str, list[str]] = field(default_factory=dict)
    un: list[FieldNote] = field(default_factory=list)
    ap: list[FieldNote] = field(default_factory=list)


def _job_table(d: _Draft, lay: Layout) -> None:
    """[job]: a description naming the scenario and the plan, and the output folder."""
    d.tables["job"] = {"description": f"stratagem: {lay.scenario.name}, {lay.plan.short()}",
                       "dump_folder": "./outputs"}


def _model_table(d: _Draft, lay: Layout) -> None:
    """[model]: the llama3 flavor with this architecture (or a named placeholder flavor), tokenizer path."""
    m = lay.scenario.model
    flavor = llama3_flavor(m)
    if flavor is None:
        flavor = f"stratagem_{_slug(m.name)}"
        arch = (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.kv_heads} kv, "
                f"head_dim {m.dim_head}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, {m.mlp}, {m.norm}, "
                f"bias {m.bias}, {m.position_embedding}, tied {str(m.tied_embeddings).lower()}"
                + (f", moe {m.moe.num_experts}x top{m.moe.top_k} ffn {m.moe.expert_ffn_hidden_size}" if m.moe else ""))
        d.un.append(FieldNote(
            "model",
            f"torchtitan builds models from registered flavors only (llama3: {', '.join(LLAMA3_FLAVORS)}) and "
            f"none has this architecture ({arch}); flavor {flavor!r} is written so that torchtitan stops "
            "with an unknown-flavor error until you register it",
        ))
    if m.mtp_layers:
        d.un.append(FieldNote("model.mtp_layers", f"{m.mtp_layers}: torchtitan v0.2.2 has no multi-token "
                              "prediction; the job trains without the modules, lighter and faster than planned"))
    d.tables["model"] = {"name": "llama3", "flavor": flavor, "hf_assets_path": "./assets/hf/REPLACE-ME"}
    consts = model_constants(m, default_theta=500000)  # torchtitan llama3 TransformerModelArgs defaults
    d.comments["model.flavor"] = [
        f"rope_theta {consts.rope_theta}, norm_eps {consts.norm_eps:g}: "
        + (f"as {consts.source}; " if consts.source else f"not known for {m.name}; ")
        + "torchtitan fixes both in the registered flavor (torchtitan/models/llama3/__init__.py: "
        "TransformerModelArgs), so a flavor registered for this model must set them",
        torchtitan_rope_comment(m)]
    d.comments["model.hf_assets_path"] = [
        "PLACEHOLDER: the directory holding your tokenizer (torchtitan's scripts/download_hf_assets.py), "
        f"whose vocabulary must have {m.vocab_size} entries"]


def _optimizer_table(d: _Draft, lay: Layout) -> None:
    """[optimizer]: AdamW, the only one of stratagem's optimizers torchtitan builds."""
    optimizer = lay.scenario.training.optimizer
    if optimizer == "adamw":
        d.tables["optimizer"] = {"name": "AdamW"}
    else:
        d.un.append(FieldNote("training.optimizer",
                              f"{optimizer}: torchtitan's build_optimizers offers Adam and AdamW only"))


def _training_table(d: _Draft, lay: Layout) -> None:
    """[training] batch sizes, steps, dataset and mixed precision; [lr_scheduler] warm-up within the run."""
    p, tr = lay.plan, lay.scenario.training
    # batch: torchtitan's local_batch_size is per data-parallel rank per gradient-accumulation step; with
    # pipelining it is split into microbatches of pipeline_parallel_microbatch_size.
    training: dict[str, Any] = {"seq_len": tr.seq_len, "global_batch_size": tr.global_batch_size}
    if p.pp > 1:
        training["local_batch_size"] = p.micro_batch_size * lay.grad_accum
        d.comments["training.local_batch_size"] = [
            f"all {lay.grad_accum} micro-batch(es) go through the pipeline in one step (no gradient accumulation)"]
    else:
        training["local_batch_size"] = p.micro_batch_size
        d.comments["training.global_batch_size"] = [
            f"= local_batch_size x data-parallel degree x {lay.grad_accum} gradient accumulation step(s)"]
    training["steps"] = lay.run_steps
    d.comments["training.steps"] = [lay.steps_comment()]
    training["dataset"] = "c4_test"
    d.comments["training.dataset"] = [
        "PLACEHOLDER: torchtitan's test slice of C4, for a throughput check; set your dataset (and dataset_path) to "
        "train. It resolves only from the root of a torchtitan checkout: its path is tests/assets/c4_test, relative "
        "to the working directory, and the pip package does not ship it (torchtitan/hf_datasets/text_datasets.py "
        "DATASETS)"]
    # the scheduler's warm-up must fit in the run (torchtitan's default is 200 steps)
    d.tables["lr_scheduler"]["warmup_steps"] = min(THROUGHPUT_WARMUP, lay.run_steps)
    training["mixed_precision_param"] = "float32" if p.precision == "fp32" else "bfloat16"
    training["mixed_precision_reduce"] = "float32"
    d.tables["training"] = training


def _converts(lay: Layout, name: str) -> bool:
    """Whether the torch record's export exclusion `name` covers the plan (spaces/exclusions.py: torchtitan has no
    exact setting for it, so the torch space never proposes it; given explicitly, the exporter converts it, with a
    note): the one rule the space and this exporter read."""
    rule = next(ex for ex in stack_record("torch").plan_exclusions if ex.name == name and ex.refused_by == "export")
    return bool(rule.applies(plan_facts(lay.plan, lay.scenario.model.moe is not None, lay.grad_accum,
                                        lay.scenario.training.seq_len)))


def _unsharded_data_parallel(d: _Draft, lay: Layout, par: dict[str, Any]) -> None:
    """Nothing sharded: plain DDP, which torchtitan allows only on its own (else FSDP2 that never reshards)."""
    p = lay.plan
    if p.zero_stage == 0:
        field_name, why = "plan.zero_stage", "0 (DDP)"
    else:
        field_name, why = "plan.dp_replicate", f"{p.dp_replicate} = dp (every rank a full replica: DDP)"
    if _converts(lay, "ddp_beside_other_parallelism"):  # dp > 1 beside tp or pp (cp = 1 here)
        par["data_parallel_replicate_degree"] = 1
        par["data_parallel_shard_degree"] = p.dp
        par["fsdp_reshard_after_forward"] = "never"
        d.ap.append(FieldNote(
            field_name,
            f"{why}: torchtitan supports DDP only as the sole parallelism "
            "(parallelize.py raises 'DDP has not supported > 1D parallelism'); written as FSDP2 with "
            "fsdp_reshard_after_forward=never, which also shards gradients and optimizer states over the "
            f"{p.dp} dp ranks (ZeRO-2): less memory than planned, plus a weight all-gather per step",
        ))
    else:
        par["data_parallel_replicate_degree"] = p.dp
        par["data_parallel_shard_degree"] = 1


def _data_parallel(d: _Draft, lay: Layout, par: dict[str, Any]) -> None:
    """[parallelism] dp degrees: ZeRO over dp*cp / dp_replicate is torchtitan's FSDP over dp_shard x cp,
    dp_replicate the HSDP replicas; [training] enable_cpu_offload for optimizer offload."""
    p = lay.plan
    shard = dp_shard(p) if p.zero_stage >= 1 else 1
    if _converts(lay, "zero0_with_ep"):
        # torchtitan/models/llama4/infra/parallelize.py: FSDP whenever ep > 1, the experts over efsdp (dp_shard x cp
        # x tp / (ep x etp)): the dp ranks shard so that ep can fold over them
        par["data_parallel_replicate_degree"] = 1
        par["data_parallel_shard_degree"] = p.dp
        par["fsdp_reshard_after_forward"] = "never"
        d.ap.append(FieldNote(
            "plan.zero_stage",
            f"0 with ep > 1: torchtitan wraps the model in FSDP whenever ep > 1 (llama4 parallelize_llama); written "
            f"as FSDP2 over the {p.dp} dp ranks with fsdp_reshard_after_forward=never (ZeRO-2): gradients and "
            "optimizer states sharded, less memory than planned",
        ))
    elif shard == 1 and p.cp == 1:
        _unsharded_data_parallel(d, lay, par)
    elif p.zero_stage == 0:
        # cp > 1: torchtitan applies FSDP over dp_shard x cp whenever cp > 1.
        par["data_parallel_replicate_degree"] = p.dp
        par["data_parallel_shard_degree"] = 1
        par["fsdp_reshard_after_forward"] = "never"
        if _converts(lay, "zero0_with_cp"):
            d.ap.append(FieldNote(
                "plan.zero_stage",
                "0 with cp > 1: torchtitan always applies FSDP over the context-parallel ranks "
                "(parallel_dims.fsdp_enabled includes cp), so gradients and optimizer states are sharded over the "
                f"{p.cp} cp ranks (weights too, between steps): less memory than planned",
            ))
    else:
        par["data_parallel_replicate_degree"] = p.dp_replicate
        par["data_parallel_shard_degree"] = shard
        # torchtitan apply_fsdp: "always" reshards after forward, "never" keeps the parameters gathered through
        # the step, "default" = not pp_enabled. Zero 3 with PP is the job zero 2 builds (parameters kept gathered,
        # as the harness runs and the model predicts it: spaces/canonical.py sharding_stage), so both write
        # "never", one setting for one job
        stage = sharding_stage(stack_record("torch"), p.pp, p.zero_stage)
        par["fsdp_reshard_after_forward"] = "always" if stage == 3 else "never"
        if p.zero_stage == 3 and stage == 2:
            d.comments["parallelism.fsdp_reshard_after_forward"] = [
                "zero_stage 3 with pp > 1: torchtitan keeps the parameters unsharded through the step with PP "
                "(apply_fsdp: reshard_after_forward = not pp_enabled), the job zero_stage 2 builds"]
        if _converts(lay, "zero1_optimizer_only"):
            d.ap.append(FieldNote(
                "plan.zero_stage",
                "1 (optimizer states sharded): torchtitan has no optimizer-only sharding; written as FSDP2 "
                "with fsdp_reshard_after_forward=never (ZeRO-2: gradients sharded too), less memory at the "
                "same communication volume",
            ))
    if _converts(lay, "optimizer_offload_cpu"):
        d.tables["training"]["enable_cpu_offload"] = True
        d.ap.append(FieldNote(
            "plan.optimizer_offload",
            "cpu: torchtitan's training.enable_cpu_offload is FSDP2 CPUOffloadPolicy, which keeps parameters "
            "and gradients on the host too (copied in per layer) and steps the optimizer on the CPU; the plan "
            "offloads optimizer states only",
        ))


def _tensor_parallel(d: _Draft, lay: Layout, par: dict[str, Any]) -> None:
    """[parallelism] tensor_parallel_degree; torchtitan's TP always shards the norms along the sequence."""
    p = lay.plan
    par["tensor_parallel_degree"] = p.tp
    if _converts(lay, "seq_len_divisor"):
        d.un.append(FieldNote(
            "plan.tp",
            f"{p.tp} with cp {p.cp}: torchtitan asserts seq_len % (tp * 2 * cp) == 0 (parallelize_llama, "
            f"ParallelDims.seq_len_divisor) and seq_len {lay.scenario.training.seq_len} is not a multiple of "
            f"{2 * p.tp * p.cp}: torchtitan stops at start-up with this plan",
        ))
    if _converts(lay, "tp_without_sp"):
        d.ap.append(FieldNote(
            "plan.sequence_parallel",
            "false: torchtitan's llama3 TP plan always shards the norms along the sequence "
            "(SequenceParallel) and uses loss parallel; activations are smaller than planned",
        ))


def _zero_bubble_chunks(d: _Draft, lay: Layout) -> tuple[str, tuple[int, ...]]:
    """The torchtitan schedule and layers per chunk for stratagem's zero_bubble (ZB-H1): ZB-V or 1F1B."""
    p, m = lay.plan, lay.scenario.model
    uneven = p.first_stage_layers > 0 or p.last_stage_layers > 0
    if uneven:
        # ZB-V puts the first and the last chunk on rank 0: explicit first/last stage counts have no V form
        d.ap.append(FieldNote(
            "plan.pp_schedule",
            f"zero_bubble with first/last stage layers ({p.first_stage_layers}/{p.last_stage_layers}): "
            "torchtitan's zero-bubble schedule (ZBVZeroBubble) places two chunks per rank in a V, so the first "
            "and last stage share rank 0; written as 1F1B over the planned stages, whose bubble is "
            "(pp-1)/micro-batches instead of about a third of that",
        ))
        return "1F1B", lay.stage_layers
    if p.pp_split == "embedding_loss" and m.num_layers + 2 >= 2 * p.pp:
        # torchtitan generate_llm_fqn_per_model_part over the 2 pp V chunks, embedding and output as layers
        d.ap.append(FieldNote(
            "plan.pp_schedule",
            "zero_bubble (ZB-H1, one chunk per rank): written as ZBVZeroBubble (ZB-V), two chunks per rank in "
            "a V, the embedding and the loss counted as one layer each over the 2 pp chunks: a smaller bubble "
            "and one more P2P exchange per micro-batch",
        ))
        return _SCHEDULES["zero_bubble"], chunk_layers(m.num_layers, p.pp, 2, split="embedding_loss")
    if m.num_layers >= 2 * p.pp:
        # ZB-V: two chunks per rank in a V; stratagem's zero_bubble is ZB-H1 (one chunk per rank).
        base, extra = divmod(m.num_layers, 2 * p.pp)
        d.ap.append(FieldNote(
            "plan.pp_schedule",
            "zero_bubble (ZB-H1, one chunk per rank): torch.distributed.pipelining has no single-chunk "
            "zero-bubble schedule; written as ZBVZeroBubble (ZB-V), which splits each rank's layers into "
            "two chunks placed in a V: a smaller bubble and one more P2P exchange per micro-batch",
        ))
        return _SCHEDULES["zero_bubble"], tuple(base + (1 if i < extra else 0) for i in range(2 * p.pp))
    d.ap.append(FieldNote(
        "plan.pp_schedule",
        f"zero_bubble: torchtitan's only zero-bubble schedules need two chunks per rank and "
        f"{m.num_layers} layers cannot fill {2 * p.pp}; written as 1F1B, whose bubble is "
        "(pp-1)/micro-batches instead of about a third of that",
    ))
    return "1F1B", lay.stage_layers


def _pipeline_parallel(d: _Draft, lay: Layout, par: dict[str, Any]) -> None:
    """[parallelism] pipeline degree, schedule, microbatch size and the modules of each model chunk."""
    p = lay.plan
    par["pipeline_parallel_degree"] = p.pp
    if p.pp == 1:
        return
    schedule, stages = _SCHEDULES[p.pp_schedule], lay.stage_layers
    if stack_record("torch").schedule_exclusion(p.pp_schedule, p.cp, p.virtual_stages, "export") is not None:
        schedule, stages = _zero_bubble_chunks(d, lay)  # ZB-H1: spaces/exclusions.py, zero_bubble with one chunk
    par["pipeline_parallel_schedule"] = schedule
    par["pipeline_parallel_microbatch_size"] = p.micro_batch_size
    par["module_fqns_per_model_part"] = _stage_fqns(stages)
    d.comments["parallelism.module_fqns_per_model_part"] = [
        f"{len(stages)} chunk(s) of {'/'.join(map(str, stages))} layers; chunk i runs on pipeline rank "
        + ("in a V (0..pp-1, then back)" if len(stages) == 2 * p.pp and p.pp_schedule == "zero_bubble"
           else "i % pp (looped)")]


def _parallelism_table(d: _Draft, lay: Layout) -> None:
    """[parallelism]: data, tensor, pipeline, context and expert degrees, in torchtitan's key order."""
    p = lay.plan
    par: dict[str, Any] = {}
    _data_parallel(d, lay, par)
    _tensor_parallel(d, lay, par)
    _pipeline_parallel(d, lay, par)
    par["context_parallel_degree"] = p.cp
    if p.ep > 1:
        # the expert grid ep x etp folds over dp_shard x cp (x tp when etp = 1): torchtitan/distributed/
        # parallel_dims.py ParallelDims._validate allows etp = tp or etp = 1 (the export refuses others, rules.py)
        par["expert_parallel_degree"] = p.ep
        par["expert_tensor_parallel_degree"] = p.etp
    elif _converts(lay, "etp_without_ep"):
        d.ap.append(FieldNote(
            "plan.etp",
            f"1 with tp={p.tp} and ep=1: without expert parallelism torchtitan splits every routed expert over the "
            f"{p.tp} TP ranks (apply_moe_ep_tp: TensorParallel on the tp mesh), as etp={p.tp} does: less expert "
            "memory per rank than planned, plus the experts' TP collectives",
        ))
    d.tables["parallelism"] = par


def _recompute_notes(d: _Draft, lay: Layout) -> None:
    """The recompute choices torchtitan's per-layer / per-op AC cannot express: some layers, some modules."""
    p = lay.plan
    if p.recompute_layers and p.activation_checkpointing != "full":
        d.un.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: torchtitan applies {p.activation_checkpointing} recompute to every layer; it "
            "cannot limit it to some layers (only full recompute of every k-th layer)",
        ))
    if p.recompute_modules:  # Megatron --recompute-modules; torchtitan's AC is per layer or per op
        d.un.append(FieldNote(
            "plan.recompute_modules",
            f"{'+'.join(p.recompute_modules)}: torchtitan's apply_ac recomputes whole layers or by an op save "
            "list (torchtitan/distributed/activation_checkpoint.py); per-module recompute is not expressible",
        ))


def _activation_checkpoint_table(d: _Draft, lay: Layout) -> None:
    """[activation_checkpoint]: mode and selective option (op policy, or full AC of every k-th layer)."""
    p, m = lay.plan, lay.scenario.model
    ac: dict[str, Any] = {"mode": p.activation_checkpointing}
    if p.activation_checkpointing == "op":  # stratagem's op policy is torchtitan's: mode selective, option op
        ac = {"mode": "selective", "selective_ac_option": "op"}
    if p.recompute_layers and p.activation_checkpointing == "full":
        # torchtitan/distributed/activation_checkpoint.py: selective_ac_option "k" wraps every k-th block in full
        # AC; stratagem recomputes the first N layers of each stage: the same count, other layers.
        per_stage = max(1, m.num_layers // max(1, p.pp))
        every = max(1, round(per_stage / p.recompute_layers))
        ac = {"mode": "selective", "selective_ac_option": str(every)}
        d.ap.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: torchtitan recomputes every {every}-th layer in full (selective_ac_option "
            f"\"{every}\"), not the first {p.recompute_layers} of each stage: about the same recompute, spread "
            "over the stage",
        ))
    _recompute_notes(d, lay)
    if _converts(lay, "selective_recompute"):
        ac["selective_ac_option"] = "op"
        d.ap.append(FieldNote(
            "plan.activation_checkpointing",
            "selective (stratagem: recompute the MLP activation feeding the down projection, keep every "
            "matmul output): written as torchtitan's per-op selective AC, which also recomputes every second "
            "matmul output of each layer (it saves matmul and attention outputs except every second mm): "
            "less activation memory, more recompute than planned",
        ))
    d.tables["activation_checkpoint"] = ac


def _float8_tables(d: _Draft, lay: Layout) -> None:
    """[quantize.linear.float8] tensorwise recipe (float8 all-gather under FSDP) and [compile] for fp8 plans."""
    p = lay.plan
    if p.precision != "fp8":
        return
    d.tables["model"]["converters"] = ["quantize.linear.float8"]
    fsdp = d.tables["parallelism"].get("data_parallel_shard_degree", 1) > 1 or p.cp > 1
    d.tables["quantize.linear.float8"] = {
        "recipe_name": "tensorwise",
        "enable_fsdp_float8_all_gather": fsdp,
        "precompute_float8_dynamic_scale_for_fsdp": fsdp,
        "filter_fqns": ["output"],
    }
    d.tables["compile"] = {"enable": True, "components": ["model", "loss"]}
    d.comments["compile.enable"] = ["docs/float8.md: float8 training is meant to run under torch.compile"]


def _metrics_table(d: _Draft, lay: Layout) -> None:
    """[metrics]: a throughput check logs every step (torchtitan/components/metrics.py MetricsProcessor.log: tps,
    tflops and mfu per log step; job_config.py Metrics.log_freq defaults to 10)."""
    if lay.throughput_check:
        d.tables["metrics"] = {"log_freq": 1}
        d.comments["metrics.log_freq"] = [
            f"every step's tokens/s per GPU (tps), TFLOP/s and MFU; leave out the first {THROUGHPUT_WARMUP} (warm-up)"]


def _checkpoint_table(d: _Draft, lay: Layout, checkpoint_interval: int | None) -> None:
    """[checkpoint]: enabled, async or blocking, and the interval in steps when a step time is known; a throughput
    check writes none (torchtitan saves at every interval and at the last step: components/checkpoint.py
    CheckpointManager._should_save), the full run's settings in a comment."""
    ck = lay.scenario.training.checkpoint
    full: dict[str, Any] = {"enable": True, "async_mode": "async" if ck.mode == "async" else "disabled"}
    if checkpoint_interval is not None:
        full["interval"] = checkpoint_interval
    else:
        d.un.append(FieldNote(
            "training.checkpoint.interval_minutes",
            "torchtitan counts the checkpoint interval in steps; no step time was given to convert it "
            "(export from a study, or pass an evaluation), so torchtitan's default interval stays",
        ))
    if lay.throughput_check:
        d.tables["checkpoint"] = {"enable": False}
        d.comments["checkpoint.enable"] = [
            "no checkpoint inside this throughput check; the full run sets "
            + ", ".join(f"{k} = {_toml_value(v)}" for k, v in full.items())]
        return
    d.tables["checkpoint"] = full
    if checkpoint_interval is not None:
        d.comments["checkpoint.interval"] = ["steps between checkpoints, from the evaluation's interval and step time"]


def _render(d: _Draft, lay: Layout) -> ExportBundle:
    """The bundle: header, torchrun command and notes as comments above the TOML tables."""
    head = header_lines(lay, f"torchtitan {TORCHTITAN_VERSION} (pytorch/torchtitan@{TORCHTITAN_COMMIT[:12]}), "
                             "TOML job config (torchtitan/config/job_config.py)")
    run = (f"Run on each node: torchrun --nnodes {lay.nodes} --nproc-per-node {lay.procs_per_node} "
           f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{RDZV_PORT} -m torchtitan.train "
           f"--job.config_file {CONFIG_FILE}")
    notes = note_lines(d.un, d.ap, f"torchtitan {TORCHTITAN_VERSION}")
    text = "\n".join([*[f"# {x}" for x in head], f"# {run}", *[f"# {x}" for x in notes], "",
                      to_toml(d.tables, d.comments)])
    return ExportBundle(target="torchtitan", main=CONFIG_FILE, files={CONFIG_FILE: text},
                        unexpressed=d.un, approximated=d.ap)


def export_torchtitan(lay: Layout, checkpoint_interval: int | None = None) -> ExportBundle:
    """torchtitan.toml: parallel degrees, FSDP/HSDP, pipeline schedule and split, activation checkpointing,
    batch sizes, mixed precision, float8; what torchtitan v0.2.2 cannot express is listed in the file."""
    d = _Draft(tables={name: {} for name in _TABLE_ORDER})
    _job_table(d, lay)
    _metrics_table(d, lay)
    _model_table(d, lay)
    _optimizer_table(d, lay)
    _training_table(d, lay)
    _parallelism_table(d, lay)
    _activation_checkpoint_table(d, lay)
    _float8_tables(d, lay)
    _checkpoint_table(d, lay, checkpoint_interval)
    return _render(d, lay)
