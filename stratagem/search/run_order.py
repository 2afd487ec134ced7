"""Which plans the real-run loop measures next: the `RunOrder` policy, apart from the loop that drives it
(search/session.py), as DeepSpeed's autotuner separates its tuners from its loop. bench/search_regret.py drives
the same policies through the same loop.

Every policy builds a batch the same way (order_batch), re-deciding before every batch with the calibration in
force:
  0. plans whose run was lost (an infra failure, a dead or stopped worker: claims.orphaned) run again first;
  1. while the study holds fewer than K measured plans: new plans, the policy's own choice;
  2. after K plans (or when no new plan is left), the re-measurements due (search/noise.py: the best measured
     plan once more, and those within its noise), within the call's re-measurement runs: they settle the
     ranking.
Step 1 by policy (RUN_ORDERS):
  "expected_improvement" (ExpectedImprovementOrder, the default): the plans whose run is expected to improve
     most on the best measured tokens/s (before a measured plan fits: on the best the model promises, the
     plug-in incumbent of search/acquisition.py), times their probability of fitting, from every plan's predictive
     distributions (evaluators/posterior.py), a batch for several workers by the kriging believer
     (search/acquisition.py);
  "ranked" (RankedOrder, the order before it): plans that may fit by predicted tokens/s, fastest first:
     predicted to fit, or predicted over the limit by less than the memory model's error on this study's runs (a
     boundary run only where it can pay); then what an Optuna NSGA-II sampler proposes, given the measured
     trials so far.
Plans the evaluator cannot run (`unsupported`) are skipped and remembered (`skipped`); a plan whose runs failed
for the cluster's sake more than INFRA_RETRIES times in this call is not proposed again (`update`).
Every comparison of a plan with the study's plans is by its job (`job_key`: the scenario's canonical form, the key
its trial is stored under), so a candidate written in another form of a measured job (torch `dp2 pp2 z3` runs
ZeRO-2's job) is not run again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import optuna
from optuna.trial import TrialState

from stratagem.errors import StratagemError
from stratagem.evaluators import Calibration, Evaluation, evaluate_many
from stratagem.evaluators.posterior import Predictive, PredictiveBasis, predictive_basis
from stratagem.search.acquisition import believer_batch, plug_in_incumbent
from stratagem.search.calibrate import calibration_id
from stratagem.search.claims import orphaned
from stratagem.search.noise import best_measured, remeasure_due
from stratagem.search.records import DIRECTIONS, plan_key, standings, trial_evaluation
from stratagem.search.screening import Screening, _unique, screen
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import usable_gib
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["Pick", "RunState", "RunOrder", "RankedOrder", "ExpectedImprovementOrder", "Predict", "rank_candidates",
           "memory_band", "screen_candidates",
           "check_candidates", "measured_trials", "DEFAULT_MEMORY_BAND", "INFRA_RETRIES", "RUN_ORDERS",
           "DEFAULT_RUN_ORDER", "order_batch", "count_infra", "admit", "screening_of", "job_key"]

Pick = tuple[Plan, str]
"""A plan to run and its role (records.ROLES)."""
INFRA_RETRIES = 2
"""Times one call retries a plan whose run failed for the cluster's sake (a rerun retries again)."""
DEFAULT_MEMORY_BAND = 0.05
"""Relative memory error assumed before a study has measured peaks to fit on: a plan predicted within 5 % over
the limit may still fit (bench/memory_accuracy.py: median error 6.6 % on published runs)."""
_MAX_RANK_ROUNDS = 50  # rounds of ranking per batch when the harness keeps refusing plans


def job_key(scenario: Scenario, plan: Plan) -> str:
    """The key the study stores `plan`'s trial under (records.plan_key with the scenario: its canonical job), to
    compare a plan as given (a user's candidate, a table's row) with the plans measured, claimed or refused."""
    return plan_key(plan, scenario)


def measured_trials(study: optuna.Study) -> dict[str, optuna.trial.FrozenTrial]:
    """Plan key -> the finished measured trial that stands for the plan (records.standings: the latest)."""
    return {k: s.trial for k, s in standings(study.get_trials(deepcopy=False)).items() if s.fidelity == "measured"}


@dataclass(frozen=True)
class RunState:
    """What the policy sees before a batch."""

    scenario: Scenario
    space: SearchSpace
    study: optuna.Study
    calibration: Calibration
    """The calibration in force (the latest adopted refit)."""
    excluded: frozenset[str]
    """Plan keys not to propose as new: measured, claimed by any worker, or known not to run (traced over the
    limit)."""
    measured_runs: int
    """Finished measured runs in the study (every worker's, re-measurements included)."""
    runs_left: int
    """New plans the study's K leaves after the measured and claimed ones."""
    unsupported: Callable[[Scenario, Plan], str | None]
    """The evaluator's `unsupported`."""
    claimed: frozenset[str] = frozenset()
    """Plan keys another run holds now (never re-measured at the same time)."""
    remeasures_left: int = 0
    """Re-measurement runs this call may still spend (--remeasure)."""


class RunOrder(Protocol):
    """A run-order policy: proposes plans, learns from results."""

    skipped: dict[str, str]
    """Plan key -> "plan: why" for plans the evaluator cannot run (never stored as trials)."""

    def next_batch(self, state: RunState, want: int) -> list[Pick]:
        """Up to `want` plans to run next, in order; none of them in state.excluded."""
        ...

    def update(self, results: Sequence[Evaluation]) -> None:
        """What the last batch measured (infra failures included)."""
        ...


@dataclass
class RankedOrder:
    """New plans by predicted tokens/s among those that may fit (see the module docstring)."""

    candidates: PlanColumns | None = None
    """Run only these plans (ranked among themselves, the ones predicted not to fit last; no sampler)."""
    skipped: dict[str, str] = field(default_factory=dict)
    infra: dict[Plan, int] = field(default_factory=dict)
    """Plan as run -> infra failures in this call."""

    def next_batch(self, state: RunState, want: int) -> list[Pick]:
        """Lost plans first, then new plans by the ranking up to K, then the due re-measurements (docstring)."""
        return order_batch(state, want, self.infra, lambda excluded, n: self._ranked(state, excluded, n))

    def update(self, results: Sequence[Evaluation]) -> None:
        """Count infra failures per plan (retried at most INFRA_RETRIES times in this call)."""
        count_infra(self.infra, results)

    def _ranked(self, state: RunState, excluded: set[str], want: int) -> list[Pick]:
        """Up to `want` new plans by the ranking; plans the evaluator refuses go to `skipped`."""
        screening = screening_of(state, self.candidates)
        excluded = set(excluded) | set(self.skipped)
        scenario = state.scenario
        band = memory_band(state.study, state.scenario, state.calibration)
        ranked: list[Pick] = []
        for _ in range(_MAX_RANK_ROUNDS):
            if len(ranked) >= want:
                break
            more = rank_candidates(screening, excluded, want - len(ranked),
                                   include_infeasible=self.candidates is not None, memory_band=band)
            if len(more) < want - len(ranked) and self.candidates is None:
                more += _sampler_proposals(screening, state.study, excluded | {job_key(scenario, p) for p, _ in more},
                                           want - len(ranked) - len(more),
                                           state.space.config.seed + state.measured_runs)
            if not more:
                break
            for plan, role in more:
                excluded.add(job_key(scenario, plan))
                if admit(state, plan, self.skipped):
                    ranked.append((plan, role))
        return ranked


def order_batch(state: RunState, want: int, infra: dict[Plan, int],
                new_plans: Callable[[set[str], int], list[Pick]]) -> list[Pick]:
    """The batch every policy builds the same way (the module docstring's steps 0 and 2 around step 1): lost plans
    first; then `new_plans(excluded, n)`, the policy's own choice of up to n new plans (n within K); when it
    has none (K plans measured, or nothing new left), the re-measurements due. `infra`: plan -> infra
    failures in this call (count_infra); a plan past INFRA_RETRIES is not proposed again. Plans are compared by
    job (job_key); `new_plans` gets the excluded jobs' keys."""
    scenario = state.scenario
    given_up = {job_key(scenario, p) for p, n in infra.items() if n > INFRA_RETRIES}
    excluded = set(state.excluded) | given_up
    picks = [(p, r) for p, r in orphaned(state.study) if job_key(scenario, p) not in excluded][:want]
    excluded |= {job_key(scenario, p) for p, _ in picks}
    busy = set(state.claimed) | given_up | {job_key(scenario, p) for p, _ in picks}
    due = [(p, r) for p, r in remeasure_due(state.study, want) if job_key(scenario, p) not in busy]
    due = due[: state.remeasures_left]
    room = want - len(picks)
    more = new_plans(excluded, min(room, state.runs_left)) if room > 0 and state.runs_left > 0 else []
    if not more:  # K plans measured, or nothing new left to explore: settle the ranking
        more = due[:room]
    return picks + more


def count_infra(infra: dict[Plan, int], results: Sequence[Evaluation]) -> None:
    """Add each infra failure in `results` to `infra` (plan as run -> failures in this call; order_batch compares
    them by job, which needs the scenario)."""
    for ev in results:
        if ev.status == "infra":
            infra[ev.plan] = infra.get(ev.plan, 0) + 1


def admit(state: RunState, plan: Plan, skipped: dict[str, str]) -> bool:
    """Whether the evaluator can run `plan`; a plan it refuses goes to `skipped` (job_key -> "plan: why")."""
    why = state.unsupported(state.scenario, plan)
    if why:
        skipped[job_key(state.scenario, plan)] = f"{plan.short()}: {why}"
    return not why


def screening_of(state: RunState, candidates: PlanColumns | None) -> Screening:
    """The plans a policy chooses among, judged with the calibration in force: exactly `candidates` when given
    (screen_candidates), else the scenario's space (screen)."""
    if candidates is not None:
        return screen_candidates(state.scenario, state.space, state.calibration, candidates)
    return screen(state.scenario, state.calibration, space=state.space)


Predict = Callable[[Scenario, PlanColumns, Calibration], Predictive]
"""predict(scenario, plans, calibration): the plans' predictive distributions (evaluators.posterior.predictive)."""


@dataclass
class ExpectedImprovementOrder:
    """New plans by expected improvement over the best measured plan (before one: acquisition.plug_in_incumbent)
    times the probability of fitting, a batch
    for several workers by the kriging believer (search/acquisition.py), from the predictive distributions the
    calibration in force gives (evaluators/posterior.py); lost plans first and the due re-measurements after K
    plans as every policy (order_batch)."""

    candidates: PlanColumns | None = None
    """Run only these plans (scored among themselves)."""
    predict: Predict | None = None
    """How the plans' predictive distributions are computed (None: the calibration's own, through
    evaluators.posterior.predictive_basis)."""
    skipped: dict[str, str] = field(default_factory=dict)
    infra: dict[Plan, int] = field(default_factory=dict)
    """Plan as run -> infra failures in this call."""
    _cache: tuple[str, PlanColumns, Predictive] | None = field(default=None, init=False, repr=False)
    _basis: tuple[PlanColumns, PredictiveBasis] | None = field(default=None, init=False, repr=False)
    _space: SearchSpace | None = field(default=None, init=False, repr=False)
    """The space the basis's plans were taken from."""

    def next_batch(self, state: RunState, want: int) -> list[Pick]:
        """Lost plans first, then new plans by acquisition up to K, then the due re-measurements."""
        return order_batch(state, want, self.infra, lambda excluded, n: self._acquired(state, excluded, n))

    def update(self, results: Sequence[Evaluation]) -> None:
        """Count infra failures per plan (retried at most INFRA_RETRIES times in this call)."""
        count_infra(self.infra, results)

    def _acquired(self, state: RunState, excluded: set[str], want: int) -> list[Pick]:
        """Up to `want` new plans by the kriging believer; plans the evaluator refuses go to `skipped`. Roles:
        "candidate" (predicted to fit at the mean), "boundary" (predicted over the limit)."""
        plans, pred = self._predicted(state)
        usable = usable_gib(state.scenario, state.space.config)
        best = best_measured(state.study)
        taken = set(excluded) | set(self.skipped)

        def runnable(i: int) -> bool:
            plan = plans.plan(i)
            key = job_key(state.scenario, plan)
            if key in taken:
                return False
            taken.add(key)
            return admit(state, plan, self.skipped)

        eligible = np.isfinite(pred.log_tokens.mean) & np.isfinite(pred.log_peak.mean)
        # the best measured plan that fits; before one, the plug-in incumbent (acquisition.plug_in_incumbent) among
        # plans not measured (their runs failed: no measured plan fits) nor known not to run
        failed = set(state.excluded) - set(state.claimed) | set(self.skipped)
        incumbent = best.tokens_per_s if best is not None else plug_in_incumbent(
            pred, usable, eligible, lambda i: job_key(state.scenario, plans.plan(i)) in failed)
        picks = believer_batch(pred, incumbent, usable, eligible, want, runnable)
        fits = pred.log_peak.mean <= np.log(usable)
        return [(plans.plan(i), "candidate" if fits[i] else "boundary") for i in picks]

    def _predicted(self, state: RunState) -> tuple[PlanColumns, Predictive]:
        """The plans to choose among (the candidates; else every valid plan of the space; over
        search.exhaustive_limit, those the screening judged) and their predictive distributions under the
        calibration in force: kept while it stays in force (most refits are not adopted), and from the formulas'
        terms kept while its constants stay (evaluators.posterior.PredictiveBasis: a new posterior of the
        multipliers costs no model evaluation)."""
        cal = state.calibration
        cid = calibration_id(cal)
        if self._cache is None or self._cache[0] != cid:
            if self.predict is not None:
                plans = self._plans(state)
                pred = self.predict(state.scenario, plans, cal)
            else:
                constants = cal.model_copy(update={"time_multipliers": None, "memory_multipliers": None})
                if self._basis is None or self._basis[1].constants != constants:
                    kept = self._basis[1] if self._basis is not None and self._same_plans(state) else None
                    plans = kept.plans if kept is not None and kept.plans is not None else self._plans(state)
                    self._basis = (plans, predictive_basis(state.scenario, plans, cal, like=kept))
                    self._space = state.space
                plans, pred = self._basis[0], self._basis[1].at(cal)
            self._cache = (cid, plans, pred)
        return self._cache[1], self._cache[2]

    def _same_plans(self, state: RunState) -> bool:
        """Whether the plans of the basis in hand are still the plans to choose among: the same space, and plans
        that no calibration chose (the candidates, or every valid plan of the space)."""
        return state.space is self._space and (
            self.candidates is not None or state.space.count() <= state.space.config.exhaustive_limit)

    def _plans(self, state: RunState) -> PlanColumns:
        if self.candidates is not None:
            return _unique(self.candidates)  # screen_candidates' plans, without its figures
        if state.space.count() <= state.space.config.exhaustive_limit:
            return state.space.enumerate()
        return screen(state.scenario, state.calibration, space=state.space).plans


RUN_ORDERS: dict[str, Callable[..., RunOrder]] = {"ranked": RankedOrder,
                                                  "expected_improvement": ExpectedImprovementOrder}
"""Run-order policies by name, each built as `RUN_ORDERS[name](candidates=...)` (None: the whole space); the
search uses DEFAULT_RUN_ORDER and bench/search_regret.py replays each."""
DEFAULT_RUN_ORDER = "expected_improvement"


def rank_candidates(screening: Screening, measured: set[str], limit: int, include_infeasible: bool = False,
                    memory_band: float = DEFAULT_MEMORY_BAND) -> list[Pick]:
    """Up to `limit` plans in run order whose job (job_key) is not in `measured`, for finding the fastest plan
    that fits in few runs.

    1. Plans that may fit, by predicted tokens/s (fastest first): those predicted to fit, and those predicted
       over the usable memory by less than `memory_band` (the memory model's relative error on this study's
       measured runs): the best plan often sits at the limit, and only there does the memory model decide which
       plan is best, so a boundary run is spent only where it can pay (it is also the fastest left). Roles:
       "front" (on the predicted Pareto front), "boundary" (predicted over the limit, within the band),
       "candidate" (the rest).
    2. (include_infeasible) the plans predicted not to fit beyond the band, nearest the limit first.
    bench/search_regret.py measured the previous order (the whole predicted front, then the feasible plans with
    least headroom) against this one: see the README's "How many real runs" figures."""
    cols = screening.columns
    tokens, peak = cols.tokens_per_s, cols.peak_gib
    plausible = peak * (1.0 - max(0.0, memory_band)) <= screening.usable_gib
    on_front = np.zeros(len(tokens), dtype=bool)
    on_front[screening.front] = True
    first = np.flatnonzero(plausible)
    first = first[np.argsort(-tokens[first], kind="stable")]
    roles = np.where(on_front, "front", np.where(screening.feasible, "candidate", "boundary"))
    groups: list[tuple[np.ndarray, np.ndarray]] = [(first, roles[first])]
    if include_infeasible:
        rest = np.flatnonzero(~plausible)
        rest = rest[np.argsort(-cols.headroom_gib[rest], kind="stable")]
        groups.append((rest, np.full(len(rest), "candidate")))
    out: list[Pick] = []
    seen = set(measured)
    for indices, labels in groups:
        for i, role in zip(indices, labels, strict=True):
            plan = screening.plan(int(i))
            key = job_key(screening.space.scenario, plan)
            if key in seen:
                continue
            seen.add(key)
            out.append((plan, str(role)))
            if len(out) >= limit:
                return out
    return out


def memory_band(study: optuna.Study, scenario: Scenario, calibration: Calibration) -> float:
    """How far the memory model over-predicts on this study's measured ok peaks, with the calibration in force:
    the median of max(0, predicted / measured - 1), at least 2 %; DEFAULT_MEMORY_BAND before any measured peak.
    One-sided: a plan predicted over the limit can fit only if the model over-predicts; under-predictions (and
    the OOMs they cause) are no reason to try plans over the limit."""
    runs = [ev for t in measured_trials(study).values()
            if (ev := trial_evaluation(t)) is not None and ev.status == "ok" and ev.memory is not None]
    if not runs:
        return DEFAULT_MEMORY_BAND
    predicted = evaluate_many(scenario, PlanColumns.from_plans([e.plan for e in runs]), calibration).peak_gib
    measured = np.array([e.memory.peak_gib for e in runs if e.memory is not None])
    return max(0.02, float(np.median(np.maximum(0.0, predicted / measured - 1.0))))


def _sampler_proposals(screening: Screening, study: optuna.Study, measured: set[str], limit: int,
                       seed: int) -> list[Pick]:
    """Plans an NSGA-II sampler proposes after seeing the measured trials (in a scratch in-memory study)."""
    from stratagem.search.samplers import ProjectingSampler, make_sampler

    space = screening.space
    scratch = optuna.create_study(directions=list(DIRECTIONS),
                                  sampler=ProjectingSampler(make_sampler("nsga2", seed), space))
    for t in measured_trials(study).values():
        if t.state == TrialState.COMPLETE and t.values:
            scratch.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions,
                                                        values=t.values))
    out: list[Pick] = []
    seen = set(measured)
    for _ in range(20 * limit):
        trial = scratch.ask()
        plan = space.suggest(trial)
        scratch.tell(trial, state=TrialState.PRUNED)
        key = job_key(space.scenario, plan)
        if key not in seen:
            seen.add(key)
            out.append((plan, "sampler"))
            if len(out) >= limit:
                break
    return out


def screen_candidates(scenario: Scenario, space: SearchSpace, calibration: Calibration,
                      candidates: PlanColumns) -> Screening:
    """A Screening of exactly `candidates` (duplicates dropped): the analytic figures, feasibility and front
    among them, so the real runs are ranked as usual but never leave this set."""
    from stratagem.search.screening import ScreenCounts, _broke, _evaluate, _feasible, _front

    t0 = time.perf_counter()
    # As given, not SearchSpace.canonical_columns: a table of measured runs (bench/search_regret.py,
    # evaluators/table.py) looks its plans up by their own text; canonical rows would miss it.
    plans = _unique(candidates)
    usable = usable_gib(scenario, space.config)
    columns = _evaluate(scenario, plans, calibration, None)
    feasible = _feasible(columns, usable)
    front = _front(columns, usable)
    counts = ScreenCounts(valid=len(plans), screened=len(plans), pruned=int((~feasible).sum()),
                          feasible=int(feasible.sum()), front=len(front))
    return Screening(space=space, plans=plans, columns=columns, feasible=feasible, front=front, counts=counts,
                     usable_gib=usable, broke=_broke(columns, usable), mode="candidates",
                     seconds=time.perf_counter() - t0)


def check_candidates(space: SearchSpace, candidates: PlanColumns) -> None:
    """Raise StratagemError naming the first candidate plan outside the space (SearchSpace.params refuses it: its
    trial could not be stored), before anything is written."""
    for i in range(len(candidates)):
        try:
            space.params(candidates.plan(i))
        except StratagemError as e:
            raise StratagemError(f"candidates: {e}") from None
