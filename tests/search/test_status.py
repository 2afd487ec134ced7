"""`stratagem status`: the counts an on-call person reads, from a study a stand-in real-run search wrote.

Nothing here depends on which plans the search runs first (that follows the predictions, which move with the
device's default calibration and the ranking rules): every candidate's first run is an infra failure, so each
measured plan stands beside exactly one released run, and the plan this test claims is one the search left."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import optuna
from sessions import run_multifidelity
from standin import SCENARIO, KnownConstants
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.search.claims import claim, release
from stratagem.search.records import plan_key
from stratagem.search.run_order import measured_trials
from stratagem.search.status import beating, study_status
from stratagem.search.storage import open_storage, parse_storage
from stratagem.spaces import Plan, SearchSpace, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)]


def test_status_counts_measured_claimed_infra_and_budget(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(scn, url, "s", KnownConstants(infra={p.short() for p in PLANS}), real_runs=2, budget_minutes=30,
                      candidates=PlanColumns.from_plans(PLANS))
    backend = open_storage(parse_storage(url))
    study = optuna.load_study(study_name="s", storage=backend)
    left = [p for p in PLANS if plan_key(p) not in measured_trials(study)]
    held = claim(backend, study, SearchSpace(scn), left[0], "front")  # a worker (this process) measuring a plan left
    s = study_status(study)
    assert s.measured == {"ok": 2} and s.claimed == 1 and s.infra == 2 and s.expired == 0  # each plan failed once
    assert len(s.workers) == 1 and s.workers[0].endswith(f":{__import__('os').getpid()}")
    assert s.best_measured and "tok/s" in s.best_measured and s.best_predicted
    assert s.analytic > 0 and len(s.calibration_trend) >= 1
    assert s.elapsed_s is not None and s.budget_left_s == 0.0  # K reached: the search closed its window
    assert len(s.windows) == 1 and s.windows[0][0] == 30 and 0 < s.windows[0][1] < 30 * 60
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["measured"] == {"ok": 2}
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"])
    assert res.exit_code == 0 and "1 running (claimed)" in res.output, res.output
    assert f"lost runs: {s.infra} infra failure(s)" in res.output, res.output
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "nope"])
    assert res.exit_code != 0
    release(backend, held, "the test's worker stopped")  # (else the rerun waits for it to expire)
    run_multifidelity(scn, url, "s", KnownConstants(), real_runs=3, budget_minutes=60,
                      candidates=PlanColumns.from_plans(PLANS))  # a rerun with a new budget: a new window
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"])
    assert "budget window 1 of 2 (30 min)" in res.output and "budget window 2 of 2 (60 min)" in res.output, res.output


def test_status_tells_heartbeats_retries_signal_releases_and_freezes_elapsed(tmp_path: Path) -> None:
    """Workers alive by their heartbeat (not only claim holders), K, retries pending vs done, releases by a
    signal, and an elapsed time that stops growing when the search has ended."""
    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(scn, url, "s", KnownConstants(infra={p.short() for p in PLANS}), real_runs=2,
                      candidates=PlanColumns.from_plans(PLANS))
    backend = open_storage(parse_storage(url))
    study = optuna.load_study(study_name="s", storage=backend)
    s = study_status(study)
    assert s.retries_done == 2 and s.retries_pending == 0 and s.signal_released == 0  # each measured after infra
    with beating(study, k=3, target=5):  # a worker waiting for others: no claim, yet alive
        s = study_status(study)
        assert s.workers == [f"{socket.gethostname()}:{os.getpid()}"] and s.k == 3 and not s.finished
    s = study_status(study)
    assert s.workers == [] and s.finished and s.k == 3 and s.target == 5
    later = study_status(study, now=time.time() + 3600)
    assert later.elapsed_s == s.elapsed_s  # frozen at the end, not the clock of whoever asks
    left = [p for p in PLANS if plan_key(p) not in measured_trials(study)]
    release(backend, claim(backend, study, SearchSpace(scn), left[0], "front"), "stopped by signal 15")
    s = study_status(study)
    assert s.signal_released == 1 and s.retries_pending == 1 and s.infra == 2
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"])
    assert res.exit_code == 0, res.output
    assert "2 of 5 done (the last call's --real-runs 3" in res.output and "1 released by a signal" in res.output, res.output
    assert "retries: 1 pending, 2 done" in res.output and "real runs (ended)" in res.output, res.output


def test_status_of_a_study_nothing_has_written_yet(tmp_path: Path) -> None:
    """A watch may start before the search stores its scenario: no measured plan, no device, nothing to pool."""
    from stratagem.search.records import DIRECTIONS

    url = f"sqlite:///{tmp_path / 'w.db'}"
    optuna.create_study(storage=url, study_name="w", directions=list(DIRECTIONS))
    s = study_status(optuna.load_study(study_name="w", storage=url))
    assert s.best_measured == "" and s.measured == {}
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "w", "--json"])
    assert res.exit_code == 0, res.output


def test_status_on_a_mistyped_path_creates_nothing(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path / 'typo.db'}", f"journal:{tmp_path / 'typo.log'}"):
        res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"])
        assert res.exit_code != 0 and "not found" in str(res.exception)
    assert list(tmp_path.iterdir()) == []


def test_status_watch_waits_out_a_database_outage(fresh_postgres, postgres_outage) -> None:
    """`status --watch` through a PostgreSQL restart: one line when the outage starts, one when it ends, and
    it keeps printing (issue 27 item 2); Ctrl-C ends it with exit 0."""
    import signal
    import subprocess
    import sys

    from stratagem.search.records import DIRECTIONS

    optuna.create_study(storage=open_storage(parse_storage(fresh_postgres)), study_name="w",
                        directions=list(DIRECTIONS))
    watch = subprocess.Popen([sys.executable, "-m", "stratagem.cli", "status", "--storage", fresh_postgres,
                              "--study", "w", "--watch", "--interval", "1", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)  # started, printed
        postgres_outage(6.0)
        time.sleep(4)
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "unreachable (" in lines[0] and "until it answers" in lines[0], lines
    assert "reachable again after" in lines[1], lines
    assert len(out.strip().splitlines()) >= 3 and all(json.loads(x)["study"] == "w" for x in out.splitlines())


def test_ctrl_c_during_an_outage_ends_the_watch(fresh_postgres, postgres_outage) -> None:
    """Ctrl-C while `status --watch` retries through an outage (an unbounded window) ends it with exit 0 at once:
    its SIGINT handler sets search.retry.STOP, which stops the retry (no KeyboardInterrupt inside a read)."""
    import signal
    import subprocess
    import sys
    import threading

    from stratagem.search.records import DIRECTIONS

    optuna.create_study(storage=open_storage(parse_storage(fresh_postgres)), study_name="c",
                        directions=list(DIRECTIONS))
    watch = subprocess.Popen([sys.executable, "-m", "stratagem.cli", "status", "--storage", fresh_postgres,
                              "--study", "c", "--watch", "--interval", "1", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    ended: list[float] = []
    try:
        time.sleep(8)  # started, printed

        def interrupt() -> None:  # 4 s into the 12 s outage: the watch is retrying
            watch.send_signal(signal.SIGINT)
            start = time.monotonic()
            watch.wait(timeout=60)
            ended.append(time.monotonic() - start)

        timer = threading.Timer(4.0, interrupt)
        timer.start()
        postgres_outage(12.0)
        timer.join()
        out, err = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0 and "Traceback" not in err, err
    assert "unreachable (" in err and ended and ended[0] < 6.0, (err, ended)  # during the outage, not after it
