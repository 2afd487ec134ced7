"""Run a function on N local ranks with a real process group (gloo on CPU), guarded against hangs.

    results = run_local(fn, world_size=4, args=(scenario, plans), timeout_s=180)

Each rank is a process forked from a forkserver that has torch and the harness imported already (about
1 s per rank on this machine instead of 3-5 s for a fresh interpreter), with the torchrun environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), one thread, and a process-group timeout. `fn(rank,
*args)` runs after `init_process_group`; its return values come back in rank order. Any rank that raises
fails the whole run with that rank's traceback; ranks still alive at the deadline are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["LocalRunError", "run_local", "free_port"]

_PRELOAD = ["stratagem.launch.harness.run", "stratagem.launch.harness.train"]  # train: torch (harness imports it lazily)


class LocalRunError(RuntimeError):
    """A rank failed or the run passed its deadline."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout_s: float,
            args: tuple[Any, ...], results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1"})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s))
        try:
            value = fn(rank, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
        results.put((rank, False, traceback.format_exc()))


def run_local(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), timeout_s: float = 300.0,
              pg_timeout_s: float = 60.0) -> list[Any]:
    """fn(rank, *args) on `world_size` ranks; the return values in rank order (they must pickle)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, pg_timeout_s, args, results),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    try:
        while len(values) < world_size and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LocalRunError(f"run of {world_size} ranks passed its {timeout_s:.0f} s deadline; "
                                    f"ranks {sorted(set(range(world_size)) - set(values))} did not finish")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead:
                    failure = (dead[0], f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if ok:
                values[rank] = value
            else:
                failure = (rank, value)
        if failure is not None:
            raise LocalRunError(f"rank {failure[0]} failed:\n{failure[1]}")
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
