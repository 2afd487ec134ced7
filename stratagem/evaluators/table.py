"""A table evaluator: every plan's measured outcome is known in advance (a tabular benchmark, as NAS-Bench and
HPOBench compare search methods), so a search's cost to find the best plan is exact and cheap to replay.

An outcome is a distribution: each plan holds the samples of its separate real runs (`TableSample`: status,
tokens/s per GPU at the run's median timed step, the steps' 95 % interval, peak, reason, the host's load and the
run's wall time). `TableEvaluator.evaluate_batch` returns one measured `Evaluation` per run, as a real run would
(status ok / oom / failed, tokens/s, peak memory, the step time the calibration refit reads, the step spread the
noise-aware ranking reads): given a seeded numpy Generator each run draws one of the plan's samples (uniformly,
with replacement: a re-measure is another independent run); without one it returns the median sample, as a
table of single measurements did. Every lookup counts as one run in `runs`. A plan missing from the table is an
error: a search benchmarked on a table must be restricted to the table's plans (the multi-fidelity loop's
`candidates` argument), never silently given a made-up figure.

Success on a table is "within the measured noise of the best" (`OutcomeTable.within_noise`). A plan's value is
its median sample's tokens/s (0 unless that sample is ok). Epsilon is the table's stated `epsilon` or, for a
table without one, `noise_epsilon` of its samples (EPSILON_RULE): the median, over the EPSILON_TOP_K plans of
highest value that have >= 2 ok samples, of each plan's between-run relative range (max - min) / median of its
ok samples' tokens/s. The range of a plan's own repeated runs is how far a re-run of the same job moves, so a
plan within that fraction of the best cannot be told apart from it by re-running; the top plans are used (not
all) because the relative noise depends on the step length, and several (not the best alone) because the range
of 3 samples of one plan is itself a noisy figure. A table of single samples has epsilon 0 (success is the best).

The old single-sample format (`{plan, status, tokens_per_s_per_gpu, peak_gib, reason}` per row) still loads and
still constructs: it becomes one sample.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stratagem.errors import StratagemError
from stratagem.evaluators.analytic import evaluate
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import Evaluation, Fidelity, MemoryBreakdown, Throughput
from stratagem.evaluators.spread import SPREAD_KEY, StepSpread
from stratagem.evaluators.zones import measured_zones
from stratagem.spaces.plan import Plan, format_plan, parse_plan
from stratagem.spaces.scenario import Scenario, scenario_from_dict

__all__ = ["TableSample", "TableOutcome", "TableEpsilon", "OutcomeTable", "TableEvaluator", "load_table",
           "noise_epsilon", "EPSILON_TOP_K", "EPSILON_RULE"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

EPSILON_TOP_K = 5
"""Plans (highest value first, >= 2 ok samples each) whose between-run ranges give epsilon."""
EPSILON_RULE = (f"epsilon = median over the top {EPSILON_TOP_K} plans by median tokens/s (median sample ok, >= 2 "
                "ok samples) of (max - min) / median of their ok runs' tokens/s; a plan is within the measured "
                "noise of the best when its median tokens/s >= best * (1 - epsilon)")
"""The rule, as the table's JSON states it (`epsilon.rule`)."""

_SINGLE = ("status", "tokens_per_s_per_gpu", "peak_gib", "reason")


class TableSample(BaseModel):
    """One real run of one plan."""

    model_config = _FROZEN

    status: Literal["ok", "oom", "failed"]
    """ok: trained; oom: exceeded the device (or the harness's memory cap); failed: crashed."""
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)
    """Tokens/s per GPU at the run's median timed step (ok runs)."""
    peak_gib: float | None = Field(default=None, ge=0)
    """Measured peak memory of the worst rank, GiB (ok runs)."""
    step_spread: StepSpread | None = None
    """The timed steps' median and 95 % interval (ok runs measured with the noise-aware harness)."""
    reason: str = ""
    """Why the run did not finish (oom / failed)."""
    load_before: float | None = None
    """The host's 1-minute load average when the run's timed steps began (else when its launch began)."""
    load_after: float | None = None
    """The host's 1-minute load average when the run ended (else when its launch ended)."""
    wall_s: float | None = Field(default=None, ge=0)
    """Wall time of the run inside its launch (build, warm-up, timed steps), seconds."""

    @property
    def value(self) -> float:
        """Tokens/s per GPU of an ok run, 0 otherwise (what a search maximises)."""
        return (self.tokens_per_s_per_gpu or 0.0) if self.status == "ok" else 0.0

    def tokens_interval(self) -> tuple[float, float] | None:
        """Tokens/s per GPU at the ends of the step interval (slow end first); None without a spread."""
        sp, tps = self.step_spread, self.tokens_per_s_per_gpu
        if sp is None or tps is None:
            return None
        return tps * sp.median_s / sp.high_s, tps * sp.median_s / sp.low_s


class TableOutcome(BaseModel):
    """The measured outcome of one plan: the samples of its runs (a distribution)."""

    model_config = _FROZEN

    plan: str
    """The plan as `key=value` pairs (`format_plan`)."""
    samples: list[TableSample] = Field(min_length=1)
    """One sample per real run, in the order they were measured."""

    @model_validator(mode="before")
    @classmethod
    def _single_sample(cls, data: Any) -> Any:
        """The old format (status, tokens_per_s_per_gpu, peak_gib, reason on the row) is one sample."""
        if isinstance(data, dict) and "samples" not in data and "status" in data:
            one = {k: data[k] for k in _SINGLE if k in data}
            return {**{k: v for k, v in data.items() if k not in _SINGLE}, "samples": [one]}
        return data

    @classmethod
    def single(cls, plan: str, status: Literal["ok", "oom", "failed"], tokens_per_s_per_gpu: float | None = None,
               peak_gib: float | None = None, reason: str = "") -> TableOutcome:
        """A plan measured once (the old row's fields; `TableOutcome(plan=..., status=...)` also still works)."""
        return cls(plan=plan, samples=[TableSample(status=status, tokens_per_s_per_gpu=tokens_per_s_per_gpu,
                                                   peak_gib=peak_gib, reason=reason)])

    def median_index(self) -> int:
        """Index of the median sample: samples ordered by value (non-ok count as 0, ties by index), the
        ((n-1)//2)-th from the slowest (the middle of 3; the slower of 2)."""
        order = sorted(range(len(self.samples)), key=lambda i: (self.samples[i].value, i))
        return order[(len(order) - 1) // 2]

    def median_sample(self) -> TableSample:
        """The median sample (what a table of single measurements held)."""
        return self.samples[self.median_index()]

    @property
    def status(self) -> str:
        """The median sample's status."""
        return self.median_sample().status

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        """The median sample's tokens/s per GPU."""
        return self.median_sample().tokens_per_s_per_gpu

    @property
    def peak_gib(self) -> float | None:
        """The median sample's peak."""
        return self.median_sample().peak_gib

    @property
    def reason(self) -> str:
        """The median sample's reason."""
        return self.median_sample().reason

    @property
    def value(self) -> float:
        """The median sample's tokens/s per GPU, 0 unless it is ok."""
        return self.median_sample().value

    def ok_tokens(self) -> list[float]:
        """Tokens/s per GPU of the ok samples, in run order."""
        return [s.tokens_per_s_per_gpu for s in self.samples if s.status == "ok" and s.tokens_per_s_per_gpu]

    def relative_range(self) -> float | None:
        """(max - min) / median of the ok samples' tokens/s; None with fewer than 2 ok samples."""
        xs = self.ok_tokens()
        return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) >= 2 else None


class TableEpsilon(BaseModel):
    """The table's stated noise: how close to the best counts as the best."""

    model_config = _FROZEN

    value: float = Field(ge=0, lt=1)
    """Relative tolerance: a plan with median tokens/s >= best * (1 - value) is within the noise of the best."""
    rule: str = EPSILON_RULE
    """How `value` was derived (the text of the rule)."""
    best_plan: str | None = None
    """The plan of highest median tokens/s."""
    plans: list[str] = Field(default_factory=list)
    """The plans whose between-run ranges gave `value`."""


def noise_epsilon(runs: Sequence[TableOutcome], top_k: int = EPSILON_TOP_K) -> TableEpsilon:
    """Epsilon by EPSILON_RULE (module docstring) from the runs' samples; 0 when no plan has 2 ok samples."""
    ranked = sorted((r for r in runs if r.value > 0), key=lambda r: -r.value)
    used = [r for r in ranked if r.relative_range() is not None][:top_k]
    ranges = [r.relative_range() or 0.0 for r in used]
    # a range of (max - min) / median can reach 1 or more on a wildly noisy plan; epsilon stays a fraction < 1
    value = min(statistics.median(ranges), 0.99) if ranges else 0.0
    return TableEpsilon(value=value, best_plan=ranked[0].plan if ranked else None, plans=[r.plan for r in used])


class OutcomeTable(BaseModel):
    """A scenario and the measured outcome of every candidate plan of it."""

    model_config = _FROZEN

    name: str
    """Benchmark instance name, e.g. `playbook 8B x 16 nodes`."""
    scenario: dict[str, Any]
    """The scenario as its YAML mapping (model, cluster, training[, search])."""
    runs: list[TableOutcome]
    """One outcome per plan (each plan once)."""
    epsilon: TableEpsilon | None = None
    """The stated noise of the table (None: derived from the samples by `noise_epsilon`)."""
    meta: dict[str, Any] = Field(default_factory=dict)
    """Source and provenance of the measurements (who measured what, where, with which versions)."""

    def load_scenario(self) -> Scenario:
        """The scenario object of this table."""
        return scenario_from_dict(self.scenario)

    def plans(self) -> list[Plan]:
        """The candidate plans, in table order."""
        return [parse_plan(r.plan) for r in self.runs]

    def outcomes(self) -> dict[str, TableOutcome]:
        """Plan key (`format_plan`) -> outcome."""
        return {format_plan(parse_plan(r.plan)): r for r in self.runs}

    def noise_epsilon(self) -> float:
        """The stated epsilon, else the one the samples give (EPSILON_RULE)."""
        return (self.epsilon or noise_epsilon(self.runs)).value

    def best_value(self) -> float:
        """The highest median tokens/s per GPU of any plan (0 when none ran)."""
        return max((r.value for r in self.runs), default=0.0)

    def within_noise(self, key: str) -> bool:
        """Whether plan `key` (`format_plan`) is within the measured noise of the best (success)."""
        best = self.best_value()
        return best > 0 and self.outcomes()[key].value >= best * (1.0 - self.noise_epsilon())


def load_table(path: str | Path) -> OutcomeTable:
    """An OutcomeTable from a JSON file; one-line errors naming the file and the field."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except OSError as e:
        raise StratagemError(f"--table ({p}): cannot read it ({e.strerror or e}); give an existing table file") from None
    except json.JSONDecodeError as e:
        raise StratagemError(f"--table ({p}): not JSON (line {e.lineno}: {e.msg})") from None
    try:
        return OutcomeTable.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"--table ({p}): {loc}: {err['msg']}") from None


class TableEvaluator:
    """Measured evaluations looked up in an OutcomeTable; every lookup counts as one real run."""

    fidelity: Fidelity = "measured"

    def __init__(self, table: OutcomeTable, calibration: Calibration | None = None, slots: int | None = None,
                 rng: np.random.Generator | None = None) -> None:
        self.table = table
        self.calibration = calibration
        self._outcomes = table.outcomes()
        self.rng = rng
        """None: every run returns the plan's median sample; else each run draws one sample from this Generator."""
        self.runs: list[str] = []
        """Plan keys in the order they were looked up (one entry per run spent)."""
        self.draws: list[tuple[str, int]] = []
        """(plan key, sample index) per run, in order."""
        self.slots = slots if slots is not None else table.load_scenario().cluster.num_gpus
        """Ranks the 'cluster' runs at once; with the scenario's GPU count one plan runs at a time."""

    def outcome(self, plan: Plan) -> TableOutcome:
        """The table's outcome of `plan`; a plan outside the table is an error (restrict the search to it)."""
        key = format_plan(plan)
        if key not in self._outcomes:
            raise StratagemError(f"plan ({key}) is not in table {self.table.name!r}: restrict the search to the "
                                 "table's plans (candidates=...)")
        return self._outcomes[key]

    def evaluate(self, scenario: Scenario, plan: Plan) -> Evaluation:
        """Look one plan up (one run spent): a drawn sample with `rng`, else the median sample."""
        out = self.outcome(plan)
        index = out.median_index() if self.rng is None else int(self.rng.integers(len(out.samples)))
        key = format_plan(plan)
        self.runs.append(key)
        self.draws.append((key, index))
        return measured_from_table(scenario, plan, out.samples[index], evaluate(scenario, plan, self.calibration),
                                   index)

    def evaluate_batch(self, scenario: Scenario, plans: Sequence[Plan]) -> list[Evaluation]:
        """Look several plans up, in order (one run spent per plan)."""
        return [self.evaluate(scenario, p) for p in plans]

    def close(self) -> None:
        """Nothing to release (the same interface as the real-run evaluator)."""

    def unsupported(self, scenario: Scenario, plan: Plan) -> str | None:
        """None: a table holds only plans that were run (evaluators.base.MeasuringEvaluator)."""
        return None

    def run_seconds(self, scenario: Scenario, plan: Plan) -> float:
        """0: a lookup takes no time (a replay has no budget in minutes)."""
        return 0.0

    def stop(self) -> int:
        """Nothing is ever in flight."""
        return 0


def measured_from_table(scenario: Scenario, plan: Plan, out: TableSample, prediction: Evaluation,
                        index: int = 0) -> Evaluation:
    """A measured Evaluation from one sample of a table row: tokens/s and peak as measured; the state blocks
    (weights, gradients, optimizer) from the prediction, the rest of the measured peak as activations; the step
    time (tokens per step / measured tokens/s) as `measurements["step_s"]`, which the calibration refit reads,
    and the sample's step spread (when measured) as `measurements["step_spread"]`."""
    provenance = {"source": "table", "sample": index}
    if out.status != "ok":
        return Evaluation(plan=plan, status=out.status, reason=out.reason or out.status, fidelity="measured",
                          prediction=prediction, provenance=provenance)
    if out.tokens_per_s_per_gpu is None or out.peak_gib is None:
        raise StratagemError(f"table row {format_plan(plan)} sample {index}: an ok run needs tokens_per_s_per_gpu "
                             "and peak_gib")
    hbm = scenario.cluster.gpu.hbm_gib
    pm = prediction.memory
    weights, grads, opt = (pm.weights_gib, pm.gradients_gib, pm.optimizer_gib) if pm else (0.0, 0.0, 0.0)
    weights, grads, opt = (min(x, out.peak_gib) for x in (weights, grads, opt))
    rest = max(0.0, out.peak_gib - weights - grads - opt)
    memory = MemoryBreakdown(
        weights_gib=weights, gradients_gib=grads, optimizer_gib=opt, activations_gib=rest, transient_gib=0.0,
        overhead_gib=0.0, peak_gib=out.peak_gib, hbm_gib=hbm, headroom_gib=hbm - out.peak_gib,
        first_block_to_break=None if out.peak_gib <= hbm else "activations",
        worst_stage=pm.worst_stage if pm else 0,
    )
    world = scenario.cluster.num_gpus
    tokens = out.tokens_per_s_per_gpu * world
    pt = prediction.throughput
    # MFU: the prediction's FLOPs per token at the measured rate (same definition as real runs).
    mfu = pt.mfu * tokens / pt.tokens_per_s if pt is not None and pt.tokens_per_s > 0 else 0.0
    zones = None
    if prediction.zones is not None and prediction.time is not None and prediction.checkpoint is not None:
        zones = measured_zones(prediction.zones, memory, prediction.time, prediction.checkpoint)
    measurements: dict[str, Any] = {"step_s": scenario.training.tokens_per_step / tokens, "tokens_per_s": tokens}
    if out.step_spread is not None:
        measurements[SPREAD_KEY] = out.step_spread.model_dump()
    return Evaluation(
        plan=plan, status="ok", fidelity="measured", memory=memory,
        throughput=Throughput(tokens_per_s=tokens, tokens_per_s_per_gpu=out.tokens_per_s_per_gpu, mfu=mfu),
        checkpoint=prediction.checkpoint, zones=zones, prediction=prediction,
        measurements=measurements, provenance=provenance,
    )
