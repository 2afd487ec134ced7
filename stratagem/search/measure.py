"""The real-run phase of a search session (`SearchSession.measure`): the budget loop and one batch's lifecycle.
Which plans run is the RunOrder policy's (search/run_order.py); this module only drives it.

Budget loop (`Measurement.run`): before each batch it stops when the budget window is spent, the call's
--timeout or --n-trials is reached, or the study holds its target of measured plans and this call has no
re-measurement left to spend (R runs a call, `--remeasure`: the best and the plans within its noise, search/noise.py); it expires dead workers' claims, asks the
policy for plans, drops those that could not finish in the budget left (the evaluator's predicted run time), and
claims as many as the cluster runs at once (slots // widest plan, re-read each batch). While other workers hold
the remaining plans it waits for them (or for their claims to expire).
Batch lifecycle (`Measurement.batch`): claim -> evaluate (claims renewed meanwhile; at the budget window's end
the runs in flight are stopped) -> finish each claim as its measured trial, or release it (infra failure,
stopped) for a retry -> refit the calibration's constants and then its per-term multipliers (each adopted only
when it predicts held-out runs better: calibrate.refit_step, multiplier_refit.refit_multipliers) -> one BatchDone
event. A re-measured plan's trial holds the figures of all its runs
pooled (search/noise.py). K counts plans not measured before (distinct jobs): the call's target is the plans
the study held measured when it started plus K (`--real-runs 4` on a resumed study measures four more), or
the target of a worker measuring the same study now with the same K, which a worker started beside it joins
(workers share one target, as they share a budget window). Re-measurements are counted apart, R per call
(each worker's call), so `--real-runs 6` measures six different jobs.
SIGINT/SIGTERM (main thread): the runs in flight are killed, their claims released, and Stopped is raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from stratagem.evaluators import Calibration, Evaluation, MeasuringEvaluator
from stratagem.search.budget import Deadline
from stratagem.search.calibrate import CalibrationStep, calibration_history, calibration_id, refit_step
from stratagem.search.claims import Claim, claim, expire_claims, finish, live_claims, release, renewing
from stratagem.search.events import RESULT_STATUSES, BatchDone, Phase, RunDone
from stratagem.search.multiplier_refit import refit_multipliers, with_multipliers
from stratagem.search.noise import pooled_evaluation, record_noise, run_noise
from stratagem.search.records import (
    StudyKey,
    TrialKey,
    plan_key,
    standings,
    trial_evaluation,
    trial_fidelity,
    trial_plan,
)
from stratagem.search.run_order import Pick, RunOrder, RunState, measured_trials
from stratagem.search.status import BUDGET_RELEASE, live_heartbeats
from stratagem.search.study import evaluation_trial, provenance

if TYPE_CHECKING:
    from stratagem.search.open_session import OpenSession

__all__ = ["Measurement", "Stopped", "stop_on_signals", "measured_runs", "traced_over_limit", "repredict", "target",
           "POLL_S"]

POLL_S = 5.0
"""Seconds between looks while other workers hold the remaining plans."""


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived during the real runs (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum
        """The signal: the process should exit with 128 + signum."""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """In the main thread, SIGINT and SIGTERM raise Stopped (instead of KeyboardInterrupt / dying at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def measured_runs(study: optuna.Study) -> int:
    """Finished measured runs in the study (COMPLETE or PRUNED measured trials, re-measurements included)."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
               if trial_fidelity(t) == "measured")


def target(study: optuna.Study, k: int, now: float | None = None) -> tuple[int, bool]:
    """(measured plans the study is to hold at the end of a call with --real-runs K, whether that joins another
    worker's target): the target of a worker measuring now with the same K (its heartbeat, search/status.py),
    else the plans measured so far + K. Under the lock."""
    joined = [int(b["target"]) for b in live_heartbeats(study, now) if b.get("k") == k
              and isinstance(b.get("target"), int)]
    if joined:
        return max(joined), True
    return len(measured_trials(study)) + k, False


def traced_over_limit(study: optuna.Study, usable_gib: float) -> dict[str, str]:
    """Plan key -> why not to run it, for each plan whose standing trial is traced and does not fit: the traced
    step (the harness's own code at full size) is closer to a real run than the analytic prediction, so no real
    run is spent on a plan whose traced memory is over the limit. A measured trial stands above
    a traced one, so a plan already run is judged by its run."""
    out: dict[str, str] = {}
    for key, s in standings(study.get_trials(deepcopy=False)).items():
        if s.fidelity != "traced" or s.feasible:
            continue
        ev = trial_evaluation(s.trial)
        peak = ev.memory.peak_gib if ev is not None and ev.memory is not None else float("nan")
        out[key] = f"{trial_plan(s.trial).short()}: traced peak {peak:.1f} GiB over the usable {usable_gib:.1f} GiB"
    return out


@dataclass
class _Tally:
    """What this call did."""

    runs: int = 0
    ok: int = 0
    results: int = 0
    first_failure: str = ""
    infra: int = 0
    stopped: int = 0
    """Runs stopped at the budget window's end (released; neither a result nor a failure)."""
    remeasured: int = 0
    """Re-measurement runs of this call that ended (not released)."""
    ended: str = ""
    """Why the loop ended ('' when the study reached K)."""


class Measurement:
    """One call's real-run phase on an open session (see the module docstring)."""

    def __init__(self, session: OpenSession, evaluator: MeasuringEvaluator, order: RunOrder, k: int,
                 recalibrate: bool, deadline: Deadline, remeasure: int = 0, target: int | None = None) -> None:
        self.s, self.evaluator, self.order, self.k = session, evaluator, order, k
        self.target = k if target is None else target
        """Measured plans the study is to hold when the call ends (the plans held at its start + K: `target`)."""
        self.remeasure = remeasure
        """Re-measurement runs this call may spend after the K plans (--remeasure)."""
        self.recalibrate, self.deadline = recalibrate, deadline
        self.tally = _Tally()
        self._budget_hit = False
        self.traced_out: dict[str, str] = {}
        stored = session.study.user_attrs.get(StudyKey.CALIBRATION)
        self.calibration: Calibration = (Calibration.model_validate(stored) if stored and recalibrate
                                         else session.start_calibration)
        """The calibration in force: the study's latest adopted refit (another worker's, an earlier call's), else
        the one the session started from."""
        self.prov = provenance(session.scenario, session.space, screening="multifidelity")

    # -- the budget loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        """Batches until K, the budget, the call's limits, or nothing left to run (tally.ended says which)."""
        with self.s.lock():
            self.traced_out = traced_over_limit(self.s.study, self.s.usable_gib)
        if self.traced_out:
            self.s.say(f"not running {len(self.traced_out)} plan(s) whose traced memory does not fit, e.g. "
                       f"{next(iter(self.traced_out.values()))}")
        with stop_on_signals():
            while True:
                why = self.deadline.over(self.tally.runs)
                if why:
                    self.tally.ended = why
                    break
                batch, waiting = self.pick()
                if batch:
                    self.batch(batch)
                    continue
                if waiting and not self.tally.ended:  # other workers hold the rest: wait for them
                    time.sleep(POLL_S)
                    continue
                break

    def pick(self) -> tuple[list[Claim], bool]:
        """Under the lock: (claims of the next batch, whether other workers hold plans of this study)."""
        s = self.s
        with s.lock():
            expire_claims(s.study, s.backend)
            done = measured_trials(s.study)
            claimed = live_claims(s.study)
            new_claims = [t for t in claimed.values() if t.user_attrs.get(TrialKey.ROLE) != "remeasured"]
            left = self.target - len(done) - len(new_claims)
            again = self.remeasure - self.tally.remeasured
            if left <= 0 and again <= 0:
                return [], False
            want = left if left > 0 else again
            if self.deadline.max_runs is not None:
                want = min(want, self.deadline.max_runs - self.tally.runs)
            if want <= 0:
                return [], bool(claimed)
            state = RunState(scenario=s.scenario, space=s.space, study=s.study, calibration=self.calibration,
                             excluded=frozenset(set(claimed) | set(self.traced_out)
                                                | set(done)),
                             measured_runs=measured_runs(s.study), runs_left=max(0, left),
                             unsupported=self.evaluator.unsupported, claimed=frozenset(claimed),
                             remeasures_left=max(0, again))
            picks = self._in_budget(self.order.next_batch(state, want))
            if not picks:
                return [], bool(claimed)
            widest = max(p.world_size for p, _ in picks)
            slots = max(1, self.evaluator.slots)  # re-read: the cluster may have changed
            return [claim(s.backend, s.study, s.space, p, role) for p, role in picks[: max(1, slots // widest)]], True

    def _in_budget(self, picks: list[Pick]) -> list[Pick]:
        """The picks whose predicted run time fits in the budget left; the loop ends when none does."""
        left = self.deadline.seconds_left()
        if left is None or not picks:
            return picks
        fit = [(p, r) for p, r in picks if self.evaluator.run_seconds(self.s.scenario, p) <= left]
        if not fit:
            p = picks[0][0]
            self.tally.ended = (f"no run started: the next plan ({p.short()}) is predicted to take "
                                f"{self.evaluator.run_seconds(self.s.scenario, p):.0f} s, {max(0.0, left):.0f} s "
                                "of the budget window are left")
        return fit

    # -- one batch --------------------------------------------------------------------------------------------
    def batch(self, batch: list[Claim]) -> None:
        """Evaluate, finish or release, refit, report (see the module docstring)."""
        s = self.s
        evaluations = self._evaluate(batch)
        with s.lock():
            done: list[RunDone] = []
            for c, ev in zip(batch, evaluations, strict=True):
                done.append(self._settle(c, ev))
            if s.host_noise:  # the host's noise file: plans measured twice (search/noise_floor.py)
                record_noise(s.study)
            step = self._refit()
        self.order.update(evaluations)
        self.tally.runs += len(batch)
        plans = len(measured_trials(s.study))
        s.emit(BatchDone(measured=plans, target=self.target, runs=tuple(done), step=step))
        start = self.target - self.k
        s.emit(Phase("real runs", min(self.k, max(0, plans - start)), self.k))

    def _evaluate(self, batch: list[Claim]) -> list[Evaluation]:
        """Run the batch with its claims renewed; the budget's end stops it; a signal releases it and re-raises."""
        s = self.s
        left = self.deadline.seconds_left()
        timer = threading.Timer(max(0.0, left), self._budget_end) if left is not None else None
        self._budget_hit = False
        try:
            with renewing(s.backend, batch):
                if timer is not None:
                    timer.daemon = True
                    timer.start()
                return list(self.evaluator.evaluate_batch(s.scenario, [c.plan for c in batch]))
        except Stopped as stop:
            self.evaluator.stop()
            s.say(f"stopping: killing {len(batch)} in-flight run(s); their plans are released for a rerun")
            with s.lock():
                for c in batch:
                    release(s.backend, c, f"stopped by signal {stop.signum}")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _budget_end(self) -> None:
        self._budget_hit = True
        n = self.evaluator.stop()
        self.s.say(f"budget window spent: stopping {n} run(s) in flight; their plans are released")

    def _settle(self, c: Claim, ev: Evaluation) -> RunDone:
        """Finish the claim as its measured trial, or release it (infra, stopped). Under the lock."""
        s, t = self.s, self.tally
        first = ev.reason.splitlines()[0] if ev.reason else ""
        t.ok += ev.status == "ok"
        t.results += ev.status in RESULT_STATUSES
        if ev.status != "ok" and not t.first_failure and not (self._budget_hit and first == "stopped"):
            t.first_failure = f"{c.plan.short()}: {ev.status}: {first}"
        if ev.status == "infra" and self._budget_hit and first == "stopped":  # the budget's end, not the cluster
            t.stopped += 1
            release(s.backend, c, BUDGET_RELEASE)
            return RunDone(c.plan.short(), "stopped", BUDGET_RELEASE, c.role == "remeasured")
        if ev.status == "infra":
            t.infra += 1
            release(s.backend, c, f"infra: {ev.reason}")
            return RunDone(c.plan.short(), ev.status, first, c.role == "remeasured")
        t.remeasured += c.role == "remeasured"
        if c.role == "remeasured" and ev.status == "ok":
            ev = pooled_evaluation([*self._previous_runs(c.plan), ev])
        reason = "" if ev.status == "ok" else f"{ev.status}: {ev.reason}"
        finish(s.backend, c, evaluation_trial(s.space, ev, s.usable_gib, c.role, self.prov, reason))
        return RunDone(c.plan.short(), ev.status, first, c.role == "remeasured")

    def _previous_runs(self, plan: Any) -> list[Evaluation]:
        key = plan_key(plan)
        standing = standings(self.s.study.get_trials(deepcopy=False)).get(key)
        out = []
        for t in standing.trials if standing else ():
            ev = trial_evaluation(t)
            if trial_fidelity(t) == "measured" and ev is not None and ev.status == "ok":
                out.append(ev)
        return out

    def _refit(self) -> CalibrationStep:
        """Refit on every measured plan of the study from the session's starting calibration; keep it only when
        it predicts held-out runs better than the calibration in force. Under the lock."""
        s = self.s
        evaluations = [ev for t in measured_trials(s.study).values() if (ev := trial_evaluation(t)) is not None]
        fit = refit_step(s.scenario, evaluations, s.start_calibration, self.calibration, refit=self.recalibrate)
        step = fit.step(measured_runs(s.study))
        if self.recalibrate:  # then the per-term multipliers, at the constants in force (search/multiplier_refit.py)
            terms = refit_multipliers(s.scenario, evaluations, s.start_calibration, fit.calibration,
                                      run_noise(s.study).sd, s.study_name, fit)
            fit = dataclasses.replace(fit, calibration=terms.calibration)
            step = with_multipliers(step, terms)
        self.calibration = fit.calibration
        history = calibration_history(s.study.user_attrs.get(StudyKey.CALIBRATION_HISTORY)) + [step]
        s.study.set_user_attr(StudyKey.CALIBRATION, fit.calibration.model_dump(mode="json"))
        s.study.set_user_attr(StudyKey.CALIBRATION_HISTORY, [h.model_dump(mode="json") for h in history])
        return step

    # -- after the loop -----------------------------------------------------------------------------------------
    def finish(self) -> int:
        """Record what was not run; re-predict the stored plans with the study's latest calibration when no other
        worker is still measuring (one set per calibration, keyed by its id). Returns trials re-predicted."""
        s = self.s
        with s.lock():
            kept = {k: v for k, v in (s.study.user_attrs.get(StudyKey.NOT_RUN) or {}).items()
                    if k not in ("harness", "traced")}  # other steps' reasons (the traced step's) stay
            s.study.set_user_attr(StudyKey.NOT_RUN, kept | {
                why: {"count": len(plans), "example": next(iter(plans.values()), "")}
                for why, plans in (("harness", self.order.skipped), ("traced", self.traced_out)) if plans})
            if live_claims(s.study):
                return 0
            stored = s.study.user_attrs.get(StudyKey.CALIBRATION)
            latest = Calibration.model_validate(stored) if stored else self.calibration
            return repredict(s, latest)


def repredict(s: OpenSession, cal: Calibration) -> int:
    """Re-predict every stored plan that was not measured with `cal`, as new analytic trials (role
    "recalibrated", provenance "calibration" = its id); a plan whose latest prediction already carries that id is
    skipped, so every worker and rerun adds one set per calibration at most. Under the lock."""
    from stratagem.evaluators import evaluate

    cid = calibration_id(cal)
    done = measured_trials(s.study)
    latest: dict[str, optuna.trial.FrozenTrial] = {}
    for t in s.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        key = t.user_attrs.get(TrialKey.PLAN)
        if key and key not in done and trial_fidelity(t) == "analytic":
            latest[key] = t
    prov = provenance(s.scenario, s.space, screening="multifidelity", calibration=cid)
    added = 0
    for t in latest.values():
        if t.user_attrs.get(TrialKey.PROVENANCE, {}).get("calibration") == cid:
            continue
        ev = trial_evaluation(t)
        if ev is None:
            continue
        s.study.add_trial(evaluation_trial(s.space, evaluate(s.scenario, ev.plan, cal), s.usable_gib,
                                           "recalibrated", prov))
        added += 1
    return added
