"""The stratagem study in an Optuna storage: create or resume it (one study serves one scenario + search
section), list what it already holds, and turn evaluations into trials per records.py."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from stratagem.errors import StratagemError
from stratagem.evaluators.evaluation import Evaluation
from stratagem.procfs import start_ticks, state
from stratagem.search.naming import check_study_name
from stratagem.search.records import (
    CONSTRAINT,
    DIRECTIONS,
    ROLES,
    StudyKey,
    TrialKey,
    objective_values,
    plan_key,
)
from stratagem.search.storage import StorageSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["open_study", "held_keys", "store_trials", "evaluation_trial", "provenance", "worker_id", "version",
           "STORE_HOLD_S"]

_LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)
STORE_HOLD_S = 1.0
"""The longest one slice of an analytic store holds its study's lock (plus the write in progress): what a claim,
a finished run or another worker's store of the same study waits at most for it. A slice re-reads the study
(incremental on an RDB: Optuna's _CachedStorage reads only trials new since its last read), so the slice
amortises that read over the trials it writes (~14 ms each to SQLite, ~2.3x that to PostgreSQL:
bench/storage_per_trial.py)."""


def version() -> str:
    """This stratagem's version (recorded with studies and trials)."""
    from stratagem import __version__

    return __version__


def provenance(scenario: Scenario, space: SearchSpace, **extra: Any) -> dict[str, Any]:
    """Where a trial's figures come from."""
    return {"stratagem_version": version(), "scenario_hash": scenario.problem_hash(),
            "space_digest": space.digest(), "optuna_version": optuna.__version__, **extra}


def worker_id() -> dict[str, Any]:
    """This process, as recorded on the trials it runs (to recognise them after a crash)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": start_ticks(os.getpid())}


def worker_alive(worker: dict[str, Any]) -> bool | None:
    """Whether the recorded worker still runs: True/False on this host, None (unknown) elsewhere."""
    if worker.get("host") != socket.gethostname():
        return None
    pid = int(worker.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process (its /proc entry may be hidden too)
    if state(pid) in ("Z", "X"):  # killed, not yet reaped by its parent
        return False
    started = worker.get("started")
    return started is None or start_ticks(pid) == started


def open_study(storage: optuna.storages.BaseStorage, spec: StorageSpec, study_name: str, scenario: Scenario,
               space: SearchSpace) -> optuna.Study:
    """Create the study, or load it and check it was made for this scenario and search section. Call it
    under `storage_lock`; the scenario attribute is written last, so a study killed while being created is
    recognised (no scenario, no trials) and completed on the next run."""
    check_study_name(study_name)  # the one naming rule (search/naming.py), for library callers too
    study = optuna.create_study(storage=storage, study_name=study_name, directions=list(DIRECTIONS),
                                load_if_exists=True)
    attrs = study.user_attrs
    if StudyKey.SCENARIO not in attrs:
        if study.get_trials(deepcopy=False):
            raise StratagemError(f"--study ({study_name!r}): {spec.url} already holds a study of that name that "
                                 "stratagem did not make; pick another name")
        if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
            raise StratagemError(f"--study ({study_name!r}): {spec.url} already holds a study of that name with "
                                 "other objectives; pick another name")
        study.set_user_attr(StudyKey.STRATAGEM_VERSION, version())
        study.set_user_attr(StudyKey.SCENARIO_HASH, scenario.problem_hash())
        study.set_user_attr(StudyKey.SPACE_DIGEST, space.digest())
        study.set_user_attr(StudyKey.SPACE, space.summary())
        study.set_user_attr(StudyKey.SCENARIO, scenario.model_dump(mode="json"))
        return study
    if attrs.get(StudyKey.SPACE_DIGEST) != space.digest():
        same_problem = attrs.get(StudyKey.SCENARIO_HASH) == scenario.problem_hash()
        what = "another search section" if same_problem else "another scenario"
        raise StratagemError(
            f"--study ({study_name!r}): that study in {spec.url} was made for {what} "
            f"(space {attrs.get(StudyKey.SPACE_DIGEST)}, this one {space.digest()}); use a new --study name")
    return study


def held_keys(study: optuna.Study) -> dict[str, FrozenTrial]:
    """Plan key -> the trial that holds it (done, queued or running); FAIL trials hold nothing."""
    out: dict[str, FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False, states=_LIVE):
        key = t.user_attrs.get(TrialKey.PLAN)
        if key is not None and key not in out:
            out[key] = t
    return out


def store_trials(study: optuna.Study, lock: Callable[[], contextlib.AbstractContextManager[None]],
                 todo: Sequence[tuple[str, FrozenTrial]], progress: Callable[[int, int], None] | None = None) -> int:
    """Add the finished trials `todo` ((plan key, trial), evaluated beforehand, outside any lock) to the study in
    slices, each under `lock()` (the study's) held for at most STORE_HOLD_S plus one write, re-reading which plans
    the study holds at the start of each: a plan another writer stored or claimed meanwhile is skipped, so
    concurrent stores of one study store each plan once, and between slices other writers take the lock.
    A store killed between slices leaves whole trials, resumed by the next (it stores only the plans missing).
    progress(done, total) after each plan. Returns the trials written."""
    written = done = 0
    while done < len(todo):
        with lock():
            held = held_keys(study)
            t0 = time.monotonic()
            while done < len(todo) and (time.monotonic() - t0 < STORE_HOLD_S):
                key, trial = todo[done]
                done += 1
                if key not in held:
                    study.add_trial(trial)
                    written += 1
                if progress is not None:
                    progress(done, len(todo))
    return written


def evaluation_trial(space: SearchSpace, ev: Evaluation, usable_gib: float, role: str, prov: dict[str, Any],
                     pruned_reason: str = "") -> FrozenTrial:
    """A finished trial for one evaluation: COMPLETE with the objective values when the plan fits within
    usable_gib, PRUNED with the reason otherwise; params per SearchSpace.params; user attrs per records.py."""
    if role not in ROLES:
        raise ValueError(f"evaluation_trial: role {role!r} is not one of the study schema's {ROLES}")
    params, dists = space.params(ev.plan)
    attrs: dict[str, Any] = {
        TrialKey.PLAN: plan_key(ev.plan, space.scenario), TrialKey.FIDELITY: ev.fidelity, TrialKey.STATUS: ev.status,
        TrialKey.EVALUATION: ev.model_dump(mode="json"), TrialKey.PROVENANCE: prov, TrialKey.ROLE: role,
    }
    constraints = None if ev.memory is None else {CONSTRAINT: ev.memory.peak_gib - usable_gib}
    fits = ev.status == "ok" and ev.memory is not None and ev.memory.peak_gib <= usable_gib
    if fits:
        try:
            values = objective_values(ev)
        except ValueError:
            fits = False
    if not fits:
        attrs[TrialKey.PRUNED] = pruned_reason or ev.reason or f"status {ev.status}"
        return optuna.trial.create_trial(state=TrialState.PRUNED, params=params, distributions=dists,
                                         user_attrs=attrs, constraints=constraints)
    return optuna.trial.create_trial(state=TrialState.COMPLETE, params=params, distributions=dists,
                                     values=values, user_attrs=attrs, constraints=constraints)
