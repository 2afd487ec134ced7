"""One plan made runnable on this rank (`build_job`) and one optimizer step of it (`train_step`).

Every step trains on the scenario's whole global batch (`synthetic_batch(step)`): data-parallel rank d takes
rows [d B/dp, (d+1) B/dp) and runs them as B / (dp * micro_batch_size) micro-batches (gradient accumulation,
or the pipeline schedule's micro-batches). The reported loss is the mean cross-entropy over the global
batch, identical on every rank, so any plan's trajectory compares with the single-process reference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stratagem.errors import StratagemError
from stratagem.launch.harness.expert_grid import (
    edp_group,
    expert_layout,
    expert_mesh,
    shards_experts,
    uses_expert_mesh,
)
from stratagem.launch.harness.model import (
    build_model,
    check_supported,
    materialize,
    named_parameters,
    synthetic_batch,
)
from stratagem.launch.harness.parallelize import (
    build_mesh,
    build_optimizer,
    check_applicable,
    parallelize,
    uses_loss_parallel,
    wrap_ddp,
)
from stratagem.launch.harness.pipeline import (
    build_schedule,
    build_stage_model,
    check_microbatches,
    rank_chunks,
)
from stratagem.launch.harness.support import DEFAULT_LR, token_split_refusal
from stratagem.spaces.groups import dp_shard, micro_batches, uses_fsdp
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Job", "build_job", "set_aux_rows", "tied_embedding_group", "sync_tied_embedding", "train_step", "loss_fn", "full_parameters", "as_dtensor", "mechanisms"]



def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [b, s, V], targets [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass
class Job:
    """Everything this rank holds for one plan."""

    scenario: Scenario
    plan: Plan
    device: torch.device
    mesh: Any
    parts: list[nn.Module]
    """The model parts this rank runs (one, or v pipeline chunks), wrapped (DDP) where the plan says."""
    stage_ids: list[int]
    optimizer: torch.optim.Optimizer
    schedule: Any = None
    dp_rank: int = 0
    microbatches: int = 1
    is_first: bool = True
    is_last: bool = True
    loss_owner: bool = True
    """Whether this rank adds its loss to the global mean (last stage, tp rank 0; every cp rank)."""
    edp_group: Any = None
    """Expert parallelism: the group of ranks holding the same expert shard (None: edp = 1 or no ep)."""
    experts_apart: bool = False
    """The experts live on the expert mesh outside DDP/FSDP, their gradients summed over edp by
    moe.sync_expert_grads (expert_grid: uses_expert_mesh and not shards_experts)."""
    tied_group: Any = None
    """Tied embeddings with pp > 1: this rank and its peer on the other end of the pipeline (None: no copy)."""


def _coord(mesh: Any, dim: str) -> int:
    return 0 if mesh is None else int(mesh[dim].get_local_rank())


def build_job(scenario: Scenario, plan: Plan, device: torch.device, seed: int, lr: float = DEFAULT_LR,
              eps: float = 1e-8) -> Job:
    """Build, parallelise and initialise the model parts, optimizer and pipeline schedule of `plan`.

    Needs an initialised default process group of plan.world_size ranks when the plan has more than one.
    """
    spec, training = scenario.model, scenario.training
    check_supported(spec)
    check_applicable(plan, spec, device)
    micro = micro_batches(plan, training.global_batch_size)
    check_microbatches(plan, micro)
    split = token_split_refusal(plan, spec, training.seq_len)
    if split:
        raise StratagemError(split)
    mesh: Any = build_mesh(plan, device.type) if plan.world_size > 1 else None
    experts: Any = expert_mesh(plan, device.type) if uses_expert_mesh(plan, spec) else None
    pp_rank = _coord(mesh, "pp")
    stage_ids = rank_chunks(plan, pp_rank) if plan.pp > 1 else [0]
    chunks = plan.pp * plan.virtual_stages
    modules = [build_stage_model(spec, plan, s) for s in stage_ids] if plan.pp > 1 else [build_model(spec)]
    for module in modules:
        parallelize(module, plan, mesh, experts)
    materialize(modules, device, seed)
    set_aux_rows(modules, plan, training.global_batch_size)
    parts = [wrap_ddp(m, plan, mesh) for m in modules]
    params = [p for _, p in named_parameters(parts)]
    optimizer = build_optimizer(params, plan, training.optimizer, mesh, lr, eps)
    schedule = None
    if plan.pp > 1:
        schedule = build_schedule(parts, stage_ids, plan, mesh["pp"].get_group(), device, micro, loss_fn)
    is_last = (chunks - 1) in stage_ids
    return Job(
        scenario=scenario, plan=plan, device=device, mesh=mesh, parts=parts, stage_ids=stage_ids,
        optimizer=optimizer, schedule=schedule, dp_rank=_coord(mesh, "dp"), microbatches=micro,
        is_first=0 in stage_ids, is_last=is_last,
        edp_group=edp_group(experts) if experts is not None else None,
        experts_apart=experts is not None and not shards_experts(plan, spec),
        tied_group=tied_embedding_group(mesh) if spec.tied_embeddings and plan.pp > 1 else None,
        loss_owner=is_last and _coord(mesh, "tp") == 0,
    )


def tied_embedding_group(mesh: Any) -> Any:
    """Tied embeddings across the pipeline: for every (dp, cp, tp) coordinate a process group of the first
    and the last pipeline rank (they hold the embedding and its output-projection copy, sharded alike); this
    rank's group, or None for a middle rank. Every rank creates every group (torch's new_group rule)."""
    import torch.distributed as dist

    ranks = mesh.mesh  # [pp, dp_replicate, dp_shard, cp, tp] global ranks
    mine = None
    for a, b in zip(ranks[0].flatten().tolist(), ranks[-1].flatten().tolist(), strict=True):
        group = dist.new_group([a, b])
        if dist.get_rank() in (a, b):
            mine = group
    return mine


def sync_tied_embedding(job: Job) -> None:
    """Sum the tied embedding's gradient over its two copies (first stage: as the embedding, last stage: as the
    output projection): each then holds the gradient of the single tied weight and takes the same step
    (Megatron's _allreduce_word_embedding_grads over its embedding group)."""
    from stratagem.launch.harness.memtrack import local

    if job.tied_group is None:
        return
    for name, p in named_parameters(job.parts):
        if name == "tok_embeddings.weight" and p.grad is not None:
            dist.all_reduce(local(p.grad), group=job.tied_group)


def set_aux_rows(modules: Sequence[nn.Module], plan: Plan, global_batch: int) -> None:
    """Tell each MoE layer how many rows the loss of one backward averages over (its balance loss is scaled
    alike): a micro-batch under a pipeline schedule (which then divides by the micro-batch count), else this
    data-parallel rank's rows (the micro-batch losses are divided by their count before backward)."""
    from stratagem.launch.harness.moe import MoE

    rows = plan.micro_batch_size if plan.pp > 1 else global_batch // plan.dp
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, MoE):
                sub.aux_rows = rows


def _forward_backward(job: Job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradients of the mean loss over this rank's rows x, y [B/dp, s]; returns that loss (detached)."""
    mbs = job.plan.micro_batch_size
    if job.schedule is not None:
        losses: list[torch.Tensor] = []
        x, y = x.clone(), y.clone()  # [B/dp, s]; context parallelism shards them in place
        # torchtitan: the loss-parallel and CP contexts around the whole pp step
        with _loss_context(job), _cp_context(job, [x, y]) as positions:
            args = (x,) if job.is_first else ()
            kwargs: dict[str, Any] = {"target": y, "losses": losses} if job.is_last else {}
            if positions is not None:  # [B/dp, s/cp], split into micro-batches with the inputs for every stage
                kwargs["positions"] = positions
            # return_outputs=False as torchtitan's train.py: else the last stage keeps every micro-batch's
            # output (logits [mbs, s, V]) in output_chunks until the step ends and concatenates them
            job.schedule.step(*args, return_outputs=False, **kwargs)
        if not job.is_last:
            return torch.zeros((), device=job.device)
        return torch.stack([_replicated(loss.detach()) for loss in losses]).mean()
    model = job.parts[0]
    total = torch.zeros((), device=job.device)
    for i in range(job.microbatches):
        last = i == job.microbatches - 1
        no_sync = getattr(model, "no_sync", None)
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        xb, yb = x[i * mbs:(i + 1) * mbs].clone(), y[i * mbs:(i + 1) * mbs].clone()  # [mbs, s]
        with sync, _loss_context(job), _cp_context(job, [xb, yb]) as positions:
            # DDP: all-reduce the accumulated gradients once, on the last micro-batch; CP: this rank's s/cp tokens
            logits = model(xb) if positions is None else model(xb, positions=positions)  # [mbs, s(/cp), V(/t)]
            loss = loss_fn(logits, yb)
            (loss / job.microbatches).backward()  # type: ignore[no-untyped-call]
        total += _replicated(loss.detach()) / job.microbatches
    return total


def _cp_context(job: Job, buffers: list[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """torch's context_parallel over the cp ranks (stratagem.launch.harness.context), yielding positions; or
    nothing to do (yielding None) when cp = 1."""
    if job.plan.cp == 1:
        return contextlib.nullcontext()
    from stratagem.launch.harness.context import cp_context

    return cp_context(job.mesh["cp"], buffers)


def _loss_context(job: Job) -> contextlib.AbstractContextManager[Any]:
    """torch's loss_parallel around forward and backward when the logits are vocabulary-sharded."""
    if not uses_loss_parallel(job.plan):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """A loss that loss_parallel returns as a replicated DTensor, as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(job: Job, step: int, seed: int, after_backward: Callable[[], None] | None = None) -> float:
    """One optimizer step on global batch `step`; returns the global mean loss (same on every rank)."""
    training = job.scenario.training
    inputs, targets = synthetic_batch(job.scenario.model, training, seed, step, job.device)  # [B, s] each
    rows = training.global_batch_size // job.plan.dp
    sl = slice(job.dp_rank * rows, (job.dp_rank + 1) * rows)
    local_loss = _forward_backward(job, inputs[sl], targets[sl])
    if job.experts_apart:
        from stratagem.launch.harness.moe import sync_expert_grads

        sync_expert_grads(job.parts, job.edp_group, job.plan.dp * job.plan.cp)
    sync_tied_embedding(job)
    if after_backward is not None:
        after_backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    if job.mesh is None:
        return float(local_loss)
    # each cp rank's loss is the mean over its equal share of the tokens: the global mean averages over dp x cp
    share = local_loss / (job.plan.dp * job.plan.cp) if job.loss_owner else torch.zeros_like(local_loss)
    dist.all_reduce(share)
    return float(share)


def as_dtensor(p: torch.Tensor) -> torch.Tensor:
    """A TP parameter that DDP holds as a local tensor between forwards, back as a DTensor (same storage)."""
    spec = getattr(p, "_st_info", None)
    if spec is None:
        return p
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(p.detach(), spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


@torch.no_grad()
def full_parameters(job: Job) -> dict[str, torch.Tensor]:
    """Canonical name -> full (unsharded) value on CPU, for the parameters of this rank's stages."""
    import logging

    from torch.distributed.tensor import DTensor

    # Gathering an FSDP x TP parameter takes two all-gathers; torch warns that it is slow. It is a check.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out = {}
    for name, p in named_parameters(job.parts):
        t = as_dtensor(p)
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().to("cpu", copy=True)
    return out


def mechanisms(job: Job) -> dict[str, str]:
    """Which PyTorch mechanism applied each part of the plan (recorded in the result)."""
    plan = job.plan
    if plan.dp * plan.cp == 1:
        dp = "none"
    elif uses_fsdp(plan):
        dp = f"FSDP2 fully_shard(reshard_after_forward={plan.zero_stage == 3 and plan.pp == 1})"
        if plan.dp_replicate > 1:
            dp += f" on a 2-D (replicate {plan.dp_replicate}, shard {dp_shard(plan)}) mesh (HSDP)"
    else:
        dp = "DDP(gradient_as_bucket_view=True)"
        if plan.zero_stage == 1:
            dp += " + ZeroRedundancyOptimizer" + (f" over dp_shard ({dp_shard(plan)})"
                                                 if plan.dp_replicate > 1 else "")
    tp = "none" if plan.tp == 1 else "DTensor parallelize_module (Colwise/Rowwise" + \
        (" + SequenceParallel)" if plan.sequence_parallel else ")")
    if uses_loss_parallel(plan):
        tp += " + loss_parallel (vocabulary-sharded logits)"
    pp = "none" if job.schedule is None else type(job.schedule).__name__
    ep = expert_layout(plan, job.scenario.model)
    ac = {"none": "none", "full": "checkpoint_wrapper(block)",
          "selective": "checkpoint_wrapper(mlp down(silu(g) * u))",
          "op": "checkpoint_wrapper(block, torchtitan op-level selective policy)"}[plan.activation_checkpointing]
    if plan.activation_checkpointing != "none" and plan.recompute_layers:
        ac += f" on the first {plan.recompute_layers} layer(s) of each stage"
    prec = "fp32" if plan.precision == "fp32" else (
        "FSDP2 MixedPrecisionPolicy(bf16, reduce fp32)" if uses_fsdp(plan) else "torch.autocast(bf16)")
    if plan.precision == "fp8":
        prec = "torchao Float8Linear + " + prec
    if plan.cp > 1:
        dp += f", gradients averaged over dp x cp ({plan.dp * plan.cp})"
    cp = "none" if plan.cp == 1 else (
        f"torch context_parallel over cp={plan.cp} (ring attention, load-balanced sequence shards)"
        + ("; CPU flash kernel through torch's templated ring (harness.context)" if job.device.type == "cpu" else ""))
    return {"data_parallel": dp, "tensor_parallel": tp, "context_parallel": cp, "pipeline": pp,
            "expert_parallel": ep,
            "activation_checkpointing": ac,
            "precision": prec}
