"""Run a function on N local ranks with a real process group (gloo on CPU), guarded against hangs.

    results = run_local(fn, world_size=4, args=(scenario, plans), timeout_s=180)

Each rank is a process forked from a forkserver that has torch and the harness imported already (about
1 s per rank on this machine instead of 3-5 s for a fresh interpreter), with the torchrun environment
(MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), one thread, and a process-group timeout. `fn(rank,
*args)` runs after `init_process_group`; its return values come back in rank order. Any rank that raises
fails the whole run: after the first failure the others' results are collected for a few more seconds, then
the ranks still running are killed, and the error gives every failed rank's traceback (in order of arrival)
and names the killed ranks. Ranks still alive at the deadline are killed.
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
# After the first failing rank, how long to keep collecting the others' results (never past the deadline): a
# rank's "Connection closed by peer" only says that another rank died, and that rank's own error may arrive
# later; peers stuck in a collective with the dead rank fail within a second or two.
_FAILURE_GRACE_S = 5.0
_CAUSE_CHARS = 160  # each failure's exception line in the summary line (callers show ~300 characters of it)


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


def _next_report(procs: list[Any], results: Any, reported: set[int], wait_s: float) -> tuple[int, bool, Any] | None:
    """The next (rank, ok, value or traceback) to arrive within wait_s, else a rank that exited non-zero without
    reporting (as a failure), else None."""
    try:
        rank, ok, value = results.get(timeout=wait_s)
    except queue.Empty:
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in reported]
        return (dead[0], False, f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") if dead else None
    return rank, ok, value


def _collect(procs: list[Any], results: Any, values: dict[int, Any], failures: dict[int, str], until: float,
             stop_at_failure: bool) -> None:
    """Read reports into `values` and `failures` (in order of arrival) until every rank has reported, the
    monotonic time `until`, or (stop_at_failure) the first failure."""
    while len(values) + len(failures) < len(procs) and not (stop_at_failure and failures):
        left = until - time.monotonic()
        if left <= 0:
            return
        report = _next_report(procs, results, set(values) | set(failures), min(left, 1.0))
        if report is None:
            continue
        rank, ok, value = report
        if ok:
            values[rank] = value
        else:
            failures[rank] = value


def _kill_running(procs: list[Any], reported: set[int]) -> list[int]:
    """Kill the ranks that have not reported and are still alive; their ranks."""
    running = [i for i, p in enumerate(procs) if i not in reported and p.is_alive()]
    for i in running:
        procs[i].kill()
    return running


def _failure_message(world: int, failures: dict[int, str], killed: list[int]) -> str:
    """Every failed rank's traceback in order of arrival, then one line naming the killed ranks and each failure
    (callers show that last line alone as the reason)."""
    blocks = [f"rank {rank} failed:\n{tb.rstrip()}" for rank, tb in failures.items()]
    killed_note = f" (ranks {killed} were still running and were killed)" if killed else ""
    causes = ", ".join(f"rank {rank} ({_cause(tb)})" for rank, tb in failures.items())
    return "\n".join([*blocks, f"{len(failures)} of {world} ranks failed{killed_note}, in order of arrival: {causes}"])


def _cause(tb: str) -> str:
    """A traceback's last line (the exception), cut to _CAUSE_CHARS so one long one leaves room for the others."""
    line = tb.strip().splitlines()[-1]
    return line if len(line) <= _CAUSE_CHARS else line[:_CAUSE_CHARS - 3] + "..."


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
    failures: dict[int, str] = {}
    try:
        _collect(procs, results, values, failures, deadline, stop_at_failure=True)
        if failures:
            grace_end = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
            _collect(procs, results, values, failures, grace_end, stop_at_failure=False)
            killed = _kill_running(procs, set(values) | set(failures))
            raise LocalRunError(_failure_message(world_size, failures, killed))
        if len(values) < world_size:
            raise LocalRunError(f"run of {world_size} ranks passed its {timeout_s:.0f} s deadline; "
                                f"ranks {sorted(set(range(world_size)) - set(values))} did not finish")
        return [values[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
