"""Claims: which worker is measuring which plan of a study, so several workers on one study never measure a
plan twice and a dead worker's plan is run again.

A claim is a RUNNING trial holding the plan's params and the user attributes "plan", "role", "fidelity"
("measured") and "claim" = {worker (host, pid, start ticks), expires (Unix time), renewed}. It is made under the
storage lock, after the live claims and finished measured trials were read, so two workers never claim one
plan. While the run goes on a thread renews it every CLAIM_RENEW_S (the same code on every storage: SQLite,
PostgreSQL, journal; on RDB storages Optuna's heartbeat is recorded too, so optuna-dashboard sees it alive).
It ends as:
  - the measured trial itself (COMPLETE, or PRUNED with its status: oom, failed, timeout) - `finish`;
  - FAIL with user attribute "released" (infra failure, or the worker was stopped) - `release`: the plan is
    free again and a later batch or rerun measures it;
  - FAIL with "expired" when its worker stopped renewing for CLAIM_TTL_S, or is known dead on this host -
    `expire_claims`, run by every worker before it picks plans.
A plan whose run was lost (released or expired) and that nobody has measured or claimed since is `orphaned`:
the search chose it, so it is the first to run again (before the ranking moves on with a newer calibration and
the budget of real runs is spent elsewhere).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from stratagem.errors import StratagemError
from stratagem.search.records import TrialKey, plan_key, trial_plan
from stratagem.search.retry import outage_grace_s
from stratagem.search.study import worker_alive, worker_id
from stratagem.spaces.plan import Plan
from stratagem.spaces.space import SearchSpace

__all__ = ["Claim", "CLAIM_TTL_S", "CLAIM_RENEW_S", "claim", "live_claims", "expire_claims", "finish", "release",
           "renewing", "orphaned"]

CLAIM_TTL_S = 90.0
"""A claim not renewed for this long is expired (its worker is gone or cut off)."""
CLAIM_RENEW_S = 15.0
"""How often a running worker renews its claims."""


@dataclass(frozen=True)
class Claim:
    """A plan this worker is measuring: its RUNNING trial."""

    trial_id: int
    number: int
    plan: Plan
    role: str


def _claim_attr(now: float) -> dict[str, Any]:
    return {"worker": worker_id(), "expires": now + CLAIM_TTL_S, "renewed": now}


def claim(storage: optuna.storages.BaseStorage, study: optuna.Study, space: SearchSpace, plan: Plan,
          role: str) -> Claim:
    """Claim `plan` for this worker (call under the storage lock, after checking nobody holds it)."""
    params, dists = space.params(plan)
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING, params=params, distributions=dists,
        user_attrs={TrialKey.PLAN: plan_key(plan, space.scenario), TrialKey.ROLE: role, TrialKey.FIDELITY: "measured",
                    TrialKey.CLAIM: _claim_attr(time.time())})
    study_id = storage.get_study_id_from_name(study.study_name)
    trial_id = storage.create_new_trial(study_id, template_trial=template)
    return Claim(trial_id=trial_id, number=storage.get_trial_number_from_id(trial_id), plan=plan, role=role)


def live_claims(study: optuna.Study) -> dict[str, FrozenTrial]:
    """Plan key -> the RUNNING trial claiming it (any worker)."""
    out: dict[str, FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if TrialKey.CLAIM in t.user_attrs and TrialKey.PLAN in t.user_attrs:
            out[t.user_attrs[TrialKey.PLAN]] = t
    return out


def expire_claims(study: optuna.Study, storage: optuna.storages.BaseStorage, now: float | None = None) -> int:
    """Fail the claims whose worker stopped renewing them (or is dead on this host); returns how many."""
    now = time.time() if now is None else now
    expired = 0
    grace = outage_grace_s(storage, CLAIM_TTL_S)  # nobody could renew during a storage outage this process saw
    for t in live_claims(study).values():
        info = t.user_attrs[TrialKey.CLAIM]
        dead = worker_alive(info.get("worker", {})) is False
        if dead or float(info.get("expires", 0.0)) + grace < now:
            why = "its worker is gone" if dead else f"not renewed for {CLAIM_TTL_S:.0f} s"
            storage.set_trial_user_attr(t._trial_id, TrialKey.EXPIRED, why)
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            expired += 1
    return expired


def orphaned(study: optuna.Study) -> list[tuple[Plan, str]]:
    """(plan, role) of each plan whose latest measured-fidelity trial is a lost run (FAIL, released or expired):
    not measured since, not claimed now; oldest loss first."""
    latest: dict[str, FrozenTrial] = {}
    for t in study.get_trials(deepcopy=False):
        key = t.user_attrs.get(TrialKey.PLAN)
        if key and t.user_attrs.get(TrialKey.FIDELITY) == "measured" and t.state != TrialState.WAITING:
            latest[key] = t  # trials come in number order: the last one wins
    lost = [t for t in latest.values() if t.state == TrialState.FAIL
            and (TrialKey.RELEASED in t.user_attrs or TrialKey.EXPIRED in t.user_attrs)]
    return [(trial_plan(t), str(t.user_attrs.get(TrialKey.ROLE, "candidate"))) for t in sorted(lost, key=lambda t: t.number)]


def finish(storage: optuna.storages.BaseStorage, c: Claim, measured: FrozenTrial) -> None:
    """Turn the claim into the measured trial (`measured`: the finished trial `evaluation_trial` built)."""
    for key, value in measured.user_attrs.items():
        storage.set_trial_user_attr(c.trial_id, key, value)
    for key, value in measured.system_attrs.items():
        storage.set_trial_system_attr(c.trial_id, key, value)
    storage.set_trial_state_values(c.trial_id, measured.state,
                                   measured.values if measured.state == TrialState.COMPLETE else None)


def release(storage: optuna.storages.BaseStorage, c: Claim, reason: str) -> None:
    """Give the plan back (FAIL with "released": reason): an infrastructure failure or a stopped worker."""
    storage.set_trial_user_attr(c.trial_id, TrialKey.RELEASED, reason)
    storage.set_trial_state_values(c.trial_id, TrialState.FAIL)


@contextlib.contextmanager
def renewing(storage: optuna.storages.BaseStorage, claims: Sequence[Claim]) -> Iterator[None]:
    """Renew `claims` every CLAIM_RENEW_S while the block runs (a daemon thread)."""
    stop = threading.Event()
    heartbeat = getattr(storage, "get_heartbeat_interval", lambda: None)() is not None

    def beat() -> None:
        while not stop.wait(CLAIM_RENEW_S):
            now = time.time()
            for c in claims:
                try:
                    storage.set_trial_user_attr(c.trial_id, TrialKey.CLAIM, _claim_attr(now))
                    if heartbeat:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")  # "experimental"
                            storage.record_heartbeat(c.trial_id)  # type: ignore[attr-defined]
                except (optuna.exceptions.StorageInternalError, optuna.exceptions.UpdateFinishedTrialError):
                    pass  # finished or released meanwhile; or the storage is briefly unreachable: retry next beat
                except StratagemError:
                    return  # the storage unreachable past its retry window: the loop meets it too and exits 2

    thread = threading.Thread(target=beat, name="stratagem-claims", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
