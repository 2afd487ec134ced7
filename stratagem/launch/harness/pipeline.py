"""Pipeline parallelism with torch.distributed.pipelining: stage split and schedule from the plan.

The L layers form pp * v chunks of consecutive layers (extra layers go to the first chunks, as the analytic
model assumes; or the plan's pp_split=embedding_loss / first_stage_layers / last_stage_layers split, counted by
stratagem.spaces.pipeline_split); chunk c runs on pipeline rank c % pp ("loop" placement, what the interleaved schedules
expect). Each chunk is the whole model with the other layers deleted: the first chunk keeps the embedding,
the last the final norm and the output projection, so parameter names match the unsplit model.

Schedules: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved -> ScheduleInterleaved1F1B (v chunks
per rank), zero_bubble -> ScheduleInterleavedZeroBubble (ZB-H1 with split input/weight backward; v >= 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stratagem.errors import StratagemError
from stratagem.launch.harness.model import Transformer, build_model
from stratagem.launch.harness.support import microbatch_refusal
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.pipeline_split import chunk_layers as split_chunk_layers
from stratagem.spaces.plan import Plan

__all__ = ["chunk_layers", "plan_chunk_layers", "rank_chunks", "check_microbatches", "build_stage_model", "build_schedule"]


def chunk_layers(num_layers: int, chunks: int) -> list[list[int]]:
    """Layer indices of each chunk: consecutive, sizes differ by at most one, larger chunks first."""
    return plan_chunk_layers(num_layers, Plan(pp=chunks))


def plan_chunk_layers(num_layers: int, plan: Plan) -> list[list[int]]:
    """Layer indices of each of the plan's pp * v chunks, in model order: the even split, embedding_loss or
    uneven first/last stage counts exactly as stratagem.spaces.pipeline_split.chunk_layers counts them (so the
    analytic model's per-stage layers are the ones the harness builds)."""
    counts = split_chunk_layers(num_layers, plan.pp, plan.virtual_stages, plan.first_stage_layers,
                                plan.last_stage_layers, plan.pp_split)
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(plan: Plan, pp_rank: int) -> list[int]:
    """Stage indices held by pipeline rank `pp_rank` (loop placement): pp_rank, pp_rank + pp, ..."""
    return [pp_rank + k * plan.pp for k in range(plan.virtual_stages)]


def check_microbatches(plan: Plan, microbatches: int) -> None:
    """torch's schedules need 1F1B: m >= pp; interleaved / zero-bubble: m a multiple of its rounds max(1, m // pp)."""
    reason = microbatch_refusal(plan, microbatches)
    if reason:
        raise StratagemError(reason)


def build_stage_model(spec: ModelSpec, plan: Plan, stage: int) -> Transformer:
    """Stage `stage` of pp * v as a meta-device Transformer holding only its layers."""
    chunks = plan.pp * plan.virtual_stages
    keep = {str(i) for i in plan_chunk_layers(spec.num_layers, plan)[stage]}
    model = build_model(spec, "meta")
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < chunks - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(parts: list[torch.nn.Module], stage_ids: list[int], plan: Plan, pp_group: Any,
                   device: torch.device, n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """PipelineStage per local part and the plan's schedule over `n_microbatches` micro-batches.

    The schedule averages the micro-batch losses' gradients (scale_grads=True), so gradients equal those of
    the mean loss over the rank's batch, as without pipelining.
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    chunks = plan.pp * plan.virtual_stages
    stages: list[Any] = [PipelineStage(part, sid, chunks, device, group=pp_group)
                         for part, sid in zip(parts, stage_ids, strict=True)]
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if plan.pp_schedule in single and len(stages) == 1:
        return single[plan.pp_schedule](stages[0], n_microbatches, loss_fn=loss_fn)
    multi = {"interleaved": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble}
    return multi[plan.pp_schedule](stages, n_microbatches, loss_fn=loss_fn)
