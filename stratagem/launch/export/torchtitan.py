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
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.pipeline_split import chunk_layers

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


def export_torchtitan(lay: Layout, checkpoint_interval: int | None = None) -> ExportBundle:
    """torchtitan.toml: parallel degrees, FSDP/HSDP, pipeline schedule and split, activation checkpointing,
    batch sizes, mixed precision, float8; what torchtitan v0.2.2 cannot express is listed in the file."""
    s, p = lay.scenario, lay.plan
    m, tr = s.model, s.training
    un: list[FieldNote] = []
    ap: list[FieldNote] = []
    tables: dict[str, dict[str, Any]] = {
        "job": {}, "model": {}, "optimizer": {}, "lr_scheduler": {}, "training": {}, "parallelism": {}, "activation_checkpoint": {},
        "checkpoint": {}, "compile": {}, "quantize.linear.float8": {},
    }
    comments: dict[str, list[str]] = {}
    tables["job"] = {"description": f"stratagem: {s.name}, {p.short()}", "dump_folder": "./outputs"}

    # model
    flavor = llama3_flavor(m)
    if flavor is None:
        flavor = f"stratagem_{_slug(m.name)}"
        arch = (f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.kv_heads} kv, "
                f"head_dim {m.dim_head}, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, {m.mlp}, {m.norm}, "
                f"bias {m.bias}, {m.position_embedding}, tied {str(m.tied_embeddings).lower()}"
                + (f", moe {m.moe.num_experts}x top{m.moe.top_k} ffn {m.moe.expert_ffn_hidden_size}" if m.moe else ""))
        un.append(FieldNote(
            "model",
            f"torchtitan builds models from registered flavors only (llama3: {', '.join(LLAMA3_FLAVORS)}) and "
            f"none has this architecture ({arch}); flavor {flavor!r} is written so that torchtitan stops "
            "with an unknown-flavor error until you register it",
        ))
    tables["model"] = {"name": "llama3", "flavor": flavor, "hf_assets_path": "./assets/hf/REPLACE-ME"}
    consts = model_constants(m, default_theta=500000)  # torchtitan llama3 TransformerModelArgs defaults
    comments["model.flavor"] = [
        f"rope_theta {consts.rope_theta}, norm_eps {consts.norm_eps:g}: "
        + (f"as {consts.source}; " if consts.source else f"not known for {m.name}; ")
        + "torchtitan fixes both in the registered flavor (torchtitan/models/llama3/__init__.py: "
        "TransformerModelArgs), so a flavor registered for this model must set them",
        torchtitan_rope_comment(m)]
    comments["model.hf_assets_path"] = [
        "PLACEHOLDER: the directory holding your tokenizer (torchtitan's scripts/download_hf_assets.py), "
        f"whose vocabulary must have {m.vocab_size} entries"]

    # optimizer
    if tr.optimizer == "adamw":
        tables["optimizer"] = {"name": "AdamW"}
    else:
        un.append(FieldNote("training.optimizer",
                            f"{tr.optimizer}: torchtitan's build_optimizers offers Adam and AdamW only"))

    # batch: torchtitan's local_batch_size is per data-parallel rank per gradient-accumulation step; with
    # pipelining it is split into microbatches of pipeline_parallel_microbatch_size.
    training: dict[str, Any] = {"seq_len": tr.seq_len, "global_batch_size": tr.global_batch_size}
    if p.pp > 1:
        training["local_batch_size"] = p.micro_batch_size * lay.grad_accum
        comments["training.local_batch_size"] = [
            f"all {lay.grad_accum} micro-batch(es) go through the pipeline in one step (no gradient accumulation)"]
    else:
        training["local_batch_size"] = p.micro_batch_size
        comments["training.global_batch_size"] = [
            f"= local_batch_size x data-parallel degree x {lay.grad_accum} gradient accumulation step(s)"]
    training["steps"] = lay.run_steps
    comments["training.steps"] = [lay.steps_comment()]
    training["dataset"] = "c4_test"
    comments["training.dataset"] = ["PLACEHOLDER: torchtitan's bundled test slice of C4, for a throughput check; "
                                    "set your dataset (and dataset_path) to train"]
    # the scheduler's warm-up must fit in the run (torchtitan's default is 200 steps)
    tables["lr_scheduler"]["warmup_steps"] = min(THROUGHPUT_WARMUP, lay.run_steps)

    # precision
    if p.precision == "fp32":
        training["mixed_precision_param"] = "float32"
    else:
        training["mixed_precision_param"] = "bfloat16"
    training["mixed_precision_reduce"] = "float32"

    # data parallel: stratagem shards ZeRO over dp*cp / dp_replicate ranks, as torchtitan's FSDP does over
    # dp_shard x cp; dp_replicate are the HSDP replicas.
    par: dict[str, Any] = {}
    multi_d = p.tp * p.pp * p.cp > 1
    shard = p.dp // p.dp_replicate if p.zero_stage >= 1 else 1
    if shard == 1 and p.cp == 1:
        # Nothing is sharded: plain data parallelism (DDP), which torchtitan allows only on its own.
        if p.zero_stage == 0:
            field, why = "plan.zero_stage", "0 (DDP)"
        else:
            field, why = "plan.dp_replicate", f"{p.dp_replicate} = dp (every rank a full replica: DDP)"
        if p.dp > 1 and multi_d:
            par["data_parallel_replicate_degree"] = 1
            par["data_parallel_shard_degree"] = p.dp
            par["fsdp_reshard_after_forward"] = "never"
            ap.append(FieldNote(
                field,
                f"{why}: torchtitan supports DDP only as the sole parallelism "
                "(parallelize.py raises 'DDP has not supported > 1D parallelism'); written as FSDP2 with "
                "fsdp_reshard_after_forward=never, which also shards gradients and optimizer states over the "
                f"{p.dp} dp ranks (ZeRO-2): less memory than planned, plus a weight all-gather per step",
            ))
        else:
            par["data_parallel_replicate_degree"] = p.dp
            par["data_parallel_shard_degree"] = 1
    elif p.zero_stage == 0:
        # cp > 1: torchtitan applies FSDP over dp_shard x cp whenever cp > 1.
        par["data_parallel_replicate_degree"] = p.dp
        par["data_parallel_shard_degree"] = 1
        par["fsdp_reshard_after_forward"] = "never"
        ap.append(FieldNote(
            "plan.zero_stage",
            "0 with cp > 1: torchtitan always applies FSDP over the context-parallel ranks "
            "(parallel_dims.fsdp_enabled includes cp), so gradients and optimizer states are sharded over the "
            f"{p.cp} cp ranks (weights too, between steps): less memory than planned",
        ))
    else:
        par["data_parallel_replicate_degree"] = p.dp_replicate
        par["data_parallel_shard_degree"] = shard
        par["fsdp_reshard_after_forward"] = "always" if p.zero_stage == 3 else "never"
        if p.zero_stage == 1:
            ap.append(FieldNote(
                "plan.zero_stage",
                "1 (optimizer states sharded): torchtitan has no optimizer-only sharding; written as FSDP2 "
                "with fsdp_reshard_after_forward=never (ZeRO-2: gradients sharded too), less memory at the "
                "same communication volume",
            ))
    if p.optimizer_offload == "cpu":
        training["enable_cpu_offload"] = True
        ap.append(FieldNote(
            "plan.optimizer_offload",
            "cpu: torchtitan's training.enable_cpu_offload is FSDP2 CPUOffloadPolicy, which keeps parameters "
            "and gradients on the host too (copied in per layer) and steps the optimizer on the CPU; the plan "
            "offloads optimizer states only",
        ))

    par["tensor_parallel_degree"] = p.tp
    if p.tp > 1 and not p.sequence_parallel:
        ap.append(FieldNote(
            "plan.sequence_parallel",
            "false: torchtitan's llama3 TP plan always shards the norms along the sequence "
            "(SequenceParallel) and uses loss parallel; activations are smaller than planned",
        ))

    par["pipeline_parallel_degree"] = p.pp
    if p.pp > 1:
        par["pipeline_parallel_schedule"] = _SCHEDULES[p.pp_schedule]
        par["pipeline_parallel_microbatch_size"] = p.micro_batch_size
        stages = lay.stage_layers
        uneven = p.first_stage_layers > 0 or p.last_stage_layers > 0
        if p.pp_schedule == "zero_bubble" and uneven:
            # ZB-V puts the first and the last chunk on rank 0: explicit first/last stage counts have no V form
            par["pipeline_parallel_schedule"] = "1F1B"
            ap.append(FieldNote(
                "plan.pp_schedule",
                f"zero_bubble with first/last stage layers ({p.first_stage_layers}/{p.last_stage_layers}): "
                "torchtitan's zero-bubble schedule (ZBVZeroBubble) places two chunks per rank in a V, so the first "
                "and last stage share rank 0; written as 1F1B over the planned stages, whose bubble is "
                "(pp-1)/micro-batches instead of about a third of that",
            ))
        elif p.pp_schedule == "zero_bubble" and p.pp_split == "embedding_loss" and m.num_layers + 2 >= 2 * p.pp:
            # torchtitan generate_llm_fqn_per_model_part over the 2 pp V chunks, embedding and output as layers
            stages = chunk_layers(m.num_layers, p.pp, 2, split="embedding_loss")
            ap.append(FieldNote(
                "plan.pp_schedule",
                "zero_bubble (ZB-H1, one chunk per rank): written as ZBVZeroBubble (ZB-V), two chunks per rank in "
                "a V, the embedding and the loss counted as one layer each over the 2 pp chunks: a smaller bubble "
                "and one more P2P exchange per micro-batch",
            ))
        elif p.pp_schedule == "zero_bubble" and m.num_layers >= 2 * p.pp:
            # ZB-V: two chunks per rank in a V; stratagem's zero_bubble is ZB-H1 (one chunk per rank).
            base, extra = divmod(m.num_layers, 2 * p.pp)
            stages = tuple(base + (1 if i < extra else 0) for i in range(2 * p.pp))
            ap.append(FieldNote(
                "plan.pp_schedule",
                "zero_bubble (ZB-H1, one chunk per rank): torch.distributed.pipelining has no single-chunk "
                "zero-bubble schedule; written as ZBVZeroBubble (ZB-V), which splits each rank's layers into "
                "two chunks placed in a V: a smaller bubble and one more P2P exchange per micro-batch",
            ))
        elif p.pp_schedule == "zero_bubble":
            par["pipeline_parallel_schedule"] = "1F1B"
            ap.append(FieldNote(
                "plan.pp_schedule",
                f"zero_bubble: torchtitan's only zero-bubble schedules need two chunks per rank and "
                f"{m.num_layers} layers cannot fill {2 * p.pp}; written as 1F1B, whose bubble is "
                "(pp-1)/micro-batches instead of about a third of that",
            ))
        par["module_fqns_per_model_part"] = _stage_fqns(stages)
        comments["parallelism.module_fqns_per_model_part"] = [
            f"{len(stages)} chunk(s) of {'/'.join(map(str, stages))} layers; chunk i runs on pipeline rank "
            + ("in a V (0..pp-1, then back)" if len(stages) == 2 * p.pp and p.pp_schedule == "zero_bubble"
               else "i % pp (looped)")]
    par["context_parallel_degree"] = p.cp
    if p.ep > 1:
        # the expert grid ep x etp folds over dp_shard x cp (x tp when etp = 1): torchtitan/distributed/
        # parallel_dims.py ParallelDims._validate allows etp = tp or etp = 1 (the export refuses others, rules.py)
        par["expert_parallel_degree"] = p.ep
        par["expert_tensor_parallel_degree"] = p.etp
    tables["parallelism"] = par

    # activation checkpointing
    ac: dict[str, Any] = {"mode": p.activation_checkpointing}
    if p.activation_checkpointing == "op":  # stratagem's op policy is torchtitan's: mode selective, option op
        ac = {"mode": "selective", "selective_ac_option": "op"}
    if p.recompute_layers and p.activation_checkpointing == "full":
        # torchtitan/distributed/activation_checkpoint.py: selective_ac_option "k" wraps every k-th block in full
        # AC; stratagem recomputes the first N layers of each stage: the same count, other layers.
        per_stage = max(1, m.num_layers // max(1, p.pp))
        every = max(1, round(per_stage / p.recompute_layers))
        ac = {"mode": "selective", "selective_ac_option": str(every)}
        ap.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: torchtitan recomputes every {every}-th layer in full (selective_ac_option "
            f"\"{every}\"), not the first {p.recompute_layers} of each stage: about the same recompute, spread "
            "over the stage",
        ))
    elif p.recompute_layers:
        un.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: torchtitan applies {p.activation_checkpointing} recompute to every layer; it "
            "cannot limit it to some layers (only full recompute of every k-th layer)",
        ))
    if p.recompute_modules:  # Megatron --recompute-modules; torchtitan's AC is per layer or per op
        un.append(FieldNote(
            "plan.recompute_modules",
            f"{'+'.join(p.recompute_modules)}: torchtitan's apply_ac recomputes whole layers or by an op save "
            "list (torchtitan/distributed/activation_checkpoint.py); per-module recompute is not expressible",
        ))
    if p.activation_checkpointing == "selective":
        ac["selective_ac_option"] = "op"
        ap.append(FieldNote(
            "plan.activation_checkpointing",
            "selective (stratagem: recompute the MLP activation feeding the down projection, keep every "
            "matmul output): written as torchtitan's per-op selective AC, which also recomputes every second "
            "matmul output of each layer (it saves matmul and attention outputs except every second mm): "
            "less activation memory, more recompute than planned",
        ))
    tables["activation_checkpoint"] = ac

    # float8
    if p.precision == "fp8":
        tables["model"]["converters"] = ["quantize.linear.float8"]
        fsdp = par.get("data_parallel_shard_degree", 1) > 1 or p.cp > 1
        tables["quantize.linear.float8"] = {
            "recipe_name": "tensorwise",
            "enable_fsdp_float8_all_gather": fsdp,
            "precompute_float8_dynamic_scale_for_fsdp": fsdp,
            "filter_fqns": ["output"],
        }
        tables["compile"] = {"enable": True, "components": ["model", "loss"]}
        comments["compile.enable"] = ["docs/float8.md: float8 training is meant to run under torch.compile"]

    # checkpoint policy
    ck = tr.checkpoint
    tables["checkpoint"] = {"enable": True, "async_mode": "async" if ck.mode == "async" else "disabled"}
    if checkpoint_interval is not None:
        tables["checkpoint"]["interval"] = checkpoint_interval
        comments["checkpoint.interval"] = ["steps between checkpoints, from the evaluation's interval and step time"]
    else:
        un.append(FieldNote(
            "training.checkpoint.interval_minutes",
            "torchtitan counts the checkpoint interval in steps; no step time was given to convert it "
            "(export from a study, or pass an evaluation), so torchtitan's default interval stays",
        ))
    tables["training"] = training

    head = header_lines(lay, f"torchtitan {TORCHTITAN_VERSION} (pytorch/torchtitan@{TORCHTITAN_COMMIT[:12]}), "
                             "TOML job config (torchtitan/config/job_config.py)")
    run = (f"Run on each node: torchrun --nnodes {lay.nodes} --nproc-per-node {lay.procs_per_node} "
           f"--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:{RDZV_PORT} -m torchtitan.train "
           f"--job.config_file {CONFIG_FILE}")
    notes = note_lines(un, ap, f"torchtitan {TORCHTITAN_VERSION}")
    text = "\n".join([*[f"# {x}" for x in head], f"# {run}", *[f"# {x}" for x in notes], "",
                      to_toml(tables, comments)])
    return ExportBundle(target="torchtitan", main=CONFIG_FILE, files={CONFIG_FILE: text},
                        unexpressed=un, approximated=ap)
