"""`stratagem clean` and a search's start-up touch only what is provably ours (launch/runners/ray_session.py, issue
36 item 2): beside a dead session of ours (its leftover "ray::RankWorker", its temp dir, a rank dir: reaped, the
positive control), fake "other searches" that look exactly like dead stratagem sessions survive: one in its own
PID namespace (`unshare --pid`), one whose marker names a session without our owner record, one run by another
user carrying our own dead session's marker. The dry run lists only ours and touches nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stratagem import procfs
from stratagem.cli import main
from stratagem.launch.runners.ray_session import OWNER_FILE, RANK_PREFIX, SESSION_ENV, TEMP_PREFIX, Owner

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: unshare --pid and a process run as "
                                 "another user (uid 65534)"),
              pytest.mark.timeout(300)]

NOBODY = 65534
FAKE = "import time; time.sleep(600)"
INNER = """\
import json, os, subprocess, sys, time
session, rank_dir, dead = sys.argv[1], sys.argv[2], int(sys.argv[3])
record = json.dumps({"uid": os.getuid(), "pid_ns": os.readlink("/proc/self/ns/pid"), "pid": dead, "start_ticks": 1,
                     "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip()})
for d in (session, rank_dir):
    os.makedirs(d)
    open(os.path.join(d, ".stratagem-owner.json"), "w").write(record)
env = {**os.environ, "STRATAGEM_RAY_SESSION": session, "RAY_RAYLET_PID": str(dead)}
argv = [["ray::RankWorker"], ["ray::IDLE"], ["/opt/ray/raylet", "--raylet_socket_name=" + session + "/raylet"]]
kids = [subprocess.Popen([a[0], "-c", "import time; time.sleep(600)", *a[1:]], executable=sys.executable, env=env)
        for a in argv]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(600)
"""


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def _record(pid: int, ns: str | None = None, uid: int | None = None) -> str:
    """An owner record naming dead `pid` as maker: ours unless another namespace or user is given."""
    return Owner(uid=os.getuid() if uid is None else uid, pid_ns=ns or procfs.pid_namespace() or "",
                 boot_id=procfs.boot_id() or "", pid=pid, start_ticks=1).model_dump_json()


def _owned_dir(path: Path, record: str | None) -> Path:
    path.mkdir()
    if record is not None:
        (path / OWNER_FILE).write_text(record)
    return path


def _fake(argv0: str, session: str, uid: int | None = None) -> subprocess.Popen[bytes]:
    """A python process whose command line reads `argv0` (as Ray's workers' do) carrying `session`'s marker;
    as another user, `sleep` (this venv's python is not theirs to run)."""
    env = {**os.environ, SESSION_ENV: session, "RAY_RAYLET_PID": str(_dead_pid())}
    args, exe = ([argv0, "600"], "/bin/sleep") if uid is not None else ([argv0, "-c", FAKE], sys.executable)
    child = subprocess.Popen(args, executable=exe, env=env, start_new_session=True, user=uid, cwd="/")
    deadline = time.monotonic() + 30  # until exec has replaced the forked copy of this process
    while not (procfs.cmdline(child.pid) or b"").startswith(argv0.encode()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child


class World:
    """The fakes and the dead session of ours, with what each must be afterwards."""

    def __init__(self, tmp: Path, rank_tmp: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._start(tmp, rank_tmp)
        except BaseException:
            self.close()
            raise

    def _start(self, tmp: Path, rank_tmp: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        dead = _dead_pid()
        self.ours_dir = _owned_dir(Path("/tmp") / f"{TEMP_PREFIX}{dead}-ours-{tag}", _record(dead))
        self.ours_rank = _owned_dir(rank_tmp / f"{RANK_PREFIX}{dead}-ours-{tag}", _record(dead))
        self.ours = self.spawn("ray::RankWorker", str(self.ours_dir))
        # another user's process with our own dead session's marker
        self.nobody = self.spawn("ray::RankWorker", str(self.ours_dir), uid=NOBODY)
        # a marker naming a session dir without an owner record (another tool's, an older stratagem's)
        self.unowned_dir = _owned_dir(Path("/tmp") / f"{TEMP_PREFIX}{dead}-unowned-{tag}", None)
        os.utime(self.unowned_dir, (time.time() - 3600, time.time() - 3600))
        self.unowned = self.spawn("ray::RankWorker", str(self.unowned_dir))
        self.unowned_rank = _owned_dir(rank_tmp / f"{RANK_PREFIX}{dead}-unowned-{tag}", None)
        # another user's record in our dir: not ours
        self.theirs_rank = _owned_dir(rank_tmp / f"{RANK_PREFIX}{dead}-theirs-{tag}", _record(dead, uid=NOBODY))
        # a search in its own PID namespace: records and processes that differ from ours only by the namespace
        self.ns_dir = Path("/tmp") / f"{TEMP_PREFIX}{dead}-ns-{tag}"
        self.ns_rank = rank_tmp / f"{RANK_PREFIX}{dead}-ns-{tag}"
        inner = tmp / "inner.py"
        inner.write_text(INNER)
        ns = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(inner),
                               str(self.ns_dir), str(self.ns_rank), str(dead)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
        self.procs.append(ns)
        assert ns.stdout is not None
        inner_pids = ns.stdout.readline().split()  # their pids inside the namespace: find them here by marker
        assert len(inner_pids) == 3, "the namespaced fake did not start"
        deadline = time.monotonic() + 30
        self.ns_pids: list[int] = []
        while len(self.ns_pids) < 3 and time.monotonic() < deadline:
            self.ns_pids = [p for p in procfs.user_pids() if procfs.alive(p) and (procfs.environ(p) or {}).get(
                SESSION_ENV.encode()) == str(self.ns_dir).encode()]
            time.sleep(0.05)
        assert len(self.ns_pids) == 3 and all(procfs.pid_namespace(p) != procfs.pid_namespace() for p in self.ns_pids)

    def spawn(self, argv0: str, session: str, uid: int | None = None) -> subprocess.Popen[bytes]:
        child = _fake(argv0, session, uid)
        self.procs.append(child)
        return child

    def foreign_pids(self) -> list[int]:
        return [self.nobody.pid, self.unowned.pid, *self.ns_pids]

    def foreign_dirs(self) -> list[Path]:
        return [self.unowned_dir, self.unowned_rank, self.theirs_rank, self.ns_dir, self.ns_rank]

    def assert_foreign_untouched(self) -> None:
        assert [p for p in self.foreign_pids() if not procfs.alive(p)] == []
        assert [d for d in self.foreign_dirs() if not d.is_dir()] == []

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            p.wait()
        for name in ("ours_dir", "ours_rank", "unowned_dir", "unowned_rank", "theirs_rank", "ns_dir", "ns_rank"):
            if hasattr(self, name):
                subprocess.run(["rm", "-rf", str(getattr(self, name))], check=False)


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    rank_tmp = tmp_path / "node-tmp"
    rank_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(rank_tmp))  # this node's temp dir, where rank dirs go
    w = World(tmp_path, rank_tmp)
    try:
        yield w
    finally:
        w.close()


def _clean(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["clean", *args])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    return out


def test_clean_and_a_new_search_touch_only_what_is_ours(world: World, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = _clean(capsys, "--dry-run")
    assert f"would kill process {world.ours.pid} of dead session {world.ours_dir}" in out, out
    assert f"would remove {world.ours_dir}" in out and f"would remove {world.ours_rank}" in out, out
    for pid in world.foreign_pids():
        assert f"process {pid} " not in out, out
    for d in world.foreign_dirs():
        assert str(d) not in out, out
    assert procfs.alive(world.ours.pid) and world.ours_dir.is_dir() and world.ours_rank.is_dir()  # nothing touched
    world.assert_foreign_untouched()

    out = _clean(capsys)
    assert f"killed process {world.ours.pid} of dead session {world.ours_dir}" in out, out
    world.ours.wait(timeout=10)
    assert not world.ours_dir.exists() and not world.ours_rank.exists(), out
    world.assert_foreign_untouched()

    # a new search's start-up (RayRunner starting its own local cluster) and a rank's start on this node
    from stratagem.launch.runners.ray_runner import RayRunner
    from stratagem.launch.runners.ray_session import reap_rank_dirs

    again_dir = _owned_dir(Path("/tmp") / f"{TEMP_PREFIX}{_dead_pid()}-again-{uuid.uuid4().hex[:8]}",
                           _record(_dead_pid()))
    again = world.spawn("ray::IDLE", str(again_dir))
    runner = RayRunner(run_dir=tmp_path / "runs", num_cpus=1)
    try:
        again.wait(timeout=10)  # the positive control: our dead session's process was reaped at start
        assert not again_dir.exists()
        assert reap_rank_dirs() == []
        world.assert_foreign_untouched()
    finally:
        runner.shutdown()
    world.assert_foreign_untouched()


def test_pid_namespaces_tell_processes_apart() -> None:
    here = procfs.pid_namespace()
    assert here is not None and here.startswith("pid:[") and procfs.pid_namespace(os.getpid()) == here
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sleep", "30"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        inner: list[int] = []
        while not inner and time.monotonic() < deadline:
            inner = [p for p in procfs.user_pids() if procfs.parent(p) == child.pid]
            time.sleep(0.05)
        assert inner and procfs.pid_namespace(child.pid) == here and procfs.pid_namespace(inner[0]) != here
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert procfs.boot_id() and len(procfs.boot_id() or "") == 36
