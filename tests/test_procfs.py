"""stratagem.procfs against real processes: a child's parent, environment, start time; a zombie is not alive."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from stratagem import procfs

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_a_live_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**os.environ, "STRATAGEM_PROCFS_TEST": "a b=c"})
    try:
        deadline = time.monotonic() + 30  # until the exec has replaced the forked copy of our memory
        while b"STRATAGEM_PROCFS_TEST" not in (procfs.environ(child.pid) or {}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procfs.alive(child.pid) and procfs.parent(child.pid) == os.getpid()
        assert procfs.environ(child.pid)[b"STRATAGEM_PROCFS_TEST"] == b"a b=c"  # type: ignore[index]
        assert procfs.cmdline(child.pid).split(b"\0")[0] == sys.executable.encode()  # type: ignore[union-attr]
        assert child.pid in procfs.user_pids()
        mine, theirs = procfs.start_ticks(os.getpid()), procfs.start_ticks(child.pid)
        assert mine is not None and theirs is not None and theirs >= mine
    finally:
        child.kill()
        child.wait()
    assert not procfs.alive(child.pid) and procfs.start_ticks(child.pid) is None


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while procfs.state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert procfs.state(child.pid) == "Z" and not procfs.alive(child.pid)
    finally:
        child.wait()


def test_status_and_a_name_with_parentheses() -> None:
    kib = procfs.status_kib(("VmRSS", "VmHWM"))
    assert kib is not None and 0 < kib["VmRSS"] <= kib["VmHWM"]
    # comm may hold ') ': fields are counted after the last ')'
    child = subprocess.Popen(["bash", "-c", "exec -a 'x) y' sleep 30"])
    try:
        deadline = time.monotonic() + 10
        while procfs.comm(child.pid) != "sleep" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procfs.parent(child.pid) == os.getpid() and procfs.state(child.pid) in ("S", "R")
    finally:
        child.kill()
        child.wait()
