"""Runs in flight that end early (issue 36): a rank's actor lost (its node died) frees the other ranks at once,
the run stored as infra, instead of their waiting for the run's timeout; stopping a search's runs (SIGINT/SIGTERM;
`ray job stop` sends SIGTERM, then SIGKILL 3 s later) leaves no rank work dir on the nodes (it left one per
rank): RayRunner.stop() ends each rank's run, which removes its dir, before it kills the actor.

One local Ray session for both (its start dominates): the hang fault makes the last rank of dp=2 sleep in its
first step while rank 0 waits for it in a collective. The stop test runs last (a stopped runner stays stopped)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from stratagem import procfs
from stratagem.launch.runners.ray_session import RANK_PREFIX
from stratagem.spaces import format_plan, parse_plan, scenario_from_dict

SCENARIO = {
    "model": {"name": "inflight", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
}
PLAN = parse_plan("dp=2,precision=fp32")
TIMEOUT_S = 240.0
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """(a RayRunner on a local session, its node's temp dir where the rank dirs go)."""
    from stratagem.launch.runners.ray_runner import RayRunner

    tmp = tmp_path_factory.mktemp("inflight")
    node_tmp = tmp / "node-tmp"
    node_tmp.mkdir()
    with pytest.MonkeyPatch.context() as mp:  # Ray's processes inherit this driver's environment at start
        mp.setenv("TMPDIR", str(node_tmp))
        mp.setenv("STRATAGEM_FAULTS", json.dumps({format_plan(PLAN): "hang"}))
        runner = RayRunner(run_dir=tmp / "runs", num_cpus=2)
    try:
        yield runner, node_tmp
    finally:
        runner.shutdown()


def _start_hung_run(runner: Any, node_tmp: Path, pool: ThreadPoolExecutor) -> tuple[Future[Any], list[int]]:
    """Run PLAN in a thread; once both ranks run the harness: the future and the harness pids by rank."""
    run = pool.submit(runner.run, scenario_from_dict(SCENARIO), PLAN, steps=2, warmup=1, timeout_s=TIMEOUT_S)
    deadline = time.monotonic() + 180
    ranks: dict[int, int] = {}
    while time.monotonic() < deadline and not run.done() and len(ranks) < 2:
        time.sleep(0.5)
        for pid in procfs.user_pids():
            cmd, env = procfs.cmdline(pid) or b"", procfs.environ(pid) or {}
            if b"stratagem.launch.harness" in cmd and env.get(b"TMPDIR", b"").startswith(
                    f"{node_tmp}/{RANK_PREFIX}".encode()) and procfs.alive(pid):
                ranks[int(env[b"RANK"])] = pid
    assert len(ranks) == 2 and not run.done(), run.done() and run.result()
    return run, [ranks[0], ranks[1]]


def test_a_lost_ranks_actor_frees_the_others_at_once(node: tuple[Any, Path]) -> None:
    runner, node_tmp = node
    with ThreadPoolExecutor(max_workers=1) as pool:
        run, ranks = _start_hung_run(runner, node_tmp, pool)
        actor = procfs.parent(ranks[0])
        assert actor is not None and procfs.alive(actor)
        lost_at = time.monotonic()
        os.kill(actor, signal.SIGKILL)  # rank 0's actor dies as with its node; rank 1 sleeps in its step
        result = run.result(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - lost_at
    assert result.status == "infra" and result.reason.startswith("rank 0: "), result
    assert took < 30, (took, result.reason)  # not the run's 240 s timeout
    deadline = time.monotonic() + 10
    while procfs.alive(ranks[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not procfs.alive(ranks[1])  # the survivor's rank was killed, not left sleeping


def test_stop_leaves_no_rank_dir(node: tuple[Any, Path]) -> None:
    runner, node_tmp = node
    with ThreadPoolExecutor(max_workers=1) as pool:
        run, _ = _start_hung_run(runner, node_tmp, pool)
        assert len(list(node_tmp.glob(f"{RANK_PREFIX}*"))) == 2
        assert runner.stop() == 1
        assert list(node_tmp.glob(f"{RANK_PREFIX}*")) == []  # gone when stop() returns: no later cleanup needed
        result = run.result(timeout=60)
    assert result.status == "infra" and result.reason == "stopped", result
