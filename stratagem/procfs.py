"""Linux /proc read once, here: process state, parent, start time, command, environment, PID namespace, the
boot id and memory status.

Field positions follow proc(5): /proc/PID/stat is "pid (comm) state ppid ... starttime ..."; the command
name may contain spaces and parentheses, so fields are counted after the last ')'. Every reader returns None
(or an empty result) when the process or /proc is gone instead of raising: a process can exit between any
two reads.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["stat_fields", "state", "alive", "parent", "start_ticks", "comm", "cmdline", "environ", "user_pids",
           "pid_namespace", "boot_id", "status_kib"]

_PROC = Path("/proc")


def stat_fields(pid: int | str) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (index 0 is the state, 1 the parent pid, 19 the start time), or None."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The one-letter state (R, S, D, Z, X, ...), or None when the process is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int | None:
    """The parent's pid, or None."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def start_ticks(pid: int) -> int | None:
    """Start time in clock ticks since boot (tells a reused pid apart), or None if unknown."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def comm(pid: int) -> str | None:
    """The command name (/proc/PID/comm), or None."""
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return None


def cmdline(pid: int) -> bytes | None:
    """The raw NUL-separated command line, or None (not ours, or gone)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None


def environ(pid: int) -> dict[bytes, bytes] | None:
    """The process's environment at start, or None (not ours, or gone)."""
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def user_pids(uid: int | None = None) -> list[int]:
    """Pids of the processes owned by `uid` (default: this user), ascending; empty without /proc."""
    me = os.getuid() if uid is None else uid
    out = []
    try:
        entries = list(_PROC.iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == me:
                out.append(int(entry.name))
        except OSError:
            continue
    return sorted(out)


def pid_namespace(pid: int | str = "self") -> str | None:
    """The process's PID namespace as the kernel names it ("pid:[4026531836]", namespaces(7)), or None (gone, or
    not ours to inspect: reading it needs the same rights as ptrace). Two processes share a namespace exactly
    when the names are equal; a pid means the same process only within one namespace."""
    try:
        return os.readlink(_PROC / str(pid) / "ns" / "pid")
    except OSError:
        return None


def boot_id() -> str | None:
    """This boot's random id (/proc/sys/kernel/random/boot_id, random(4)): a pid and start time recorded
    before a reboot name nothing after it. None without /proc."""
    try:
        return (_PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None


def status_kib(keys: tuple[str, ...], pid: int | str = "self") -> dict[str, int] | None:
    """Values (KiB) of /proc/PID/status lines such as VmRSS, VmHWM; None without /proc."""
    out: dict[str, int] = {}
    try:
        with open(_PROC / str(pid) / "status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    out[key] = int(rest.split()[0])
    except OSError:
        return None
    return out
