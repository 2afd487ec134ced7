"""One plan per job: the job a plan builds (`job_description`) and the one Plan that stands for it
(`canonical_plan`).

Two valid plans that build the same job -- the same mesh, the same layers on each model chunk (the embedding on
the first chunk, the loss on the last), the same schedule, dtypes, sharding and recomputation -- have one
canonical form. `Plan.canonical()` resets what is inert from the plan alone (sequence_parallel with tp = 1, the
pipeline fields with pp = 1, recompute_layers without recomputation); here the rest, which needs the model and
the stack:
  pipeline split   pp_split / first_stage_layers / last_stage_layers give the chunks
                   `spaces.pipeline_split.chunk_layers` counts; the harness builds exactly those chunks
                   (harness/pipeline.py plan_chunk_layers) and the model sums exactly those layers
                   (evaluators/stages.py), so every encoding of one chunk tuple is one job. The canonical one is
                   the first the stack has, in this order: the even split (no fields), embedding_loss, first only,
                   last only, first and last. E.g. 4 layers, pp = 2: `1f1b`, `1f1b emb+loss`, `split-/2`,
                   `split2/-` and `split2/2` all give chunks (2, 2): the even split.
  recompute_layers the first k blocks of each chunk recompute (harness parallelize.recomputed_layers, memory.py
                   recomputed_layers: min(k, chunk)); k at least the largest chunk is every layer: 0.
  gpipe / 1f1b     with one micro-batch per step both run forward then backward on every stage (1F1B's warm-up
                   covers the one micro-batch: torch/distributed/pipelining/schedules.py Schedule1F1B); the model
                   gives them the same figures (memory.py _in_flight: m = 1; timing.py bubble (p-1)/m). Canonical:
                   gpipe where the stack has it (torch's Schedule1F1B refuses fewer micro-batches than stages:
                   harness/support.py microbatch_refusal), else 1f1b.
  zero_stage       3 with pp > 1 on a stack that keeps parameters unsharded through the step with PP
                   (StackRecord.reshard_after_forward_with_pp False; torchtitan v0.2.2 models/llama3/infra/
                   parallelize.py apply_fsdp: reshard_after_forward_policy "default" = not pp_enabled) is FSDP2's
                   fully_shard(reshard_after_forward=False), which is that stack's zero 2: the harness builds it
                   (harness/parallelize.py parallelize), the model predicts it (evaluators/memory.py
                   _kept_gathered, timing.py once_per_step) and torchtitan runs it alike. Canonical: 2, the
                   stage that names what runs (parameters kept gathered, gradients and optimizer states sharded),
                   where the stack has zero 2 with pp (`sharding_stage`).
Fields not named here (and any added to Plan later) are kept: a field is reset only once proved inert. An
invalid plan's offending fields are left as they are (its canonical form is as invalid as it is), except the
plan-alone resets of `Plan.canonical()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.spaces.groups import dp_shard, micro_batches
from stratagem.spaces.pipeline_split import chunk_layers, rank_layers, split_problem
from stratagem.spaces.plan import Plan

if TYPE_CHECKING:
    from stratagem.spaces.scenario import Scenario
    from stratagem.spaces.stacks import StackRecord  # scenario.py imports space.py, which imports this module

__all__ = ["Job", "job_description", "canonical_plan", "canonical_split", "sharding_stage", "KNOWN_FIELDS"]

# Plan fields this module knows the effect of; any other field is part of the job as it is (conservative).
KNOWN_FIELDS = frozenset({
    "dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate", "zero_stage", "sequence_parallel", "micro_batch_size",
    "precision", "activation_checkpointing", "recompute_layers", "pp_schedule", "virtual_stages",
    "first_stage_layers", "last_stage_layers", "pp_split", "optimizer_offload",
})


@dataclass(frozen=True)
class Job:
    """What a plan builds, field by field as the harness builds it: two plans with equal Jobs are one job."""

    mesh: tuple[tuple[str, int], ...]
    """(dim, size) of the device mesh: pp, dp_replicate, dp_shard, cp, tp (harness/parallelize.py build_mesh),
    and the expert grid ep, etp."""
    chunks: tuple[int, ...]
    """Transformer layers of each model chunk, in model order; chunk c runs on pipeline rank c % pp."""
    embedding_chunk: int
    """The chunk holding the embedding (always the first)."""
    loss_chunk: int
    """The chunk holding the final norm, the output layer and the loss (always the last)."""
    schedule: str
    """The pipeline schedule as it runs ("none" without pipelining; gpipe for 1f1b with one micro-batch)."""
    micro_batch_size: int
    """Sequences per micro-batch."""
    micro_batches: int
    """Micro-batches per optimizer step per pipeline."""
    precision: str
    """Compute precision."""
    sharding: tuple[int, str]
    """(ZeRO stage as run: `sharding_stage`, optimizer offload)."""
    sequence_parallel: bool
    """Activations sharded along the sequence over the TP group (tp > 1 only)."""
    recompute: tuple[str, tuple[int, ...]]
    """(mode, recomputed layers of each chunk)."""
    other: tuple[tuple[str, Any], ...]
    """Plan fields this module does not know, as they are."""


def sharding_stage(rec: StackRecord, pp: int, zero_stage: int) -> int:
    """The ZeRO stage a plan with `pp` and `zero_stage` runs as on the stack `rec` (see the module docstring):
    2 for zero 3 with pp > 1 where the stack keeps parameters unsharded with PP and has zero 2 with pp, else
    `zero_stage`."""
    if zero_stage == 3 and pp > 1 and not rec.reshard_after_forward_with_pp and 2 in rec.zero_stages \
            and rec.max_zero_with_pp >= 2:
        return 2
    return zero_stage


def _micro_batches(scenario: Scenario, plan: Plan) -> int:
    return max(1, micro_batches(plan, scenario.training.global_batch_size))


def _chunks(scenario: Scenario, plan: Plan) -> tuple[int, ...]:
    return chunk_layers(scenario.model.num_layers, plan.pp, plan.virtual_stages, plan.first_stage_layers,
                        plan.last_stage_layers, plan.pp_split)


def _schedule(scenario: Scenario, plan: Plan) -> str:
    if plan.pp == 1:
        return "none"
    if plan.pp_schedule in ("gpipe", "1f1b") and _micro_batches(scenario, plan) == 1:
        return "gpipe"
    return plan.pp_schedule + (f"x{plan.virtual_stages}" if plan.virtual_stages > 1 else "")


def job_description(scenario: Scenario, plan: Plan) -> Job:
    """The job `plan` builds in `scenario` (see `Job`), derived from what the harness and the model read, not
    from `canonical_plan`: equal Jobs mean one job."""
    chunks = _chunks(scenario, plan)
    ac = plan.activation_checkpointing
    k = plan.recompute_layers
    redone = tuple(0 if ac == "none" else (n if k <= 0 else min(k, n)) for n in chunks)
    mesh = (("pp", plan.pp), ("dp_replicate", plan.dp_replicate), ("dp_shard", dp_shard(plan)),
            ("cp", plan.cp), ("tp", plan.tp), ("ep", plan.ep), ("etp", plan.etp))
    return Job(
        mesh=mesh, chunks=chunks, embedding_chunk=0, loss_chunk=len(chunks) - 1,
        schedule=_schedule(scenario, plan), micro_batch_size=plan.micro_batch_size,
        micro_batches=_micro_batches(scenario, plan), precision=plan.precision,
        sharding=(sharding_stage(scenario.training.record, plan.pp, plan.zero_stage), plan.optimizer_offload),
        sequence_parallel=plan.sequence_parallel and plan.tp > 1,
        recompute=(ac, redone),
        other=tuple((name, getattr(plan, name)) for name in Plan.model_fields if name not in KNOWN_FIELDS),
    )


def canonical_split(scenario: Scenario, plan: Plan) -> tuple[str, int, int]:
    """(pp_split, first_stage_layers, last_stage_layers): the first encoding the stack has (even, embedding_loss,
    first only, last only, first and last) that gives the plan's chunks; the plan's own when it has no pipeline
    or its split is invalid."""
    own = (plan.pp_split, plan.first_stage_layers, plan.last_stage_layers)
    layers, pp, v = scenario.model.num_layers, plan.pp, plan.virtual_stages
    rec = scenario.training.record
    if pp == 1 or split_problem(layers, pp, v, plan.first_stage_layers, plan.last_stage_layers, plan.pp_split):
        return own
    chunks = _chunks(scenario, plan)
    ranks = rank_layers(chunks, pp)
    forms: list[tuple[str, int, int]] = [("layers", 0, 0), ("embedding_loss", 0, 0)]
    if rec.uneven_stages:
        forms += [("layers", ranks[0], 0), ("layers", 0, ranks[-1]), ("layers", ranks[0], ranks[-1])]
    for split, first, last in forms:
        if split not in rec.pp_splits:
            continue
        if split_problem(layers, pp, v, first, last, split) is None and \
                chunk_layers(layers, pp, v, first, last, split) == chunks:
            return split, first, last
    return own


def canonical_plan(scenario: Scenario, plan: Plan) -> Plan:
    """The one Plan that stands for the job `plan` builds in `scenario` (see the module docstring): equal for two
    valid plans exactly when their `job_description`s are equal."""
    p = plan.canonical()
    update: dict[str, Any] = {}
    split, first, last = canonical_split(scenario, p)
    if (split, first, last) != (p.pp_split, p.first_stage_layers, p.last_stage_layers):
        update.update(pp_split=split, first_stage_layers=first, last_stage_layers=last)
    if p.recompute_layers and p.activation_checkpointing != "none" and \
            p.recompute_layers >= max(_chunks(scenario, p.model_copy(update=update)), default=0):
        update["recompute_layers"] = 0
    if p.pp > 1 and p.pp_schedule == "1f1b" and _micro_batches(scenario, p) == 1 and \
            "gpipe" in scenario.training.record.schedules:
        update["pp_schedule"] = "gpipe"
    stage = sharding_stage(scenario.training.record, p.pp, p.zero_stage)
    if stage != p.zero_stage:
        update["zero_stage"] = stage
    return p.model_copy(update=update) if update else p
