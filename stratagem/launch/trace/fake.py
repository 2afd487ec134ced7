"""Tracing tools: a fake process group of any size, and a live-bytes counter that splits the peak into blocks.

`fake_world(world_size, rank)`: torch's fake process group (`FakeStore`, backend "fake": every collective
returns at once, nothing is sent), so one process can be rank `rank` of `world_size` and build the real
DeviceMesh, DTensor shards and FSDP2 units of that rank.

`BlockBytes`: a TorchDispatchMode that follows every storage an op returns, real or fake (FakeTensors carry
exact sizes without data), like `stratagem.launch.harness.memtrack.LiveBytes`, plus a log of allocations and frees so
that the storages alive at the peak can be named afterwards: each storage gets a serial number and a block
(weights, gradients, optimizer, activations, rest), decided when the step is over by what it turned out to be.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["BLOCKS", "fake_world", "BlockBytes"]

_TO_COPY = torch.ops.aten._to_copy.default
BLOCKS = ("weights", "gradients", "optimizer", "activations", "rest")


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """The default process group is a fake one of `world_size` ranks in which this process is `rank`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: tracing needs its own fake one")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    while isinstance(t, DTensor):
        t = t._local_tensor
    return t


class BlockBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live storage bytes with their history: `peak` (bytes) since `reset_peak()`, and `blocks_at_peak(...)`.

    Phases: `phase` is "build", "forward", "backward" or "optimizer"; a storage made while autograd's engine
    runs (a backward, or a recompute inside it) counts as made in backward whatever `phase` says. A storage can
    be labelled at any time with `label(tensor, block)` (e.g. parameters, unsharded parameters, gradients); a
dtype cast (`aten._to_copy`) of a storage labelled "weights" is labelled "weight_copy" (autocast's copies).
Integer storages (token batches, indices) are marked as made in phase "integer".
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._serial_of: dict[int, int] = {}  # id(storage) -> serial of the live storage
        self._size: dict[int, int] = {}  # serial -> bytes now
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.made_in: dict[int, str] = {}  # serial -> phase it was made in
        self.labels: dict[int, str] = {}  # serial -> block given by label()
        self.made_by: dict[int, Any] = {}  # serial -> the op that returned it (None: tracked or labelled)
        self._log: list[tuple[int, int]] = []  # (serial, new size) in order
        self._next = 0
        self.current = 0
        self.peak = 0
        self._peak_at = 0  # log length at the peak
        self.phase = "build"
        self.ignoring = 0  # > 0: storages made now are not tracked (shape inference on fake tensors)
        self._resize: Callable[..., Any] | None = None

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def _set(self, serial: int, size: int) -> None:
        self.current += size - self._size.get(serial, 0)
        self._size[serial] = size
        self._log.append((serial, size))
        if self.current > self.peak:
            self.peak = self.current
            self._peak_at = len(self._log)

    def _free(self, key: int, serial: int, _ref: Any) -> None:
        if self._serial_of.get(key) == serial:
            del self._serial_of[key]
            self._refs.pop(key, None)
        self._set(serial, 0)
        self._size.pop(serial, None)

    def serial(self, t: torch.Tensor, make: bool = True) -> int | None:
        """The serial number of t's storage (tracked from now on when `make`)."""
        t = _local(t)
        if t.device.type == "meta" and not _is_fake(t):
            return None
        st = t.untyped_storage()
        key = id(st)
        serial = self._serial_of.get(key)
        if serial is None and make and not self.ignoring:
            serial = self._next
            self._next += 1
            self._serial_of[key] = serial
            self._refs[key] = weakref.ref(st, partial(self._free, key, serial))
            in_backward = torch._C._current_graph_task_id() != -1
            phase = "backward" if in_backward and self.phase != "build" else self.phase
            self.made_in[serial] = phase if t.is_floating_point() else "integer"
            self._set(serial, st.nbytes())
        elif serial is not None and self._size.get(serial) != st.nbytes():
            self._set(serial, st.nbytes())
        return serial

    def track(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """Count tensors that exist already (made before the mode was entered)."""
        for t in tensors:
            if t is not None:
                self.serial(t)

    def label(self, tensors: Iterable[torch.Tensor | None], block: str) -> None:
        """Name the block of these tensors' storages (the last label given wins)."""
        for t in tensors:
            if t is not None:
                s = self.serial(t)
                if s is not None:
                    self.labels[s] = block

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak = self.current
        self._peak_at = len(self._log)

    def alive_at_peak(self) -> dict[int, int]:
        """serial -> bytes of every storage alive at the peak (replays the log)."""
        alive: dict[int, int] = {}
        for serial, size in self._log[: self._peak_at]:
            if size:
                alive[serial] = size
            else:
                alive.pop(serial, None)
        return alive

    def blocks_at_peak(self, classify: Callable[[int], str]) -> dict[str, int]:
        """Bytes per block of the storages alive at the peak; `classify(serial)` names each one's block."""
        out = dict.fromkeys(BLOCKS, 0)
        for serial, size in self.alive_at_peak().items():
            out[classify(serial)] += size
        return out

    def ops_at_peak(self, classify: Callable[[int], str]) -> dict[tuple[str, str], int]:
        """Bytes alive at the peak per (block, op that made the storage): where a block's bytes come from."""
        out: dict[tuple[str, str], int] = {}
        for serial, size in self.alive_at_peak().items():
            key = (classify(serial), str(self.made_by.get(serial, "-")))
            out[key] = out.get(key, 0) + size
        return out

    # ---- the dispatch mode ---------------------------------------------------------------------------------
    def __enter__(self) -> BlockBytes:
        original = torch.UntypedStorage.resize_
        self._resize = original

        def resize_(st: torch.UntypedStorage, size: int) -> Any:  # FSDP2 frees and refills by resize_
            out = original(st, size)
            serial = self._serial_of.get(id(st))
            if serial is not None:
                self._set(serial, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)  # type: ignore[no-untyped-call]
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                serial = self.serial(leaf)
                if serial is not None:
                    self.made_by.setdefault(serial, func)
        if func is _TO_COPY and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            src = self.serial(args[0], make=False)  # a dtype cast of a parameter: autocast's weight copy
            if src is not None and self.labels.get(src) == "weights":
                self.label([out], "weight_copy")
        return out


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return bool(is_fake(t))
