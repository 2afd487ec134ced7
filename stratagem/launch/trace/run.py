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
point-to-point messages that a fake group cannot answer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stratagem.errors import StratagemError
from stratagem.launch.harness.expert_grid import edp_group, shards_experts
from stratagem.launch.harness.model import build_model, check_supported, named_parameters
from stratagem.launch.harness.moe import sync_expert_grads
from stratagem.launch.harness.parallelize import (
    build_mesh,
    build_optimizer,
    check_applicable,
    expert_mesh,
    parallelize,
    uses_expert_mesh,
    uses_fsdp,
    wrap_ddp,
)
from stratagem.launch.harness.pipeline import (
    build_schedule,
    build_stage_model,
    check_microbatches,
    rank_chunks,
)
from stratagem.launch.harness.support import token_split_refusal
from stratagem.launch.harness.train import DEFAULT_LR, Job, _forward_backward, loss_fn, set_aux_rows
from stratagem.launch.trace.fake import BLOCKS, BlockBytes, fake_world
from stratagem.launch.trace.kernels import bounded_routing, gpu_step
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["ANALYTIC_BLOCKS", "TracedRole", "TraceFailed", "role_ranks", "trace_role", "trace_plan",
           "analytic_blocks"]

ANALYTIC_BLOCKS = ("weights", "gradients", "optimizer", "activations", "transient")
"""The analytic model's blocks in the order of `BLOCKS` (its transient is compared with the traced rest)."""


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


@contextmanager
def _ddp_without_shape_check() -> Iterator[None]:
    """DDP's constructor compares parameter shapes across ranks by reading data; fake tensors have none."""
    import torch.nn.parallel.distributed as ddp

    name = "_verify_param_shape_across_processes"
    original = getattr(ddp, name)
    setattr(ddp, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(ddp, name, original)


def _in_place_allreduce(part: nn.Module) -> None:
    """DDP's default hook divides the bucket in place and all-reduces it in place; the fake group's work has no
    result to hand back, so the hook hands back the bucket itself (the same storage the real hook returns)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(part, DistributedDataParallel):
        return

    def hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    part.register_comm_hook(None, hook)


def _hidden_dtype(plan: Plan) -> torch.dtype:
    """dtype of the residual stream between stages: FSDP2's bf16 policy casts every unit's inputs; under
    autocast the residual adds promote to fp32 (embedding and residual stay fp32)."""
    return torch.bfloat16 if uses_fsdp(plan) and plan.precision != "fp32" else torch.float32


def _static_stages(schedule: Any, scenario: Scenario, plan: Plan) -> list[tuple[nn.Module, torch.Size, torch.dtype]]:
    """Give each pipeline stage its input/output metadata and skip the vote (point-to-point messages a fake
    group cannot answer). Returns (module, shape, dtype) of each non-last stage's output, checked after the
    step against what the stage really produced."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    spec, tr = scenario.model, scenario.training
    mbs, s = plan.micro_batch_size, tr.seq_len
    rows = s // plan.tp if plan.sequence_parallel and plan.tp > 1 else s
    hidden = torch.empty((mbs, rows, spec.hidden_size), dtype=_hidden_dtype(plan), device="meta",
                         requires_grad=True)
    tokens = torch.empty((mbs, s), dtype=torch.int64, device="meta")
    logits = torch.empty((mbs, s, spec.vocab_size), device="meta",
                         dtype=torch.float32 if plan.precision == "fp32" else torch.bfloat16, requires_grad=True)
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    expected = []
    for stage in stages:
        inputs = tokens if stage.is_first else hidden
        outputs = logits if stage.is_last else hidden
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas((inputs,)),
                                      outputs=extract_tensor_metas((outputs,)))
        stage._inference_mode = InferenceMode.STATIC
        if not stage.is_last:
            expected.append((stage.submod, hidden.shape, hidden.dtype))

    def vote(stages: Any, has_backward: bool, p2p_done: bool) -> None:
        for st in stages:
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote
    return expected


def _optimizer_states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    from stratagem.launch.harness.memtrack import local

    lt = local(t)
    return lt.numel() * lt.element_size()


def trace_role(scenario: Scenario, plan: Plan, role: str, rank: int, seed: int = 0,
               kernels: str = "cuda") -> TracedRole:
    """Trace one rank's training step (see the module docstring); raises StratagemError for plans the harness
    cannot apply, with its one-line reason. `kernels`: "cuda" saves what the GPU kernels save (fused RMSNorm;
    stratagem.launch.trace.kernels), "cpu" what this CPU's do (to compare with a CPU run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, training = scenario.model, scenario.training
    device = torch.device("cpu")
    check_supported(spec)
    check_applicable(plan, spec, device)
    micro = plan.grad_accumulation(training.global_batch_size)
    check_microbatches(plan, micro)
    split = token_split_refusal(plan, spec, training.seq_len)
    if split:
        raise StratagemError(split)
    # Without pipelining, micro-batches run one after another into the same gradients: micro-batches 2..m-1
    # repeat micro-batch 2's memory exactly (gradients held + one micro-batch's activations), and the last
    # adds DDP's in-place all-reduce. So the first and the last are traced; a pipeline schedule runs all m
    # (its in-flight micro-batches and receive buffers depend on m).
    traced = micro if plan.pp > 1 else min(micro, 2)
    start, cpu_start = time.perf_counter(), time.process_time()
    with fake_world(plan.world_size, rank):
        mesh: Any = build_mesh(plan, "cpu") if plan.world_size > 1 else None
        # MoE under ep or tp: the routed experts on their own mesh, FSDP-sharded over edp or apart (as build_job)
        experts: Any = expert_mesh(plan, "cpu") if uses_expert_mesh(plan, spec) else None
        pp_rank = 0 if mesh is None else int(mesh["pp"].get_local_rank())
        stage_ids = rank_chunks(plan, pp_rank) if plan.pp > 1 else [0]
        chunks = plan.pp * plan.virtual_stages
        modules = [build_stage_model(spec, plan, s) for s in stage_ids] if plan.pp > 1 else [build_model(spec)]
        for module in modules:  # outside fake mode: FSDP2 and DeviceMesh compute coordinates with real ops
            parallelize(module, plan, mesh, experts)
        tracker = BlockBytes()
        saved_outputs: list[tuple[nn.Module, torch.Size, torch.dtype]] = []
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            for module in modules:
                module.to_empty(device=device)
            set_aux_rows(modules, plan, training.global_batch_size)
            with _ddp_without_shape_check():
                parts = [wrap_ddp(m, plan, mesh) for m in modules]
            for part in parts:
                _in_place_allreduce(part)
            params = [p for _, p in named_parameters(parts)]
            tracker.label(params, "weights")
            optimizer = build_optimizer(params, plan, training.optimizer, mesh, DEFAULT_LR)
            schedule = None
            if plan.pp > 1:
                schedule = build_schedule(parts, stage_ids, plan, mesh["pp"].get_group(), device, micro, loss_fn)
                saved_outputs = _static_stages(schedule, scenario, plan)
            is_last = (chunks - 1) in stage_ids
            job = Job(scenario=scenario, plan=plan, device=device, mesh=mesh, parts=parts, stage_ids=stage_ids,
                      optimizer=optimizer, schedule=schedule,
                      dp_rank=0, microbatches=traced, is_first=0 in stage_ids, is_last=is_last,
                      loss_owner=is_last, experts_apart=experts is not None and not shards_experts(plan, spec),
                      edp_group=edp_group(experts) if experts is not None else None)
            if kernels == "cuda" and scenario.cluster.gpu.kind != "cpu":
                _foreach(optimizer)
            _warm_up_optimizer(params, optimizer)
            tracker.label(_optimizer_states(optimizer), "optimizer")
            states = {"param_bytes": sum(_nbytes(p) for p in params),
                      "optimizer_bytes": sum(_nbytes(v) for v in _optimizer_states(optimizer) if v.numel() > 1)}
            produced = _watch_outputs([m for m, _, _ in saved_outputs])
            tracker.reset_peak()
            tracker.phase = "forward"
            grads: list[int] = []

            def after_backward() -> None:
                held = [p.grad for p in params if p.grad is not None]
                tracker.label(held, "gradients")
                grads.append(sum(_nbytes(g) for g in held))
                tracker.phase = "optimizer"

            rows = traced * plan.micro_batch_size  # this data-parallel rank's rows (all of them with pp > 1)
            x = torch.zeros((rows, training.seq_len), dtype=torch.int64, device=device)
            y = torch.zeros((rows, training.seq_len), dtype=torch.int64, device=device)
            with _saved_tensor_labels(tracker), gpu_step(tracker, params, kernels), \
                    bounded_routing(scenario, plan):  # train_step without its batch draw and float(loss)
                _forward_backward(job, x, y)
                if job.experts_apart:  # train_step: expert gradients summed over edp
                    sync_expert_grads(job.parts, job.edp_group, plan.dp * plan.cp)
                after_backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tracker.phase = "done"
            states["grad_bytes"] = grads[0] if grads else 0
        _check_outputs(saved_outputs, produced)
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

    blocks = tracker.blocks_at_peak(classify)
    by_op = sorted(((b, op, n) for (b, op), n in tracker.ops_at_peak(classify).items()), key=lambda r: -r[2])
    return TracedRole(role=role, rank=rank, stage_ids=stage_ids, peak_bytes=tracker.peak, blocks=blocks,
                      states=states, analytic=analytic_blocks(scenario, plan, role),
                      seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu_start, microbatches=(micro, traced),
                      top_ops=[(b, op, n) for b, op, n in by_op[:12]])


def _foreach(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's multi-tensor (foreach) implementation, the one torch picks for CUDA tensors
    (torch/optim/optimizer.py _default_to_fused_or_foreach; on CPU tensors it picks the for-loop): its step
    holds a transient copy of the states (torch/optim/adam.py _multi_tensor_adam: exp_avg_sq_sqrt)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    for group in inner.param_groups:
        if "foreach" in group:
            group["foreach"] = True


def _warm_up_optimizer(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
    """Allocate the optimizer's states as its first step does (zero gradients), then drop the gradients."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _watch_outputs(modules: list[nn.Module]) -> dict[int, tuple[torch.Size, torch.dtype]]:
    seen: dict[int, tuple[torch.Size, torch.dtype]] = {}
    for m in modules:
        def hook(mod: nn.Module, _args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                seen[id(mod)] = (out.shape, out.dtype)
        m.register_forward_hook(hook)
    return seen


def _check_outputs(expected: list[tuple[nn.Module, torch.Size, torch.dtype]],
                   produced: dict[int, tuple[torch.Size, torch.dtype]]) -> None:
    """The static stage metadata must match what each stage produced (else the trace is of the wrong run)."""
    for module, shape, dtype in expected:
        got = produced.get(id(module))
        if got is not None and got != (shape, dtype):
            raise RuntimeError(f"traced pipeline metadata {tuple(shape)} {dtype} differs from the stage's output "
                               f"{tuple(got[0])} {got[1]}")


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


def trace_plan(scenario: Scenario, plan: Plan, seed: int = 0, kernels: str = "cuda") -> list[TracedRole]:
    """Trace every distinct rank role of `plan` (see `role_ranks`), each in a forked child process: a rank's
    fake process group, meshes and the groups DTensor caches by name belong to that rank alone. A plan that
    breaks the scenario's rules is refused first (StratagemError naming the rule)."""
    from stratagem.spaces.rules import violations

    broken = violations(scenario, plan)
    if broken:
        raise StratagemError(f"plan: {broken[0]}")
    if plan.cp > 1 and plan.pp > 1:  # `_static_stages` gives stages [b, s, h] inputs, not cp's shards + positions
        raise StratagemError(f"plan.cp ({plan.cp}): tracing a pipeline with context parallelism is not supported yet "
                             "(its stages' inputs are sequence shards with their positions); trace cp=1 or pp=1")
    _warm_imports()
    try:
        return [_forked(_role_or_reason, scenario, plan, role, rank, seed, kernels) for role, rank in role_ranks(plan)]
    except TraceFailed as e:  # one line naming the plan; a traced search records it and goes on
        raise TraceFailed(f"plan ({plan.short()}): {e}", e.details) from None


class TraceFailed(StratagemError):
    """The harness's own step raised while a plan was traced (what a real run of the plan would likely meet
    too): one line; the child process's traceback is kept in `details`."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


def _role_or_reason(scenario: Scenario, plan: Plan, role: str, rank: int, seed: int, kernels: str) -> TracedRole:
    """`trace_role`; an op fake tensors cannot run (no fake kernel, a size that depends on data) becomes a
    StratagemError naming it: this plan cannot be traced, and a traced search records why and goes on."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    try:
        return trace_role(scenario, plan, role, rank, seed, kernels)
    except (DynamicOutputShapeException, DataDependentOutputException, UnsupportedOperatorException) as e:
        raise StratagemError(f"plan ({plan.short()}): cannot be traced on fake tensors ({role} stage): "
                             f"{type(e).__name__} in {e}") from None


def _warm_imports() -> None:
    """Import what the first fake-tensor op would import (torch._dynamo: seconds) once, before forking."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.empty(2, device="meta").normal_()


def _forked(fn: Any, *args: Any) -> Any:
    """fn(*args) in a forked child; its return value or its exception comes back through a pipe."""
    import multiprocessing
    import os
    import traceback

    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            receiver.close()
            try:
                sender.send(("ok", fn(*args)))
            except StratagemError as e:
                sender.send(("error", e))
            except BaseException as e:  # sent to the parent, which raises it with the child's traceback
                sender.send(("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            sender.close()
        finally:
            os._exit(code)
    sender.close()
    try:
        kind, value = receiver.recv()
    except EOFError:
        kind, value = "crash", "the tracing process died without a result"
    finally:
        receiver.close()
        os.waitpid(pid, 0)
    if kind == "ok":
        return value
    if kind == "error":
        raise value
    first = value.splitlines()[0] if value else "no result"
    raise TraceFailed(f"the harness's step failed under tracing ({first[:400]})", value)
