"""Issue 27 item 3's acceptance run: `ray job submit --working-dir .` of `stratagem search`, twice back to back
from one directory, on a Ray head of this test only (dashboard and job server on free ports, own temp dir,
stopped by pid: never `ray stop`; the Cluster harness of test_cluster_acceptance.py). Both jobs succeed (Ray
gives identical submissions one shared copy of the directory and deletes it with the session), and the run logs
are in the runs directory after the cluster is gone. Needs `stratagem[cluster]` (ray[default])."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from test_cluster_acceptance import ENV, RAY, SCENARIO, Cluster

pytest.importorskip("aiohttp", reason="`ray job submit` needs stratagem[cluster] (ray[default])")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JobCluster(Cluster):
    """A one-node cluster with the dashboard and job server (every port of its own: a busy host may run another
    cluster's agent on Ray's default ports)."""

    def start_head(self, cpus: int) -> str:
        """Start the head; the job server's address."""
        self.dashboard = f"http://127.0.0.1:{_free_port()}"
        self._ray("start", "--head", "--port", str(self.port), "--num-cpus", str(cpus),
                  "--dashboard-host", "127.0.0.1", "--dashboard-port", self.dashboard.rsplit(":", 1)[1],
                  "--dashboard-agent-listen-port", str(_free_port()),
                  "--dashboard-agent-grpc-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
                  "--runtime-env-agent-port", str(_free_port()))
        return self.dashboard

    def submit(self, cwd: Path, args: list[str]) -> subprocess.CompletedProcess:
        """`ray job submit --working-dir .` from `cwd`, waiting for the job; again while the head's job agent is
        not up yet ("No available agent": seconds after `ray start` on a loaded host)."""
        deadline = time.monotonic() + 120
        while True:
            done = subprocess.run([RAY, "job", "submit", "--address", self.dashboard, "--working-dir", ".", "--",
                                   sys.executable, "-m", "stratagem.cli", *args], cwd=cwd, env=ENV,
                                  capture_output=True, text=True, timeout=400)
            if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
                return done
            time.sleep(3)

    def submit_at_once(self, cwd: Path, args: list[str], n: int) -> list[subprocess.CompletedProcess]:
        """`n` identical `ray job submit` from `cwd` started together (after one job shows the agent is up)."""
        cmd = [RAY, "job", "submit", "--address", self.dashboard, "--working-dir", ".", "--", sys.executable, "-m",
               "stratagem.cli", *args]
        procs = [subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for _ in range(n)]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        return [subprocess.CompletedProcess(cmd, p.returncode, out, "") for p, out in zip(procs, outs, strict=True)]


@pytest.fixture
def job_cluster() -> Iterator[JobCluster]:
    c = JobCluster()
    try:
        yield c
    finally:
        c.stop()


def test_ray_job_submit_twice_back_to_back_from_one_directory(tmp_path: Path, job_cluster: JobCluster) -> None:
    here = tmp_path / "project"  # the submitted working dir: the scenario only
    here.mkdir()
    (here / "scenario.yaml").write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"], "name": "jobs"}}))
    url = f"sqlite:///{tmp_path / 'study.db'}"  # a storage every worker reaches (here: the head's own disk)
    runs = tmp_path / "runs"
    job_cluster.start_head(cpus=2)
    common = ["search", "scenario.yaml", "--storage", url, "--study", "jobs", "--steps", "2", "--ray-address",
              "auto", "--no-report", "--runs-dir", str(runs), "--remeasure", "0"]  # each plan once: claims, not noise
    first = job_cluster.submit(here, [*common, "--real-runs", "1"])
    second = job_cluster.submit(here, [*common, "--real-runs", "1"])  # a second worker: one more plan (K more)
    for done in (first, second):
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "succeeded" in out, out[-3000:]
        assert "FileNotFoundError" not in out and "Traceback" not in out, out[-3000:]
    assert "already exists, skipping upload" in second.stdout + second.stderr  # one shared copy of the directory
    job_cluster.stop()  # the cluster, its session folder and Ray's copy of the directory are gone
    assert not Path(job_cluster.temp_dir).exists()
    workers = sorted(d for d in runs.iterdir() if d.is_dir())
    assert len(workers) == 2 and all(re.fullmatch(r"\d{8}-\d{6}-.+-\d+", d.name) for d in workers), workers
    for worker in workers:  # each job's run: its per-rank logs and result, in its own folder
        (run,) = [d for d in worker.iterdir() if d.is_dir()]
        assert {"scenario.yaml", "rank0.log", "rank1.log", "result.json"} <= {p.name for p in run.iterdir()}
    assert not (here / "runs").exists() and not (here / "stratagem.db").exists()
    st = optuna.load_study(study_name="jobs", storage=url)
    assert sum(t.user_attrs.get("fidelity") == "measured" for t in st.trials) == 2


def test_workers_submitted_at_once_from_one_directory_share_the_study(tmp_path: Path, job_cluster: JobCluster) -> None:
    here = tmp_path / "project"
    here.mkdir()
    (here / "scenario.yaml").write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"], "name": "at-once"}}))
    url = f"sqlite:///{tmp_path / 'study.db'}"
    runs = tmp_path / "runs"
    job_cluster.start_head(cpus=2)
    args = ["search", "scenario.yaml", "--storage", url, "--study", "at-once", "--steps", "2", "--ray-address",
            "auto", "--no-report", "--runs-dir", str(runs), "--remeasure", "0", "--real-runs", "2"]
    warm = job_cluster.submit(here, [*args[:-1], "0"])  # analytic only: the job agent is up, the study exists
    assert warm.returncode == 0, (warm.stdout + warm.stderr)[-3000:]
    for done in job_cluster.submit_at_once(here, args, 2):
        assert done.returncode == 0 and "succeeded" in done.stdout, done.stdout[-3000:]
        assert "Traceback" not in done.stdout, done.stdout[-3000:]
    job_cluster.stop()
    st = optuna.load_study(study_name="at-once", storage=url)
    measured = [t for t in st.trials if t.user_attrs.get("fidelity") == "measured"]
    assert len(measured) == 2 and len({t.params.get("zero_stage") for t in measured}) == 2  # disjoint plans
    # each worker writes its own subfolder (a worker that got no run leaves none): both runs' logs, apart
    found = [d for w in runs.iterdir() if w.is_dir() for d in w.iterdir() if d.is_dir()]
    assert len(found) == 2 and all((d / "rank1.log").is_file() for d in found), found
