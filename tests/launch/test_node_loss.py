"""A node lost during a run spread across nodes frees the other node's ranks within seconds (issue 36 item 3: they
waited for the run's timeout, 3 min 17 s, holding their CPUs). Two torchrun "nodes" on this host, each its own
TMPDIR: once every rank is in its timed steps, one node is frozen (SIGSTOP: a host powered off or cut off, whose
connections never close) or killed (SIGKILL); the other node's ranks leave on the timed steps' collective timeout
(harness/collective_timeout.py) or the closed connections, within 30 s."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stratagem import procfs

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "tiny-cpu.yaml"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
MARK = "STRATAGEM_NODE_LOSS_TEST"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node_pids(tag: str) -> list[int]:
    """Live processes of one "node": its torchrun agent and ranks (they inherit the node's MARK)."""
    return [p for p in procfs.user_pids() if procfs.alive(p)
            and (procfs.environ(p) or {}).get(MARK.encode()) == tag.encode()]


def _ranks(tag: str) -> list[int]:
    return [p for p in _node_pids(tag) if b"stratagem.launch.harness" in (procfs.cmdline(p) or b"")
            and b"torch.distributed.run" not in (procfs.cmdline(p) or b"")]


def _signal_node(tag: str, sig: int) -> None:
    for pid in _node_pids(tag):
        try:
            os.kill(pid, sig)
        except OSError:
            pass


@pytest.mark.parametrize(("how", "lost"), [("freeze", 1), ("kill", 0)])
def test_a_lost_node_frees_the_other_nodes_ranks(how: str, lost: int, tmp_path: Path) -> None:
    port = _free_port()
    tags = [f"{uuid.uuid4().hex}-{r}" for r in (0, 1)]
    nodes, logs = [], []
    for r in (0, 1):
        node_tmp = tmp_path / f"node{r}"
        node_tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(node_tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               MARK: tags[r]}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "stratagem.launch.harness", "--scenario", str(SCENARIO), "--plan", "dp=4,precision=fp32",
               "--steps", "100000", "--warmup", "2", "--no-checkpoint"]
        log = tmp_path / f"node{r}.log"
        logs.append(log)
        nodes.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                      start_new_session=True))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and all(n.poll() is None for n in nodes):
            if sum(log.read_text(errors="replace").count("timed steps: collective timeout") for log in logs) == 4:
                break
            time.sleep(0.5)
        texts = [log.read_text(errors="replace") for log in logs]
        assert sum(t.count("timed steps: collective timeout") for t in texts) == 4, texts
        survivors = _ranks(tags[1 - lost])
        assert len(survivors) == 2 and len(_ranks(tags[lost])) == 2
        time.sleep(2)  # a few timed steps
        lost_at = time.monotonic()
        _signal_node(tags[lost], signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
        while time.monotonic() - lost_at < 60 and any(procfs.alive(p) for p in survivors):
            time.sleep(0.2)
        took = time.monotonic() - lost_at
        assert took < 30, (took, logs[1 - lost].read_text(errors="replace")[-3000:])
    finally:
        for tag in tags:
            _signal_node(tag, signal.SIGKILL)
        for n in nodes:
            n.wait(timeout=60)
    print(f"{how} node {lost}: the other node's ranks left after {took:.1f} s")
