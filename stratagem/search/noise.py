"""Noise-aware ranking of measured plans (a short run's step time varies 10-30 % on a loaded host): which
measured plan is best, whether that is
within noise, which plans to run again, and how the runs of one plan combine.

Combining runs of one plan: the timed steps of every ok run of the plan are pooled into one sample and its
spread taken afresh (`spread_of_samples`: median and the order-statistic 95 % interval of the median). Pooling
rather than keeping each run as one sample: two or three runs' medians cannot give a 95 % interval (n < 6), and
pooled steps can; a systematic difference between runs (a slower node, a load spike over one run) widens the
pooled distribution and so the interval, so between-run noise is not hidden. The pooled figures are stored
with the re-measurement's trial (role "remeasured"), which then stands for the plan: tokens/s = tokens per step
/ pooled median step, peak memory = the highest of the runs. A run without per-step times (a table, an older
harness) cannot be pooled: the runs' medians are then combined as their median, and the interval as the hull of
the runs' intervals (when every run has one; else the spread stays unknown).

Run-to-run noise (`run_noise`): the interval of one run's median says how well its steps pin that run's
median, not what a second run of the same job gives: a different host load, process placement or node moves
the whole run (measured here: the demo's best plan rerun at the same load moved -10 % against a within-run
+-6.7 %). It is estimated from repeated runs: for every plan measured more than once, the log of each run's
median step about the plan's mean, pooled (the within-plan mean square of a one-way layout; Montgomery,
*Design and Analysis of Experiments*, 9th ed., sec. 3.3.1), so s^2 = sum_plans sum_runs (x - mean_plan)^2 /
sum_plans (runs - 1), x = ln(run median step), with dof = sum (runs - 1) degrees of freedom, over the plans of
this study and of every other study driven from this host on the same device (search/noise_floor.py: one study's
two re-measurements give 2 dof, with which no rerun could be told apart). A plan's figure pooled over k runs is then uncertain by
t(dof) * s / sqrt(k) in log terms (Student's t at 97.5 %: the prediction interval of a mean of k runs when s
comes from dof degrees of freedom). Each plan's tokens/s interval is its within-run interval widened to at
least that (`plan_interval`). Without any plan measured twice the run-to-run noise is unknown and said so.

Ranking: measured feasible plans by tokens/s. The best plan is "within noise" of every other whose tokens/s
interval overlaps the best's. A run without a spread (a table, a harness before spreads) is of unknown spread:
it neither triggers a re-measurement nor is called distinct.
Re-measurement (`remeasure_due`): first the best once more when it was measured once (one run cannot show how
far a rerun moves), then the best and the plans within its noise, each at most MAX_RUNS runs, fewest runs
first; the loop spends its re-measurement runs on them after the K new plans (search/run_order.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna

from stratagem.evaluators.evaluation import Evaluation, Throughput
from stratagem.evaluators.spread import SPREAD_KEY, StepSpread, spread_of, spread_of_samples
from stratagem.search.noise_floor import NoiseGroup, pooled, read_groups, record_groups
from stratagem.search.records import (
    Standing,
    StudyKey,
    standings,
    study_scenario,
    trial_evaluation,
    trial_fidelity,
    trial_plan,
    trial_status,
)
from stratagem.spaces.plan import Plan

__all__ = ["MAX_RUNS", "POOLED_KEY", "pooled_runs", "timed_steps", "pooled_evaluation", "BestMeasured", "best_measured",
           "remeasure_due", "tokens_interval", "RunNoise", "run_noise", "plan_interval", "t_975", "study_groups",
           "record_noise", "RecordFigure", "record_figures"]

POOLED_KEY = "pooled"
"""Provenance key of a pooled trial's runs (`pooled_runs`)."""
MAX_RUNS = 3
"""Runs of one plan at most (the first and two re-measurements): past that, more runs of the same plan narrow
the interval only as 1/sqrt(n) and the budget is better spent elsewhere."""


def timed_steps(ev: Evaluation) -> list[float] | None:
    """The run's timed step times (warm-up dropped), or None when the run kept none."""
    m = ev.measurements or {}
    steps = m.get("step_times_s")
    if not steps:
        return None
    warmup = int(m.get("warmup") or 0)
    timed = [float(t) for t in steps[warmup:] if float(t) > 0]
    return timed or None


def _own_step(ev: Evaluation) -> float:
    """The run's own median step (a pooled trial keeps its own as the last of its pooled "run_step_s")."""
    own = pooled_runs(ev).get("run_step_s")
    return float(own[-1]) if own else float((ev.measurements or {}).get("step_s", 0.0))


def pooled_runs(ev: Evaluation) -> dict[str, Any]:
    """{"runs": n, "run_step_s": [each run's median]} of a pooled trial (its provenance["pooled"]), {} for one run.
    Kept in the provenance: `measurements` is the harness result's stored part, read back by `reproduce`."""
    return dict((ev.provenance or {}).get(POOLED_KEY) or {})


def _combined_spread(runs: Sequence[Evaluation]) -> StepSpread | None:
    samples = [timed_steps(e) for e in runs]
    if all(s is not None for s in samples):
        return spread_of_samples([t for s in samples if s for t in s])
    spreads = [spread_of(e.measurements) for e in runs]
    if any(s is None for s in spreads):
        return None
    known = [s for s in spreads if s is not None]
    return StepSpread(median_s=statistics.median(s.median_s for s in known), low_s=min(s.low_s for s in known),
                      high_s=max(s.high_s for s in known), q1_s=min(s.q1_s for s in known),
                      q3_s=max(s.q3_s for s in known), n=sum(s.n for s in known),
                      confident=all(s.confident for s in known))


def pooled_evaluation(runs: Sequence[Evaluation]) -> Evaluation:
    """The latest of `runs` (ok runs of one plan, oldest first) with the figures of all of them pooled (see the
    module docstring); `pooled_runs(...)` = how many and each run's median (provenance["pooled"])."""
    last = runs[-1]
    if len(runs) < 2 or last.throughput is None or last.memory is None:
        return last
    spread = _combined_spread(runs)
    medians = [_own_step(e) for e in runs]
    own = medians[-1]
    step = spread.median_s if spread is not None else statistics.median(m for m in medians if m > 0)
    tp = last.throughput
    per_step = (last.measurements or {}).get("tokens_per_step")
    if per_step and step > 0 and tp.tokens_per_s > 0:  # as the harness and reproduce: tokens per step / median step
        scale = float(per_step) / step / tp.tokens_per_s
    else:
        scale = own / step if own > 0 and step > 0 else 1.0  # same plan, same tokens per step
    throughput = Throughput(tokens_per_s=tp.tokens_per_s * scale, tokens_per_s_per_gpu=tp.tokens_per_s_per_gpu * scale,
                            mfu=tp.mfu * scale)
    peak_run = max((e for e in runs if e.memory is not None), key=lambda e: e.memory.peak_gib if e.memory else 0.0)
    measurements = {**(last.measurements or {}), "step_s": step}
    if "tokens_per_s" in measurements:  # the harness result's own figure, read back by `reproduce`: pooled too
        measurements["tokens_per_s"] = throughput.tokens_per_s
    provenance = {**(last.provenance or {}), POOLED_KEY: {"runs": len(runs), "run_step_s": medians}}
    if spread is not None:
        measurements[SPREAD_KEY] = spread.model_dump(mode="json")
    return last.model_copy(update={"throughput": throughput, "memory": peak_run.memory,
                                   "measurements": measurements, "provenance": provenance})


def tokens_interval(tokens_per_s: float, spread: StepSpread) -> tuple[float, float]:
    """The tokens/s interval matching a step-time interval (tokens per step fixed: tokens/s ~ 1 / step)."""
    return tokens_per_s * spread.median_s / spread.high_s, tokens_per_s * spread.median_s / spread.low_s


# Student's t, 97.5 % quantile (two-sided 95 %) for 1..30 degrees of freedom (NIST/SEMATECH e-Handbook of
# Statistical Methods, sec. 1.3.6.7.2, "Critical values of the Student's t distribution"); 1.96 beyond.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042)


def t_975(dof: int) -> float:
    """Student's t 97.5 % quantile at `dof` (>= 1) degrees of freedom."""
    if dof < 1:
        raise ValueError(f"t quantile needs dof >= 1, got {dof}")
    return _T_975[dof - 1] if dof <= len(_T_975) else 1.96


@dataclass(frozen=True)
class RunNoise:
    """Run-to-run noise of one run's median step on the study's hardware (module docstring)."""

    sd: float | None
    """Standard deviation of ln(one run's median step) between runs of one plan; None: no plan measured twice."""
    dof: int
    """Degrees of freedom behind `sd` (sum over re-measured plans of runs - 1)."""
    plans: int
    """Plans measured more than once."""
    studies: int = 0
    """Studies those plans belong to (this one and others driven from this host on the same device)."""

    def half_width(self, runs: int = 1) -> float | None:
        """95 % half-width, in ln terms, of a plan's figure pooled over `runs` runs; None when unknown."""
        if self.sd is None or self.dof < 1:
            return None
        return t_975(self.dof) * self.sd / math.sqrt(max(1, runs))

    def rerun_band(self, runs: int) -> float | None:
        """Relative band (a fraction) within which one new run of a plan measured `runs` times is expected to
        land, 95 %: exp(t * s * sqrt(1 + 1/runs)) - 1 (the prediction interval of one more run); None: unknown."""
        if self.sd is None or self.dof < 1:
            return None
        return math.expm1(t_975(self.dof) * self.sd * math.sqrt(1.0 + 1.0 / max(1, runs)))

    def describe(self) -> str:
        """`run-to-run noise 4.2 % (2 plans measured again, 2 dof)` or why it is unknown."""
        if self.sd is None:
            return "run-to-run noise unknown (no plan measured twice on this host)"
        studies = f"{self.studies} stud{'y' if self.studies == 1 else 'ies'}"
        return (f"run-to-run noise {100 * math.expm1(self.sd):.2g} % (pooled over {self.plans} plan(s) measured "
                f"again in {studies} on this host, {self.dof} dof)")


def _study_id(study: optuna.Study) -> str:
    """The study in the host's noise file: its name and when its real runs began (unique on a host)."""
    return f"{study.study_name}@{study.user_attrs.get(StudyKey.REAL_RUNS_STARTED)}"


def study_groups(study: optuna.Study) -> list[NoiseGroup]:
    """One group per measured plan of the study: the ln of each ok run's median step, by trial."""
    device = study_scenario(study).cluster.gpu.name
    sid, out = _study_id(study), []
    for s in standings(study.get_trials(deepcopy=False)).values():
        if s.fidelity != "measured":
            continue
        runs = {f"trial {t.number}": math.log(m) for t, m in _run_medians(s) if m > 0}
        if runs:
            out.append(NoiseGroup(study=sid, plan=s.key, device=device, runs=runs))
    return out


def record_noise(study: optuna.Study, extra: NoiseGroup | None = None) -> None:
    """Keep the study's plans measured more than once (and `extra`: a rerun's group) in the host's noise file."""
    record_groups([*study_groups(study), *([extra] if extra is not None else [])])


def run_noise(study: optuna.Study) -> RunNoise:
    """Run-to-run noise pooled over this study's plans measured more than once and those of the other studies
    in the host's noise file on the same device (module docstring; search/noise_floor.py)."""
    if StudyKey.SCENARIO not in study.user_attrs:  # no search wrote into it yet (a watch may start first): no device
        return RunNoise(sd=None, dof=0, plans=0, studies=0)
    own = {(g.study, g.plan): g for g in study_groups(study)}
    groups = []
    for g in read_groups(study_scenario(study).cluster.gpu.name):
        mine = own.pop((g.study, g.plan), None)  # the study's own trials are read from it: current
        groups.append(g if mine is None else mine.model_copy(update={"runs": {**g.runs, **mine.runs}}))
    sd, dof, plans, studies = pooled([*groups, *own.values()])
    return RunNoise(sd=sd, dof=dof, plans=plans, studies=studies)


def _run_medians(s: Standing) -> list[tuple[optuna.trial.FrozenTrial, float]]:
    """Each ok measured run of the plan with its own median step (seconds), oldest first."""
    out = []
    for t in s.trials:
        if trial_fidelity(t) != "measured" or trial_status(t) != "ok":
            continue
        ev = trial_evaluation(t)
        if ev is not None and ev.measurements:
            out.append((t, _own_step(ev)))
    return out


def plan_interval(tokens_per_s: float, spread: StepSpread | None, runs: int,
                  noise: RunNoise) -> tuple[float, float] | None:
    """A measured plan's tokens/s 95 % interval: its within-run interval (pooled steps) widened to at least the
    run-to-run half-width of a figure pooled over `runs` runs; None when its spread is unknown."""
    if spread is None:
        return None
    lo, hi = tokens_interval(tokens_per_s, spread)
    w = noise.half_width(runs)
    if w is None:
        return lo, hi
    return min(lo, tokens_per_s * math.exp(-w)), max(hi, tokens_per_s * math.exp(w))


@dataclass(frozen=True)
class RecordFigure:
    """A measured plan's record as every view prints it (`text`): tokens/s pooled over its runs with its 95 %
    interval (`plan_interval`: within-run, widened to the run-to-run noise), its runs and timed steps."""

    standing: Standing
    tokens: float
    """Tokens/s of the record (pooled over its ok runs)."""
    spread: StepSpread | None
    """The pooled step-time spread (None: unknown)."""
    runs: int
    """Measured ok runs of the plan."""
    interval: tuple[float, float] | None
    """Tokens/s 95 % interval (None: spread unknown)."""

    @property
    def number(self) -> int:
        """The record's trial number (records.Standing.number: the plan's first measured trial)."""
        return self.standing.number

    def parts(self) -> tuple[str, str]:
        """(`1,310`, `95% 1,090-1,740`): the figure and its interval as every view prints them ("range" for fewer
        than 6 steps: no 95 % interval of the median, evaluators/spread.py; '' without a spread)."""
        if self.spread is None or self.interval is None:
            return f"{self.tokens:,.0f}", ""
        lo, hi = self.interval
        return f"{self.tokens:,.0f}", f"{'95%' if self.spread.confident else 'range'} {lo:,.0f}-{hi:,.0f}"

    def text(self, note: str = "") -> str:
        """`1,310 tok/s (95% 1,090-1,740, 2 runs, n=24)`, `note` added inside the brackets after a ';';
        `(spread unknown)` without a spread."""
        figure, interval = self.parts()
        if not interval or self.spread is None:
            return f"{figure} tok/s (spread unknown)"
        return (f"{figure} tok/s ({interval}, {self.runs} run{'s' if self.runs != 1 else ''}, n={self.spread.n}"
                f"{'; ' + note if note else ''})")


@dataclass(frozen=True)
class BestMeasured:
    """The best measured plan of a study, with what is known of its noise."""

    plan: Plan
    key: str
    trial: optuna.trial.FrozenTrial
    """The trial that stands for it (pooled figures when it was re-measured)."""
    tokens_per_s: float
    spread: StepSpread | None
    """Its pooled step-time spread (None: unknown)."""
    runs: int
    """Measured ok runs of the plan."""
    within_noise: tuple[str, ...]
    """Labels (Plan.short()) of measured plans whose tokens/s interval overlaps the best's."""
    note: str
    """One line: the plan, its figure with its interval, and whether the ranking is settled."""
    noise: RunNoise = RunNoise(sd=None, dof=0, plans=0)
    """The run-to-run noise behind the interval."""
    number: int = -1
    """The record's trial number (its first measured trial: re-measurements keep it)."""


def record_figures(study: optuna.Study, noise: RunNoise | None = None) -> list[RecordFigure]:
    """Every measured feasible plan's record, highest tokens/s first (`noise`: default `run_noise(study)`)."""
    noise = run_noise(study) if noise is None else noise
    out = []
    for s in standings(study.get_trials(deepcopy=False)).values():
        if s.fidelity != "measured" or not s.feasible or not s.trial.values:
            continue
        ev = trial_evaluation(s.trial)
        runs = sum(trial_fidelity(t) == "measured" and trial_status(t) == "ok" for t in s.trials)
        tokens = float(s.trial.values[0])
        spread = spread_of(ev.measurements) if ev else None
        out.append(RecordFigure(s, tokens, spread, runs, plan_interval(tokens, spread, runs, noise)))
    return sorted(out, key=lambda r: (-r.tokens, r.standing.trial.number))


def _overlapping(best: RecordFigure, others: Sequence[RecordFigure]) -> list[RecordFigure]:
    if best.interval is None:
        return []
    lo = best.interval[0]
    return [r for r in others if r.interval is not None and r.interval[1] >= lo]


def best_measured(study: optuna.Study) -> BestMeasured | None:
    """The measured feasible plan with the highest tokens/s (pooled over its runs), and the plans within its
    noise (within-run and run-to-run); None when no measured plan fits. The one rule front, report, status and
    `export --best` use."""
    noise = run_noise(study)
    ranked = record_figures(study, noise)
    if not ranked:
        return None
    best, rest = ranked[0], ranked[1:]
    close = _overlapping(best, rest)
    plan = best.standing.trial
    label = trial_plan(plan).short()
    if best.interval is None:
        figure, verdict = best.text(), "ranking not judged for noise"
    else:
        figure = best.text(noise.describe())
        verdict = ("distinct from every other measured plan" if not close else
                   f"within noise of {len(close)} plan(s): " + ", ".join(
                       trial_plan(r.standing.trial).short() for r in close[:3]) + (" ..." if len(close) > 3 else ""))
    return BestMeasured(plan=trial_plan(plan), key=best.standing.key, trial=plan, tokens_per_s=best.tokens,
                        spread=best.spread, runs=best.runs,
                        within_noise=tuple(trial_plan(r.standing.trial).short() for r in close),
                        note=f"best measured: {label}: {figure}; {verdict}", noise=noise, number=best.number)


def remeasure_due(study: optuna.Study, limit: int) -> list[tuple[Plan, str]]:
    """Up to `limit` (plan, "remeasured") to run again: the best measured plan when it ran once (one run cannot
    show how far a rerun moves), and the plans within its noise, each measured fewer than MAX_RUNS times, the
    fewest runs first (the best first among equals). Only plans with a known spread."""
    ranked = record_figures(study)
    if not ranked or limit <= 0 or ranked[0].interval is None:
        return []
    best = ranked[0]
    close = _overlapping(best, ranked[1:])
    if not close and best.runs >= 2:
        return []
    due = [r for r in [best, *close] if r.runs < MAX_RUNS]
    due.sort(key=lambda r: r.runs)  # stable: the best first among equals
    return [(trial_plan(r.standing.trial), "remeasured") for r in due[:limit]]
