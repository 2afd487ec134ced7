"""One rank of a RayRunner run on its node: the Ray actor (RankWorker) that holds the rank's bundle, writes the
scenario it received into a work dir of its own, runs the harness there as a child process with the rendezvous
environment, streams its log on request and returns its exit code, its log and (rank 0) the result JSON.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from stratagem.launch.runners.ray_session import RANK_PREFIX, make_owned_dir, reap_rank_dirs

__all__ = ["RankWorker", "LOG_BYTES"]

LOG_BYTES = 4 << 20  # per rank log returned to the driver (its end)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die when the actor dies
    except OSError:
        pass


class RankWorker:
    """A Ray actor holding one bundle; runs one rank of the harness as a child process on its node (two
    concurrent calls: `kill` while `run` waits)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False
        self.log_path: Path | None = None
        self.idle = threading.Event()  # clear while run() holds a work dir
        self.idle.set()

    def where(self) -> dict[str, Any]:
        """This rank's node: IP, a free port (used by rank 0 as MASTER_PORT), Ray's GPU ids."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return {"ip": ray.util.get_node_ip_address(), "port": port,  # type: ignore[no-untyped-call]
                "node": ray.get_runtime_context().get_node_id(),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def run(self, scenario_yaml: str, plan_text: str, args: dict[str, Any], env: dict[str, str],
            rank: int) -> dict[str, Any]:
        """Write the scenario to a temp dir here, run the harness, return code, log (its end) and result.

        The dir is named after this actor's pid, holds its owner record (ray_session) and is the harness's
        TMPDIR (its timed checkpoint included): removed at the end, and by the next rank on this node when this
        actor died without cleaning up."""
        self.idle.clear()
        reap_rank_dirs()
        work = make_owned_dir(f"{RANK_PREFIX}{os.getpid()}-", tempfile.gettempdir())
        try:
            (work / "scenario.yaml").write_text(scenario_yaml)
            cmd = [sys.executable, "-m", "stratagem.launch.harness", "--scenario", "scenario.yaml", "--plan",
                   plan_text, "--out", "result.json", *args["extra"]]
            log_path = self.log_path = work / "rank.log"
            with open(log_path, "wb") as log:
                if self.killed:
                    return {"code": -9, "log": "", "result": None}
                env = {**os.environ, **env, "TMPDIR": str(work)}
                self.proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log,
                                             stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
                code = self.proc.wait()
            with open(log_path, "rb") as f:
                f.seek(max(0, log_path.stat().st_size - LOG_BYTES))
                text = f.read().decode(errors="replace")
            out = work / "result.json"
            # rank 0 replaces result.json atomically after the last collective: present means complete, even
            # when a rank died at exit afterwards (ray_outcome.classify names that case)
            result = out.read_text() if rank == 0 and out.exists() else None
            return {"code": code, "log": text, "result": result}
        finally:
            self.log_path = None
            shutil.rmtree(work, ignore_errors=True)
            self.idle.set()

    def read_log(self, offset: int) -> tuple[str, int]:
        """The log written since byte `offset` (at most LOG_BYTES) and the new offset; ('', offset) when the
        rank has not started or has finished (run() returns the whole log then)."""
        path = self.log_path
        try:
            with open(path, "rb") if path else open(os.devnull, "rb") as f:
                f.seek(offset)
                data = f.read(LOG_BYTES)
        except OSError:
            return "", offset
        return data.decode(errors="replace"), offset + len(data)

    def kill(self, wait_s: float = 0.0) -> bool:
        """SIGKILL the rank's process group (the rank and its children), remembering that it was killed; then
        wait up to `wait_s` for run() to end (its work dir removed): a caller about to kill this actor (ray.kill
        ends it without running its `finally`) waits for that. Whether run() has ended."""
        self.killed = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.idle.wait(wait_s)
