"""What the harness's training step needs to run in a fake process group (`fake.fake_world`), whose
collectives and point-to-point messages return at once with no data:

- DDP: its constructor's parameter-shape check reads data across ranks (skipped), and its default comm hook
  all-reduces in place into a result the fake group never hands back (a hook that returns the bucket itself);
- pipeline stages: their input/output metadata is given statically and the schedule's vote skipped (both are
  point-to-point exchanges), then checked after the step against what each stage really produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from stratagem.spaces.groups import uses_fsdp
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["ddp_without_shape_check", "in_place_allreduce", "hidden_dtype", "static_stages", "watch_outputs",
           "check_outputs"]


@contextmanager
def ddp_without_shape_check() -> Iterator[None]:
    """DDP's constructor compares parameter shapes across ranks by reading data; fake tensors have none."""
    import torch.nn.parallel.distributed as ddp

    name = "_verify_param_shape_across_processes"
    original = getattr(ddp, name)
    setattr(ddp, name, lambda *a, **k: None)
    try:
        yield
    finally:
        setattr(ddp, name, original)


def in_place_allreduce(part: nn.Module) -> None:
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


def hidden_dtype(plan: Plan) -> torch.dtype:
    """dtype of the residual stream between stages: FSDP2's bf16 policy casts every unit's inputs; under
    autocast the residual adds promote to fp32 (embedding and residual stay fp32)."""
    return torch.bfloat16 if uses_fsdp(plan) and plan.precision != "fp32" else torch.float32


def static_stages(schedule: Any, scenario: Scenario, plan: Plan) -> list[tuple[nn.Module, torch.Size, torch.dtype]]:
    """Give each pipeline stage its input/output metadata and skip the vote (point-to-point messages a fake
    group cannot answer). Returns (module, shape, dtype) of each non-last stage's output, checked after the
    step against what the stage really produced."""
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas

    spec, tr = scenario.model, scenario.training
    mbs, s = plan.micro_batch_size, tr.seq_len
    rows = s // plan.tp if plan.sequence_parallel and plan.tp > 1 else s
    hidden = torch.empty((mbs, rows, spec.hidden_size), dtype=hidden_dtype(plan), device="meta",
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


def watch_outputs(modules: list[nn.Module]) -> dict[int, tuple[torch.Size, torch.dtype]]:
    """A forward hook on each of `modules`: the dict it returns fills with (shape, dtype) of each one's output."""
    seen: dict[int, tuple[torch.Size, torch.dtype]] = {}
    for m in modules:
        def hook(mod: nn.Module, _args: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor):
                seen[id(mod)] = (out.shape, out.dtype)
        m.register_forward_hook(hook)
    return seen


def check_outputs(expected: list[tuple[nn.Module, torch.Size, torch.dtype]],
                  produced: dict[int, tuple[torch.Size, torch.dtype]]) -> None:
    """The static stage metadata must match what each stage produced (else the trace is of the wrong run)."""
    for module, shape, dtype in expected:
        got = produced.get(id(module))
        if got is not None and got != (shape, dtype):
            raise RuntimeError(f"traced pipeline metadata {tuple(shape)} {dtype} differs from the stage's output "
                               f"{tuple(got[0])} {got[1]}")
