"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under a different plan.

The state is keyed by canonical parameter names (no wrapper prefixes), with every sharded tensor a DTensor
of its global shape, so DCP reshards on load: a checkpoint saved under dp=4 loads under dp=2 x tp=2 or a
pipeline split. Keys:
    model.<name>                 parameter
    optim.<name>.<state>         optimizer state of that parameter (AdamW exp_avg, exp_avg_sq, step; SGD
                                 momentum_buffer); under ZeRO-1 only the rank owning the parameter has it
Optimizer hyper-parameters are not saved: the plan's run builds them the same way.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stratagem.launch.harness.model import named_parameters
from stratagem.launch.harness.train import Job, as_dtensor

__all__ = ["state_dict", "init_optimizer_state", "save", "load", "save_load_times"]


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """An optimizer state shaped like its (local) parameter, as a DTensor when the parameter is one."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) or value.dim() == 0:
        return value
    spec = getattr(param, "_st_info", None)
    if spec is None:
        return value
    return DTensor.from_local(value, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)


def state_dict(job: Job) -> dict[str, Any]:
    """The rank's part of the checkpoint (tensors share storage with the live ones: DCP loads in place)."""
    out: dict[str, Any] = {}
    names = {id(p): n for n, p in named_parameters(job.parts)}
    for name, p in named_parameters(job.parts):
        out[f"model.{name}"] = as_dtensor(p).detach() if hasattr(p, "_st_info") else p.detach()
    opt = _inner(job.optimizer)
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{names[id(p)]}.{key}"] = _like(value, p)
    return out


@torch.no_grad()
def init_optimizer_state(job: Job) -> None:
    """Create the optimizer states (zeros) before a load: one step with zero gradients and lr 0."""
    params = [p for _, p in named_parameters(job.parts)]
    if all(_inner(job.optimizer).state.get(p) for p in params if p in _owned(job)):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    groups = _inner(job.optimizer).param_groups + list(job.optimizer.param_groups)
    saved = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0
    job.optimizer.step()
    for g, lr in zip(groups, saved, strict=True):
        g["lr"] = lr
    job.optimizer.zero_grad(set_to_none=True)


def _owned(job: Job) -> set[torch.Tensor]:
    return {p for g in _inner(job.optimizer).param_groups for p in g["params"]}


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(job: Job, path: str | Path, use_async: bool = False) -> dict[str, float]:
    """Save the job's state to `path`: blocking seconds, and with `use_async` the seconds until training
    could resume (staging) and until the write completed."""
    import torch.distributed.checkpoint as dcp

    state = state_dict(job)
    _barrier()
    start = time.perf_counter()
    if not use_async:
        dcp.save(state, checkpoint_id=str(path))  # type: ignore[attr-defined]
        _barrier()
        return {"save_s": time.perf_counter() - start}
    future = dcp.async_save(state, checkpoint_id=str(path))  # type: ignore[attr-defined]
    staged = time.perf_counter() - start
    future.result()  # type: ignore[union-attr]
    _barrier()
    return {"async_save_blocking_s": staged, "async_save_total_s": time.perf_counter() - start}


def load(job: Job, path: str | Path) -> float:
    """Load `path` into the job (any plan's checkpoint of the same model); returns seconds."""
    import torch.distributed.checkpoint as dcp

    init_optimizer_state(job)
    state = state_dict(job)
    _barrier()
    start = time.perf_counter()
    dcp.load(state, checkpoint_id=str(path))  # type: ignore[attr-defined]
    _barrier()
    return time.perf_counter() - start


def save_load_times(job: Job, directory: str | Path) -> dict[str, float]:
    """Blocking save, async save, then load of the job's current state; the directory is removed after."""
    root = Path(directory)
    out = save(job, root / "blocking")
    try:
        out.update(save(job, root / "async", use_async=True))
    except (RuntimeError, NotImplementedError) as e:  # async staging unsupported here: keep the blocking figure
        out["async_save_error"] = str(e).splitlines()[0]  # type: ignore[assignment]
    out["load_s"] = load(job, root / "blocking")
    _barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return out
