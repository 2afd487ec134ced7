"""Real runs through Ray (a local cluster of 2 CPU slots, gloo): the multi-fidelity search records measured
trials beside their predictions; an injected crash, hang (integration suite) and memory-cap OOM end with their status and cause
while the search finishes the rest; the best measured plan round-trips through `export --to torchrun` and
`reproduce`; a driver killed mid-run resumes with no trial lost or repeated and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from sessions import run_multifidelity
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.search import screen
from stratagem.search.records import plan_key, trial_evaluation
from stratagem.search.run_order import measured_trials, rank_candidates
from stratagem.spaces import scenario_from_dict
from stratagem.spaces.columns import PlanColumns

RANKS = 2  # ranks per run: each rank is a process importing torch, and CI has 2 cores
SCENARIO = {
    "model": {"name": "ray-test", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": RANKS},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
    "search": {"pp": 1, "tp": 1, "precision": "fp32", "memory_margin_gib": 0.0},
}
VENV_BIN = str(Path(sys.executable).parent)
pytestmark = pytest.mark.timeout(420)


def _harness_processes() -> list[int]:
    """Harness ranks started by the Ray runner (they run in a stratagem-rank-* temp dir on their node)."""
    out = subprocess.run(["pgrep", "-f", "stratagem.launch.harness"], capture_output=True, text=True)
    pids = []
    for pid in out.stdout.split():
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if Path(cwd).name.startswith("stratagem-rank-"):
            pids.append(int(pid))
    return pids


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if "stratagem-ray-" in line or "ray::" in line]


def _faulted_search(tmp: Path, faults: list[str], timeout_s: float) -> dict:
    """One multi-fidelity search whose first candidates get `faults` in rank order ("" = none), one real run each."""
    from stratagem.launch.runners.real import RayRunEvaluator

    scn = scenario_from_dict(SCENARIO)
    first = [p for p, _ in rank_candidates(screen(scn), set(), len(faults))]
    os.environ["STRATAGEM_FAULTS"] = json.dumps({plan_key(p): f for p, f in zip(first, faults, strict=True) if f})
    url = f"sqlite:///{tmp / 'study.db'}"
    evaluator = RayRunEvaluator(tmp / "runs", num_cpus=RANKS, steps=3, warmup=1, timeout_s=timeout_s)
    try:  # one run per plan, no repeat
        # the faulted plans are the candidates: every one of them runs whichever order the run-order policy picks
        mf = run_multifidelity(scn, url, "ray-test", evaluator, real_runs=len(faults), remeasure=0,
                               candidates=PlanColumns.from_plans(first))
    finally:
        evaluator.close()
        del os.environ["STRATAGEM_FAULTS"]
    (tmp / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO))
    return {"scn": scn, "url": url, "mf": mf, "first": first, "tmp": tmp}


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory):
    """One multi-fidelity search with 3 real runs: crash, OOM (memory cap), then a good run (the hang, which waits
    out its timeout, is test_a_hung_run_is_killed_at_its_timeout, in the integration suite)."""
    return _faulted_search(tmp_path_factory.mktemp("ray"), ["crash", "cap=1e-6", ""], timeout_s=45)


def _trial_of(url: str, plan) -> optuna.trial.FrozenTrial:
    st = optuna.load_study(study_name="ray-test", storage=url)
    return measured_trials(st)[plan_key(plan)]


def test_failures_become_statuses_and_the_search_finishes(study) -> None:
    mf, first, url = study["mf"], study["first"], study["url"]
    assert mf.measured == 3 and mf.runs == 3
    crash, oom, good = (_trial_of(url, p) for p in first)
    assert crash.user_attrs["status"] == "failed"
    assert "fault injected" in trial_evaluation(crash).reason  # the failing rank's last log lines
    assert oom.user_attrs["status"] == "oom" and "OOM" in trial_evaluation(oom).reason
    for t in (crash, oom):
        assert t.state == optuna.trial.TrialState.PRUNED
    assert good.state == optuna.trial.TrialState.COMPLETE and good.user_attrs["status"] == "ok"


def test_a_hung_run_is_killed_at_its_timeout(tmp_path: Path) -> None:
    """A rank that hangs is killed when the run passes its timeout: stored as `timeout`, pruned, and the search
    goes on to the next plan (integration suite: it waits out the timeout)."""
    run = _faulted_search(tmp_path, ["hang", ""], timeout_s=45)  # 45 s: a good run under CI load fits
    hang, good = (_trial_of(run["url"], p) for p in run["first"])
    assert hang.user_attrs["status"] == "timeout" and "killed" in trial_evaluation(hang).reason
    assert hang.state == optuna.trial.TrialState.PRUNED
    assert good.user_attrs["status"] == "ok" and run["mf"].runs == 2


def test_measured_trial_sits_next_to_its_prediction(study) -> None:
    good = _trial_of(study["url"], study["first"][2])
    ev = trial_evaluation(good)
    assert ev.fidelity == "measured" and ev.prediction is not None and ev.prediction.fidelity == "analytic"
    assert good.values[0] == pytest.approx(ev.throughput.tokens_per_s)
    assert ev.memory.peak_gib > 0 and len(ev.measurements["losses"]) == 1 + 3
    prov = ev.provenance
    assert prov["seed"] == 0 and prov["torch"] and prov["command"] and prov["git_revision"]
    cal = optuna.load_study(study_name="ray-test", storage=study["url"]).user_attrs["calibration"]
    assert cal["matmul_efficiency"] > 0  # refitted and stored with the study


def test_export_torchrun_then_reproduce_round_trip(study) -> None:
    tmp, url = study["tmp"], study["url"]
    out = tmp / "export"
    runner = CliRunner()
    res = runner.invoke(app, ["export", "--storage", url, "--study", "ray-test", "--best", "tokens",
                              "--to", "torchrun", "-o", str(out)])
    assert res.exit_code == 0, res.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(out / "run.sh")], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    best = [t for t in measured_trials(optuna.load_study(study_name="ray-test", storage=url)).values()
            if t.user_attrs["status"] == "ok"][0]
    from stratagem.launch.reproduce import reproduce_trial

    rep = reproduce_trial(optuna.load_study(study_name="ray-test", storage=url), best.number,
                          result_file=out / "result.json")
    assert rep.environment == []
    assert rep.losses_match is True  # same harness, plan and seed: the same loss trajectory
    memory = [r for r in rep.rows if r.metric.startswith("peak memory")][0]
    assert not memory.flagged
    res = runner.invoke(app, ["reproduce", "--storage", url, "--study", "ray-test", "--trial", str(best.number),
                              "--result", str(out / "result.json")])
    assert res.exit_code in (0, 1), res.output  # 1 only when timing noise on this shared machine is exceeded
    assert "identical trajectory" in res.output


def test_killed_driver_resumes_without_loss_or_repeat(tmp_path: Path) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"], "name": "kill-test"}}))
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    cmd = [sys.executable, "-m", "stratagem.cli", "search", str(scenario), "--storage", url, "--study", "kill",
           "--real-runs", "2", "--remeasure", "0", "--steps", "2", "--no-report"]  # each plan once
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not _harness_processes():
        time.sleep(0.5)
    assert _harness_processes(), "no real run started"
    time.sleep(1.0)
    driver.send_signal(signal.SIGKILL)  # the driver only: Ray and the ranks must go down with it
    driver.wait(timeout=30)
    time.sleep(5)
    assert _harness_processes() == []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    st = optuna.load_study(study_name="kill", storage=url)
    measured = list(measured_trials(st).values())
    keys = [t.user_attrs["plan"] for t in measured]
    finished = [t for t in st.get_trials(deepcopy=False) if t.user_attrs.get("fidelity") == "measured"
                and t.state != optuna.trial.TrialState.FAIL]
    assert len(finished) == 2  # the killed driver's claim expired (FAIL), its plan measured once by the rerun
    assert any("expired" in t.user_attrs for t in st.get_trials(deepcopy=False))
    assert len(keys) == 2 and len(set(keys)) == 2  # none lost, none repeated
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in st.get_trials(deepcopy=False))
    time.sleep(2)
    assert _harness_processes() == []
    # Ray's agents exit on their own some seconds after their raylet; the runner's reaping (at start and after
    # shutdown) removes those of our dead sessions. Give them that time, then nothing of ours may be left.
    from stratagem.launch.runners.ray_session import leftovers, reap_dead_sessions

    deadline = time.monotonic() + 30
    while leftovers().processes and time.monotonic() < deadline:
        reap_dead_sessions()
        time.sleep(1)
    assert leftovers().processes == {}


def test_local_rank_and_visible_devices_are_per_node() -> None:
    from stratagem.launch.runners.ray_trial import local_layout

    # ranks 0, 2 on node a; 1, 3 on node b; Ray gave each rank one GPU id on its node
    env = local_layout(["a", "b", "a", "b"], [["3"], ["0"], ["5"], ["1"]])
    assert [e["LOCAL_RANK"] for e in env] == ["0", "0", "1", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["3,5", "0,1", "3,5", "0,1"]  # cuda:LOCAL_RANK is its own
    assert "CUDA_VISIBLE_DEVICES" not in local_layout(["a", "a"])[0]


def _running_trials(db: Path) -> int:
    """RUNNING trials in SQLite file `db`, read through a read-only connection: a poll through Optuna's
    RDBStorage would create its tables while the driver creates them, and the driver then (rightly) refuses the
    file as not its storage. 0 while the driver has not made them yet."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return int(con.execute("SELECT count(*) FROM trials WHERE state = 'RUNNING'").fetchone()[0])
        finally:
            con.close()
    except sqlite3.Error:
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_sigint_kills_in_flight_runs_releases_claims_and_exits_130(signum: int, tmp_path: Path) -> None:
    """Started from another directory (a relative scenario path): ranks get content, not paths. Ctrl-C (or
    SIGTERM) while a run hangs: "stopping: ...", ranks killed, the claim released, exit 128 + N within 10 s,
    nothing left: no rank work dir on the node."""
    scn = scenario_from_dict({**SCENARIO, "model": {**SCENARIO["model"], "name": "stop-test"}})
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"],
                                                                                  "name": "stop-test"}}))
    first = [p for p, _ in rank_candidates(screen(scn), set(), 4)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    url = f"sqlite:///{tmp_path / 'stop.db'}"
    node_tmp = tmp_path / "node-tmp"  # where the ranks make their work dirs (Ray's processes inherit TMPDIR)
    node_tmp.mkdir()
    env = {**os.environ, "STRATAGEM_FAULTS": json.dumps({plan_key(p): "hang" for p in first}),
           "TMPDIR": str(node_tmp)}
    cmd = [sys.executable, "-m", "stratagem.cli", "search", "../scenario.yaml", "--storage", url, "--study",
           "stop", "--real-runs", "2", "--remeasure", "0", "--steps", "2", "--no-report"]
    driver = subprocess.Popen(cmd, cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    runs = tmp_path / "runs" / "stop"
    deadline = time.monotonic() + 180
    claimed = False
    while time.monotonic() < deadline and not claimed and driver.poll() is None:
        time.sleep(1.0)
        claimed = _running_trials(tmp_path / "stop.db") > 0
    assert claimed, driver.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_harness_processes()) < RANKS:
        time.sleep(0.5)  # the ranks start and hang
    assert len(_harness_processes()) == RANKS  # a plan in flight on every rank
    assert list(node_tmp.glob("stratagem-rank-*")), "the control: the ranks work in dirs there"
    sent = time.monotonic()
    driver.send_signal(signum)
    out, err = driver.communicate(timeout=60)
    took = time.monotonic() - sent
    assert driver.returncode == 128 + signum, (out[-1500:], err[-1500:])
    assert "stopping: killing 1 in-flight run" in out + err
    assert took < 10, took
    st = optuna.load_study(study_name="stop", storage=url)
    assert not st.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    released = [t for t in st.trials if "released" in t.user_attrs]
    assert len(released) == 1 and released[0].user_attrs["released"] == f"stopped by signal {signum}"
    assert not measured_trials(st)  # a stopped run is not the plan's verdict
    assert (runs / "").is_dir() and not (elsewhere / "runs").exists()  # logs beside the scenario, not the cwd
    time.sleep(2)
    assert _harness_processes() == []
    assert list(node_tmp.glob("stratagem-rank-*")) == [], "a rank work dir left after the stop"


def test_only_session_dirs_proven_ours_and_dead_are_removed() -> None:
    """A session dir is removed when its owner record is ours and its driver dead; one without a record (an older
    stratagem's, another tool's: whatever its age), or whose driver lives, stays (ray_session)."""
    import tempfile

    from stratagem.launch.runners.ray_session import OWNER_FILE, Owner, make_owned_dir, reap_dead_sessions

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = make_owned_dir("stratagem-ray-", "/tmp")
    record = Owner.of_this_process().model_copy(update={"pid": gone.pid})
    (dead / OWNER_FILE).write_text(record.model_dump_json())
    live = make_owned_dir("stratagem-ray-", "/tmp")  # this process is its driver
    unowned = tempfile.mkdtemp(prefix="stratagem-ray-", dir="/tmp")
    os.utime(unowned, (time.time() - 3600, time.time() - 3600))
    try:
        removed = reap_dead_sessions().session_dirs
        assert removed.count(str(dead)) == 1 and not dead.exists()
        assert live.is_dir() and os.path.isdir(unowned)
        assert str(live) not in removed and unowned not in removed
    finally:
        for d in (dead, live, Path(unowned)):
            subprocess.run(["rm", "-rf", str(d)], check=False)


# -- one rank's process as the Ray actor runs it (the actor class, called in this process) ---------------------

def _rank_outcome(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan_text: str, faults: dict[str, str],
                  *extra: str) -> dict:
    """Run `plan_text` as rank 0 of 1 the way RankWorker.run does (no Ray needed to call it), with tmp_path
    as the node's temp dir (where the rank dir goes)."""
    import tempfile

    from stratagem.launch.runners.ray_rank import RankWorker

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scenario_yaml = yaml.safe_dump(scenario_from_dict(SCENARIO).model_dump(mode="json", exclude={"search"}))
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STRATAGEM_FAULTS": json.dumps(faults)}
    return RankWorker().run(scenario_yaml, plan_text, {"extra": ["--steps", "2", "--warmup", "1", *extra]}, env, 0)


def test_an_abort_at_exit_after_the_result_is_an_ok_run_that_says_so(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 item 7: a rank that aborts (SIGABRT) after rank 0 wrote the result is neither a silent ok nor a
    failure: the run is ok, its reason and the result's exit_fault name the rank and the signal."""
    from stratagem.launch.harness.result import parse_result
    from stratagem.launch.runners.ray_outcome import classify
    from stratagem.spaces import format_plan, parse_plan

    plan = format_plan(parse_plan("dp=1,precision=fp32"))
    outcome = _rank_outcome(tmp_path, monkeypatch, plan, {plan: "exit-abort"}, "--no-checkpoint")
    assert outcome["code"] == -signal.SIGABRT and outcome["result"]
    run = classify([outcome], str(tmp_path), "cmd", 1.0)
    assert run.status == "ok" and "rank 0 exited -6 (SIGABRT) after rank 0 wrote the result" in run.reason
    assert parse_result(run.result, "r").exit_fault == run.reason
    assert "exit_fault" in parse_result(run.result, "r").stored()
    assert not list(tmp_path.glob("stratagem-rank-*"))  # the rank dir went with the run


def test_a_checkpoint_the_node_cannot_write_is_infra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27 item 1: a failure of the environment (here a checkpoint dir under a file) is `infra`."""
    from stratagem.launch.runners.ray_outcome import classify

    (tmp_path / "a-file").write_text("")
    outcome = _rank_outcome(tmp_path, monkeypatch, "dp=1,precision=fp32", {}, "--checkpoint-dir",
                            str(tmp_path / "a-file" / "x"))
    assert outcome["code"] == 4
    run = classify([outcome], str(tmp_path), "cmd", 1.0)
    assert run.status == "infra" and run.reason.startswith("rank 0: INFRA: checkpoint under")


def test_rank_dirs_of_dead_actors_are_reaped(tmp_path: Path) -> None:
    """Only rank dirs whose owner record is ours and whose actor is dead; not a live actor's, not one without a
    record (whatever its age)."""
    from stratagem.launch.runners.ray_session import OWNER_FILE, Owner, make_owned_dir, reap_rank_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = make_owned_dir(f"stratagem-rank-{gone.pid}-", tmp_path)
    (dead / OWNER_FILE).write_text(Owner.of_this_process().model_copy(update={"pid": gone.pid}).model_dump_json())
    live = make_owned_dir(f"stratagem-rank-{os.getpid()}-", tmp_path)
    old_unnamed = tmp_path / "stratagem-rank-q1w2e3"
    old_unnamed.mkdir()
    os.utime(old_unnamed, (time.time() - 3600, time.time() - 3600))
    for d in (dead, live, old_unnamed):
        (d / "scenario.yaml").write_text("x")
    assert reap_rank_dirs(str(tmp_path)) == [str(dead)]
    assert live.is_dir() and not dead.exists() and old_unnamed.is_dir()


def test_run_folder_names_do_not_nest() -> None:
    from stratagem.launch.runners.ray_trial import run_folder_name

    assert run_folder_name("dp2 pp2 split2/- mb2-1a2b3c") == "dp2_pp2_split2_-_mb2-1a2b3c"
    assert run_folder_name("../../etc") == "_.._etc" and run_folder_name("/") == "_"


def test_a_published_raylet_error_is_one_plain_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27 item 8: Ray prints a dead raylet's log tail (ANSI-coloured) into the driver's output; the runner
    makes it one plain line on stderr."""
    import ray._private.worker as ray_worker

    from stratagem.launch.runners.ray_runner import quiet_driver_errors

    assert quiet_driver_errors() and quiet_driver_errors()  # idempotent
    dump = ("\x1b[33mRaylet is terminated. Termination is unexpected.\x1b[0m Last 20 lines of the Raylet logs:\n"
            + "\n".join(f"    [2026-12-01 10:00:{i:02d}] \x1b[36mstate dump line {i}\x1b[0m" for i in range(34)))
    ray_worker.print_to_stdstream({"lines": [dump], "pid": "raylet", "is_err": False}, ignore_prefix=False)
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "ray: Raylet is terminated. Termination is unexpected. Last 20 lines of the Raylet logs:"]
