"""deepspeed target: a ds_config JSON and a README next to it.

Verified against DeepSpeed 0.19.8 (PyPI), by reading and by running its own parser in the tests:
  deepspeed/runtime/config.py                    DeepSpeedConfig: batch triple, bf16, pipeline, removed keys
  deepspeed/runtime/zero/config.py               DeepSpeedZeroConfig (pydantic, extra keys forbidden)
  deepspeed/runtime/zero/offload_config.py       offload_optimizer {device, pin_memory}
  deepspeed/runtime/activation_checkpointing/config.py   the activation_checkpointing keys
  deepspeed/runtime/tensor_parallel/config.py    tensor_parallel.autotp_size (AutoTP training)
  deepspeed/runtime/pipe/engine.py               pipeline.activation_checkpoint_interval seeds PipelineModule
The notes (fields DeepSpeed's config cannot express) go in two places: the `_stratagem` key of the JSON, which
DeepSpeed ignores (it reads known keys only and rejects only removed ones), and README.md beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stratagem.launch.export.bundle import ExportBundle, FieldNote, Layout, header_lines, note_lines
from stratagem.launch.export.model_fields import model_constants
from stratagem.spaces.model import ModelSpec

__all__ = ["DEEPSPEED_VERSION", "COMMENT_KEY", "export_deepspeed", "ds_config"]

DEEPSPEED_VERSION = "0.19.8"
COMMENT_KEY = "_stratagem"
CONFIG_FILE = "ds_config.json"
README_FILE = "README.md"


@dataclass
class _Notes:
    """The fields an export cannot express (un) and those it writes approximately (ap), in the order found."""

    un: list[FieldNote] = field(default_factory=list)
    ap: list[FieldNote] = field(default_factory=list)


def _batch_and_precision(lay: Layout, notes: _Notes) -> dict[str, Any]:
    """The batch triple (global, micro, accumulation) and bf16; fp8 matmuls noted (no config key)."""
    p, tr = lay.plan, lay.scenario.training
    cfg: dict[str, Any] = {
        "train_batch_size": tr.global_batch_size,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": lay.grad_accum,
        "bf16": {"enabled": p.precision in ("bf16", "fp8")},
    }
    if p.precision == "fp8":
        notes.un.append(FieldNote(
            "plan.precision",
            "fp8: DeepSpeed's config has no FP8 matmul setting (bf16 is enabled here); run the matmuls in FP8 "
            "from the model code, e.g. Transformer Engine's fp8_autocast",
        ))
    return cfg


def _zero_optimization(lay: Layout, cfg: dict[str, Any], notes: _Notes) -> None:
    """zero_optimization: stage, overlap, optimizer offload (with DeepSpeed's CPU AdamW); no hybrid sharding."""
    p = lay.plan
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        zero["overlap_comm"] = True
        zero["contiguous_gradients"] = True
    if p.zero_stage in (1, 2):
        zero["reduce_scatter"] = True
    if p.optimizer_offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # ZeRO-Offload wants DeepSpeed's own CPU Adam, built from this section
        if lay.scenario.training.optimizer == "adamw":
            cfg["optimizer"] = {"type": "AdamW"}
    cfg["zero_optimization"] = zero
    if p.zero_stage >= 1 and p.dp_replicate > 1:
        notes.un.append(FieldNote(
            "plan.dp_replicate",
            f"{p.dp_replicate}: DeepSpeed {DEEPSPEED_VERSION} has no hybrid sharding (MiCS was removed; ZeRO++ "
            "hpZ only adds a secondary weight copy), so ZeRO shards over all data-parallel ranks: less memory, "
            "more cross-node traffic than planned",
        ))


def _activation_checkpointing(lay: Layout, cfg: dict[str, Any], notes: _Notes) -> None:
    """activation_checkpointing and pipeline.activation_checkpoint_interval; what the model code must wrap."""
    p = lay.plan
    if p.activation_checkpointing != "none":
        cfg["activation_checkpointing"] = {
            "partition_activations": p.tp > 1 and p.sequence_parallel,
            "contiguous_memory_optimization": False,
            "cpu_checkpointing": False,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        }
    if p.pp > 1:
        cfg["pipeline"] = {"activation_checkpoint_interval": 1 if p.activation_checkpointing == "full" else 0}
    if p.activation_checkpointing == "selective":
        notes.un.append(FieldNote(
            "plan.activation_checkpointing",
            "selective: DeepSpeed's config cannot choose what to recompute; in the model code wrap the MLP "
            "activation (act(gate) * up, the down projection's input) in deepspeed.checkpointing.checkpoint",
        ))
    elif p.activation_checkpointing == "op":
        notes.un.append(FieldNote(
            "plan.activation_checkpointing",
            "op: DeepSpeed's config has no per-op recompute policy; in the model code wrap each layer with "
            "torch.utils.checkpoint and a selective checkpoint policy that saves matmul and attention outputs",
        ))
    elif p.activation_checkpointing == "full" and p.pp == 1:
        notes.un.append(FieldNote(
            "plan.activation_checkpointing",
            "full: without a PipelineModule DeepSpeed recomputes only what the model code wraps: call "
            "deepspeed.checkpointing.checkpoint around every transformer layer (the activation_checkpointing "
            "section configures that function)",
        ))


def _recompute_notes(lay: Layout, notes: _Notes) -> None:
    """Per-module and first-N-layers recompute: not expressible in DeepSpeed's config."""
    p = lay.plan
    if p.recompute_modules:  # Megatron --recompute-modules; DeepSpeed checkpoints whole wrapped layers
        notes.un.append(FieldNote(
            "plan.recompute_modules",
            f"{'+'.join(p.recompute_modules)}: DeepSpeed's activation checkpointing recomputes whole wrapped layers "
            "(deepspeed/runtime/activation_checkpointing/checkpointing.py checkpoint); per-module recompute is "
            "not expressible in its config",
        ))
    if p.recompute_layers:
        notes.un.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: DeepSpeed's config recomputes every wrapped layer (PipelineModule's "
            "activation_checkpoint_interval spaces them evenly); wrap only the first "
            f"{p.recompute_layers} layers of each stage in the model code",
        ))


def _tensor_parallel(lay: Layout, cfg: dict[str, Any], notes: _Notes) -> None:
    """tensor_parallel.autotp_size (AutoTP training); no Megatron-style sequence parallelism."""
    p = lay.plan
    if p.tp == 1:
        return
    cfg["tensor_parallel"] = {"autotp_size": p.tp}
    notes.ap.append(FieldNote(
        "plan.tp",
        f"{p.tp}: written as AutoTP training (tensor_parallel.autotp_size), which splits the Linear layers "
        "of supported Hugging Face models column/row-wise like Megatron TP; give deepspeed.initialize an "
        f"mpu or mesh so its data-parallel size is dp={p.dp}",
    ))
    if p.sequence_parallel:
        notes.un.append(FieldNote(
            "plan.sequence_parallel",
            "true: AutoTP keeps norm and dropout activations replicated across the TP group (no Megatron-"
            "style sequence parallelism): more activation memory than planned",
        ))


def _pipeline_notes(lay: Layout, notes: _Notes) -> None:
    """Pipeline stages, split, schedule and virtual stages: DeepSpeed builds its PipelineModule in code."""
    p = lay.plan
    if p.pp == 1:
        return
    notes.un.append(FieldNote(
        "plan.pp",
        f"{p.pp}: DeepSpeed's pipeline is built in code: PipelineModule(layers, num_stages={p.pp}, "
        "partition_method='uniform'); the config holds only its activation_checkpoint_interval",
    ))
    # PipelineModule partitions in code (partition_method 'uniform', 'parameters' or 'type:...'): explicit
    # first/last stage sizes and counting the embedding/loss as layers are not config keys
    for name, value, default in (("first_stage_layers", p.first_stage_layers, 0),
                                 ("last_stage_layers", p.last_stage_layers, 0), ("pp_split", p.pp_split, "layers")):
        if value != default:
            notes.un.append(FieldNote(
                f"plan.{name}",
                f"{value}: DeepSpeed's PipelineModule partitions in code (partition_method 'uniform', "
                "'parameters' or 'type:...'); give it explicit layer boundaries to get this split",
            ))
    if p.pp_schedule != "1f1b":
        notes.un.append(FieldNote(
            "plan.pp_schedule",
            f"{p.pp_schedule}: DeepSpeed's PipelineEngine runs one schedule (TrainSchedule, 1F1B-like); "
            "it has no GPipe, interleaved or zero-bubble variant",
        ))
    if p.virtual_stages > 1:
        notes.un.append(FieldNote(
            "plan.virtual_stages",
            f"{p.virtual_stages}: DeepSpeed's PipelineModule holds one chunk per stage (no interleaving): "
            "the bubble is (pp-1)/micro-batches instead of that over virtual_stages",
        ))


def _sequence_parallel(lay: Layout, cfg: dict[str, Any], notes: _Notes) -> None:
    """sequence_parallel_size: context parallelism written as DeepSpeed-Ulysses."""
    p, m = lay.plan, lay.scenario.model
    if p.cp == 1:
        return
    cfg["sequence_parallel_size"] = p.cp
    notes.ap.append(FieldNote(
        "plan.cp",
        f"{p.cp}: written as DeepSpeed-Ulysses sequence parallelism (sequence_parallel_size), which swaps "
        "sequence and head shards with all-to-all instead of ring attention's KV exchange; the heads "
        f"({m.num_attention_heads}) and kv heads ({m.kv_heads}) must divide by {p.cp}, and the model code "
        "sets it up (deepspeed.sequence.layer.DistributedAttention)",
    ))


def _expert_notes(lay: Layout, notes: _Notes) -> None:
    """Expert and expert-tensor parallelism: set on deepspeed.moe.layer.MoE in the model code."""
    p = lay.plan
    if p.ep > 1:
        notes.un.append(FieldNote(
            "plan.ep",
            f"{p.ep}: expert parallelism is set in the model code: deepspeed.moe.layer.MoE(..., ep_size={p.ep})",
        ))
    if p.etp > 1:
        notes.un.append(FieldNote(
            "plan.etp",
            f"{p.etp}: expert tensor parallelism is set in the model code: deepspeed.moe.layer.MoE(..., "
            "enable_expert_tensor_parallelism=True), which splits each expert over the model-parallel group",
        ))


def _model_and_checkpoint_notes(lay: Layout, notes: _Notes) -> None:
    """The model (built in the user's code, its dimensions and constants) and checkpointing (in the loop)."""
    m, tr = lay.scenario.model, lay.scenario.training
    notes.un.append(FieldNote(
        "model",
        "DeepSpeed's config does not describe the model: build it in your code "
        f"({m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads}/{m.kv_heads} heads, "
        f"ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, {m.mlp}, {m.norm}, seq_len {tr.seq_len}, "
        + _constants(m) + ")",
    ))
    notes.un.append(FieldNote(
        "training.checkpoint",
        f"{tr.checkpoint.mode}: DeepSpeed saves when the training loop calls engine.save_checkpoint(); "
        "call it at the interval the evaluation gives",
    ))


def ds_config(lay: Layout) -> tuple[dict[str, Any], list[FieldNote], list[FieldNote]]:
    """The DeepSpeed config (without the comment key) and the unexpressed / approximated fields."""
    notes = _Notes()
    cfg = _batch_and_precision(lay, notes)
    _zero_optimization(lay, cfg, notes)
    _activation_checkpointing(lay, cfg, notes)
    _recompute_notes(lay, notes)
    _tensor_parallel(lay, cfg, notes)
    _pipeline_notes(lay, notes)
    _sequence_parallel(lay, cfg, notes)
    _expert_notes(lay, notes)
    _model_and_checkpoint_notes(lay, notes)
    return cfg, notes.un, notes.ap


def _constants(m: ModelSpec) -> str:
    """`rope_theta X, rope_scaling ... , norm eps Y (as SOURCE)`: the model constants a hand-built model must not
    default (launch/export/rope.py: DeepSpeed builds no model, so they are named for the one you build)."""
    c = model_constants(m)
    rope = f"rope_theta {c.rope_theta}, " if c.rope_theta is not None else "learned positions, "
    scaling = f"{c.rope_scaling.words()}, " if c.rope_scaling is not None else ""
    return rope + scaling + f"norm eps {c.norm_eps:g}" + (
        f" as {c.source}" if c.source else f" (not known for {m.name}: set your checkpoint's, rope_scaling too)")


def export_deepspeed(lay: Layout, checkpoint_interval: int | None = None) -> ExportBundle:
    """ds_config.json (notes under its `_stratagem` key) and README.md (the same notes, the launch line)."""
    cfg, un, ap = ds_config(lay)
    if checkpoint_interval is not None:
        un = [FieldNote(n.field, n.why.replace("at the interval the evaluation gives",
                                               f"every {checkpoint_interval} steps"))
              if n.field == "training.checkpoint" else n for n in un]
    target = f"DeepSpeed {DEEPSPEED_VERSION} ds_config JSON (deepspeed/runtime/config.py)"
    head = header_lines(lay, target)
    notes = note_lines(un, ap, f"DeepSpeed {DEEPSPEED_VERSION}")
    launch = (f"deepspeed --num_nodes {lay.nodes} --num_gpus {lay.procs_per_node} --hostfile hostfile "
              f"your_train.py --deepspeed --deepspeed_config {CONFIG_FILE}")
    comment = {
        "export": head,
        "unexpressed": [n.line() for n in un],
        "approximated": [n.line() for n in ap],
        "readme": README_FILE,
    }
    text = json.dumps({COMMENT_KEY: comment, **cfg}, indent=2) + "\n"
    readme = "\n".join([
        f"# DeepSpeed config from stratagem ({CONFIG_FILE})",
        "",
        *[f"    {x}" for x in head],
        "",
        f"Launch: `{launch}`",
        "",
        f"The notes below are also in the `{COMMENT_KEY}` key of {CONFIG_FILE}; DeepSpeed ignores that key.",
        "Optimizer hyperparameters, data (PLACEHOLDER: yours), tokenizer (PLACEHOLDER: yours) and the model are "
        "your training script's.",
        f"Steps: {lay.steps_comment()}.",
        "",
        *[f"    {x}" for x in notes],
        "",
    ])
    return ExportBundle(target="deepspeed", main=CONFIG_FILE, files={CONFIG_FILE: text, README_FILE: readme},
                        unexpressed=un, approximated=ap)
