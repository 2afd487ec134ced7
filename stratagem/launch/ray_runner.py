"""Run one plan as a short real training job through Ray: a placement group of world-size bundles, one
actor per rank that starts the harness as a child process with the rendezvous environment, a per-trial
timeout, per-rank logs, and cleanup whatever happens.

Failures become statuses, never exceptions: `oom` (a rank printed "OOM:", CUDA OOM or the memory cap),
`failed` (a rank exited non-zero: the last lines of its log), `timeout` (no result in time: all ranks killed).

    runner = RayRunner(run_dir="runs/my-study", address=None, num_cpus=4)
    result = runner.run(scenario, plan, steps=6, warmup=2, seed=0, timeout_s=120)
    runner.shutdown()
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from stratagem import procfs
from stratagem.spaces.plan import Plan, format_plan
from stratagem.spaces.scenario import Scenario

__all__ = ["RunResult", "RayRunner", "harness_command", "reap_orphans"]

RunStatus = Literal["ok", "oom", "failed", "timeout"]
_TAIL_LINES = 20
# What a rank prints when another rank died under it (gloo/NCCL): not the cause.
_PEER_FAILURE = ("remote worker", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "NCCL communicator was aborted", "ProcessGroupNCCL")


@dataclass
class RunResult:
    """What one real run produced."""

    status: RunStatus
    reason: str
    result: dict[str, Any] | None
    """The harness JSON (rank 0's file), when the run finished."""
    log_dir: str
    """Per-rank logs (rank<i>.log) and the scenario/plan files of this run."""
    command: str
    """The harness command each rank ran (with the rendezvous environment)."""
    wall_s: float
    """Wall time from submission to the end of the run (scheduling + process start + training)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: exit code and log tail."""


def harness_command(scenario_path: str, plan: Plan, steps: int, warmup: int, seed: int, out: str,
                    memory_cap_gib: float | None = None) -> list[str]:
    """The harness invocation one rank runs (torchrun-compatible environment supplied separately)."""
    cmd = [sys.executable, "-m", "stratagem.launch.harness", "--scenario", scenario_path,
           "--plan", format_plan(plan), "--steps", str(steps), "--warmup", str(warmup),
           "--seed", str(seed), "--out", out]
    if memory_cap_gib is not None:
        cmd += ["--memory-cap-gib", f"{memory_cap_gib:g}"]
    return cmd


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die when the actor dies
    except OSError:
        pass


class _RankWorker:
    """A Ray actor holding one bundle; runs one rank of the harness as a child process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port  # type: ignore[no-untyped-call]

    def run(self, cmd: list[str], env: dict[str, str], log_path: str, out_path: str | None) -> dict[str, Any]:
        full_env = {**os.environ, **env}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent)
            code = self.proc.wait()
        tail = Path(log_path).read_text(errors="replace").splitlines()[-_TAIL_LINES:]
        result = None
        if out_path and code == 0 and os.path.exists(out_path):
            result = Path(out_path).read_text()  # returned as text: ranks may live on another node
        return {"code": code, "tail": tail, "result": result}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


class RayRunner:
    """Runs plans through Ray on a local cluster (started here) or an existing one (`address="auto"`)."""

    def __init__(self, run_dir: str | Path, address: str | None = None, num_cpus: int | None = None,
                 use_gpus: bool | None = None) -> None:
        import ray

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 token auth: not needed locally
        self._owns_cluster = not ray.is_initialized()
        if self._owns_cluster:
            reap_orphans()
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if address is None:
                # Unix socket paths must stay short: a private temp dir under /tmp.
                kwargs["_temp_dir"] = tempfile.mkdtemp(prefix="stratagem-ray-", dir="/tmp")
                if num_cpus is not None:
                    kwargs["num_cpus"] = num_cpus
            ray.init(address=address, **kwargs)
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.use_gpus = bool(resources.get("GPU", 0)) if use_gpus is None else use_gpus
        self.slots = int(resources.get("GPU" if self.use_gpus else "CPU", 0))
        self._lock = threading.Lock()

    # -- one trial -------------------------------------------------------------------------------------
    def run(self, scenario: Scenario, plan: Plan, steps: int = 6, warmup: int = 2, seed: int = 0,
            timeout_s: float = 300.0, memory_cap_gib: float | None = None, name: str | None = None) -> RunResult:
        """Run `plan` for `steps` steps; never raises for a failing run."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        start = time.perf_counter()
        world = plan.world_size
        log_dir = self.run_dir / (name or f"run-{uuid.uuid4().hex[:8]}")
        log_dir.mkdir(parents=True, exist_ok=True)
        scenario_path = log_dir / "scenario.yaml"
        scenario_path.write_text(yaml.safe_dump(scenario.model_dump(mode="json", exclude={"search"}),
                                                sort_keys=False))
        out_path = str(log_dir / "result.json")
        cmd = harness_command(str(scenario_path), plan, steps, warmup, seed, out_path, memory_cap_gib)
        unit = {"GPU": 1, "CPU": 1} if self.use_gpus else {"CPU": 1}
        if world > self.slots:
            return RunResult("failed", f"plan needs {world} ranks but the cluster has {self.slots} "
                             f"{'GPUs' if self.use_gpus else 'CPUs'}", None, str(log_dir),
                             shlex.join(cmd), time.perf_counter() - start)
        pg = placement_group([dict(unit) for _ in range(world)], strategy="PACK")
        actors: list[Any] = []
        try:
            if not _wait(pg.ready(), timeout_s):
                return RunResult("timeout", f"placement group of {world} bundles not ready in {timeout_s:.0f} s",
                                 None, str(log_dir), shlex.join(cmd), time.perf_counter() - start)
            worker = ray.remote(_RankWorker)
            opts = {"num_cpus": 1, "num_gpus": 1 if self.use_gpus else 0}
            actors = [
                worker.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=i)).remote()
                for i in range(world)
            ]
            master_addr, master_port = ray.get(actors[0].address.remote(), timeout=timeout_s)
            refs = []
            for rank, actor in enumerate(actors):
                env = {"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": "0" if self.use_gpus else str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
                       "PYTHONUNBUFFERED": "1",
                       # STRATAGEM_* settings of the driver (e.g. STRATAGEM_FAULTS) reach every rank.
                       **{k: v for k, v in os.environ.items() if k.startswith("STRATAGEM_")}}
                refs.append(actor.run.remote(cmd, env, str(log_dir / f"rank{rank}.log"),
                                             out_path if rank == 0 else None))
            remaining = timeout_s - (time.perf_counter() - start)
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=max(1.0, remaining))
            if pending:
                return RunResult("timeout", f"no result within {timeout_s:.0f} s; all {world} ranks killed",
                                 None, str(log_dir), shlex.join(cmd), time.perf_counter() - start,
                                 _partial(done))
            ranks = [ray.get(r) for r in refs]
            return _classify(ranks, str(log_dir), shlex.join(cmd), time.perf_counter() - start)
        except Exception as e:  # Ray-level failure (actor died, node lost): a failed run, with its cause
            return RunResult("failed", f"{type(e).__name__}: {e}".splitlines()[0], None, str(log_dir),
                             shlex.join(cmd), time.perf_counter() - start)
        finally:
            for a in actors:
                try:
                    a.kill.remote()
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - cleanup must go on for the other actors
                    pass
            remove_placement_group(pg)

    def run_many(self, jobs: Sequence[tuple[Scenario, Plan, str]], **kwargs: Any) -> list[RunResult]:
        """Run several plans at once, as many as the cluster's free slots allow; results in input order."""
        if not jobs:
            return []
        widest = max(p.world_size for _, p, _ in jobs)
        parallel = max(1, self.slots // max(1, widest))
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = [pool.submit(self.run, s, p, name=n, **kwargs) for s, p, n in jobs]
            return [f.result() for f in futures]

    def shutdown(self) -> None:
        import ray

        if self._owns_cluster and ray.is_initialized():
            ours = set(_ray_helpers())
            ray.shutdown()
            deadline = time.monotonic() + 15.0  # the raylet takes a moment to exit; then its agents are orphans
            while True:
                reap_orphans()
                if not any(procfs.alive(pid) for pid in ours) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)


def _ray_helpers() -> dict[int, int]:
    """This user's Ray helper processes (ray::...) and the pid of the raylet each belongs to: RAY_RAYLET_PID
    from its environment, else its parent (the raylet starts them)."""
    out = {}
    for pid in procfs.user_pids():
        if not (procfs.cmdline(pid) or b"").startswith(b"ray::"):
            continue
        env, parent = procfs.environ(pid), procfs.parent(pid)
        if env is None or parent is None:
            continue
        raylet = env.get(b"RAY_RAYLET_PID", str(parent).encode())
        if raylet.isdigit():
            out[pid] = int(raylet)
    return out


def _is_raylet(pid: int) -> bool:
    """A live raylet (not a zombie, not a reused pid)."""
    return procfs.alive(pid) and procfs.comm(pid) == "raylet"


def reap_orphans() -> list[int]:
    """Kill Ray helper processes (dashboard/runtime-env agents, workers) whose raylet is dead.

    A driver killed with SIGKILL takes its local GCS, raylet, workers and harness ranks with it (Ray's fate
    sharing and our PR_SET_PDEATHSIG), but Ray 2.60's per-node agents outlive it (and linger for a while after
    a clean shutdown too). They carry their raylet's pid in RAY_RAYLET_PID; when that raylet is gone they serve
    nothing, so they are removed here.
    """
    killed = []
    for pid, raylet in _ray_helpers().items():
        if not _is_raylet(raylet):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def _wait(ref: Any, timeout_s: float) -> bool:
    import ray

    ready, _ = ray.wait([ref], timeout=timeout_s)
    return bool(ready)


def _partial(done: list[Any]) -> list[dict[str, Any]]:
    import ray

    return [ray.get(r) for r in done]


def _classify(ranks: list[dict[str, Any]], log_dir: str, command: str, wall_s: float) -> RunResult:
    summary = [{"code": r["code"], "tail": r["tail"]} for r in ranks]
    for rank, r in enumerate(ranks):
        oom = [line for line in r["tail"] if "OOM:" in line or "OutOfMemoryError" in line]
        if oom:
            return RunResult("oom", f"rank {rank}: {oom[-1].strip()}", None, log_dir, command, wall_s, summary)
    failed = [(i, r) for i, r in enumerate(ranks) if r["code"] != 0]
    if failed:
        # The rank that raised explains best; its peers only report the broken collective.
        def own_error(r: dict[str, Any]) -> bool:
            text = "\n".join(r["tail"])
            return "Error" in text and not any(m in text for m in _PEER_FAILURE)

        rank, r = next(((i, r) for i, r in failed if own_error(r)), failed[0])
        last = "\n".join(r["tail"][-8:])
        return RunResult("failed", f"rank {rank} exited with {r['code']}:\n{last}", None, log_dir, command,
                         wall_s, summary)
    text = ranks[0]["result"]
    if not text:
        return RunResult("failed", "rank 0 finished but wrote no result", None, log_dir, command, wall_s, summary)
    return RunResult("ok", "", json.loads(text), log_dir, command, wall_s, summary)
