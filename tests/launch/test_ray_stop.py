"""Stopping a search's runs (SIGINT/SIGTERM; `ray job stop` sends SIGTERM, then SIGKILL 3 s later) leaves no rank
work dir on the nodes (issue 36 item 5: `ray job stop` left one per rank): RayRunner.stop() ends each rank's run,
which removes its dir, before it kills the actor."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stratagem.spaces import format_plan, parse_plan, scenario_from_dict

SCENARIO = {
    "model": {"name": "stop-dirs", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
}
pytestmark = pytest.mark.timeout(300)


def test_stop_leaves_no_rank_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stratagem.launch.runners.ray_runner import RayRunner
    from stratagem.launch.runners.ray_session import RANK_PREFIX

    node_tmp = tmp_path / "node-tmp"  # the node's temp dir: Ray's workers inherit TMPDIR from this driver
    node_tmp.mkdir()
    plan = parse_plan("dp=2,precision=fp32")
    monkeypatch.setenv("TMPDIR", str(node_tmp))
    monkeypatch.setenv("STRATAGEM_FAULTS", json.dumps({format_plan(plan): "hang"}))  # the last rank sleeps
    runner = RayRunner(run_dir=tmp_path / "runs", num_cpus=2)
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        run = pool.submit(runner.run, scenario_from_dict(SCENARIO), plan, steps=2, warmup=1, timeout_s=240)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not run.done():
            logs = [d / "rank.log" for d in node_tmp.glob(f"{RANK_PREFIX}*")]
            if len(logs) == 2 and all(p.exists() and p.stat().st_size for p in logs):
                break  # both ranks are running the harness
            time.sleep(0.5)
        assert not run.done() and len(list(node_tmp.glob(f"{RANK_PREFIX}*"))) == 2, run.done() and run.result()
        assert runner.stop() == 1
        assert list(node_tmp.glob(f"{RANK_PREFIX}*")) == []  # gone when stop() returns: no later cleanup needed
        result = run.result(timeout=60)
        assert result.status == "infra" and result.reason == "stopped", result
    finally:
        pool.shutdown(wait=True)
        runner.shutdown()
