"""Measured evaluations (real runs) from the study's queue: several processes may work one study at once.

The selected plans are queued (WAITING trials); `study.ask()` hands each to exactly one worker (the
storage changes WAITING -> RUNNING atomically). When the queue is empty and the budget allows, the
study's sampler (wrapped by ProjectingSampler) proposes more; a proposal already held by another trial is
not run again. A worker killed mid-run leaves a RUNNING trial: the next search marks it FAIL (RDB: no
heartbeat for GRACE_S; any storage: its recorded process is gone from this host) and queues its plan again.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import optuna
from optuna.trial import TrialState

from stratagem.evaluators import Evaluation, Evaluator
from stratagem.search.records import CONSTRAINT, objective_values, plan_key
from stratagem.search.samplers import ProjectingSampler, make_sampler
from stratagem.search.screening import Progress
from stratagem.search.storage import StorageSpec
from stratagem.search.study import held_keys, worker_alive, worker_id
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["run_queue", "recover"]


def recover(study: optuna.Study, storage: optuna.storages.BaseStorage) -> int:
    """Fail the RUNNING trials whose worker is dead and queue their plans again; returns how many."""
    if getattr(storage, "get_heartbeat_interval", lambda: None)() is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental"
            optuna.storages.fail_stale_trials(study)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker is not None and worker_alive(worker) is False:
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    held = held_keys(study)
    requeued = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
        key = t.user_attrs.get("plan")
        if key is None or key in held:
            continue
        study.enqueue_trial(dict(t.params), user_attrs={"plan": key, "role": t.user_attrs.get("role", "sampler"),
                                                        "retry_of": t.number})
        held[key] = t
        requeued += 1
    return requeued


def _values(ev: Evaluation) -> list[float] | None:
    try:
        return objective_values(ev)
    except ValueError:
        return None


@contextlib.contextmanager
def _heartbeat(storage: optuna.storages.BaseStorage, trial_id: int) -> Iterator[None]:
    interval = getattr(storage, "get_heartbeat_interval", lambda: None)()
    if interval is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]
            stop.wait(interval)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_queue(study: optuna.Study, storage: optuna.storages.BaseStorage, spec: StorageSpec, scenario: Scenario,
              space: SearchSpace, evaluator: Evaluator, usable_gib: float, prov: dict[str, Any],
              n_trials: int | None, timeout: float | None, progress: Progress | None,
              sampler: str = "nsga2") -> int:
    """Run queued plans, then sampler proposals, until the queue is empty (n_trials None) or n_trials runs
    are done or the timeout passes. Returns the runs this process did."""
    study.sampler = ProjectingSampler(make_sampler(sampler, space.config.seed), space)
    deadline = None if timeout is None else time.monotonic() + timeout
    done = attempts = 0
    budget = n_trials
    while budget is None or done < budget:
        if deadline is not None and time.monotonic() > deadline:
            break
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        if budget is None and not waiting:
            break
        attempts += 1
        if attempts > 10 * (budget or len(waiting)) + 100:
            break  # the sampler keeps proposing plans already held: the space is exhausted
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "heartbeat is supposed to be used with optimize": _heartbeat does it
            trial = study.ask()
        queued = "plan" in trial.user_attrs  # enqueued with its plan key
        plan = space.suggest(trial)
        key = plan_key(plan)
        if not queued:
            twin = held_keys(study).get(key)
            if twin is not None and twin.number != trial.number:
                trial.set_user_attr("plan", key)
                trial.set_user_attr("duplicate_of", twin.number)
                study.tell(trial, state=TrialState.PRUNED)
                continue
            trial.set_user_attr("plan", key)
            trial.set_user_attr("role", "sampler")
        trial.set_user_attr("worker", worker_id())
        with _heartbeat(storage, trial._trial_id):
            ev = evaluator.evaluate(scenario, plan)
        trial.set_user_attr("fidelity", ev.fidelity)
        trial.set_user_attr("status", ev.status)
        trial.set_user_attr("evaluation", ev.model_dump(mode="json"))
        trial.set_user_attr("provenance", {**prov, "evaluator": type(evaluator).__name__})
        if ev.memory is not None:
            trial.set_constraint(CONSTRAINT, ev.memory.peak_gib - usable_gib)
        fits = ev.status == "ok" and ev.memory is not None and ev.memory.peak_gib <= usable_gib
        values = _values(ev) if fits else None
        if values is not None:
            study.tell(trial, values)
        else:
            reason = ev.reason or (f"peak {ev.memory.peak_gib:.1f} GiB exceeds {usable_gib:.1f} GiB"
                                   if ev.memory is not None else f"status {ev.status}")
            trial.set_user_attr("pruned", reason)
            study.tell(trial, state=TrialState.PRUNED)
        done += 1
        if progress:
            progress("evaluate", done, budget if budget is not None else done + len(waiting) - 1)
    return done
