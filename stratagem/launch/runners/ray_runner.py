"""Run one plan as a short real training job through Ray: a placement group of world-size bundles, one
actor per rank that starts the harness as a child process with the rendezvous environment, a per-trial
timeout, per-rank logs, and cleanup whatever happens.

Ranks get content, not paths: the scenario (YAML text) and the plan travel to each rank's actor through Ray;
the actor writes them to a temp dir on its own node, runs the harness with its node's Python, and returns its
exit code, its log and (rank 0) the result JSON through Ray; while the ranks run the driver pulls their new log
lines every LOG_STREAM_S into rank<i>.log of its run folder, and writes the whole logs and result.json at the end. Nothing assumes a shared filesystem; every node needs the same Python environment (stratagem,
torch) - the Python running the actor.

LOCAL_RANK / LOCAL_WORLD_SIZE are per node (ranks ordered by global rank on each node); on GPUs each rank's
CUDA_VISIBLE_DEVICES lists the GPUs Ray gave that node's ranks, in local-rank order, so cuda:LOCAL_RANK is the
rank's own GPU (as under torchrun) and NCCL sees its node peers.

Failures become statuses, never exceptions: `oom` (a rank printed "OOM:", CUDA OOM or the memory cap),
`failed` (a rank exited non-zero: the last lines of its log; but a rank that exits non-zero after rank 0
wrote the result is `ok` with the fault named in the reason and the result's `exit_fault`), `timeout` (no result within timeout_s of the
ranks starting: all ranks killed), `infra` (the cluster's fault, not the plan's: an actor or node lost - the
other ranks are killed as soon as the driver sees it, not at the timeout; on their own they leave on the harness's
collective timeout, harness/collective_timeout.py - a Ray system error, the bundles not schedulable within resource_wait_s, the runner stopped, or a rank's "INFRA:"
line: its timed checkpoint could not be written or read on its node). On a cluster it
joined, a plan wider than the cluster's slots now waits up to resource_wait_s for nodes to join (a lost node
restarted or replaced) before it is `infra`.

    runner = RayRunner(run_dir="runs/my-study", address=None, num_cpus=4)
    result = runner.run(scenario, plan, steps=6, warmup=2, seed=0, timeout_s=120)   # or budget=StepBudget()
    runner.shutdown()

A runner that starts its own local cluster owns that Ray session (its temp dir /tmp/stratagem-ray-*): at
shutdown it waits for the session's processes to exit, kills the ones that linger (Ray's per-node dashboard and
runtime-env agents, which the raylet always starts: Ray 2.60 has no switch to skip them; the dashboard head is
off) and removes the temp dir; at start it reaps what our dead sessions left (ray_session: only processes and
dirs proven ours by our marker and owner record, in this PID namespace, whose driver is dead). Joined to an
external cluster (`address`) it reaps nothing and does not wait.

The rank actor is ray_rank.RankWorker; the session's processes and the reaping live in ray_session.py; a run's
folder, harness command and rank environments in ray_trial.py; its outcome's classification in ray_outcome.py.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stratagem import procfs
from stratagem.launch.harness.budget import StepBudget
from stratagem.launch.runners.ray_actors import collect, end_actors, first_line, lost
from stratagem.launch.runners.ray_outcome import (
    RunResult,
    classify,
    rank_summary,
)
from stratagem.launch.runners.ray_rank import RankWorker
from stratagem.launch.runners.ray_session import (
    SESSION_DIRS,
    SESSION_ENV,
    TEMP_PREFIX,
    kill_session,
    make_owned_dir,
    reap_dead_sessions,
    reap_rank_dirs,
    session_pids,
)
from stratagem.launch.runners.ray_trial import (
    Trial,
    rank_envs,
)
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["RayRunner",
           "quiet_driver_errors"]

START_ATTEMPTS = 2
"""Tries to start a local Ray session (Ray's raylet registration window is a fixed 30 s)."""
LOG_STREAM_S = 3.0
"""How often the driver pulls the ranks' new log lines into the run folder while they run."""


class RayRunner:
    """Runs plans through Ray on a local cluster (started here) or an existing one (`address="auto"`)."""

    def __init__(self, run_dir: str | Path, address: str | None = None, num_cpus: int | None = None,
                 use_gpus: bool | None = None, resource_wait_s: float = 600.0) -> None:
        import ray

        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.resource_wait_s = resource_wait_s
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 token auth: not needed locally
        self._connected = not ray.is_initialized()  # we called ray.init, so we disconnect at shutdown
        quiet_driver_errors()
        self._temp_dir: str | None = None  # set when we started the Ray session: we own it
        # where a local session's ranks make their work dirs: the TMPDIR Ray's processes inherit from here
        self._rank_tmp = os.environ.get("TMPDIR") or tempfile.gettempdir()
        if self._connected:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if address is None:
                reap_dead_sessions()  # only what provably ours and dead runs left (ray_session says how)
                if num_cpus is not None:
                    kwargs["num_cpus"] = num_cpus
                self._start_local(kwargs)
            else:
                ray.init(address=address, **kwargs)
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.use_gpus = bool(resources.get("GPU", 0)) if use_gpus is None else use_gpus
        self._stop = threading.Event()
        self._inflight: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def _start_local(self, kwargs: dict[str, Any]) -> None:
        """Start a local Ray session in a private temp dir; once more if its raylet missed Ray's fixed 30 s
        registration window (a heavily loaded host), after removing the failed session's processes."""
        import ray

        for attempt in range(START_ATTEMPTS):
            # Unix socket paths must stay short: a private temp dir under /tmp, holding our owner record (this
            # driver, its PID namespace and boot). The processes ray.init starts inherit SESSION_ENV (the dir),
            # and hand it on to the workers and agents they start: the session's marker, which is what
            # ray_session's reaping and `stratagem clean` require before touching anything. The driver's other
            # children (started later) do not get it.
            self._temp_dir = str(make_owned_dir(f"{TEMP_PREFIX}{os.getpid()}-", SESSION_DIRS))
            before = os.environ.get(SESSION_ENV)
            os.environ[SESSION_ENV] = self._temp_dir
            try:
                ray.init(_temp_dir=self._temp_dir, **kwargs)
                return
            except Exception as e:
                ray.shutdown()  # whatever failed, the session's processes and temp dir go
                kill_session(self._temp_dir)
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None
                if "timed out during startup" not in str(e) or attempt == START_ATTEMPTS - 1:
                    raise
            finally:
                if before is None:
                    os.environ.pop(SESSION_ENV, None)
                else:
                    os.environ[SESSION_ENV] = before

    @property
    def slots(self) -> int:
        """Ranks the cluster can run at once (GPUs, or CPUs on a CPU cluster), read now: nodes come and go."""
        import ray

        return int(ray.cluster_resources().get("GPU" if self.use_gpus else "CPU", 0))  # type: ignore[no-untyped-call]

    # -- one trial -------------------------------------------------------------------------------------
    def run(self, scenario: Scenario, plan: Plan, steps: int = 6, warmup: int = 2, seed: int = 0,
            timeout_s: float = 300.0, memory_cap_gib: float | None = None, name: str | None = None,
            budget: StepBudget | None = None) -> RunResult:
        """Run `plan` for `steps` timed steps (or as many as `budget` buys); never raises for a failing run.
        timeout_s counts from the ranks' start (waiting for resources is not the plan's time: up to
        resource_wait_s, then `infra`)."""
        from ray.util.placement_group import placement_group

        trial = Trial.open(self.run_dir, scenario, plan, steps, warmup, seed, memory_cap_gib, name, budget)
        if not self._wait_for_slots(trial.world):
            return trial.result("infra", self._no_slots_reason(trial.world))
        pg = placement_group([self._unit for _ in range(trial.world)], strategy="PACK")
        actors: list[Any] = []  # the rank actors, once created: _release kills them whatever happens
        try:
            return self._run_ranks(trial, pg, actors, timeout_s)
        except Exception as e:
            if type(e).__module__.startswith("ray"):  # actor died, node lost, GetTimeoutError: the cluster's
                return trial.result("infra", first_line(e))
            raise
        finally:
            self._release(actors, pg)

    @property
    def _unit(self) -> dict[str, int]:
        """One rank's bundle: a GPU and a CPU on a GPU cluster, a CPU here."""
        return {"GPU": 1, "CPU": 1} if self.use_gpus else {"CPU": 1}

    def _no_slots_reason(self, world: int) -> str:
        """Why a plan of `world` ranks did not start: the runner stopped, or the cluster lacks the slots."""
        if self._stop.is_set():
            return "stopped"
        return (f"plan needs {world} ranks but the cluster has {self.slots} "
                f"{'GPUs' if self.use_gpus else 'CPUs'} now" + (
                    "" if self._temp_dir is not None else f" (waited {self.resource_wait_s:.0f} s)"))

    def _run_ranks(self, trial: Trial, pg: Any, actors: list[Any], timeout_s: float) -> RunResult:
        """Once the bundles of `pg` are ready: one actor per rank (added to `actors`, registered in flight for
        stop()), the harness on each, their outcomes collected into the run folder and classified."""
        if not self._wait([pg.ready()], self.resource_wait_s):
            return trial.result("infra", "stopped" if self._stop.is_set() else
                                f"{trial.world} bundles of {self._unit} not schedulable within "
                                f"{self.resource_wait_s:.0f} s")
        actors += self._start_actors(pg, trial.world)
        with self._lock:
            self._inflight[id(actors)] = actors
        if self._stop.is_set():
            return trial.result("infra", "stopped")
        refs = self._launch(actors, trial)
        ranks_started = time.perf_counter()
        finished = self._wait(refs, timeout_s, all_of=True, stream=(actors, trial.log_dir))
        if not finished:  # timed out, stopped, or a rank's actor lost: the other ranks are killed now
            for a in actors:  # each run() then returns its log
                try:
                    a.kill.remote()
                except Exception:  # noqa: BLE001 - the lost actor itself: nothing to kill
                    pass
        outcomes = collect(refs, trial.log_dir)
        return self._verdict(trial, outcomes, finished, timeout_s, ranks_started)

    def _start_actors(self, pg: Any, world: int) -> list[Any]:
        """One RankWorker actor per bundle of `pg`, bundle i for rank i."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        worker = ray.remote(RankWorker)
        opts = {"num_cpus": 1, "num_gpus": 1 if self.use_gpus else 0, "max_concurrency": 2}
        return [
            worker.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)).remote()
            for i in range(world)
        ]

    def _launch(self, actors: list[Any], trial: Trial) -> list[Any]:
        """Start the harness on every rank's actor with its rendezvous environment; the refs of their runs."""
        import ray

        places = ray.get([a.where.remote() for a in actors], timeout=self.resource_wait_s)
        envs = rank_envs(places, self.use_gpus)
        return [actor.run.remote(trial.scenario_yaml, trial.plan_text, {"extra": trial.extra}, env, rank)
                for rank, (actor, env) in enumerate(zip(actors, envs, strict=True))]

    def _verdict(self, trial: Trial, outcomes: list[dict[str, Any]], finished: bool, timeout_s: float,
                 ranks_started: float) -> RunResult:
        """The run's status from its ranks' outcomes: stopped, a rank's actor lost, timed out, else classify."""
        lost = [(i, o["lost"]) for i, o in enumerate(outcomes) if "lost" in o]
        if self._stop.is_set():
            return trial.result("infra", "stopped", rank_summary(outcomes))
        if lost:
            return trial.result("infra", f"rank {lost[0][0]}: {lost[0][1]}", rank_summary(outcomes))
        if not finished:
            return trial.result("timeout", f"no result within {timeout_s:.0f} s of the ranks' start "
                                f"({time.perf_counter() - ranks_started:.0f} s); all {trial.world} ranks killed",
                                rank_summary(outcomes))
        return classify(outcomes, str(trial.log_dir), trial.command, time.perf_counter() - trial.start)

    def _release(self, actors: list[Any], pg: Any) -> None:
        """The run is no longer in flight: end its rank actors (ray_actors.end_actors), free its bundles."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            self._inflight.pop(id(actors), None)
        end_actors(actors)
        remove_placement_group(pg)

    def _wait_for_slots(self, world: int) -> bool:
        """Whether the cluster has `world` slots: at once on a local cluster we started (no node will join),
        else within resource_wait_s (a lost node may come back, or be replaced: waiting, not failing)."""
        deadline = time.monotonic() + self.resource_wait_s
        while not self._stop.is_set():
            if self.slots >= world:
                return True
            if self._temp_dir is not None or time.monotonic() >= deadline:
                return False
            time.sleep(1.0)
        return False

    def _wait(self, refs: list[Any], timeout_s: float, all_of: bool = False,
              stream: tuple[list[Any], Path] | None = None) -> bool:
        """Wait for refs (all, or the first) up to timeout_s, waking every 0.5 s to honour stop(); with
        `stream` (the rank actors, the run folder), append what each rank logged to rank<i>.log every
        LOG_STREAM_S (run() later replaces each file with the rank's whole log)."""
        import ray

        deadline = time.monotonic() + timeout_s
        offsets = [0] * (len(stream[0]) if stream else 0)
        next_pull = time.monotonic() + LOG_STREAM_S
        seen: set[Any] = set()
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _ = ray.wait(refs, num_returns=len(refs) if all_of else 1, timeout=min(0.5, left))
            if len(ready) == (len(refs) if all_of else 1):
                return True
            if all_of and lost([r for r in ready if r not in seen]):
                return False  # a rank's actor is gone (its node lost): its peers would wait for the timeout
            seen.update(ready)
            if stream and time.monotonic() >= next_pull:
                next_pull = time.monotonic() + LOG_STREAM_S
                actors, folder = stream
                try:
                    chunks = ray.get([a.read_log.remote(o) for a, o in zip(actors, offsets, strict=True)], timeout=10)
                except Exception as e:
                    if type(e).__module__.startswith("ray"):
                        continue  # an actor lost: run() reports it; streaming is best effort
                    raise
                for rank, (text, offset) in enumerate(chunks):
                    offsets[rank] = offset
                    if text:
                        with open(folder / f"rank{rank}.log", "a") as f:
                            f.write(text)
        return False

    def stop(self) -> int:
        """Kill every in-flight run's ranks now (SIGINT/SIGTERM); their runs return `infra: stopped`. Returns
        how many runs were in flight."""
        self._stop.set()
        with self._lock:
            groups = list(self._inflight.values())
        end_actors([a for actors in groups for a in actors])
        return len(groups)

    def run_many(self, jobs: Sequence[tuple[Scenario, Plan, str]], **kwargs: Any) -> list[RunResult]:
        """Run several plans at once, as many as the cluster's free slots allow; results in input order. An
        interruption (KeyboardInterrupt or any BaseException) kills the in-flight runs before it propagates."""
        if not jobs:
            return []
        widest = max(p.world_size for _, p, _ in jobs)
        parallel = max(1, self.slots // max(1, widest))
        pool = ThreadPoolExecutor(max_workers=parallel)
        try:
            futures = [pool.submit(self.run, s, p, name=n, **kwargs) for s, p, n in jobs]
            return [f.result() for f in futures]
        except BaseException:
            self.stop()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def shutdown(self) -> None:
        """Disconnect; for a session we started, also wait for its processes, kill stragglers, remove its temp
        dir. Nothing on the host is touched for a cluster we only joined."""
        import ray

        if not (self._connected and ray.is_initialized()):
            return
        if self._temp_dir is None:
            ray.shutdown()
            return
        ray.shutdown()
        deadline = time.monotonic() + 15.0  # the raylet takes a moment to exit; its agents follow or linger
        while time.monotonic() < deadline and any(procfs.comm(p) == "raylet" for p in session_pids(self._temp_dir)):
            time.sleep(0.3)
        killed = kill_session(self._temp_dir)  # what lingers (Ray 2.60's per-node agents): this session's only
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(procfs.alive(p) for p in killed):
            time.sleep(0.1)
        # every rank of a local session ran on this node, in the temp dir its processes inherited: a rank whose
        # actor was killed before its run's `finally` (end_actors' wait ran out on a loaded host, a signal stop)
        # left its work dir, removed now that its actor is dead (ray_session proves each ours and dead)
        reap_rank_dirs(self._rank_tmp)
        shutil.rmtree(self._temp_dir, ignore_errors=True)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def quiet_driver_errors() -> bool:
    """One plain line per error the cluster publishes to this driver, instead of Ray's full text.

    Ray's driver prints every published error into this process's stdout (worker.listen_error_messages ->
    print_to_stdstream, whatever log_to_driver says); a dead raylet's is "Raylet is terminated ..." and the
    last lines of its raylet.out, ANSI-coloured (34 lines in a worker's output for one lost node). The runner
    reports such a run itself (`infra`, one line), so the error becomes `ray: <its first line>` on stderr
    (the full text stays in the session's logs). Ray's other output is untouched. Returns whether it applies
    (False when this Ray has no such hook: then Ray prints as before)."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return False
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "stratagem_quiet", False):
        return original is not None

    def one_line(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            original(data, ignore_prefix)
            return
        text = _ANSI.sub("", "\n".join(str(x) for x in data.get("lines", [])))
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        print(f"ray: {first[:240]}", file=sys.stderr, flush=True)

    one_line.stratagem_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = one_line
    return True
