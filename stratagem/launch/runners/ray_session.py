"""This user's Ray sessions and rank work dirs on this host, and the reaping of what dead runs left behind.

Nothing is touched on a guess. A RayRunner that starts a local Ray session writes an owner record (OWNER_FILE:
uid, PID namespace, boot id, the driver's pid and start time) into the session's temp dir before Ray starts,
and hands every process of the session its marker, SESSION_ENV = that dir. A rank's work dir carries the same
record for its actor. Something is ours to reap only when all of these hold:
- a process: owned by this user, in this process's PID namespace (/proc/PID/ns/pid), its environment's
  SESSION_ENV names a session dir whose record is ours, and that session's driver is dead;
- a session dir: owned by this user, its record names this user, this PID namespace and this boot, its driver
  (pid and start time) is dead, and no live process of ours carries its marker;
- a rank dir: the same, for the actor that made it.
A pid from another namespace (a container), another boot or another user means nothing here, so a search
running in a container beside ours, another user's runs and Ray clusters that stratagem did not start are
never touched; a dir or process without a record (or with a foreign one) is left alone.

RayRunner (ray_runner.py) names its session and rank dirs with the prefixes here and reaps at start;
`stratagem clean` lists (`--dry-run`) or reaps the same `leftovers()`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from stratagem import procfs

__all__ = ["SESSION_ENV", "TEMP_PREFIX", "RANK_PREFIX", "OWNER_FILE", "Owner", "Leftovers", "make_owned_dir",
           "read_owner", "session_pids", "leftovers", "reap", "kill_session", "reap_rank_dirs", "reap_dead_sessions"]

TEMP_PREFIX = "stratagem-ray-"  # + the driver's pid + "-": a session's temp dir under /tmp
SESSION_DIRS = Path("/tmp")
"""Where sessions live: Unix socket paths must stay short (ray_runner._start_local)."""
SESSION_ENV = "STRATAGEM_RAY_SESSION"
"""The session's marker: its temp dir, handed to every process Ray starts for it (not to the driver's others)."""
RANK_PREFIX = "stratagem-rank-"  # + the actor's pid + "-": one rank's work dir on its node
OWNER_FILE = ".stratagem-owner.json"
_EXIT_WAIT_S = 5.0  # how long reap() waits for killed processes to exit before it removes their session dir


class Owner(BaseModel):
    """Who made a session or rank dir: enough to prove it ours and to tell whether its maker still runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    uid: int
    """The maker's user id."""
    pid_ns: str
    """The maker's PID namespace (procfs.pid_namespace): its pid means nothing in another."""
    boot_id: str
    """The boot it ran in (procfs.boot_id): its pid means nothing after a reboot."""
    pid: int
    """The maker: the session's driver, or the rank's actor."""
    start_ticks: int
    """The maker's start time (procfs.start_ticks): tells it apart from a later process given the same pid."""

    @classmethod
    def of_this_process(cls) -> Owner:
        """This process as the maker of a dir."""
        ticks = procfs.start_ticks(os.getpid())
        return cls(uid=os.getuid(), pid_ns=procfs.pid_namespace() or "", boot_id=procfs.boot_id() or "",
                   pid=os.getpid(), start_ticks=-1 if ticks is None else ticks)

    def is_mine(self) -> bool:
        """Made by this user, in this PID namespace, in this boot (so its pid can be checked here)."""
        here = procfs.pid_namespace()
        return (self.uid == os.getuid() and here is not None and self.pid_ns == here
                and self.boot_id == (procfs.boot_id() or "") and self.start_ticks >= 0)

    def running(self) -> bool:
        """The maker still runs (same pid, same start time, not a zombie)."""
        return procfs.alive(self.pid) and procfs.start_ticks(self.pid) == self.start_ticks


class Leftovers(BaseModel):
    """What dead runs of ours left on this host: what `stratagem clean` lists and reap() removes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    processes: dict[int, str]
    """Live processes of dead sessions: pid -> their session dir."""
    session_dirs: list[str]
    """Temp dirs of dead sessions (removed once their processes are gone)."""
    rank_dirs: list[str]
    """Work dirs of dead rank actors."""
    left: dict[str, str] = {}
    """Dirs reap() found but did not remove: dir -> why (reap's answer only)."""


def make_owned_dir(prefix: str, parent: str | Path | None = None) -> Path:
    """A new private dir (tempfile.mkdtemp) holding this process's owner record: the only kind reaping touches."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    tmp = d / (OWNER_FILE + ".tmp")
    tmp.write_text(Owner.of_this_process().model_dump_json())
    tmp.replace(d / OWNER_FILE)  # whole or absent: a reaper never reads half a record
    return d


def read_owner(d: str | Path) -> Owner | None:
    """The owner record of dir `d` when it is ours (Owner.is_mine) and the dir is this user's; else None."""
    path = Path(d) / OWNER_FILE
    try:
        st = Path(d).lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or path.lstat().st_uid != os.getuid():
            return None  # a link, a file or another user's: not a dir we made
        owner = Owner.model_validate(json.loads(path.read_text()))
    except (OSError, ValueError, ValidationError):
        return None
    return owner if owner.is_mine() else None


def _marker(pid: int, here: str | None) -> str | None:
    """The session dir that live process `pid` names in SESSION_ENV, when it is this user's and runs in PID
    namespace `here` (ours); else None."""
    try:
        if here is None or os.stat(f"/proc/{pid}").st_uid != os.getuid() or procfs.pid_namespace(pid) != here:
            return None
    except OSError:
        return None
    value = (procfs.environ(pid) or {}).get(SESSION_ENV.encode())
    return value.decode(errors="replace") if value and procfs.alive(pid) else None


def _markers() -> dict[int, str]:
    """Our live processes (this user's, this PID namespace) that carry a session marker: pid -> its session."""
    here = procfs.pid_namespace()
    return {pid: m for pid in procfs.user_pids() if (m := _marker(pid, here)) is not None}


def session_pids(temp_dir: str) -> list[int]:
    """Our live processes that carry the marker of session `temp_dir` (its GCS, raylet, agents, workers, ranks)."""
    return sorted(pid for pid, s in _markers().items() if s == temp_dir)


def _dead_sessions() -> list[str]:
    """Session dirs under SESSION_DIRS whose record is ours and whose driver is dead."""
    out = []
    for d in sorted(SESSION_DIRS.glob(f"{TEMP_PREFIX}*")):
        owner = read_owner(d)
        if owner is not None and not owner.running():
            out.append(str(d))
    return out


def _dead_rank_dirs(temp_dir: str | None) -> list[str]:
    """Rank dirs in `temp_dir` (default: this node's temp dir) whose record is ours and whose actor is dead."""
    out = []
    for d in sorted(Path(temp_dir or tempfile.gettempdir()).glob(f"{RANK_PREFIX}*")):
        owner = read_owner(d)
        if owner is not None and not owner.running():
            out.append(str(d))
    return out


def leftovers(rank_temp_dir: str | None = None) -> Leftovers:
    """What reap() would remove now: processes and temp dirs of our dead sessions, our dead actors' rank dirs."""
    dead = _dead_sessions()
    procs = {pid: s for pid, s in _markers().items() if s in dead}
    return Leftovers(processes=procs, session_dirs=dead, rank_dirs=_dead_rank_dirs(rank_temp_dir))


def reap(found: Leftovers) -> Leftovers:
    """Kill `found`'s processes, then remove its session dirs no live process of ours still marks and its rank
    dirs, each proved ours and dead again just before (a dir's maker can be checked only while the dir has
    its record). Returns what was done."""
    here = procfs.pid_namespace()
    killed = {pid: session for pid, session in found.processes.items() if _kill(pid, session, here)}
    deadline = time.monotonic() + _EXIT_WAIT_S
    while any(procfs.alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    marked = set(_markers().values())
    left = {d: "a live process still carries its marker" for d in found.session_dirs if d in marked}
    left |= {d: why for d in [*found.session_dirs, *found.rank_dirs] if d not in left
             and (why := _remove_if_dead(d)) is not None}
    return Leftovers(processes=killed, session_dirs=[d for d in found.session_dirs if d not in left],
                     rank_dirs=[d for d in found.rank_dirs if d not in left], left=left)


def _kill(pid: int, session: str, here: str | None) -> bool:
    """SIGKILL `pid` if it is still ours and marks `session`, checked on a pidfd (os.pidfd_open) so that the
    check and the signal are about one process, never a later one given the same pid; whether it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if _marker(pid, here) != session:
            return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def kill_session(temp_dir: str) -> list[int]:
    """SIGKILL every live process of ours that carries the marker of session `temp_dir` (a runner ending the
    session it started, or one that failed to start); the pids signalled."""
    here = procfs.pid_namespace()
    return [pid for pid in session_pids(temp_dir) if _kill(pid, temp_dir, here)]


def _remove_if_dead(d: str) -> str | None:
    """Remove dir `d` when its record is still ours and its maker dead: None once nothing is left at `d` (a
    link included: os.path.lexists), else why it stays (the first error of the removal)."""
    owner = read_owner(d)
    if owner is None:
        return "no longer a dir holding our owner record"
    if owner.running():
        return "its maker runs again"
    errors: list[str] = []
    shutil.rmtree(d, onerror=lambda _f, path, exc: errors.append(f"{path}: {getattr(exc[1], 'strerror', None) or exc[1]}"))
    if not os.path.lexists(d):
        return None
    return errors[0] if errors else "still present after removal"


def reap_dead_sessions() -> Leftovers:
    """Kill the processes and remove the temp dirs of our dead sessions (a RayRunner's start-up)."""
    dead = leftovers()
    return reap(Leftovers(processes=dead.processes, session_dirs=dead.session_dirs, rank_dirs=[]))


def reap_rank_dirs(temp_dir: str | None = None) -> list[str]:
    """Remove our dead actors' rank dirs in `temp_dir` (default: this node's temp dir); what was removed. A rank
    calls it at its start: an actor killed with its driver or its node never ran its `finally`."""
    return [d for d in _dead_rank_dirs(temp_dir) if _remove_if_dead(d) is None]
