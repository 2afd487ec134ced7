"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under a different plan.

The state is keyed by canonical parameter names (no wrapper prefixes), with every sharded tensor a DTensor
of its global shape, so DCP reshards on load: a checkpoint saved under dp=4 loads under dp=2 x tp=2 or a
pipeline split. Keys:
    model.<name>                 parameter
    optim.<name>.<state>         optimizer state of that parameter (AdamW exp_avg, exp_avg_sq, step; SGD
                                 momentum_buffer); under ZeRO-1 only the rank owning the parameter has it
Optimizer hyper-parameters are not saved: the plan's run builds them the same way.

Timing (`save_load_times`) assumes no shared filesystem (a cluster's nodes may each have only local disks).
Every rank writes under the same
path on its own node (the given directory, else its node's temp dir) in a folder whose name rank 0 draws and
broadcasts. A DCP save works on such per-node folders (each rank writes its own files, the coordinator the
`.metadata`); a DCP load does not (a rank reads the coordinator's `.metadata` and the replicated tensors
another rank wrote). So the load is timed as DCP does it when every rank sees the coordinator's metadata (one
node, or a shared directory: `load_scope` "dcp"), else as each rank reading back its own state from its own
node (a no-coordination DCP save and load of the rank's state dict, `no_dist=True`: `load_scope`
"rank-local"). Every rank removes its node's folder whatever happens. An OSError while writing or reading
(disk full, permissions, a missing file) is the environment's fault, not the plan's: it is raised as
CheckpointEnvironmentError, which the command reports as `INFRA:` (exit 4).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stratagem.launch.harness.model import named_parameters
from stratagem.launch.harness.train import Job, as_dtensor

__all__ = ["state_dict", "init_optimizer_state", "save", "load", "save_load_times", "CheckpointEnvironmentError",
           "CKPT_PREFIX"]

CKPT_PREFIX = "stratagem-ckpt-"
"""Name prefix of the timed checkpoint's folder (one per run, on every node)."""


class CheckpointEnvironmentError(RuntimeError):
    """The timed checkpoint could not be written or read where the run put it (an OSError on some rank: disk
    full, permissions, a file another node holds): the environment's fault, not the plan's."""


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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _every_rank(flag: bool) -> bool:
    """Collective: whether `flag` holds on every rank."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _agreed_folder(base: Path) -> Path:
    """`base`/stratagem-ckpt-<12 hex drawn by rank 0>: the same path string on every rank (collective)."""
    name = [f"{CKPT_PREFIX}{uuid.uuid4().hex[:12]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return base / str(name[0])


def _rank_local_load(job: Job, path: Path) -> float:
    """Seconds for every rank to load its own state back from its own node (a DCP save and load with
    no_dist=True: no coordinator, no other rank's files), the slowest rank's."""
    import torch.distributed.checkpoint as dcp

    state = state_dict(job)
    with warnings.catch_warnings():  # "assuming the intent is to ... in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)  # type: ignore[attr-defined]
        _barrier()
        start = time.perf_counter()
        dcp.load(state, checkpoint_id=str(path), no_dist=True)  # type: ignore[attr-defined]
        _barrier()
        return time.perf_counter() - start


def _environment_cause(e: BaseException) -> OSError | None:
    """The OSError behind a checkpoint failure (DCP wraps each rank's in a CheckpointException), else None."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, OSError):
        return e
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            if isinstance(exc, OSError):
                return exc
    cause = e.__cause__ or e.__context__
    return _environment_cause(cause) if cause is not None and cause is not e else None


def save_load_times(job: Job, directory: str | Path | None = None) -> dict[str, float | str]:
    """Blocking save, async save, then load of the job's current state under `directory` (default: each
    node's temp dir), in a folder every rank removes from its node after (see the module docstring)."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = _agreed_folder(Path(directory) if directory is not None else Path(tempfile.gettempdir()))
    try:
        out: dict[str, float | str] = dict(save(job, root / "blocking"))
        try:
            out.update(save(job, root / "async", use_async=True))
        except (RuntimeError, NotImplementedError) as e:  # async staging unsupported here: keep the blocking figure
            out["async_save_error"] = str(e).splitlines()[0]
        if _every_rank((root / "blocking" / ".metadata").is_file()):
            out["load_s"], out["load_scope"] = load(job, root / "blocking"), "dcp"
        else:  # per-node folders: the coordinator's metadata is on its node only
            out["load_s"] = _rank_local_load(job, root / f"rank{_rank()}")
            out["load_scope"] = "rank-local"
        _barrier()
        return out
    except (Exception, CheckpointException) as e:
        cause = _environment_cause(e)
        if cause is None:
            raise
        raise CheckpointEnvironmentError(
            f"checkpoint under {root.parent} on rank {_rank()}: {type(cause).__name__}: {cause}".splitlines()[0]
        ) from e
    finally:
        shutil.rmtree(root, ignore_errors=True)  # every rank its node's folder (several at once: a shared one)
