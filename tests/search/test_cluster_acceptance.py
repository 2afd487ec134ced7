"""Issue 18's acceptance runs with real Ray workers, on an external Ray cluster started here (`ray start --head`
+ `ray start --address`, own --temp-dir, stopped by pid at the end: never `ray stop`):

  - two `stratagem search --real-runs K` workers started at once on one PostgreSQL study measure disjoint plans
    and together reach K; one is SIGKILLed while its run is in flight and the other runs its plan again;
  - a node lost mid-run (its raylet SIGKILLed) yields an `infra` trial and the plan is retried on the node that
    joins next, measuring ok; while the cluster has no slots for the plan (before the first node joins) the
    search waits with its claim instead of failing the plan, or every plan, at once.

Tiny world-2 plans (2 layers, h=64), 2 timed steps, a space of three plans: each run is seconds; the cluster has
2 CPU slots, so the runs of both workers take turns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from stratagem import procfs

SCENARIO = {
    "model": {"name": "cluster-test", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
    # three plans (dp2 z0/z2/z3 mb4; the torch space has no ZeRO-1): K = 3 needs every plan, the killed worker's too
    "search": {"pp": 1, "tp": 1, "precision": "fp32", "memory_margin_gib": 0.0, "zero_stage": [0, 2, 3],
               "micro_batch_size": 4, "activation_checkpointing": "none"},
}
RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _descendants(roots: set[int]) -> set[int]:
    """`roots` and every process below them (read now)."""
    children: dict[int, list[int]] = {}
    for pid in procfs.user_pids():
        parent = procfs.parent(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    out, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


class Cluster:
    """A Ray cluster of this test only: a head and worker nodes on this host, one temp dir, stopped by pid."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="stratagem-acc-", dir="/tmp")  # unix socket paths stay short
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.seen: dict[int, int | None] = {}
        """Every process of the cluster seen so far -> its start ticks (a reused pid is not killed)."""
        self.drivers: list[subprocess.Popen] = []

    def search(self, scenario: Path, url: str, study: str, real_runs: int, log: Path) -> subprocess.Popen:
        """`stratagem search --real-runs` joined to this cluster, its output in `log` (a pipe nobody reads could
        fill); killed by stop() if still running (a failed test)."""
        cmd = [sys.executable, "-m", "stratagem.cli", "search", str(scenario), "--storage", url, "--study", study,
               "--real-runs", str(real_runs), "--remeasure", "0", "--steps", "2", "--ray-address", self.address, "--no-report"]
        with open(log, "w") as f:
            self.drivers.append(subprocess.Popen(cmd, cwd=log.parent, env=ENV, stdout=f, stderr=subprocess.STDOUT,
                                                 start_new_session=True))
        return self.drivers[-1]

    def raylets(self) -> set[int]:
        return {pid for pid in self._daemons() if procfs.comm(pid) == "raylet"}

    def _daemons(self) -> set[int]:
        """The cluster's node processes (GCS, raylets, monitors: their command lines name the temp dir)."""
        needle = self.temp_dir.encode()
        return {pid for pid in procfs.user_pids() if needle in (procfs.cmdline(pid) or b"")}

    def _note(self) -> None:
        for pid in _descendants(self._daemons()):
            self.seen.setdefault(pid, procfs.start_ticks(pid))

    def start(self, head_cpus: int) -> None:
        """Start the head node with `head_cpus` CPU slots."""
        self._ray("start", "--head", "--port", str(self.port), "--num-cpus", str(head_cpus),
                  "--include-dashboard=false")

    def add_node(self, cpus: int) -> int:
        """Start a worker node; its raylet's pid."""
        before = self.raylets()
        self._ray("start", "--address", self.address, "--num-cpus", str(cpus))
        new = self.raylets() - before
        assert len(new) == 1, new
        return new.pop()

    def cpus(self) -> float | None:
        """CPU slots the cluster's GCS counts now (`ray status`; a dead node's go some 20 s after its raylet), or
        None when `ray status` failed."""
        done = subprocess.run([RAY, "status", "--address", self.address], env=ENV, capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0 or "Total Usage" not in done.stdout:
            return None
        for row in done.stdout.splitlines():  # " 0.0/2.0 CPU" under "Total Usage"; no line without CPUs
            if row.strip().endswith(" CPU") and "/" in row:
                return float(row.split("/")[1].split()[0])
        return 0.0

    def kill_raylet(self, pid: int) -> None:
        self._note()  # its agents and workers are orphaned when it dies: remember them for stop()
        os.kill(pid, signal.SIGKILL)

    def processes(self, marker: bytes) -> list[int]:
        """Live processes of this cluster (below its raylets) whose command line holds `marker`."""
        return [pid for pid in _descendants(self.raylets())
                if marker in (procfs.cmdline(pid) or b"") and procfs.alive(pid)]

    def _ray(self, *args: str) -> None:
        """Run `ray ARGS` for this cluster; once more if it failed (a loaded host can miss Ray's registration
        deadlines), after killing what the failed try started."""
        for _ in range(2):
            before = self._daemons()
            done = subprocess.run([RAY, *args, "--temp-dir", self.temp_dir, "--disable-usage-stats"], env=ENV,
                                  capture_output=True, text=True, timeout=180)
            self._note()
            if done.returncode == 0:
                return
            started = self._daemons() - before  # the failed node's GCS/raylet/monitors, and below its raylet
            for pid in _descendants(started):
                if procfs.alive(pid) and procfs.start_ticks(pid) == self.seen.get(pid):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(2.0)
        raise AssertionError(f"ray {' '.join(args)} failed twice: {done.stderr[-2000:]}")

    def stop(self) -> None:
        for d in self.drivers:
            if d.poll() is None:
                d.kill()
                d.wait(timeout=30)
        self._note()
        for pid, ticks in self.seen.items():
            if procfs.alive(pid) and procfs.start_ticks(pid) == ticks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()




def _scenario(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, "model": {**SCENARIO["model"], "name": name}}))
    return path


_OPENED: dict[str, optuna.storages.BaseStorage] = {}


def _load(url: str, study: str) -> optuna.Study | None:
    """The study as `stratagem status` opens it (while the workers may be creating the database's tables: None
    until they have); the storage opened once per URL (each opening is a connection pool)."""
    from stratagem.errors import StratagemError
    from stratagem.search.storage import open_storage, parse_storage

    if url not in _OPENED:
        try:
            _OPENED[url] = open_storage(parse_storage(url), write=False)
        except StratagemError:
            return None  # no Optuna tables yet: a read-only open creates nothing; ask again
    try:
        return optuna.load_study(study_name=study, storage=_OPENED[url])
    except KeyError:
        return None


def _measured(st: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in st.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if t.user_attrs.get("fidelity") == "measured"]


def _claims(st: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in st.get_trials(deepcopy=False, states=(TrialState.RUNNING,)) if "claim" in t.user_attrs]


def _pid(t: optuna.trial.FrozenTrial) -> int:
    return int(t.user_attrs["claim"]["worker"]["pid"])


def test_two_workers_on_one_postgres_study_share_the_runs_and_take_over_a_killed_ones(
        tmp_path: Path, fresh_postgres: str, cluster: Cluster) -> None:
    cluster.start(head_cpus=2)
    scenario = _scenario(tmp_path, "two-workers")
    k = 3
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [cluster.search(scenario, fresh_postgres, "two", k, log) for log in logs]
    pids = {w.pid for w in workers}
    # Kill a worker that has measured a plan and holds a claim, while the cluster's ranks run (its own run, or the
    # other worker's while its run waits for the 2 slots: Ray does not schedule pending placement groups in order).
    victim = None
    seen: list[str] = []  # what the loop saw, for the message when no moment to kill came
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline and all(w.poll() is None for w in workers):
        time.sleep(0.3)
        st = _load(fresh_postgres, "two")
        if st is None:
            continue
        claims = sorted(_claims(st), key=lambda t: t.number)
        ranks = len(cluster.processes(b"stratagem.launch.harness"))
        seen.append(f"claims {[(t.number, _pid(t)) for t in claims]} measured "
                    f"{[(t.number, _pid(t)) for t in _measured(st)]} ranks {ranks}")
        measured_by = {_pid(t) for t in _measured(st)}
        ready = [t for t in claims if _pid(t) in measured_by]
        if ready and ranks >= 2:
            victim = next(w for w in workers if w.pid == _pid(ready[0]))
            killed_plan = ready[0].user_attrs["plan"]
    print("\n".join(sorted(set(seen), key=seen.index)))  # shown when the test fails
    assert victim is not None, [log.read_text()[-1500:] for log in logs]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)  # reaped: a zombie would still look alive on this host
    survivor = next(w for w in workers if w is not victim)
    survivor.wait(timeout=240)
    assert survivor.returncode == 0, logs[workers.index(survivor)].read_text()[-3000:]

    st = _load(fresh_postgres, "two")
    assert st is not None
    done = _measured(st)
    keys = [t.user_attrs["plan"] for t in done]
    assert len(done) == k and len(set(keys)) == k, keys  # together K, no plan measured twice
    by = {t.user_attrs["plan"]: _pid(t) for t in done}
    assert set(by.values()) == pids, by  # both workers measured plans
    assert by[killed_plan] == survivor.pid  # the killed worker's plan was run again, by the other
    expired = [t for t in st.get_trials(deepcopy=False) if "expired" in t.user_attrs]
    assert [t.user_attrs["plan"] for t in expired] == [killed_plan]
    assert expired[0].state == TrialState.FAIL and _pid(expired[0]) == victim.pid
    assert not _claims(st)
    from stratagem.search.status import study_status

    s = study_status(st)  # what `stratagem status` shows for the PostgreSQL study
    assert sum(s.measured.values()) == k and s.claimed == 0 and s.expired == 1 and s.workers == []
    print(f"killed worker {victim.pid} holding {killed_plan}; {len(done)} measured: {by}")
    time.sleep(2)
    assert cluster.processes(b"stratagem.launch.harness") == []  # the killed driver's ranks died with it


def test_a_node_lost_mid_run_is_infra_and_the_plan_is_retried(tmp_path: Path, cluster: Cluster) -> None:
    cluster.start(head_cpus=0)  # no slots yet: the search claims its plan and waits for a node
    scenario = _scenario(tmp_path, "node-lost")
    url = f"sqlite:///{tmp_path / 'node.db'}"
    log = tmp_path / "driver.log"
    driver = cluster.search(scenario, url, "node", 1, log)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and driver.poll() is None and not ((st := _load(url, "node")) and _claims(st)):
        time.sleep(0.5)
    time.sleep(3.0)
    assert driver.poll() is None, log.read_text()[-3000:]  # waiting, not failing the plan (or every plan) at once
    st = _load(url, "node")
    assert st is not None and len(_claims(st)) == 1 and not st.get_trials(states=(TrialState.FAIL,))
    node = cluster.add_node(2)  # every rank runs on the worker node
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and driver.poll() is None and \
            len(cluster.processes(b"stratagem.launch.harness")) < 2:
        time.sleep(0.3)
    assert driver.poll() is None, log.read_text()[-3000:]
    assert len(cluster.processes(b"stratagem.launch.harness")) == 2, "the run never started"
    cluster.kill_raylet(node)  # the node is lost while its two ranks run
    lost = time.monotonic()
    st = None
    while time.monotonic() < deadline and driver.poll() is None:
        st = _load(url, "node")
        if st is not None and any(t.user_attrs.get("released", "").startswith("infra")
                                  for t in st.get_trials(deepcopy=False, states=(TrialState.FAIL,))):
            break
        time.sleep(0.5)
    noticed = time.monotonic() - lost
    while time.monotonic() < deadline and driver.poll() is None and cluster.cpus() != 0:
        time.sleep(1.0)  # until the cluster knows the node is gone
    gone = time.monotonic() - lost
    assert driver.poll() is None, log.read_text()[-3000:]
    cluster.add_node(2)  # the node is back (or replaced): the search retries the plan on it
    driver.wait(timeout=240)
    assert driver.returncode == 0, log.read_text()[-3000:]

    st = _load(url, "node")
    assert st is not None
    infra = [t for t in st.get_trials(deepcopy=False, states=(TrialState.FAIL,))
             if t.user_attrs.get("released", "").startswith("infra")]
    assert len(infra) == 1, [t.user_attrs for t in st.get_trials(deepcopy=False, states=(TrialState.FAIL,))]
    done = _measured(st)
    assert len(done) == 1 and done[0].user_attrs["status"] == "ok" and done[0].state == TrialState.COMPLETE
    assert done[0].user_attrs["plan"] == infra[0].user_attrs["plan"]  # the same plan, retried, not a verdict
    status = subprocess.run([sys.executable, "-m", "stratagem.cli", "status", "--storage", url, "--study", "node",
                             "--json"], capture_output=True, text=True, timeout=120)
    s = json.loads(status.stdout)
    assert s["infra"] == 1 and s["measured"] == {"ok": 1}, status.stdout
    print(f"infra noticed {noticed:.0f} s after the raylet was killed, the node gone from the cluster after "
          f"{gone:.0f} s: {infra[0].user_attrs['released']}")
    assert cluster.processes(b"stratagem.launch.harness") == []



def test_two_workers_ride_out_a_20_s_postgres_outage(tmp_path: Path, fresh_postgres: str, postgres_outage,
                                                     cluster: Cluster) -> None:
    """Issue 27 item 2: PostgreSQL stopped (`pg_ctl stop -m immediate`) for 20 s while two workers hold claims
    and a run is in flight (it finishes during the outage): both wait it out, saying so in one line at the
    outage and one at recovery, store what finished, and reach K together; nothing lost, no claim left RUNNING
    or expired, each plan measured once."""
    cluster.start(head_cpus=2)
    scenario = _scenario(tmp_path, "outage")
    k = 3
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    workers = [cluster.search(scenario, fresh_postgres, "out", k, log) for log in logs]
    ready = False
    deadline = time.monotonic() + 300
    while not ready and time.monotonic() < deadline and all(w.poll() is None for w in workers):
        time.sleep(0.3)
        st = _load(fresh_postgres, "out")
        ready = st is not None and len({_pid(t) for t in _claims(st)}) == 2 and len(
            cluster.processes(b"stratagem.launch.harness")) >= 2
    assert ready, [log.read_text()[-1500:] for log in logs]
    postgres_outage(20.0)
    for w in workers:
        w.wait(timeout=300)
    texts = [log.read_text() for log in logs]
    for w, text in zip(workers, texts, strict=True):
        assert w.returncode == 0, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        assert text.count("unreachable (") == 1 and text.count("reachable again after") == 1, text[-3000:]
    _OPENED.pop(fresh_postgres, None)  # its pooled connections died with the server
    st = _load(fresh_postgres, "out")
    assert st is not None
    done = _measured(st)
    keys = [t.user_attrs["plan"] for t in done]
    assert len(done) == k and len(set(keys)) == k, keys
    assert not _claims(st) and not [t for t in st.get_trials(deepcopy=False) if "expired" in t.user_attrs]
