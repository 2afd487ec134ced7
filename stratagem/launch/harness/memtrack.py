"""Per-rank memory measurement: model-state bytes, peak memory during a step, RSS, and the memory cap.

Model states (bytes of this rank's local tensors, the quantities of the analytic model's blocks):
  param_bytes            parameters at rest (the rank's shards under TP / FSDP2)
  unsharded_param_bytes  unsharded parameters held from forward to backward (FSDP2 with
                         reshard_after_forward=False, i.e. zero 2); 0 otherwise
  grad_bytes             gradients after backward (DDP's bucket views, or FSDP2's sharded gradients)
  optimizer_bytes        optimizer states shaped like parameters (scalar `step` counters excluded)
  host_state_bytes       parameters, gradients and optimizer states FSDP2's CPUOffloadPolicy keeps in host
                         memory (not counted above: the blocks above are the compute device's)
Peak: CUDA max allocated / reserved; on CPU the peak of live tensor bytes seen by `LiveBytes`, a
TorchDispatchMode that follows every storage (what torch's MemTracker does, without its per-module stats).
"""

from __future__ import annotations

import resource
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stratagem import procfs
from stratagem.launch.harness.model import named_parameters

__all__ = ["MemoryCapExceeded", "local", "state_bytes", "grad_bytes", "host_resident", "HeldParams", "LiveBytes", "peak_memory",
           "rss_bytes"]


class MemoryCapExceeded(RuntimeError):
    """The tracked peak exceeded --memory-cap-gib: reported as an OOM ("OOM: ..." on stderr)."""


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local tensor of a DTensor; the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def _optimizer_states(optimizer: torch.optim.Optimizer,
                      skip: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Optimizer states shaped like parameters (not the scalar step), of parameters not in `skip` (ids)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer holds the rank's partition
    for param, state in inner.state.items():
        if skip and id(param) in skip:
            continue
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                yield value


def host_resident(parts: list[nn.Module]) -> set[int]:
    """ids of the parameters kept in host memory between uses: FSDP2's CPUOffloadPolicy (the FSDPParam's
    own `offload_to_cpu` flag); their gradients and optimizer states live there too."""
    out: set[int] = set()
    for part in parts:
        for module in part.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            group = getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None
            for fsdp_param in getattr(group, "fsdp_params", None) or []:
                if getattr(fsdp_param, "offload_to_cpu", False):
                    out.add(id(fsdp_param.sharded_param))
    return out


def state_bytes(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """param_bytes (at rest) and optimizer_bytes of this rank on its compute device; host_state_bytes: the
    parameters and optimizer states offloaded to host memory (FSDP2 CPUOffloadPolicy)."""
    host = host_resident(parts)
    params = list(named_parameters(parts))
    on_host = sum(_nbytes(p) for _, p in params if id(p) in host)
    host_states = sum(_nbytes(v) for v in _optimizer_states(optimizer)) - \
        sum(_nbytes(v) for v in _optimizer_states(optimizer, host))
    return {
        "param_bytes": sum(_nbytes(p) for _, p in params if id(p) not in host),
        "optimizer_bytes": sum(_nbytes(v) for v in _optimizer_states(optimizer, host)),
        "host_state_bytes": on_host + host_states,
    }


def grad_bytes(parts: list[nn.Module], where: str = "device") -> int:
    """Bytes of the gradients currently held (call after backward, before zero_grad) on the compute device,
    or (where="host") in host memory for offloaded parameters."""
    host = host_resident(parts)
    return sum(_nbytes(p.grad) for _, p in named_parameters(parts)
               if p.grad is not None and (id(p) in host) == (where == "host"))


class HeldParams:
    """Largest bytes of parameters registered on the model after a forward that are not the at-rest ones:
    the unsharded parameters FSDP2 keeps from forward to backward when it does not reshard after forward."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts
        self.at_rest = {id(p) for _, p in named_parameters(parts)}
        self.peak = 0
        self._handles: list[Any] = []

    def _measure(self, *_: Any) -> None:
        held = {id(p): _nbytes(p) for part in self.parts for p in part.parameters() if id(p) not in self.at_rest}
        self.peak = max(self.peak, sum(held.values()))

    def __enter__(self) -> HeldParams:
        self.at_rest = {id(p) for _, p in named_parameters(self.parts)}
        self._handles = [part.register_forward_hook(self._measure, always_call=True) for part in self.parts]
        return self

    def __exit__(self, *_: Any) -> None:
        for h in self._handles:
            h.remove()


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Bytes of live tensor storages: every storage an op returns (DTensors desugared to their local shards)
    is counted until its Python object dies or `resize_` changes it; `peak` is the high-water mark.

    torch's MemTracker does the same but refuses a root module called more than once per step, which gradient
    accumulation and pipeline schedules do; this counter keeps only the totals.
    """

    def __init__(self, initial: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.current = 0
        self.peak = 0
        for t in initial:
            self._track(t)
        self.baseline = self.current
        self.peak = self.current

    def _free(self, key: int, _ref: Any) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def _track(self, t: torch.Tensor) -> None:
        t = local(t)
        if t.device.type == "meta" or is_fake(t):
            return
        st = t.untyped_storage()
        key, size = id(st), st.nbytes()
        if key in self._sizes:
            self.current += size - self._sizes[key]
        else:
            self._refs[key] = weakref.ref(st, partial(self._free, key))
            self.current += size
        self._sizes[key] = size
        self.peak = max(self.peak, self.current)

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._sizes:
            self.current += st.nbytes() - self._sizes[key]
            self._sizes[key] = st.nbytes()
            self.peak = max(self.peak, self.current)

    def __enter__(self) -> LiveBytes:
        original = torch.UntypedStorage.resize_
        self._original_resize = original

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]  # FSDP2 frees by resize_(0)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)  # type: ignore[no-untyped-call]
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out


def _model_states(parts: list[nn.Module], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p for _, p in named_parameters(parts)]
    return params + [p.grad for p in params if p.grad is not None] + list(_optimizer_states(optimizer))


@contextmanager
def peak_memory(parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                device: torch.device) -> Iterator[dict[str, Any]]:
    """Measure the peak memory of the enclosed code; fills the yielded dict on exit.

    CUDA: max_memory_allocated / max_memory_reserved since entry. CPU: the peak of live tensor bytes
    (`LiveBytes`), counting the model states present at entry from the start.
    """
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        out["peak_bytes"] = out["peak_allocated_bytes"]
        return
    counter = LiveBytes(_model_states(parts, optimizer))
    with counter:
        yield out
    out["peak_tracked_bytes"] = counter.peak
    out["tracked_at_entry_bytes"] = counter.baseline
    out["peak_bytes"] = counter.peak


def rss_bytes() -> dict[str, int]:
    """Resident set size of this process now and at its peak (VmHWM)."""
    kib = procfs.status_kib(("VmRSS", "VmHWM"))
    if kib is None:  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS; only the peak)
        return {"rss_bytes": 0, "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return {"rss_bytes": kib.get("VmRSS", 0) * 1024, "rss_peak_bytes": kib.get("VmHWM", 0) * 1024}
