"""The harness entry point as launchers use it: one process, torchrun, and one process per rank with the
torchrun environment set by hand (what the Ray runner does); its result JSON, exit codes and OOM line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stratagem.launch.runners.local import free_port

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = str(ROOT / "examples" / "tiny-cpu.yaml")
DEADLINE_S = 150
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "STRATAGEM_PG_TIMEOUT_S": "60", "PYTHONUNBUFFERED": "1"}


def _harness(plan: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stratagem.launch.harness", "--scenario", SCENARIO, "--plan", plan,
            "--steps", "2", "--warmup", "1", "--out", str(out), "--checkpoint-dir", str(out.parent), *extra]


def _run(cmds: list[list[str]], envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess[str]]:
    """Start all commands at once; kill every one of them if any passes the deadline."""
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for c, e in zip(cmds, envs, strict=True)]
    done = []
    try:
        for cmd, p in zip(cmds, procs, strict=True):
            out, err = p.communicate(timeout=DEADLINE_S)
            done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def _ranks_env(world: int) -> list[dict[str, str]]:
    port = str(free_port())
    return [{**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": str(world),
             "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)} for r in range(world)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("single") / "result.json"
    (done,) = _run([_harness("dp=1,precision=fp32", out)], [ENV])
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_single_process_result(single: dict[str, Any]) -> None:
    r = single
    assert (r["world_size"], r["backend"], r["device"], r["steps"], r["warmup"]) == (1, "none", "cpu", 2, 1)
    assert len(r["losses"]) == len(r["step_times_s"]) == 3 and all(4 < x < 7 for x in r["losses"])
    assert r["step_s"] > 0 and r["tokens_per_s"] == pytest.approx(8 * 32 / r["step_s"])
    (rank,) = r["ranks"]
    n = 180800  # examples/tiny-cpu.yaml parameters
    assert (rank["param_bytes"], rank["grad_bytes"], rank["optimizer_bytes"]) == (4 * n, 4 * n, 8 * n)
    assert rank["peak_bytes"] > 16 * n and rank["rss_peak_bytes"] > rank["peak_bytes"]
    assert r["checkpoint"]["save_s"] > 0 and r["checkpoint"]["load_s"] > 0
    assert r["versions"]["torch"] and r["mechanisms"]["data_parallel"] == "none"


def test_ranks_launched_like_the_ray_runner(tmp_path: Path, single: dict[str, Any]) -> None:
    out = tmp_path / "result.json"
    cmd = _harness("dp=2,zero=3,precision=fp32", out)
    done = _run([cmd, cmd], _ranks_env(2))
    assert [d.returncode for d in done] == [0, 0], done[0].stderr + done[1].stderr
    r = json.loads(out.read_text())
    assert (r["world_size"], r["backend"]) == (2, "gloo")
    assert r["mechanisms"]["data_parallel"] == "FSDP2 fully_shard(reshard_after_forward=True)"
    assert [x["param_bytes"] for x in r["ranks"]] == [single["ranks"][0]["param_bytes"] // 2] * 2
    assert r["losses"] == pytest.approx(single["losses"], rel=1e-5)  # same training as one process


def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *_harness("tp=2,sp=true,precision=fp32", out)[1:]]
    (done,) = _run([cmd], [ENV])
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and "+ SequenceParallel) + loss_parallel" in r["mechanisms"]["tensor_parallel"]


def test_memory_cap_fails_every_rank_with_an_oom_line(tmp_path: Path) -> None:
    cmd = _harness("dp=2,precision=fp32", tmp_path / "result.json", "--memory-cap-gib", "0.001")
    done = _run([cmd, cmd], _ranks_env(2))
    for d in done:
        assert d.returncode == 3, d.stderr
        assert any(line.startswith("OOM: tracked peak") for line in d.stderr.splitlines()), d.stderr
    assert not (tmp_path / "result.json").exists()


def test_plan_for_another_world_size_is_one_line_error(tmp_path: Path) -> None:
    (done,) = _run([_harness("dp=2,tp=2", tmp_path / "r.json")], [ENV])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: plan: dp*tp*pp*cp (2*2*1*1 = 4) must equal the 1 rank(s) the harness was launched with; "
        "launch 4 ranks or change the plan"]


# scripts/gpu_check.sh now wraps `stratagem calibrate`: its test is tests/launch/test_calibrate.py.


def test_package_import_does_not_load_torch() -> None:
    code = ("import sys, stratagem.launch, stratagem.launch.export; assert 'torch' not in sys.modules; "
            "from stratagem.launch import run_harness, unsupported; assert 'torch' not in sys.modules; "
            "from stratagem.launch.harness import build_job; assert 'torch' in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, check=False).returncode == 0
