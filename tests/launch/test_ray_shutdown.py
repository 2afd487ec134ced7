"""A rank whose actor was killed before its run's `finally` (end_actors' wait ran out on a loaded host, as in 3 of
6 signal stops of a real-run search, issue 37 item 6) left its work dir: the runner's shutdown, which a stopped
search always reaches (real.py), removes it once the session's processes are dead (ray_runner.RayRunner.shutdown).
Both actors of a hung dp=2 run are SIGKILLed (their dirs stay: the control), then the runner shuts down."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stratagem import procfs
from stratagem.launch.runners.ray_session import RANK_PREFIX
from stratagem.spaces import format_plan, parse_plan, scenario_from_dict

SCENARIO = {
    "model": {"name": "leftover", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
}
PLAN = parse_plan("dp=2,precision=fp32")
pytestmark = pytest.mark.timeout(400)


def _harness_ranks(node_tmp: Path) -> dict[int, int]:
    """The harness processes running in rank dirs under `node_tmp`: rank -> pid."""
    ranks = {}
    for pid in procfs.user_pids():
        cmd, env = procfs.cmdline(pid) or b"", procfs.environ(pid) or {}
        if b"stratagem.launch.harness" in cmd and env.get(b"TMPDIR", b"").startswith(
                f"{node_tmp}/{RANK_PREFIX}".encode()) and procfs.alive(pid):
            ranks[int(env[b"RANK"])] = pid
    return ranks


def test_shutdown_removes_rank_dirs_of_killed_actors(tmp_path: Path) -> None:
    from stratagem.launch.runners.ray_runner import RayRunner

    node_tmp = tmp_path / "node-tmp"
    node_tmp.mkdir()
    with pytest.MonkeyPatch.context() as mp:  # Ray's processes inherit this driver's environment at start
        mp.setenv("TMPDIR", str(node_tmp))
        mp.setenv("STRATAGEM_FAULTS", json.dumps({format_plan(PLAN): "hang"}))
        runner = RayRunner(run_dir=tmp_path / "runs", num_cpus=2)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            run = pool.submit(runner.run, scenario_from_dict(SCENARIO), PLAN, steps=2, warmup=1, timeout_s=240)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not run.done() and len(ranks := _harness_ranks(node_tmp)) < 2:
                time.sleep(0.5)
            assert len(ranks) == 2 and not run.done(), run.done() and run.result()
            for pid in ranks.values():  # each actor dies without its run's `finally`
                actor = procfs.parent(pid)
                assert actor is not None
                os.kill(actor, signal.SIGKILL)
            assert run.result(timeout=300).status == "infra"
        assert len(list(node_tmp.glob(f"{RANK_PREFIX}*"))) == 2, "the control: killed actors left their dirs"
    finally:
        runner.shutdown()
    assert list(node_tmp.glob(f"{RANK_PREFIX}*")) == []
