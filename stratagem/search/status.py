"""What a study holds right now, for whoever watches an unattended search: `study_status(study)`; and the
worker heartbeat it reads (`beating`).

Read-only. Counts: analytic trials stored; measured trials by status (ok, oom, failed, timeout) against K (the
real runs asked for), live claims, lost runs (released for an infrastructure failure, released by a signal,
expired claims) with the retries still pending and those done; the workers alive by their heartbeat (a study
attribute each worker refreshes every WORKER_BEAT_S, whether it is measuring or waiting for others) and the
claim holders; the best plan measured and predicted; the calibration error after each batch; the run time (the
sum of the measured runs' own durations: what the runs cost, whatever the gaps between calls), the time since
the real-run phase started (frozen when the search has ended) and what is left of its budget.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from stratagem.errors import StratagemError
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import Evaluation
from stratagem.evaluators.taught import taught_lines
from stratagem.search.budget import budget_windows
from stratagem.search.calibrate import calibration_history
from stratagem.search.claims import live_claims
from stratagem.search.headline import headline_tokens
from stratagem.search.noise import best_measured
from stratagem.search.records import (
    StudyKey,
    TrialKey,
    front_trials,
    standings,
    study_scenario,
    trial_evaluation,
    trial_feasible,
    trial_fidelity,
    trial_status,
)
from stratagem.search.study import worker_alive, worker_id
from stratagem.spaces.plan import Plan

__all__ = ["StudyStatus", "study_status", "beating", "live_heartbeats", "run_seconds", "WORKER_BEAT_S",
           "WORKER_STALE_S"]

WORKER_BEAT_S = 15.0
"""How often a worker refreshes its heartbeat."""
WORKER_STALE_S = 4 * WORKER_BEAT_S
"""A heartbeat older than this is a worker gone (killed, cut off, or its storage unreachable)."""
SIGNAL_RELEASE = "stopped by signal"
"""How claims.release words a release by SIGINT/SIGTERM (the reason's prefix)."""
BUDGET_RELEASE = "budget window ended"
"""How a run stopped at its --budget-minutes window's end is released (search.measure; not an infra failure)."""


@dataclass(frozen=True)
class StudyStatus:
    """A study's progress (see the module docstring)."""

    study: str
    analytic: int
    """Analytic trials stored (screened plans, recalibrated predictions)."""
    measured: dict[str, int]
    """Finished measured trials by status (ok, oom, failed, timeout)."""
    claimed: int
    """Plans being measured now (live claims)."""
    infra: int
    """Runs released after an infrastructure failure (their plans are retried)."""
    expired: int
    """Claims whose worker died or stopped renewing (their plans are retried)."""
    workers: list[str]
    """host:pid of each worker alive: a fresh heartbeat, or a claim that has not expired."""
    best_measured: str
    """The best measured plan ('' when none): `noise.best_measured`'s line (tokens/s with its interval, runs,
    whether other plans are within its noise) and its trial."""
    best_predicted: str
    """The predicted front's headline plan by the report's rules (search.headline: risk-aware; '' when none), with
    what the rules did when they passed over a faster plan."""
    calibration_trend: list[tuple[int, float, float]] = field(default_factory=list)
    """Per batch: (measured trials, median step-time error, median peak-memory error) after refitting."""
    taught: list[str] = field(default_factory=list)
    """What the runs taught per term and block (evaluators.taught.taught_lines of the study's calibration)."""
    elapsed_s: float | None = None
    """Wall seconds since the real-run phase started, up to its end once no worker is alive (None: not started):
    a span that includes the gaps between calls; the runs' own time is `run_s`."""
    run_s: float = 0.0
    """The sum of the measured runs' durations (`run_seconds`)."""
    runs: int = 0
    """Measured runs that ended (every status, lost runs included): what `run_s` sums."""
    budget_left_s: float | None = None
    """Seconds left of --budget-minutes (None: no budget)."""
    k: int | None = None
    """The --real-runs K of the latest worker (plans to measure beyond those held when it started; None: unknown,
    no worker recorded it)."""
    target: int | None = None
    """Measured plans the latest worker's call aims the study at: the plans held when it started + K (None:
    unknown)."""
    signal_released: int = 0
    """Runs released because their worker was stopped by SIGINT/SIGTERM (their plans are retried)."""
    budget_released: int = 0
    """Runs stopped at their budget window's end and released (their plans are retried in a later window)."""
    retries_pending: int = 0
    """Plans whose last run was lost (infra, signal, expired) and that nobody has measured or claimed since."""
    retries_done: int = 0
    """Plans measured after a lost run."""
    finished: bool = False
    """No worker alive and nothing claimed: the search has ended (or stopped); elapsed_s is frozen."""
    windows: list[tuple[float, float, float]] = field(default_factory=list)
    """Per --budget-minutes window, oldest first: (minutes, seconds spent, seconds left)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def _tokens(t: FrozenTrial) -> float:
    return float(t.values[0]) if t.values else 0.0


@dataclass
class _Lost:
    infra: int = 0
    signal: int = 0
    budget: int = 0
    expired: int = 0


def _measured(trials: list[FrozenTrial]) -> tuple[dict[str, int], _Lost, int, int, float]:
    """(statuses, lost runs by kind, retries pending, retries done, last finish time) of the measured trials,
    in number order."""
    measured: dict[str, int] = {}
    lost = _Lost()
    latest: dict[str, FrozenTrial] = {}
    lost_plans: set[str] = set()
    retried: set[str] = set()
    last_finish = 0.0
    for t in sorted(trials, key=lambda t: t.number):
        if t.user_attrs.get(TrialKey.FIDELITY) != "measured":
            continue
        key = str(t.user_attrs.get(TrialKey.PLAN, ""))
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
            measured[trial_status(t)] = measured.get(trial_status(t), 0) + 1
            if key in lost_plans:
                retried.add(key)
            if t.datetime_complete is not None:
                last_finish = max(last_finish, t.datetime_complete.timestamp())
        elif t.state == TrialState.FAIL:
            released = str(t.user_attrs.get(TrialKey.RELEASED, ""))
            lost.infra += released.startswith("infra")
            lost.signal += released.startswith(SIGNAL_RELEASE)
            lost.budget += released.startswith(BUDGET_RELEASE)
            lost.expired += TrialKey.EXPIRED in t.user_attrs
            if released or TrialKey.EXPIRED in t.user_attrs:
                lost_plans.add(key)
        if t.state != TrialState.WAITING:
            latest[key] = t
    pending = sum(1 for k in lost_plans if latest[k].state == TrialState.FAIL)
    return measured, lost, pending, len(retried), last_finish


def _heartbeats(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for k, v in attrs.items() if k.startswith(StudyKey.WORKER_PREFIX) and isinstance(v, dict)]


def live_heartbeats(study: optuna.Study, now: float | None = None) -> list[dict[str, Any]]:
    """The heartbeats of the workers still at work on `study` (fresh, measuring or waiting, not known dead)."""
    now = time.time() if now is None else now
    return [b for b in _heartbeats(study.user_attrs) if _beating(b, now)]


def run_seconds(trials: list[FrozenTrial]) -> tuple[float, int]:
    """(seconds, runs): the sum of the durations of the measured runs that ended (COMPLETE, PRUNED or FAIL):
    each run's own wall time as its evaluator recorded it (provenance "wall_s": Ray start of the ranks to their
    end), else its trial's span from claim to finish. Concurrent runs each count their own time."""
    total, runs = 0.0, 0
    for t in trials:
        if t.user_attrs.get(TrialKey.FIDELITY) != "measured" or t.state not in _ENDED:
            continue
        wall = ((t.user_attrs.get(TrialKey.EVALUATION) or {}).get("provenance") or {}).get("wall_s")
        if isinstance(wall, int | float) and wall > 0:
            total += float(wall)
        elif t.datetime_start is not None and t.datetime_complete is not None:
            total += max(0.0, (t.datetime_complete - t.datetime_start).total_seconds())
        else:
            continue
        runs += 1
    return total, runs


_ENDED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def _beating(beat: dict[str, Any], now: float) -> bool:
    """A heartbeat of a worker still at work: fresh, not ended, and its process not known dead."""
    if beat.get("phase") not in ("measuring", "waiting") or float(beat.get("seen", 0.0)) < now - WORKER_STALE_S:
        return False
    return worker_alive(beat.get("worker", {})) is not False


def _name(worker: dict[str, Any]) -> str:
    return f"{worker.get('host')}:{worker.get('pid')}"


def study_status(study: optuna.Study, now: float | None = None) -> StudyStatus:
    """Read the study once and summarise it."""
    now = time.time() if now is None else now
    trials = study.get_trials(deepcopy=False)
    attrs = study.user_attrs
    analytic = sum(t.user_attrs.get(TrialKey.FIDELITY) == "analytic" for t in trials)
    measured, lost, pending, done, last_finish = _measured(trials)
    claims = [t for t in trials if t.state == TrialState.RUNNING and TrialKey.CLAIM in t.user_attrs]
    beats = _heartbeats(attrs)
    alive = {_name(b.get("worker", {})) for b in beats if _beating(b, now)}
    alive |= {_name(c["worker"]) for t in claims
              if float((c := t.user_attrs[TrialKey.CLAIM]).get("expires", 0)) >= now}
    predicted = [t for t in front_trials(study) if t.user_attrs.get(TrialKey.FIDELITY) != "measured"]
    started = attrs.get(StudyKey.REAL_RUNS_STARTED)
    budget = attrs.get(StudyKey.REAL_RUNS_BUDGET_MINUTES)
    windows = budget_windows(study)
    finished = started is not None and not alive and not claims
    end = now
    if finished:  # frozen: the last heartbeat or result, not the clock of whoever asks
        end = max([last_finish, *(float(b.get("seen", 0.0)) for b in beats)]) or now
    elapsed = None if started is None else max(0.0, end - float(started))
    left = None if budget is None or elapsed is None else max(0.0, 60.0 * float(budget) - elapsed)
    if windows:  # the current window's (a rerun with --budget-minutes opens a new one: search/budget.py)
        left = 0.0 if finished else windows[-1].left_s(now)
    trend = [(h.measured, h.step_error_after, h.memory_error_after)
             for h in calibration_history(attrs.get(StudyKey.CALIBRATION_HISTORY))]
    latest = max((b for b in beats if isinstance(b.get("k"), int)), key=lambda b: float(b.get("started", 0.0)),
                 default=None)
    run_s, runs = run_seconds(trials)
    return StudyStatus(study=study.study_name, analytic=analytic, measured=measured, claimed=len(live_claims(study)),
                       infra=lost.infra, expired=lost.expired, workers=sorted(alive),
                       best_measured=_best_measured(study),
                       best_predicted=_best_predicted(study, trials, predicted),
                       calibration_trend=trend, taught=_taught(attrs), elapsed_s=elapsed, budget_left_s=left,
                       k=None if latest is None else int(latest["k"]),
                       target=None if latest is None or not isinstance(latest.get("target"), int) else int(latest["target"]),
                       run_s=run_s, runs=runs,
                       signal_released=lost.signal, budget_released=lost.budget, retries_pending=pending,
                       retries_done=done, finished=finished,
                       windows=[(w.minutes, w.spent_s(end), 0.0 if finished else w.left_s(now)) for w in windows])


def _taught(attrs: dict[str, Any]) -> list[str]:
    """taught_lines of the study's calibration in force on its scenario's device (none before a refit)."""
    stored = attrs.get(StudyKey.CALIBRATION)
    if not stored:
        return []
    device = ((attrs.get(StudyKey.SCENARIO) or {}).get("cluster") or {}).get("gpu") or {}
    return taught_lines(Calibration.model_validate(stored), str(device.get("name", "")))


def _best_measured(study: optuna.Study) -> str:
    """The best measured plan by the one rule (`noise.best_measured`: pooled over re-measures, with its noise),
    its trial; '' when no measured plan fits."""
    best = best_measured(study)
    if best is None:
        return ""
    return f"trial {best.number}: {best.note.removeprefix('best measured: ')}"  # the number on its own plan


def _describe(t: FrozenTrial | None) -> str:
    if t is None:
        return ""
    ev = trial_evaluation(t)
    name = ev.plan.short() if ev is not None else str(t.user_attrs.get(TrialKey.PLAN, t.number))
    return f"{name} ({_tokens(t):,.0f} tok/s, trial {t.number})"


@dataclass(frozen=True)
class _Standing:
    """A plan as search.headline's rules read it (headline.PlanStanding)."""

    index: int
    plan: Plan
    fidelity: str
    status: str
    values: tuple[float, ...] | None
    feasible: bool
    evaluation: Evaluation | None
    prediction: Evaluation | None
    label: str


def _standing(index: int, t: FrozenTrial, prediction: Evaluation | None = None) -> _Standing | None:
    ev = trial_evaluation(t)
    if ev is None:
        return None
    return _Standing(index=index, plan=ev.plan, fidelity=trial_fidelity(t), status=trial_status(t),
                     values=tuple(t.values) if t.values else None, feasible=trial_feasible(t), evaluation=ev,
                     prediction=prediction, label=ev.plan.short())


def _best_predicted(study: optuna.Study, trials: list[FrozenTrial], predicted: list[FrozenTrial]) -> str:
    """The predicted front's headline pick (search.headline, the report's rules under the study's calibration):
    the measured plans that ran out of memory take part in its first rule, never as a pick."""
    if not predicted:
        return ""
    oomed = []
    for s in standings(trials).values():
        if s.fidelity == "measured" and trial_status(s.trial) == "oom":
            analytic = [t for t in s.trials if trial_fidelity(t) == "analytic"]
            oomed.append((s.trial, trial_evaluation(analytic[-1]) if analytic else None))
    plans = [p for i, t in enumerate(predicted) if (p := _standing(i, t)) is not None]
    refuted = [p for i, (t, pred) in enumerate(oomed) if (p := _standing(len(predicted) + i, t, pred)) is not None]
    stored = study.user_attrs.get(StudyKey.CALIBRATION)
    pick, note = headline_tokens([*plans, *refuted], study_scenario(study),
                                 Calibration.model_validate(stored) if stored else None)
    if pick is None:
        return ""
    return _describe(predicted[pick]) + (f"; {note}" if note else "")


class Heartbeat:
    """This worker's heartbeat in a study (`beating`): phase "measuring" or "waiting" while it works (set
    `phase`), "done" or "stopped: <why>" at the end; refreshed every WORKER_BEAT_S by a daemon thread."""

    def __init__(self, study: optuna.Study, k: int | None, target: int | None = None) -> None:
        me = worker_id()
        self.key = f"{StudyKey.WORKER_PREFIX}{me['host']}:{me['pid']}"
        self.study = study
        self.phase = "measuring"
        self.runs = 0
        self._record: dict[str, Any] = {"worker": me, "started": time.time(), "k": k, "target": target}
        self._lock = threading.Lock()

    def write(self) -> None:
        """Store the heartbeat now."""
        with self._lock:
            self.study.set_user_attr(self.key, {**self._record, "seen": time.time(), "phase": self.phase,
                                                "runs": self.runs})


@contextlib.contextmanager
def beating(study: optuna.Study, k: int | None = None, target: int | None = None) -> Iterator[Heartbeat]:
    """Keep this worker's heartbeat fresh in `study` for the block (the measuring loop); `k` is --real-runs,
    `target` the measured plans the call aims the study at (measure.target: another worker with the same K joins it).
    Ends as phase "done", or "stopped: <exception>" when the block raises (a signal, an outage past the
    window). A refresh that fails (the storage unreachable past its window) stops the refreshes: the loop meets
    the same storage and reports it."""
    beat = Heartbeat(study, k, target)
    beat.write()
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(WORKER_BEAT_S):
            try:
                beat.write()
            except (StratagemError, optuna.exceptions.StorageInternalError):
                return

    thread = threading.Thread(target=refresh, name="stratagem-heartbeat", daemon=True)
    thread.start()
    try:
        yield beat
        beat.phase = "done"
    except BaseException as e:
        beat.phase = f"stopped: {type(e).__name__}"
        raise
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(StratagemError, optuna.exceptions.StorageInternalError):
            beat.write()
