"""`ray job submit` as an operator runs it (issue 36): on a fresh head (no ~/stratagem-runs yet) the README's
command without --no-report succeeds, its report and run logs under ~/stratagem-runs; `ray job stop` of a search
whose ranks are running leaves no rank work dir on the node. A Ray head of this test only (JobCluster), its HOME
and TMPDIR fresh folders of the test. Needs `stratagem[cluster]` (ray[default])."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_cluster_acceptance import ENV, RAY, SCENARIO
from test_cluster_jobs import JobCluster

from stratagem.launch.runners.ray_session import RANK_PREFIX
from stratagem.search import screen
from stratagem.search.run_order import rank_candidates
from stratagem.spaces import format_plan, scenario_from_dict

pytest.importorskip("aiohttp", reason="`ray job submit` needs stratagem[cluster] (ray[default])")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def fresh_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[JobCluster, Path, Path]:
    """(a cluster whose head runs with a fresh HOME and TMPDIR, that HOME, that TMPDIR): the job's driver and
    the rank actors inherit the head's environment."""
    home, node_tmp = tmp_path / "home", tmp_path / "node-tmp"
    home.mkdir()
    node_tmp.mkdir()
    monkeypatch.setitem(ENV, "HOME", str(home))
    monkeypatch.setitem(ENV, "TMPDIR", str(node_tmp))
    c = JobCluster()
    yield c, home, node_tmp  # type: ignore[misc]
    c.stop()


def _project(tmp_path: Path, name: str) -> Path:
    here = tmp_path / "project"
    here.mkdir()
    (here / "scenario.yaml").write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"], "name": name}}))
    return here


def test_the_readme_command_without_no_report_on_a_fresh_head(tmp_path: Path, fresh_head) -> None:
    cluster, home, _ = fresh_head
    here = _project(tmp_path, "fresh")
    cluster.start_head(cpus=2)
    assert not (home / "stratagem-runs").exists()
    done = cluster.submit(here, ["search", "scenario.yaml", "--storage", f"sqlite:///{tmp_path / 'study.db'}",
                                 "--study", "fresh", "--real-runs", "1", "--remeasure", "0", "--steps", "2",
                                 "--ray-address", "auto"])
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in out, out[-3000:]
    assert (home / "stratagem-runs" / "fresh.html").is_file(), out[-3000:]
    (worker,) = (home / "stratagem-runs" / "fresh").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-.+-\d+", worker.name)


def test_ray_job_stop_leaves_no_rank_dir(tmp_path: Path, fresh_head, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, _, node_tmp = fresh_head
    scn = scenario_from_dict(SCENARIO)
    hang = {format_plan(p): "hang" for p, _ in rank_candidates(screen(scn), set(), 10)}  # every plan's last rank
    monkeypatch.setitem(ENV, "STRATAGEM_FAULTS", json.dumps(hang))
    here = _project(tmp_path, "stopped")
    cluster.start_head(cpus=2)
    job = subprocess.run([RAY, "job", "submit", "--address", cluster.dashboard, "--working-dir", ".", "--no-wait",
                          "--", sys.executable, "-m", "stratagem.cli", "search", "scenario.yaml", "--storage",
                          f"sqlite:///{tmp_path / 'study.db'}", "--study", "stopped", "--real-runs", "1", "--steps",
                          "2", "--ray-address", "auto", "--no-report", "--runs-dir", str(tmp_path / "runs")],
                         cwd=here, env=ENV, capture_output=True, text=True, timeout=300)
    found = re.search(r"raysubmit_\w+", job.stdout + job.stderr)
    assert job.returncode == 0 and found, job.stdout + job.stderr
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(node_tmp.glob(f"{RANK_PREFIX}*"))) < 2:
        time.sleep(1)
    assert len(list(node_tmp.glob(f"{RANK_PREFIX}*"))) == 2  # both ranks run (the last one hangs)
    stop = subprocess.run([RAY, "job", "stop", "--address", cluster.dashboard, found.group(0)], env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    deadline = time.monotonic() + 30  # Ray ends the job's actors once its driver is gone
    while time.monotonic() < deadline and list(node_tmp.glob(f"{RANK_PREFIX}*")):
        time.sleep(1)
    assert list(node_tmp.glob(f"{RANK_PREFIX}*")) == [], stop.stdout
