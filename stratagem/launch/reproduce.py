"""Reproduce a stored measured trial: rerun it through Ray with the same harness, plan and seed (or read a
result file from a run made elsewhere, e.g. the exported torchrun command) and compare with what was recorded.

The comparison is data first (`Reproduction`), then printed by the CLI. Step time and tokens/s are judged
against the stored spread: each run's median step comes with its 95 % interval
(stratagem.evaluators.spread, order statistics of the timed steps), and the rerun reproduces when the two
intervals overlap (`spread.distinct` is false): the rerun's median then lies within the recorded interval
widened by the rerun's own half-interval on that side, and that band, relative to the recorded median, is
the row's threshold. A result without per-step times (nothing to build an interval from) falls back to a 2 %
band. Those intervals say how well each run pins its own median, not how far a whole rerun moves (host load,
placement, node: search/noise.py); the run-to-run noise, pooled over every plan measured more than once in this
study and the host's other studies (search/noise_floor.py, stated with its dof), gives the band a rerun of a plan
measured k times lands in (95 %, `RunNoise.rerun_band`), and the time rows are flagged only beyond both. Without
any plan measured twice the run-to-run noise is unknown and the verdict says so. The recorded tokens/s prints as
the record prints everywhere (`search.noise.RecordFigure.text`: pooled over its runs, the interval widened to the
run-to-run noise); `--trial` names any run of the plan, the comparison is with its record (re-measurements pool
into it). A Ray rerun that did not start (Ray start-up, lost actors: infra) is no verdict: `RerunNotStarted`
(the CLI exits 4); one that ended oom, failed or timeout did not reproduce. A Ray rerun that reproduced the
environment joins the host's noise file as one more run of the plan. Peak memory: 1% or the allocation granularity, whichever is larger (2 MiB CUDA blocks; 64 KiB of small
buffers on CPU);
losses must agree to 1e-5 relative (same seed, same data, same arithmetic).
The environment is compared first: a different device kind/name or world size, or a different torch
major.minor makes the comparison meaningless and is reported as such (the CLI exits 3).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.errors import StratagemError
from stratagem.evaluators.spread import StepSpread
from stratagem.launch.harness.result import HarnessResult, parse_result, read_result
from stratagem.quantities import memory_in, memory_unit, percent, sig

if TYPE_CHECKING:
    import optuna

    from stratagem.search.noise import RecordFigure
    from stratagem.search.records import Standing
    from stratagem.spaces.model import ModelSpec
    from stratagem.spaces.plan import Plan

__all__ = ["Comparison", "Reproduction", "RerunNotStarted", "environment_differences", "compare_results",
           "reproduce_trial"]


class RerunNotStarted(Exception):
    """The rerun could not be made (Ray did not start, the cluster lost its ranks): an infrastructure error, no
    verdict on the trial."""


@dataclass(frozen=True)
class Comparison:
    """One metric, recorded vs now."""

    metric: str
    recorded: float
    now: float
    threshold: float
    """Relative difference allowed (the original run's noise)."""
    floor: float = 0.0
    """Absolute difference always allowed (the measurement's granularity), in the metric's unit."""
    recorded_band: tuple[float, float] | None = None
    """The recorded run's 95 % interval in the metric's unit (step time, tokens/s), None for other metrics."""
    now_band: tuple[float, float] | None = None
    """The rerun's 95 % interval in the metric's unit."""
    steps: tuple[int, int] | None = None
    """Timed steps behind the two intervals (recorded, now)."""
    run_band: float | None = None
    """Relative move a whole rerun makes within run-to-run noise (95 %, search/noise.py), None: unknown or not a
    time row."""
    unit: str = ""
    """How the figures print: "GiB" (memory, unit by magnitude), "s", "" (a plain figure)."""
    recorded_text: str = ""
    """The recorded figure as the record prints everywhere (search.noise.RecordFigure.text); '' : `band`."""

    @property
    def rel_diff(self) -> float:
        """(now - recorded) / recorded; inf when nothing was recorded."""
        return (self.now - self.recorded) / self.recorded if self.recorded else float("inf")

    @property
    def flagged(self) -> bool:
        """With both intervals: they do not overlap, and the move is beyond the run-to-run band where that is
        known. Else the difference exceeds both the relative threshold and the absolute floor."""
        if self.recorded_band is not None and self.now_band is not None:
            (a_lo, a_hi), (b_lo, b_hi) = self.recorded_band, self.now_band
            apart = a_hi < b_lo or b_hi < a_lo
            if self.run_band is None or not self.recorded or not self.now:
                return apart
            return apart and abs(math.log(self.now / self.recorded)) > math.log1p(self.run_band)
        return abs(self.now - self.recorded) > max(self.threshold * abs(self.recorded), self.floor)

    @property
    def noise(self) -> float:
        """The relative move allowed: the larger of the within-run band and the run-to-run band."""
        return max(self.threshold, self.run_band or 0.0)

    @property
    def noise_text(self) -> str:
        """The allowed move as printed: `±6.70%`, or `×/÷28.0` once the band passes 100 % (a run-to-run band is
        symmetric in ln terms: a factor either way)."""
        if self.noise <= 1.0:
            return f"±{percent(self.noise)}"
        return f"×/÷{sig(1.0 + self.noise)}"

    def _text(self, *values: float) -> list[str]:
        if self.unit == "GiB":
            unit = memory_unit(*values)
            return [memory_in(v, unit, with_unit=i == len(values) - 1) for i, v in enumerate(values)]
        suffix = f" {self.unit}" if self.unit else ""
        return [sig(v) + (suffix if i == len(values) - 1 else "") for i, v in enumerate(values)]

    def band(self, which: str = "recorded") -> str:
        """`0.281 s (0.262-0.301, n=12)`: a median with its interval and steps (3 significant figures, memory in
        its unit: stratagem.quantities), for the table."""
        if which == "recorded" and self.recorded_text:
            return self.recorded_text
        band = self.recorded_band if which == "recorded" else self.now_band
        value = self.recorded if which == "recorded" else self.now
        if band is None:
            return self._text(value)[0]
        n = "" if self.steps is None else f", n={self.steps[0 if which == 'recorded' else 1]}"
        lo, hi, mid = self._text(band[0], band[1], value)
        return f"{mid} ({lo}-{hi}{n})"


@dataclass(frozen=True)
class Reproduction:
    """The outcome of reproducing one trial."""

    trial: int
    plan: str
    environment: list[str]
    """Differences that make the comparison meaningless (empty when comparable)."""
    rows: list[Comparison] = field(default_factory=list)
    losses_match: bool | None = None
    """Same loss trajectory (to 1e-5 relative), None when not comparable."""
    log_dir: str = ""
    noise_note: str = ""
    """The study's run-to-run noise behind the time rows' band (search/noise.py RunNoise.describe)."""
    rerun: str = ""
    """How the rerun ended when it produced no figures ("oom: ..."), '' when it did."""
    record: int = -1
    """The record compared with (the plan's first measured trial: records.Standing.number)."""
    host_load: tuple[float | None, float | None] = (None, None)
    """The host's 1-minute load average during the timed steps, recorded and now (a CPU host's steps stretch
    with load: harness.budget's measurements), None where the result has none."""

    @property
    def load_note(self) -> str:
        """`host load: recorded 7.8, now 26.1` when either run recorded it, else ''."""
        if self.host_load == (None, None):
            return ""
        rec, now = ("?" if x is None else f"{x:.1f}" for x in self.host_load)
        return f"host load (1-min average during the timed steps): recorded {rec}, now {now}"

    @property
    def reproduced(self) -> bool:
        """Same environment, no flagged figure, and the losses did not differ."""
        return (not self.environment and not self.rerun and not any(r.flagged for r in self.rows)
                and self.losses_match is not False)


def _memory_granularity(result: HarnessResult, model: ModelSpec | None = None) -> float:
    """GiB: CUDA's caching allocator reserves 2 MiB blocks. On CPU the tracked live bytes move by what gloo's
    worker thread still holds when the step peaks: one collective's tensor (at most the largest parameter, in
    fp32: FSDP2's reduce-scatter / DDP's bucket of it) released a moment earlier or later, plus 64 KiB of small
    buffers. Measured: the same dp4 ZeRO-2 plan under torchrun four times moved one rank's peak by 16 KiB + 64 B
    and by 64 KiB + 256 B (a 64x64 and the 256x64 embedding fp32 tensor)."""
    cuda = "cuda" in str(result.device or "").lower() or result.worst_rank.peak_reserved_bytes is not None
    if cuda:
        return 2.0 / 1024
    largest = 0 if model is None else model.hidden_size * max(
        model.vocab_size, model.ffn_hidden_size, model.q_size, model.moe.expert_ffn_hidden_size if model.moe else 0)
    return (64 * 1024 + 4 * largest) / 2**30


def _major_minor(version: str | None) -> str:
    return ".".join((version or "?").split("+")[0].split(".")[:2])


def environment_differences(recorded: HarnessResult, now: HarnessResult) -> list[str]:
    """What differs between two harness results' environments in a way that voids the comparison."""
    out = []
    if recorded.device != now.device:
        out.append(f"device: recorded {recorded.device!r}, now {now.device!r}")
    if recorded.world_size != now.world_size:
        out.append(f"world size: recorded {recorded.world_size}, now {now.world_size}")
    rv, nv = recorded.versions.get("torch"), now.versions.get("torch")
    if _major_minor(rv) != _major_minor(nv):
        out.append(f"torch: recorded {rv}, now {nv}")
    return out


def compare_results(recorded: HarnessResult, now: HarnessResult, model: ModelSpec | None = None,
                    run_band: float | None = None) -> tuple[list[Comparison], bool]:
    """Rows for tokens/s, step time and peak memory, and whether the losses match (`model`: the run's model,
    whose largest tensor bounds the CPU memory noise; `run_band`: the run-to-run band of the time rows)."""
    rows = [*_time_rows(recorded, now, run_band),
            Comparison("peak memory", recorded.peak_gib, now.peak_gib, 0.01, _memory_granularity(recorded, model),
                       unit="GiB")]
    a, b = recorded.losses, now.losses
    match = len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b, strict=True))
    return rows, match


_NO_SPREAD_BAND = 0.02
"""Relative band for a result whose steps cannot give an interval (no per-step times, a single step)."""


def _spread(result: HarnessResult) -> StepSpread | None:
    """The result's stored spread, else one built from its timed steps; None from a single number."""
    spread = result.spread
    return spread if spread.n > 1 else None


def _allowed(rec: StepSpread, now: StepSpread) -> float:
    """The relative move that keeps the intervals overlapping, in the direction the median moved: the recorded
    half-interval on that side plus the rerun's on the other (spread.distinct's rule, as a band)."""
    if now.median_s >= rec.median_s:
        return ((rec.high_s - rec.median_s) + (now.median_s - now.low_s)) / rec.median_s
    return ((rec.median_s - rec.low_s) + (now.high_s - now.median_s)) / rec.median_s


def _time_rows(recorded: HarnessResult, now: HarnessResult, run_band: float | None) -> list[Comparison]:
    """tokens/s and step time, judged on the two runs' 95 % intervals of the median step (the rows' `flagged`
    is spread.distinct's rule: the intervals do not overlap)."""
    rec, cur = _spread(recorded), _spread(now)
    if rec is None or cur is None:
        return [Comparison("tokens/s", recorded.tokens_per_s, now.tokens_per_s, _NO_SPREAD_BAND),
                Comparison("step time", recorded.step_s, now.step_s, _NO_SPREAD_BAND, unit="s")]
    steps = (rec.n, cur.n)
    tokens_rec, tokens_now = recorded.tokens_per_s * recorded.step_s, now.tokens_per_s * now.step_s
    allowed = _allowed(rec, cur)
    # tokens/s = tokens_per_step / step: its interval is the step interval inverted (ends swapped)
    return [Comparison("tokens/s", recorded.tokens_per_s, now.tokens_per_s, allowed,
                       recorded_band=(tokens_rec / rec.high_s, tokens_rec / rec.low_s),
                       now_band=(tokens_now / cur.high_s, tokens_now / cur.low_s), steps=steps, run_band=run_band),
            Comparison("step time", recorded.step_s, now.step_s, allowed, recorded_band=(rec.low_s, rec.high_s),
                       now_band=(cur.low_s, cur.high_s), steps=steps, run_band=run_band, unit="s")]


def _record(study: optuna.Study, number: int) -> Standing:
    """The plan of trial `number` (any of its runs) as it stands: its record."""
    from stratagem.search.records import standings

    for st in standings(study.get_trials(deepcopy=False)).values():
        if any(t.number == number for t in st.trials):
            if st.fidelity != "measured":
                break
            return st
    if not any(t.number == number for t in study.get_trials(deepcopy=False)):
        raise StratagemError(f"--trial ({number}): no such trial in study {study.study_name!r}")
    raise StratagemError(f"--trial {number}: an analytic trial has no run to reproduce; pick a measured trial "
                         "(stratagem search ... --real-runs K records them)")


def _recorded_result(trial: optuna.trial.FrozenTrial, number: int) -> HarnessResult:
    from stratagem.search.records import TrialKey

    result = (trial.user_attrs.get(TrialKey.EVALUATION) or {}).get("measurements")
    if not result:
        raise StratagemError(f"--trial {number}: the plan's run ended {trial.user_attrs.get(TrialKey.STATUS)} and "
                             "recorded no result to compare with; pick a trial that measured its plan")
    return parse_result(result, f"--trial {number}: the recorded run")


def _rerun(study: optuna.Study, plan: Plan, recorded: HarnessResult, number: int, run_dir: str | Path | None,
           address: str | None) -> tuple[HarnessResult | None, str, str]:
    """(the rerun's result or None, how it ended when not ok, its log dir) through Ray; RerunNotStarted when Ray
    did not start or lost the run."""
    from stratagem.launch.runners.ray_runner import RayRunner
    from stratagem.search.records import study_scenario

    scenario = study_scenario(study)
    try:
        runner = RayRunner(run_dir or Path("runs") / study.study_name / "reproduce", address=address,
                           num_cpus=max(plan.world_size, 1) if address is None else None)
    except Exception as e:  # whatever ray.init raised: the cluster's failure, not the trial's
        raise RerunNotStarted(f"Ray did not start ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                              "nothing was rerun or compared; retry (a loaded host can miss Ray's start-up window)"
                              ) from None
    try:
        cap = scenario.cluster.gpu.hbm_gib if scenario.cluster.gpu.kind == "cpu" else None
        run = runner.run(scenario, plan, steps=recorded.steps if recorded.steps is not None else 6,
                         warmup=recorded.warmup if recorded.warmup is not None else 2, seed=recorded.seed or 0,
                         memory_cap_gib=cap, name=f"reproduce-trial{number}")
    finally:
        runner.shutdown()
    first = run.reason.splitlines()[0] if run.reason else ""
    if run.status == "infra":
        raise RerunNotStarted(f"the rerun was lost to the cluster ({first}; logs in {run.log_dir}); nothing was "
                              "compared; retry")
    if run.status != "ok" or run.result is None:
        return None, f"{run.status}: {first}", run.log_dir
    return parse_result(run.result, f"reproduce: the rerun's result ({run.log_dir})"), "", run.log_dir


def reproduce_trial(study: optuna.Study, number: int, result_file: str | Path | None = None,
                    run_dir: str | Path | None = None, address: str | None = None) -> Reproduction:
    """Rerun trial `number`'s plan through Ray (or read `result_file`) and compare with its record."""
    from stratagem.search.noise import pooled_runs, record_figures, record_noise, run_noise, study_groups
    from stratagem.search.records import study_scenario, trial_evaluation, trial_plan
    from stratagem.spaces.plan import format_plan

    st = _record(study, number)
    trial = st.trial
    recorded = _recorded_result(trial, number)
    plan = trial_plan(trial)
    if result_file is not None:
        now: HarnessResult | None = read_result(result_file)
        ended, log_dir = "", str(Path(result_file).parent)
    else:
        now, ended, log_dir = _rerun(study, plan, recorded, number, run_dir, address)
    if now is None:
        return Reproduction(number, format_plan(plan), [], log_dir=log_dir, rerun=ended, record=st.number)
    env = environment_differences(recorded, now)
    if env:
        return Reproduction(number, format_plan(plan), env, log_dir=log_dir, record=st.number)
    noise = run_noise(study)
    ev = trial_evaluation(trial)
    runs = int(pooled_runs(ev).get("runs") or 1) if ev is not None else 1
    rows, match = compare_results(recorded, now, study_scenario(study).model, noise.rerun_band(runs))
    figure = next((f for f in record_figures(study, noise) if f.standing.key == st.key), None)
    if figure is not None and figure.interval is not None:
        rows = [_as_record(r, figure) for r in rows]
    note = noise.describe() + (f"; the record pools {runs} runs" if runs > 1 else "")
    if noise.sd is None:
        note += ": judged on the two runs' own intervals, which understate how far a rerun moves"
    if result_file is None and now.step_s > 0:  # a rerun on this host: one more run of the plan (noise_floor.py)
        group = next((g for g in study_groups(study) if g.plan == st.key), None)
        if group is not None:
            record_noise(study, group.model_copy(update={"runs": {**group.runs,
                                                                   f"reproduce {time.time():.0f}": math.log(now.step_s)}}))
    return Reproduction(number, format_plan(plan), [], rows, match, log_dir, note, record=st.number,
                        host_load=(_load(recorded), _load(now)))


def _as_record(row: Comparison, figure: RecordFigure) -> Comparison:
    """The tokens/s and step-time rows against the record's interval (as every view prints it), not the one
    run's own."""
    if figure.interval is None or row.metric not in ("tokens/s", "step time") or row.recorded_band is None:
        return row
    lo, hi = figure.interval
    if row.metric == "tokens/s":
        return replace(row, recorded_band=(lo, hi), recorded_text=figure.text())
    per_step = row.recorded * figure.tokens  # step time x tokens/s = tokens per step
    return replace(row, recorded_band=(per_step / hi, per_step / lo))


def _load(result: HarnessResult) -> float | None:
    """The larger of the two load averages a result recorded around its timed steps."""
    return max(result.host_load) if result.host_load else None
