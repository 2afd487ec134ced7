"""This user's Ray sessions and rank work dirs on this host: which processes belong to a session a RayRunner
started, and the reaping of what dead runs left behind (Ray's per-node agents whose raylet is gone, session
temp dirs under /tmp, rank work dirs in a node's temp dir). RayRunner (ray_runner.py) names its session and
rank dirs with the prefixes here and reaps at start and shutdown; `stratagem clean` calls the reap_* functions.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from stratagem import procfs

__all__ = ["SESSION_ENV", "TEMP_PREFIX", "RANK_PREFIX", "session_pids", "reap_rank_dirs", "remove_stale_temp_dirs",
           "ray_helpers", "reap_session_dirs", "reap_orphans"]

TEMP_PREFIX = "stratagem-ray-"  # + the driver's pid + "-"
SESSION_ENV = "STRATAGEM_RAY_SESSION"
"""Set to the session's temp dir in the driver before ray.init: every process of the session inherits it."""
_STALE_S = 300.0  # a session temp dir nobody names for this long is a dead run's
RANK_PREFIX = "stratagem-rank-"  # + the actor's pid + "-": one rank's work dir on its node


def session_pids(temp_dir: str) -> list[int]:
    """This user's processes whose command line names `temp_dir` (the session's GCS, raylet, monitors)."""
    needle = temp_dir.encode()
    return [pid for pid in procfs.user_pids() if needle in (procfs.cmdline(pid) or b"")]


def reap_rank_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove this user's rank work dirs (stratagem-rank-<pid>-*) in this node's temp dir whose actor is
    dead (killed with the driver, a node restart: its `finally` never ran), and older unnamed ones (before
    the pid was in the name) after _STALE_S. Returns what it removed (issue 27 item 8)."""
    removed = []
    me = os.getuid()
    for d in Path(temp_dir or tempfile.gettempdir()).glob(f"{RANK_PREFIX}*"):
        try:
            st = d.stat()
            if st.st_uid != me or not d.is_dir():
                continue
        except OSError:
            continue
        pid = d.name[len(RANK_PREFIX):].split("-")[0]
        dead = not procfs.alive(int(pid)) if pid.isdigit() else time.time() - st.st_mtime > _STALE_S
        if dead:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def remove_stale_temp_dirs() -> list[str]:
    """Remove /tmp/stratagem-ray-* dirs of this user that no live process names and whose driver (the pid in
    the name) is dead, or, without a pid, that are older than _STALE_S (sessions that died; a younger one may be
    a session another runner is starting right now)."""
    removed = []
    me = os.getuid()
    cmdlines = [procfs.cmdline(pid) or b"" for pid in procfs.user_pids()]
    for d in Path("/tmp").glob(f"{TEMP_PREFIX}*"):
        owner = d.name[len(TEMP_PREFIX):].split("-")[0]
        try:
            st = d.stat()
            young = time.time() - st.st_mtime < _STALE_S
            if st.st_uid != me or not d.is_dir() or (young and not (owner.isdigit() and not procfs.alive(int(owner)))):
                continue
        except OSError:
            continue
        if not any(str(d).encode() in c for c in cmdlines):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def ray_helpers() -> dict[int, int]:
    """This user's Ray helper processes (ray::...) and the pid of the raylet each belongs to: RAY_RAYLET_PID
    from its environment, else its parent (the raylet starts them)."""
    out = {}
    for pid in procfs.user_pids():
        if not (procfs.cmdline(pid) or b"").startswith(b"ray::"):
            continue
        env, parent = procfs.environ(pid), procfs.parent(pid)
        if env is None or parent is None:
            continue
        raylet = env.get(b"RAY_RAYLET_PID", str(parent).encode())
        if raylet.isdigit():
            out[pid] = int(raylet)
    return out


def _is_raylet(pid: int) -> bool:
    """A live raylet (not a zombie, not a reused pid)."""
    return procfs.alive(pid) and procfs.comm(pid) == "raylet"


def reap_session_dirs() -> list[str]:
    """Remove the Ray temp dirs of this user's dead stratagem sessions (see `remove_stale_temp_dirs`)."""
    return remove_stale_temp_dirs()


def reap_orphans(only_ours: bool = False) -> list[int]:
    """Kill Ray helper processes (dashboard/runtime-env agents, workers) whose raylet is dead.

    A driver killed with SIGKILL takes its local GCS, raylet, workers and harness ranks with it (Ray's fate
    sharing and our PR_SET_PDEATHSIG), but Ray 2.60's per-node agents outlive it (and linger for a while after
    a clean shutdown too). They carry their raylet's pid in RAY_RAYLET_PID; when that raylet is gone they serve
    nothing, so they are removed here.
    """
    killed = []
    for pid, raylet in ray_helpers().items():
        if only_ours and SESSION_ENV.encode() not in (procfs.environ(pid) or {}):
            continue  # `stratagem clean`: only helpers of sessions a RayRunner started
        if not _is_raylet(raylet):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed
