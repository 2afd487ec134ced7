"""megatron target: a bash script with Megatron-LM's pretrain_gpt.py arguments.

Verified against NVIDIA/Megatron-LM tag core_v0.19.0, commit 5be9626709af2722333bf54797c954c09edeada3
(2026-08-19), by building its real parser (megatron/training/arguments.py `add_megatron_arguments`, which also
generates options from TransformerConfig and the megatron/training/config dataclasses) and reading:
  arguments.py validate_args   pipeline split rules (num_layers % pp, --num-layers-per-virtual-pipeline-stage,
                               --pipeline-model-parallel-layout), Megatron-FSDP needs --ckpt-format
                               fsdp_dtensor, --optimizer-cpu-offload needs --use-precision-aware-optimizer
  core/transformer/transformer_config.py   --recompute-modules (core_attn, moe_act, layernorm, mlp, ...)
  core/transformer/pipeline_parallel_layer_layout.py   the layout string: E, t, L, stages split by '|'
  core/distributed/fsdp/mcore_fsdp_adapter.py   --num-distributed-optimizer-instances > 1 enables HSDP
  training/vocab_utils.py      vocabulary padding to a multiple of 128 x tp
The option names, nargs and types used here are checked in at tests/launch/golden/megatron_options.json.
The model arguments (MODEL_ARGS) and the pinned release live in megatron_model.py.
"""

from __future__ import annotations

import shlex

from stratagem.launch.export.bundle import (
    ExportBundle,
    FieldNote,
    Layout,
    comment_safe,
    header_lines,
    master_addr_line,
    note_lines,
)
from stratagem.launch.export.megatron_model import MEGATRON_COMMIT, MEGATRON_VERSION, Notes, model_args
from stratagem.launch.export.model_fields import THROUGHPUT_WARMUP
from stratagem.spaces.plan import Plan

__all__ = ["export_megatron", "megatron_args", "full_run_save_args",
           "pipeline_layout"]

SCRIPT_FILE = "megatron.sh"


def pipeline_layout(stage_layers: tuple[int, ...]) -> str:
    """Megatron's --pipeline-model-parallel-layout for these chunk sizes: embedding first, loss last."""
    stages = []
    for i, n in enumerate(stage_layers):
        part = ("E" if i == 0 else "") + (f"t*{n}" if n > 1 else "t" * n)
        if i == len(stage_layers) - 1:
            part += "L"
        stages.append(part)
    return "|".join(stages)


def _overlap_refused(plan: Plan) -> bool:
    """Whether Megatron refuses the MoE all-to-all overlap for this plan (evaluators/ep_overlap.py's predicate)."""
    from stratagem.evaluators.ep_overlap import a2a_overlap_refused
    from stratagem.spaces.columns import PlanColumns

    return bool(a2a_overlap_refused(PlanColumns.from_plans([plan]))[0])


def _pipeline_args(lay: Layout, notes: Notes) -> list[str]:
    """The pipeline split (uneven first/last, embedding/loss, layout, virtual stages); schedule noted."""
    p = lay.plan
    if p.pp == 1:
        return []
    par: list[str] = []
    v = p.virtual_stages
    if p.first_stage_layers or p.last_stage_layers:
        # uneven stages (transformer_config.py: the middle stages split the rest evenly)
        if p.first_stage_layers:
            par += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
        if p.last_stage_layers:
            par += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
        if v > 1:  # validate_args: uneven stages take the virtual degree, not layers per virtual stage
            par += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    elif p.pp_split == "embedding_loss":
        par += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
        if v > 1:
            par += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    elif not lay.even_stages:
        par += ["--pipeline-model-parallel-layout", pipeline_layout(lay.stage_layers)]
    elif v > 1:
        par += ["--num-layers-per-virtual-pipeline-stage", str(lay.stage_layers[0])]
    if p.pp_schedule == "gpipe":
        notes.ap.append(FieldNote(
            "plan.pp_schedule",
            "gpipe: Megatron-LM has no GPipe schedule; 1F1B runs instead (same bubble, at most pp "
            "micro-batches in flight instead of all: less activation memory than planned)",
        ))
    elif p.pp_schedule == "zero_bubble":
        notes.ap.append(FieldNote(
            "plan.pp_schedule",
            f"zero_bubble: Megatron-LM {MEGATRON_VERSION} has no zero-bubble schedule; 1F1B runs instead, "
            "with a bubble of (pp-1)/micro-batches instead of about a third of that",
        ))
    return par


def _ckpt_format(p: Plan) -> str:
    """--ckpt-format: Megatron-FSDP (ZeRO-2/3) needs fsdp_dtensor (validate_args), else torch_dist."""
    return "fsdp_dtensor" if p.zero_stage >= 2 else "torch_dist"


def _data_parallel_args(p: Plan) -> list[str]:
    """ZeRO-1 = distributed optimizer; ZeRO-2/3 = Megatron-FSDP; HSDP replicas = optimizer instances
    (Megatron-FSDP turns hybrid when there is more than one); gradient reduce / param gather overlap."""
    par: list[str] = []
    if p.zero_stage == 1:
        par.append("--use-distributed-optimizer")
    elif p.zero_stage >= 2:
        strategy = "optim_grads" if p.zero_stage == 2 else "optim_grads_params"
        par += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
    if p.zero_stage >= 1 and p.dp_replicate > 1:
        par += ["--num-distributed-optimizer-instances", str(p.dp_replicate)]
    if p.dp > 1 or p.cp > 1:
        par.append("--overlap-grad-reduce")
        if p.zero_stage >= 1:
            par.append("--overlap-param-gather")
    return par


def _parallel_args(lay: Layout, notes: Notes) -> list[str]:
    """PARALLEL_ARGS: tensor, pipeline, context, sequence and expert degrees, pipeline split, data parallel."""
    p = lay.plan
    par = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
           "--context-parallel-size", str(p.cp)]
    if p.sequence_parallel:
        par.append("--sequence-parallel")
    if p.ep > 1:
        par += ["--expert-model-parallel-size", str(p.ep)]
    if lay.scenario.model.moe is not None:
        # MoE parallel folding (megatron/core/parallel_state.py): the expert grid etp x ep x edp re-partitions
        # tp x cp x dp; Megatron's default etp is tp, so it is always written
        par += ["--expert-tensor-parallel-size", str(p.etp)]
    return par + _pipeline_args(lay, notes) + _data_parallel_args(p)


def _precision_args(lay: Layout) -> list[str]:
    """bf16 for bf16 and fp8 plans; fp8 format and the recipe the time model used (megatron/core/fp8_utils.py)."""
    p, tr = lay.plan, lay.scenario.training
    train: list[str] = []
    if p.precision in ("bf16", "fp8"):
        train.append("--bf16")
    if p.precision == "fp8":
        # the recipe the time model used (training.fp8_recipe, else the stack's first): megatron/core/fp8_utils.py
        recipe = tr.fp8_recipe_used
        train += ["--fp8-format", "e4m3" if recipe == "blockwise" else "hybrid", "--fp8-recipe", recipe]
    return train


def _comm_overlap_args(lay: Layout, notes: Notes) -> list[str]:
    """TP communication overlap, the MoE token dispatcher and the expert all-to-all overlap the time model used."""
    p, tr = lay.plan, lay.scenario.training
    train: list[str] = []
    if tr.tp_overlap and p.tp > 1 and p.sequence_parallel:  # TE userbuffers (evaluators/step_terms.tp_layer_s)
        train.append("--tp-comm-overlap")
    if lay.scenario.model.moe is not None:  # the dispatcher and EP overlap the time model used (evaluators/experts.py)
        train += (["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"] if tr.dispatcher == "deepep"
                  else ["--moe-token-dispatcher-type", "alltoall"])
        if tr.ep_overlap and _overlap_refused(p):  # the time model gives it no credit either
            notes.un.append(FieldNote("training.ep_comm_overlap", "true: not written: Megatron refuses "
                                      "--overlap-moe-expert-parallel-comm for this plan (evaluators/ep_overlap.py "
                                      "a2a_overlap_refused, transformer_config.py __post_init__)"))
        elif tr.ep_overlap:
            train += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    return train


def _selective_recompute_args(lay: Layout, notes: Notes) -> list[str]:
    """Selective recompute: the planned module list, else moe_act (MoE) or the whole MLP (dense, noted)."""
    p = lay.plan
    if p.recompute_modules:
        # transformer_config.py recompute_modules: Megatron's module list, exactly as planned
        return ["--recompute-granularity", "selective", "--recompute-modules", *p.recompute_modules]
    if lay.scenario.model.moe is not None:
        return ["--recompute-granularity", "selective", "--recompute-modules", "moe_act"]
    notes.ap.append(FieldNote(
        "plan.activation_checkpointing",
        "selective (stratagem: recompute the MLP activation feeding the down projection, keep the "
        "gate/up outputs): Megatron recomputes an activation alone only in MoE layers (moe_act); for "
        "this dense model --recompute-modules mlp recomputes the whole MLP from its input, freeing the "
        "gate/up outputs too and re-running their matmuls: less memory, more recompute than planned",
    ))
    return ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]


def _recompute_args(lay: Layout, notes: Notes) -> list[str]:
    """Activation recompute: granularity, method and layers or modules; the fp8 SwiGLU-input store noted."""
    p, tr = lay.plan, lay.scenario.training
    train: list[str] = []
    if p.precision == "fp8" and tr.activation_func_fp8_input_store:  # fused_bias_swiglu.py: SwiGLU input in fp8
        notes.un.append(FieldNote(
            "training.activation_func_fp8_input_store",
            "true: TransformerConfig.activation_func_fp8_input_store has no command-line flag in Megatron-LM "
            f"{MEGATRON_VERSION} (arguments.py leaves it out of the generated options); set it in the model "
            "provider's TransformerConfig",
        ))
    if p.activation_checkpointing == "full" and p.recompute_layers:
        # arguments.py / transformer_block.py _checkpointed_forward: method block recomputes the first N layers of
        # each pipeline stage (of each virtual chunk) in full and keeps the rest: stratagem's partial recompute
        train += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                  str(p.recompute_layers)]
    elif p.activation_checkpointing == "full":
        train += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif p.activation_checkpointing == "op":
        train += ["--recompute-granularity", "selective"]
        notes.ap.append(FieldNote(
            "plan.activation_checkpointing",
            "op (torchtitan's op-level policy: keep matmul and attention outputs, recompute the elementwise ops): "
            "Megatron has no per-op policy; written as its default selective recompute (core attention "
            "recomputed, every other activation kept): more activation memory, less recompute than planned",
        ))
    elif p.activation_checkpointing == "selective":
        train += _selective_recompute_args(lay, notes)
    if p.recompute_layers and p.activation_checkpointing != "full":
        notes.un.append(FieldNote(
            "plan.recompute_layers",
            f"{p.recompute_layers}: Megatron limits recompute to some layers only with full granularity "
            "(--recompute-method block); selective recompute applies to every layer",
        ))
    return train


def _optimizer_args(lay: Layout, notes: Notes) -> list[str]:
    """The optimizer (adam or sgd) and optimizer CPU offload (needs the precision-aware optimizer)."""
    optimizer = lay.scenario.training.optimizer
    train: list[str] = []
    if optimizer in ("adamw", "sgd"):
        train += ["--optimizer", "adam" if optimizer == "adamw" else "sgd"]
    else:
        notes.un.append(FieldNote("training.optimizer",
                                  f"{optimizer}: Megatron-LM offers adam (decoupled weight decay), sgd and others, "
                                  "not this one"))
    if lay.plan.optimizer_offload == "cpu":
        train += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0",
                  "--use-precision-aware-optimizer"]
    return train


def _save_args(lay: Layout, notes: Notes, checkpoint_interval: int | None) -> list[str]:
    """Checkpoint directory, interval in iterations and async save (torch_dist only): the full run's saving."""
    train = ["--save", "$CHECKPOINT_DIR"]
    if checkpoint_interval is not None:
        train += ["--save-interval", str(checkpoint_interval)]
    else:
        notes.un.append(FieldNote(
            "training.checkpoint.interval_minutes",
            "Megatron counts --save-interval in iterations; no step time was given to convert it (export from "
            "a study, or pass an evaluation): add --save-interval",
        ))
    if lay.scenario.training.checkpoint.mode == "async":
        if _ckpt_format(lay.plan) == "torch_dist":
            train += ["--async-save", "--use-persistent-ckpt-worker"]
        else:
            notes.un.append(FieldNote(
                "training.checkpoint.mode",
                "async: Megatron's --async-save is wired for --ckpt-format torch_dist; Megatron-FSDP needs "
                "fsdp_dtensor, so checkpoints are saved synchronously",
            ))
    return train


def _logging_args(lay: Layout) -> list[str]:
    """A throughput check logs every iteration with its throughput (megatron/training/config/training_config.py
    LoggerConfig: log_interval defaults to 100, log_throughput to False) and runs no validation pass after the
    timed iterations (ValidationConfig.eval_iters 100 by default; training.py: do_valid needs eval_iters > 0)."""
    if lay.throughput_check:
        return ["--log-interval", "1", "--log-throughput", "--eval-iters", "0"]
    return ["--log-throughput"]


def _training_args(lay: Layout, notes: Notes, save: list[str]) -> list[str]:
    """TRAINING_ARGS: batch sizes and iterations, logging, precision, overlaps, recompute, optimizer, checkpoint
    format (validate_args checks it even when nothing is saved) and, for the full run, `save`."""
    p, tr = lay.plan, lay.scenario.training
    train = ["--micro-batch-size", str(p.micro_batch_size), "--global-batch-size", str(tr.global_batch_size),
             "--train-iters", str(lay.run_steps)]
    return (train + _logging_args(lay) + _precision_args(lay) + _comm_overlap_args(lay, notes)
            + _recompute_args(lay, notes) + _optimizer_args(lay, notes) + ["--ckpt-format", _ckpt_format(p)]
            + ([] if lay.throughput_check else save))


def _data_args(lay: Layout) -> list[str]:
    """DATA_ARGS placeholders: mock data, no tokenizer, a fixed learning rate (a throughput check)."""
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(lay.scenario.model.vocab_size),
            "--lr", "0.0001"]


def _environment(p: Plan) -> dict[str, str | None]:
    """Environment variables Megatron wants for this plan (None: unset)."""
    if p.zero_stage >= 2:
        # validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS != "1" under Megatron-FSDP, and
        # docs/user-guide/features/megatron_fsdp.md recommends unsetting it (FSDP's streams run in parallel)
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if p.tp > 1 or p.cp > 1:
        # validate_args: TP or CP before Blackwell asserts CUDA_DEVICE_MAX_CONNECTIONS == 1
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _environment_lines(p: Plan) -> list[str]:
    """The shell lines that set (or unset) what _environment gives, with Megatron's own caveat."""
    lines = []
    if p.zero_stage >= 2 and (p.tp > 1 or p.cp > 1):
        lines.append("# Megatron-LM warns (validate_args, before Blackwell): TP/CP kernels are ordered best with "
                     "CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-FSDP refuses; FSDP's setting wins here")
    for k, v in _environment(p).items():
        lines.append(f"unset {k}" if v is None else f"export {k}={v}")
    return lines


def megatron_args(lay: Layout, checkpoint_interval: int | None = None
                  ) -> tuple[dict[str, list[str]], dict[str, str | None], list[FieldNote], list[FieldNote]]:
    """Argument groups (name -> args), environment variables Megatron wants (None: unset), and the unexpressed /
    approximated fields. A throughput check (Layout.throughput_check) saves no checkpoint: `full_run_save_args`
    gives what the full run adds."""
    notes = Notes()
    save = _save_args(lay, notes, checkpoint_interval)
    groups = {"MODEL_ARGS": model_args(lay, notes), "PARALLEL_ARGS": _parallel_args(lay, notes),
              "TRAINING_ARGS": _training_args(lay, notes, save), "DATA_ARGS": _data_args(lay)}
    return groups, _environment(lay.plan), notes.un, notes.ap


def full_run_save_args(lay: Layout, checkpoint_interval: int | None = None) -> list[str]:
    """The checkpoint arguments of the full run (those a throughput check leaves out)."""
    return _save_args(lay, Notes(), checkpoint_interval)


def _array(name: str, args: list[str]) -> list[str]:
    lines = [f"{name}=("]
    i = 0
    while i < len(args):
        word = args[i]
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"  {word} {_quote(args[i + 1])}")
            i += 2
        else:
            lines.append(f"  {word}")
            i += 1
    lines.append(")")
    return lines


def _quote(arg: str) -> str:
    return '"$CHECKPOINT_DIR"' if arg == "$CHECKPOINT_DIR" else shlex.quote(arg)


def _save_comment(lay: Layout, checkpoint_interval: int | None) -> list[str]:
    """Comment lines: no checkpoint inside a throughput check, and the arguments the full run adds."""
    if not lay.throughput_check:
        return []
    full = " ".join(_quote(a) for a in full_run_save_args(lay, checkpoint_interval))
    return ["# No checkpoint is written inside this throughput check (no --save: Megatron saves at every "
            "--save-interval and after the", f"# last iteration). The full run adds to TRAINING_ARGS: {full}"]


def export_megatron(lay: Layout, checkpoint_interval: int | None = None) -> ExportBundle:
    """megatron.sh: the arguments in four bash arrays and the torchrun line that passes them."""
    groups, _, un, ap = megatron_args(lay, checkpoint_interval)
    head = header_lines(lay, f"Megatron-LM {MEGATRON_VERSION} (NVIDIA/Megatron-LM@{MEGATRON_COMMIT[:12]}), "
                             "pretrain_gpt.py arguments (megatron/training/arguments.py)")
    notes = note_lines(un, ap, f"Megatron-LM {MEGATRON_VERSION}")
    rdzv = master_addr_line(lay.nodes)
    lines = [
        "#!/usr/bin/env bash",
        *[f"# {x}" for x in head],
        *[f"# {x}" for x in notes],
        f"# Run on each of the {lay.nodes} node(s) with MEGATRON_LM pointing at a Megatron-LM {MEGATRON_VERSION} "
        "checkout.",
        "set -euo pipefail",
        ': "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"',
        rdzv,
        *([] if lay.throughput_check else ['CHECKPOINT_DIR="${CHECKPOINT_DIR:-./checkpoints}"']),
        *_environment_lines(lay.plan),
        "",
    ]
    for name, args in groups.items():
        if name == "DATA_ARGS":
            lines.append("# PLACEHOLDERS: synthetic data (--mock-data), no tokenizer (NullTokenizer) and a fixed learning")
            lines.append("# rate, for a throughput check of this layout. To train, replace --mock-data with --data-path")
            lines.append("# <your tokenized data prefix> and the tokenizer with e.g. --tokenizer-type HuggingFaceTokenizer")
            lines.append("# --tokenizer-model <your tokenizer>, and set your learning-rate schedule.")
        if name == "TRAINING_ARGS":
            lines.append(f"# --train-iters {lay.run_steps}: {comment_safe(lay.steps_comment())}")
            if lay.throughput_check:
                lines.append("# --log-interval 1 --log-throughput: every iteration's time (ms) and TFLOP/s per GPU; "
                             f"leave out the first {THROUGHPUT_WARMUP} (warm-up)")
            lines += _save_comment(lay, checkpoint_interval)
        lines += _array(name, args)
    lines += [
        "",
        f"torchrun --nnodes {lay.nodes} --nproc-per-node {lay.procs_per_node} --rdzv-backend c10d "
        "--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT \\",
        '  "$MEGATRON_LM/pretrain_gpt.py" ' + " ".join(f'"${{{n}[@]}}"' for n in groups),
        "",
    ]
    return ExportBundle(target="megatron", main=SCRIPT_FILE, files={SCRIPT_FILE: "\n".join(lines)},
                        unexpressed=un, approximated=ap)
