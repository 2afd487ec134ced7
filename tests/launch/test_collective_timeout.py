"""The timed steps' collective timeout (harness/collective_timeout.py): sized from the slowest step so far with a
floor, set on every process group of the process (the default one and subgroups made before)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from stratagem.launch.harness.collective_timeout import (
    STEP_TIMEOUT_FLOOR_S,
    STEP_TIMEOUT_STEPS,
    step_timeout_s,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_timeout_is_steps_of_the_slowest_step_with_a_floor() -> None:
    assert step_timeout_s([0.05, 0.2, 0.1]) == STEP_TIMEOUT_FLOOR_S
    assert step_timeout_s([4.0, 2.0]) == STEP_TIMEOUT_STEPS * 4.0 > STEP_TIMEOUT_FLOOR_S
    assert step_timeout_s([]) == STEP_TIMEOUT_FLOOR_S


def test_every_group_of_the_process_gets_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import os, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from stratagem.launch.harness.collective_timeout import SETUP_TIMEOUT_S, set_timeout, tighten
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
sub = dist.new_group([0])
def timeouts():
    return sorted(pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in c10d._world.pg_map)
print(timeouts())
print(tighten([1.5, 3.0]), timeouts())
set_timeout(SETUP_TIMEOUT_S)
print(timeouts() == [SETUP_TIMEOUT_S] * 2)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stderr[-2000:]
    assert lines[1] == "30.0 [30.0, 30.0]" and lines[2] == "True", lines
    assert "timed steps: collective timeout 30 s (10 x the slowest step so far, 3.000 s" in out.stderr
