"""Traced fidelity: one rank's memory in the harness's own training step, at full size, on fake tensors.

For each rank role of a plan (the first, a middle and the last pipeline stage; "only" without pipelining) this
process joins a fake process group of the plan's world size as that role's rank (dp, cp, tp coordinates 0),
builds the rank's model parts with the harness's own functions (`build_stage_model` / `build_model`,
`parallelize`: DTensor TP, activation checkpointing, FSDP2; then `wrap_ddp`, `build_optimizer`,
`build_schedule`), materialises them as FakeTensors (exact shapes and dtypes, no data), allocates the optimizer
states (one optimizer step on zero gradients: the warm-up's lasting effect) and runs one `train_step` of the
harness, while `BlockBytes` counts every storage. The peak of that step is split into blocks:

  weights      the rank's parameters at rest, plus the compute copies kept for backward (autocast's bf16
               casts, FSDP2's unsharded parameters under zero 2); under zero 3 the gathered units go to rest,
               as in the analytic model (its transient gather)
  gradients    the storages that hold the parameters' gradients after backward (DDP buckets, FSDP2 shards)
  optimizer    the optimizer's states
  activations  floating-point storages made during forward that are still alive (saved for backward, kept by
               checkpointing or the pipeline schedule, the logits)
  rest         everything else: storages made in backward or the optimizer step, integer tensors (the batch),
               gathered zero-3 units, buffers made while building

beside the analytic model's blocks for the same stage (`rank_memory_columns`: weights, gradients, optimizer,
activations, transient; its allocator/context overhead is reported apart: tracing has no allocator).

What this needs from torch internals (torch 2.13): the fake process group; DDP's parameter-shape check reads
data and is skipped; pipeline stages get their metadata statically (the vote and the metadata exchange are
point-to-point messages that a fake group cannot answer): `fake_group`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratagem.errors import StratagemError
from stratagem.launch.harness.expert_grid import edp_group, expert_mesh, shards_experts, uses_expert_mesh
from stratagem.launch.harness.model import Transformer, build_model, check_supported, named_parameters
from stratagem.launch.harness.moe import sync_expert_grads
from stratagem.launch.harness.parallelize import (
    build_mesh,
    build_optimizer,
    check_applicable,
    parallelize,
    wrap_ddp,
)
from stratagem.launch.harness.pipeline import (
    build_schedule,
    build_stage_model,
    check_microbatches,
    rank_chunks,
)
from stratagem.launch.harness.support import DEFAULT_LR, token_split_refusal
from stratagem.launch.harness.train import Job, _forward_backward, loss_fn, set_aux_rows
from stratagem.launch.trace.child import TraceFailed, forked, warm_imports
from stratagem.launch.trace.fake import BLOCKS, BlockBytes, fake_world
from stratagem.launch.trace.fake_group import (
    check_outputs,
    ddp_without_shape_check,
    in_place_allreduce,
    static_stages,
    watch_outputs,
)
from stratagem.launch.trace.kernels import bounded_routing, gpu_step
from stratagem.spaces.groups import micro_batches, uses_fsdp
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["ANALYTIC_BLOCKS", "TracedRole", "role_ranks", "trace_role", "trace_plan",
           "analytic_blocks"]

ANALYTIC_BLOCKS = ("weights", "gradients", "optimizer", "activations", "transient")
"""The analytic model's blocks in the order of `BLOCKS` (its transient is compared with the traced rest)."""
_DEVICE = torch.device("cpu")  # the fake tensors' device: fake "cuda" fails on a CPU-only torch build


@dataclass
class TracedRole:
    """One rank role's traced step: the peak, its blocks, and the analytic prediction for the same stage."""

    role: str
    """first, middle or last pipeline stage; only when pp = 1."""
    rank: int
    """The global rank traced (data/context/tensor-parallel coordinates 0)."""
    stage_ids: list[int]
    """Pipeline chunks this rank holds."""
    peak_bytes: int
    """Traced peak of live storage bytes during the step."""
    blocks: dict[str, int]
    """Traced peak split into weights, gradients, optimizer, activations, rest (bytes)."""
    states: dict[str, int]
    """Model-state bytes at rest: param_bytes, grad_bytes (after backward), optimizer_bytes."""
    analytic: dict[str, float] = field(default_factory=dict)
    """Analytic bytes per block (weights, gradients, optimizer, activations, transient), `peak` (their sum,
    no overhead) and `overhead` (fragmentation + context: not traced)."""
    seconds: float = 0.0
    """Wall time of this role's trace (build + step)."""
    cpu_seconds: float = 0.0
    """CPU time of this role's trace (what it takes on an idle core; wall time grows with the machine's load)."""
    top_ops: list[tuple[str, str, int]] = field(default_factory=list)
    """The largest (block, op that made the storage, bytes alive at the peak): where the bytes come from."""
    microbatches: tuple[int, int] = (1, 1)
    """(micro-batches of the step, micro-batches traced): without pipelining the first and the last."""

    def to_json(self) -> dict[str, Any]:
        """The `stratagem trace --json` object of this role."""
        traced = {b: self.blocks[b] / GIB for b in BLOCKS}
        predicted = {b: self.analytic.get(a, 0.0) / GIB for b, a in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True)}
        return {
            "role": self.role, "rank": self.rank, "stage_ids": self.stage_ids,
            "peak_gib": self.peak_bytes / GIB,
            "analytic_peak_gib": self.analytic.get("peak", 0.0) / GIB,
            "analytic_overhead_gib": self.analytic.get("overhead", 0.0) / GIB,
            "blocks_gib": traced, "analytic_blocks_gib": predicted,
            "difference_gib": {b: traced[b] - predicted[b] for b in BLOCKS},
            "states_gib": {k: v / GIB for k, v in self.states.items()},
            "seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "microbatches": self.microbatches[0], "microbatches_traced": self.microbatches[1],
            "top_ops_gib": [[b, op, n / GIB] for b, op, n in self.top_ops],
        }


def role_ranks(plan: Plan) -> list[tuple[str, int]]:
    """(role, global rank) per distinct pipeline role: pp rank 0, pp // 2 (pp > 2) and pp - 1."""
    per_stage = plan.world_size // plan.pp  # mesh (pp, dp, cp, tp): pp is the slowest dim
    if plan.pp == 1:
        return [("only", 0)]
    roles = [("first", 0)]
    if plan.pp > 2:
        roles.append(("middle", plan.pp // 2 * per_stage))
    roles.append(("last", (plan.pp - 1) * per_stage))
    return roles


def analytic_blocks(scenario: Scenario, plan: Plan, role: str, calibration: Any = None) -> dict[str, float]:
    """The analytic model's bytes per block for the stage of `role` (a middle stage uses the first stage's
    formula, the model's worst case for it), `peak` without overhead and `overhead`."""
    from stratagem.evaluators.calibration import default_calibration
    from stratagem.evaluators.memory import rank_memory_columns
    from stratagem.spaces.columns import PlanColumns

    cal = calibration or default_calibration(scenario.cluster.gpu.name)
    # pp = 1 ("only"): the first-stage formula includes the head
    cols = rank_memory_columns(scenario, PlanColumns.from_plans([plan]), cal, "last" if role == "last" else "first")
    out = {a: float(cols[a][0]) for a in ANALYTIC_BLOCKS}
    out["peak"] = sum(out[a] for a in ANALYTIC_BLOCKS)
    out["overhead"] = float(cols["overhead"][0])
    return out


def _optimizer_states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    from stratagem.launch.harness.memtrack import local

    lt = local(t)
    return lt.numel() * lt.element_size()


def trace_role(scenario: Scenario, plan: Plan, role: str, rank: int, seed: int = 0,
               kernels: str = "cuda", calibration: Any = None) -> TracedRole:
    """Trace one rank's training step (see the module docstring); raises StratagemError for plans the harness
    cannot apply, with its one-line reason. `kernels`: "cuda" saves what the GPU kernels save (fused RMSNorm;
    stratagem.launch.trace.kernels), "cpu" what this CPU's do (to compare with a CPU run). `calibration`: the
    analytic prediction's constants (None: the GPU's defaults), as `explain` and `evaluate` take them."""
    micro = _check_traceable(scenario, plan)
    # Without pipelining, micro-batches run one after another into the same gradients: micro-batches 2..m-1
    # repeat micro-batch 2's memory exactly (gradients held + one micro-batch's activations), and the last
    # adds DDP's in-place all-reduce. So the first and the last are traced; a pipeline schedule runs all m
    # (its in-flight micro-batches and receive buffers depend on m).
    traced = micro if plan.pp > 1 else min(micro, 2)
    start, cpu_start = time.perf_counter(), time.process_time()
    with fake_world(plan.world_size, rank):
        built = _build_rank(scenario, plan)
        tracker, states = _fake_step(scenario, plan, built, micro, traced, kernels)
    classify = _classifier(tracker, plan)
    blocks = tracker.blocks_at_peak(classify)
    by_op = sorted(((b, op, n) for (b, op), n in tracker.ops_at_peak(classify).items()), key=lambda r: -r[2])
    return TracedRole(role=role, rank=rank, stage_ids=built.stage_ids, peak_bytes=tracker.peak, blocks=blocks,
                      states=states, analytic=analytic_blocks(scenario, plan, role, calibration),
                      seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start, microbatches=(micro, traced),
                      top_ops=[(b, op, n) for b, op, n in by_op[:12]])


def _check_traceable(scenario: Scenario, plan: Plan) -> int:
    """The harness's own refusals of this plan (StratagemError, one line); else its micro-batches per step."""
    spec, training = scenario.model, scenario.training
    check_supported(spec)
    check_applicable(plan, spec, _DEVICE)
    micro = micro_batches(plan, training.global_batch_size)
    check_microbatches(plan, micro)
    split = token_split_refusal(plan, spec, training.seq_len)
    if split:
        raise StratagemError(split)
    return micro


@dataclass
class _RankParts:
    """What the traced rank builds before fake mode: its meshes and its model parts, parallelised."""

    mesh: Any
    """The plan's device mesh (None at world size 1)."""
    experts: Any
    """The routed experts' own mesh under ep or tp (None otherwise)."""
    stage_ids: list[int]
    """Pipeline chunks this rank holds ([0] without pipelining)."""
    modules: list[Transformer]
    """One model part per chunk, on the meta device, with TP, checkpointing and FSDP2 applied."""


def _build_rank(scenario: Scenario, plan: Plan) -> _RankParts:
    """The rank's meshes and model parts with the harness's own functions, outside fake mode: FSDP2 and
    DeviceMesh compute coordinates with real ops."""
    spec = scenario.model
    mesh: Any = build_mesh(plan, "cpu") if plan.world_size > 1 else None
    # MoE under ep or tp: the routed experts on their own mesh, FSDP-sharded over edp or apart (as build_job)
    experts: Any = expert_mesh(plan, "cpu") if uses_expert_mesh(plan, spec) else None
    pp_rank = 0 if mesh is None else int(mesh["pp"].get_local_rank())
    stage_ids = rank_chunks(plan, pp_rank) if plan.pp > 1 else [0]
    modules = [build_stage_model(spec, plan, s) for s in stage_ids] if plan.pp > 1 else [build_model(spec)]
    for module in modules:
        parallelize(module, plan, mesh, experts)
    return _RankParts(mesh, experts, stage_ids, modules)


def _fake_step(scenario: Scenario, plan: Plan, rank: _RankParts, micro: int, traced: int,
               kernels: str) -> tuple[BlockBytes, dict[str, int]]:
    """In fake mode, counted by a BlockBytes: the harness's Job for the rank, its optimizer states allocated,
    one training step of `traced` micro-batches. Returns the tracker and the model-state bytes (param_bytes,
    optimizer_bytes, grad_bytes); the pipeline stages' static metadata is checked against their outputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker = BlockBytes()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        job, params, saved_outputs = _fake_job(scenario, plan, rank, micro, traced, tracker)
        states = _model_states(job.optimizer, params, tracker,
                               on_cuda=kernels == "cuda" and scenario.cluster.gpu.kind != "cpu")
        produced = watch_outputs([m for m, _, _ in saved_outputs])
        states["grad_bytes"] = _one_step(job, params, tracker, traced, kernels)
    check_outputs(saved_outputs, produced)
    return tracker, states


def _fake_job(scenario: Scenario, plan: Plan, rank: _RankParts, micro: int, traced: int,
              tracker: BlockBytes) -> tuple[Job, list[nn.Parameter], list[tuple[nn.Module, torch.Size, torch.dtype]]]:
    """The rank's parts as fake tensors, wrapped (DDP) as the harness does, their parameters labelled weights,
    the optimizer and (pp > 1) the schedule with static stage metadata. Returns the harness's Job, the
    parameters and the (stage, shape, dtype) outputs to check after the step."""
    training = scenario.training
    for module in rank.modules:
        module.to_empty(device=_DEVICE)
    set_aux_rows(rank.modules, plan, training.global_batch_size)
    with ddp_without_shape_check():
        parts = [wrap_ddp(m, plan, rank.mesh) for m in rank.modules]
    for part in parts:
        in_place_allreduce(part)
    params = [p for _, p in named_parameters(parts)]
    tracker.label(params, "weights")
    optimizer = build_optimizer(params, plan, training.optimizer, rank.mesh, DEFAULT_LR)
    schedule = None
    saved_outputs: list[tuple[nn.Module, torch.Size, torch.dtype]] = []
    if plan.pp > 1:
        schedule = build_schedule(parts, rank.stage_ids, plan, rank.mesh["pp"].get_group(), _DEVICE, micro,
                                  loss_fn)
        saved_outputs = static_stages(schedule, scenario, plan)
    is_last = (plan.pp * plan.virtual_stages - 1) in rank.stage_ids
    experts = rank.experts
    job = Job(scenario=scenario, plan=plan, device=_DEVICE, mesh=rank.mesh, parts=parts, stage_ids=rank.stage_ids,
              optimizer=optimizer, schedule=schedule,
              dp_rank=0, microbatches=traced, is_first=0 in rank.stage_ids, is_last=is_last,
              loss_owner=is_last, experts_apart=experts is not None and not shards_experts(plan, scenario.model),
              edp_group=edp_group(experts) if experts is not None else None)
    return job, params, saved_outputs


def _model_states(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], tracker: BlockBytes,
                  on_cuda: bool) -> dict[str, int]:
    """Allocate the optimizer's states (with the implementation the harness runs on CUDA when `on_cuda`: a GPU
    scenario with the cuda kernels) and label them; the parameter and optimizer-state bytes at rest."""
    if on_cuda:
        _cuda_implementation(optimizer)
    _warm_up_optimizer(params, optimizer)
    tracker.label(_optimizer_states(optimizer), "optimizer")
    return {"param_bytes": sum(_nbytes(p) for p in params),
            "optimizer_bytes": sum(_nbytes(v) for v in _optimizer_states(optimizer) if v.numel() > 1)}


def _one_step(job: Job, params: list[nn.Parameter], tracker: BlockBytes, traced: int, kernels: str) -> int:
    """The harness's train_step without its batch draw and float(loss), on zero tokens, the tracker's peak
    reset before it; returns the gradients' bytes after backward (labelled gradients)."""
    scenario, plan = job.scenario, job.plan
    tracker.reset_peak()
    tracker.phase = "forward"
    grads: list[int] = []

    def after_backward() -> None:
        held = [p.grad for p in params if p.grad is not None]
        tracker.label(held, "gradients")
        grads.append(sum(_nbytes(g) for g in held))
        tracker.phase = "optimizer"

    rows = traced * plan.micro_batch_size  # this data-parallel rank's rows (all of them with pp > 1)
    x = torch.zeros((rows, scenario.training.seq_len), dtype=torch.int64, device=_DEVICE)
    y = torch.zeros((rows, scenario.training.seq_len), dtype=torch.int64, device=_DEVICE)
    with _saved_tensor_labels(tracker), gpu_step(tracker, params, kernels), \
            bounded_routing(scenario, plan):  # train_step without its batch draw and float(loss)
        _forward_backward(job, x, y)
        if job.experts_apart:  # train_step: expert gradients summed over edp
            sync_expert_grads(job.parts, job.edp_group, plan.dp * plan.cp)
        after_backward()
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
    tracker.phase = "done"
    return grads[0] if grads else 0


def _classifier(tracker: BlockBytes, plan: Plan) -> Callable[[int], str]:
    """Each storage's block, decided after the step from its label and the phase that made it."""
    # zero 3 gathers each unit for its forward and backward (a transient); with pp > 1 the harness keeps the
    # stage's units gathered through the step (reshard_after_forward = not pp, as torchtitan): weights then
    copies_to_rest = uses_fsdp(plan) and plan.zero_stage == 3 and plan.pp == 1

    def classify(serial: int) -> str:
        label = tracker.labels.get(serial)
        if label == "weight_copy":
            return "rest" if copies_to_rest else "weights"
        if label in ("weights", "gradients", "optimizer", "rest"):
            return label
        return "activations" if tracker.made_in.get(serial) == "forward" else "rest"

    return classify


def _cuda_implementation(optimizer: torch.optim.Optimizer) -> None:
    """The implementation the harness's optimizer runs on CUDA tensors (the fake tensors here are on the CPU):
    AdamW's fused kernel (harness.parallelize.build_optimizer, as torchtitan), in place, no step transient;
    other optimizers torch's default there, the multi-tensor (foreach) path (torch/optim/optimizer.py
    _default_to_fused_or_foreach)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    fused = isinstance(inner, torch.optim.AdamW)
    for group in inner.param_groups:
        if fused and "fused" in group:
            group["fused"], group["foreach"] = True, False
        elif "foreach" in group:
            group["foreach"] = True


def _warm_up_optimizer(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's states as its first step does (zero gradients), then drop the gradients."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextmanager
def _saved_tensor_labels(tracker: BlockBytes) -> Iterator[None]:
    """Label parameters saved for backward (FSDP2's unsharded parameters) as weight copies; storages already
    labelled (the parameters at rest) keep their label."""
    from torch.distributed.tensor import DTensor

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or (isinstance(base, DTensor) and isinstance(base, nn.Parameter)):
            serial = tracker.serial(base)
            if serial is not None and serial not in tracker.labels:
                tracker.labels[serial] = "weight_copy"
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def trace_plan(scenario: Scenario, plan: Plan, seed: int = 0, kernels: str = "cuda",
               calibration: Any = None) -> list[TracedRole]:
    """Trace every distinct rank role of `plan` (see `role_ranks`), each in a forked child process: a rank's
    fake process group, meshes and the groups DTensor caches by name belong to that rank alone. A plan that
    breaks the scenario's rules is refused first (StratagemError naming the rule). `calibration`: the
    analytic prediction's constants (None: the GPU's defaults)."""
    from stratagem.spaces.rules import violations

    broken = violations(scenario, plan)
    if broken:
        raise StratagemError(f"plan: {broken[0]}")
    if plan.cp > 1 and plan.pp > 1:  # `static_stages` gives stages [b, s, h] inputs, not cp's shards + positions
        raise StratagemError(f"plan.cp ({plan.cp}): tracing a pipeline with context parallelism is not supported yet "
                             "(its stages' inputs are sequence shards with their positions); trace cp=1 or pp=1")
    warm_imports()
    try:
        return [forked(_role_or_reason, scenario, plan, role, rank, seed, kernels, calibration)
                for role, rank in role_ranks(plan)]
    except TraceFailed as e:  # one line naming the plan; a traced search records it and goes on
        raise TraceFailed(f"plan ({plan.short()}): {e}", e.details) from None


def _role_or_reason(scenario: Scenario, plan: Plan, role: str, rank: int, seed: int, kernels: str,
                    calibration: Any) -> TracedRole:
    """`trace_role`; an op fake tensors cannot run (no fake kernel, a size that depends on data) becomes a
    StratagemError naming it: this plan cannot be traced, and a traced search records why and goes on."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    try:
        return trace_role(scenario, plan, role, rank, seed, kernels, calibration)
    except (DynamicOutputShapeException, DataDependentOutputException, UnsupportedOperatorException) as e:
        raise StratagemError(f"plan ({plan.short()}): cannot be traced on fake tensors ({role} stage): "
                             f"{type(e).__name__} in {e}") from None
