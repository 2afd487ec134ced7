"""Which plan to export from a study: a trial by number, or the best feasible plan by one objective. Reads the
study through its schema (stratagem.search.records): one trial stands for each plan (measured beats traced
beats analytic), so a plan whose real run went out of memory is never exported on the strength of its
prediction; among feasible plans, measured ones are preferred."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem.errors import StratagemError
from stratagem.evaluators.evaluation import Evaluation
from stratagem.launch.harness.result import HarnessResult, parse_result
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

if TYPE_CHECKING:
    import optuna

__all__ = ["BEST", "Chosen", "choose_trial", "feasible"]

BEST: dict[str, str] = {"tokens": "tokens_per_s", "headroom": "headroom_gib", "risk": "goodput_loss"}
"""--best name -> the objective (records.OBJECTIVES) it ranks by."""


@dataclass(frozen=True)
class Chosen:
    """The trial to export and what it holds."""

    scenario: Scenario
    plan: Plan
    evaluation: Evaluation | None
    trial: int
    source: str
    """e.g. `study llama trial 12 (measured; best tokens_per_s among 3 feasible measured trials)`."""
    steps: int | None
    """Timed steps of the measured run, if the trial has one."""
    seed: int | None
    """Seed of the measured run, if recorded."""
    warmup: int | None = None
    """Warm-up steps of the measured run, if recorded."""
    why: str = ""
    """Why this trial: its state and fidelity, or the rule that chose it (one line)."""


def feasible(trial: optuna.trial.FrozenTrial) -> bool:
    """The study schema's feasibility (records.trial_feasible)."""
    from stratagem.search.records import trial_feasible

    return trial_feasible(trial)


def choose_trial(study: optuna.Study, trial: int | None = None, best: str | None = None) -> Chosen:
    """The trial numbered `trial`, or the best feasible one by `best` (default tokens)."""
    from stratagem.search.records import (
        DIRECTIONS,
        OBJECTIVES,
        standings,
        study_scenario,
        trial_evaluation,
        trial_fidelity,
        trial_plan,
    )

    if trial is not None and best is not None:
        raise StratagemError("--trial and --best: give one of them")
    scenario = study_scenario(study)
    trials = study.get_trials(deepcopy=False)
    name = study.study_name
    if trial is not None:
        found = [t for t in trials if t.number == trial]
        if not found:
            have = f"trials 0-{max(t.number for t in trials)}" if trials else "no trials"
            raise StratagemError(f"--trial ({trial}): study {name!r} has {have}")
        chosen = found[0]
        why = f"{chosen.state.name.lower()}, {trial_fidelity(chosen)}"
    else:
        key = best or "tokens"
        if key not in BEST:
            raise StratagemError(f"--best ({key!r}): use one of {', '.join(BEST)}")
        i = OBJECTIVES.index(BEST[key])
        sign = -1.0 if DIRECTIONS[i] == "maximize" else 1.0
        ok = [s.trial for s in standings(trials).values() if s.feasible]
        if not ok:
            raise StratagemError(f"--best ({key}): study {name!r} has no feasible trial among {len(trials)}; "
                                 "export one by number with --trial")
        measured = [t for t in ok if trial_fidelity(t) == "measured"]
        pool = measured or ok
        chosen = min(pool, key=lambda t: (sign * t.values[i], t.number))
        kind = "measured" if measured else "analytic"
        why = f"{kind}; best {BEST[key]} among {len(pool)} feasible {kind} trial(s)"
        if key == "tokens" and not measured:  # the analytic pick is risk-aware, as capacity's and the report's
            chosen, why = _risk_aware(study, scenario, sorted(pool, key=lambda t: t.number), chosen, why)
        if key == "tokens" and measured:  # the one rule for the best measured plan (search.noise)
            from stratagem.search.noise import best_measured

            top = best_measured(study)
            if top is not None:
                chosen, why = top.trial, top.note
    ev = trial_evaluation(chosen)
    plan = trial_plan(chosen)
    return Chosen(scenario=scenario, plan=plan, evaluation=ev, trial=chosen.number,
                  source=f"study {name} trial #{chosen.number} ({why})", steps=_steps(ev),
                  seed=_seed(ev), warmup=_warmup(ev), why=why)


def _risk_aware(study: optuna.Study, scenario: Scenario, pool: list[optuna.trial.FrozenTrial],
                fastest: optuna.trial.FrozenTrial, why: str) -> tuple[optuna.trial.FrozenTrial, str]:
    """`fastest` unless evaluators.risk_pick.RISK_RULE prefers another of `pool` (analytic trials): a plan with a
    zone at bad loses to the fastest with none within the model's noise of it (the study's calibration)."""
    import numpy as np
    from numpy.typing import NDArray

    from stratagem.evaluators.analytic import evaluate_many
    from stratagem.evaluators.calibration import Calibration
    from stratagem.evaluators.evaluation import ZONE_NAMES
    from stratagem.evaluators.posterior import predictive_from_figures
    from stratagem.evaluators.risk_pick import RISK_RULE, risk_aware_best
    from stratagem.search.records import StudyKey, trial_evaluation, trial_plan

    fitted = study.user_attrs.get(StudyKey.CALIBRATION)
    cal = Calibration.model_validate(fitted) if fitted else None
    plans = [trial_plan(t) for t in pool]
    figs = evaluate_many(scenario, plans, cal)
    pred = predictive_from_figures(scenario, figs, cal).log_tokens
    evs = [trial_evaluation(t) for t in pool]
    bad: dict[str, NDArray[np.bool_]] = {
        z: np.array([ev is not None and ev.zones is not None and getattr(ev.zones, z).level == "bad" for ev in evs],
                    dtype=bool) for z in ZONE_NAMES}
    values = np.array([t.values[0] for t in pool], dtype=np.float64)
    pick = risk_aware_best(values, np.ones(len(pool), dtype=bool), bad, pred.shares, pred.cov)
    if pick is None or not pick.bad:
        return fastest, why
    return pool[pick.index], f"{why}; {pick.note(plans[pick.fastest].short())} ({RISK_RULE})"


def _run(ev: Evaluation | None) -> HarnessResult | None:
    """The harness result a measured evaluation recorded; None for analytic ones and measurements that are not
    a harness run (e.g. a table evaluator's)."""
    if ev is None or not ev.measurements:
        return None
    try:
        return parse_result(ev.measurements, "the recorded run")
    except StratagemError:
        return None


def _steps(ev: Evaluation | None) -> int | None:
    """Timed steps of the measured run (the harness records them; older results: all step times)."""
    run = _run(ev)
    if run is None:
        return None
    return run.steps if run.steps is not None else (len(run.step_times_s) or None)


def _warmup(ev: Evaluation | None) -> int | None:
    """Warm-up steps of the measured run, if recorded."""
    run = _run(ev)
    return run.warmup if run is not None else None


def _seed(ev: Evaluation | None) -> int | None:
    """The measured run's seed (its provenance, else the harness result)."""
    seed: Any = (ev.provenance or {}).get("seed") if ev is not None else None
    if isinstance(seed, int):
        return seed
    run = _run(ev)
    return run.seed if run is not None else None
