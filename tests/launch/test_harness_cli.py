"""The harness entry point as launchers use it: one process, torchrun, and one process per rank with the
torchrun environment set by hand (what the Ray runner does); its result JSON (with the timed steps' spread),
exit codes, OOM and INFRA lines; a step budget; two torchrun "nodes" without a shared temp dir; the tp=2
torchrun case launched 40 times without an abort at exit (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stratagem.evaluators.spread import spread_of_samples
from stratagem.launch.harness.budget import StepBudget, timed_steps
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
    return {**json.loads(out.read_text()), "_out": str(out)}


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
    assert r["checkpoint"]["load_scope"] == "dcp"  # one process sees its own metadata
    assert r["versions"]["torch"] and r["mechanisms"]["data_parallel"] == "none"
    timed = r["step_times_s"][1:]
    assert r["step_spread"] == spread_of_samples(timed).model_dump() and r["step_s"] == r["step_spread"]["median_s"]
    assert r["step_budget"] is None
    assert not [p for p in Path(r["_out"]).parent.iterdir() if p.name.startswith("stratagem-ckpt")]


def test_timed_steps_follow_the_budget() -> None:
    budget = StepBudget(budget_s=2.0, min_steps=6, max_steps=20)
    assert [timed_steps(budget, s) for s in (10.0, 0.25, 0.15, 0.01)] == [6, 8, 14, 20]
    with pytest.raises(ValueError, match="max_steps"):
        StepBudget(min_steps=8, max_steps=7)


def test_a_step_budget_chooses_the_timed_steps(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = _harness("dp=1,precision=fp32", out, "--no-checkpoint")
    i = cmd.index("--steps")
    cmd[i:i + 2] = ["--step-budget-s", "1000", "--min-steps", "3", "--max-steps", "4"]
    (done,) = _run([cmd], [ENV])
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert r["steps"] == 4 and len(r["step_times_s"]) == 5 and r["step_spread"]["n"] == 4
    assert r["step_budget"] == {"budget_s": 1000.0, "min_steps": 3, "max_steps": 4}
    (both,) = _run([[*cmd, "--steps", "2"]], [ENV])
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_an_unwritable_checkpoint_dir_is_the_environment(tmp_path: Path) -> None:
    """A checkpoint that cannot be written is the environment's fault: exit 4 and one INFRA line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cmd = _harness("dp=1,precision=fp32", tmp_path / "r.json")
    cmd[cmd.index("--checkpoint-dir") + 1] = str(blocker / "sub")
    (done,) = _run([cmd], [ENV])
    assert done.returncode == 4, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("INFRA:")]
    assert "checkpoint under" in line and "NotADirectoryError" in line


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


def _torchrun_tp2(out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            *_harness("tp=2,sp=true,precision=fp32", out)[1:]]


def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    (done,) = _run([_torchrun_tp2(out)], [ENV])
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and "+ SequenceParallel) + loss_parallel" in r["mechanisms"]["tensor_parallel"]


@pytest.mark.slow
@pytest.mark.timeout(40 * DEADLINE_S)  # 40 launches, each under its own deadline (~13 s idle, ~30 s loaded)
def test_torchrun_40_launches_without_an_abort_at_exit(tmp_path: Path) -> None:
    """Issue 22 item 7: the tp=2 case once died with SIGABRT ("terminate called without an active exception")
    after training, in interpreter teardown with gloo threads alive; the harness now leaves by os._exit
    (harness.run.cli) after a barrier, without destroying the group (CI still saw 1 abort in 40 launches while
    each rank destroyed it). 40 launches in a row, every one exit 0 with its result and no abort line; a
    failure shows the aborting rank's Python stacks (faulthandler) in its stderr."""
    aborts = []
    for i in range(40):
        out = tmp_path / f"r{i}" / "result.json"
        (done,) = _run([_torchrun_tp2(out)], [ENV])
        if done.returncode != 0 or "terminate called" in done.stderr or not out.exists():
            aborts.append((i, done.returncode, done.stderr[-6000:]))
    assert aborts == []


@pytest.mark.slow
def test_two_nodes_without_a_shared_temp_dir(tmp_path: Path) -> None:
    """Issue 27 item 1: two torchrun "nodes" on this host, each with its own TMPDIR (what separate machines
    do to tempfile.gettempdir()), run a dp x pp plan spanning both: the checkpoint is timed (each rank loads
    its own state back) and no checkpoint folder is left on either node."""
    port = str(free_port())
    out = tmp_path / "result.json"
    cmds, envs = [], []
    for node in (0, 1):
        tmp = tmp_path / f"node{node}"
        tmp.mkdir()
        harness = _harness("dp=2,pp=2,precision=fp32", out)
        i = harness.index("--checkpoint-dir")
        del harness[i:i + 2]  # each node's temp dir
        cmds.append([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                     "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", port, *harness[1:]])
        envs.append({**ENV, "TMPDIR": str(tmp)})
    done = _run(cmds, envs)
    assert [d.returncode for d in done] == [0, 0], done[0].stderr[-3000:] + done[1].stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 4 and r["mechanisms"]["pipeline"] != "none"
    ckpt = r["checkpoint"]
    assert ckpt["save_s"] > 0 and ckpt["load_s"] > 0 and ckpt["load_scope"] == "rank-local"
    left = [p.name for node in (0, 1) for p in (tmp_path / f"node{node}").iterdir() if "stratagem" in p.name]
    assert left == []


def test_memory_cap_fails_every_rank_with_an_oom_line(tmp_path: Path) -> None:
    cmd = _harness("dp=2,precision=fp32", tmp_path / "result.json", "--memory-cap-gib", "0.001")
    done = _run([cmd, cmd], _ranks_env(2))
    for d in done:
        assert d.returncode == 3, d.stderr
        assert any(line.startswith("OOM: peak") for line in d.stderr.splitlines()), d.stderr
    assert not (tmp_path / "result.json").exists()


def test_plan_for_another_world_size_is_one_line_error(tmp_path: Path) -> None:
    (done,) = _run([_harness("dp=2,tp=2", tmp_path / "r.json")], [ENV])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: plan: dp*tp*pp*cp (2*2*1*1 = 4) must equal the 1 rank(s) the harness was launched with; "
        "launch 4 ranks or change the plan"]


# scripts/gpu_check.sh now wraps `stratagem calibrate`: its test is tests/launch/test_calibrate.py.


def test_package_import_does_not_load_torch() -> None:
    code = ("import sys, stratagem.launch, stratagem.launch.export, stratagem.launch.harness, stratagem.launch.runners, "
            "stratagem.launch.trace; assert 'torch' not in sys.modules; "
            "from stratagem.launch.harness.run import run_harness; from stratagem.launch.harness.support import "
            "unsupported; assert 'torch' not in sys.modules; "
            "from stratagem.launch.harness.train import build_job; assert 'torch' in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, check=False).returncode == 0
