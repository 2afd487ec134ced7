"""A table evaluator: every plan's measured outcome is known in advance (a tabular benchmark, as NAS-Bench and
HPOBench compare search methods), so a search's cost to find the best plan is exact and cheap to replay.

`TableEvaluator.evaluate_batch` looks each plan up and returns a measured `Evaluation`, as a real run would
(status ok / oom / failed, tokens/s, peak memory, the step time the calibration refit reads), and counts each
lookup as one run in `runs` (the order a search spent its runs in). A plan missing from the table is an error:
a search benchmarked on a table must be restricted to the table's plans (the multi-fidelity loop's
`candidates` argument), never silently given a made-up figure.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stratagem.errors import StratagemError
from stratagem.evaluators.analytic import evaluate
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import Evaluation, Fidelity, MemoryBreakdown, Throughput
from stratagem.evaluators.zones import measured_zones
from stratagem.spaces.plan import Plan, format_plan, parse_plan
from stratagem.spaces.scenario import Scenario, scenario_from_dict

__all__ = ["TableOutcome", "OutcomeTable", "TableEvaluator", "load_table"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class TableOutcome(BaseModel):
    """The measured outcome of one plan."""

    model_config = _FROZEN

    plan: str
    """The plan as `key=value` pairs (`format_plan`)."""
    status: Literal["ok", "oom", "failed"]
    """ok: trained; oom: exceeded the device (or the harness's memory cap); failed: crashed."""
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)
    """Measured tokens/s per GPU (ok runs)."""
    peak_gib: float | None = Field(default=None, ge=0)
    """Measured peak memory of the worst rank, GiB (ok runs)."""
    reason: str = ""
    """Why a run did not finish (oom / failed)."""


class OutcomeTable(BaseModel):
    """A scenario and the measured outcome of every candidate plan of it."""

    model_config = _FROZEN

    name: str
    """Benchmark instance name, e.g. `playbook 8B x 16 nodes`."""
    scenario: dict[str, Any]
    """The scenario as its YAML mapping (model, cluster, training[, search])."""
    runs: list[TableOutcome]
    """One outcome per plan (each plan once)."""
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

    def __init__(self, table: OutcomeTable, calibration: Calibration | None = None, slots: int | None = None) -> None:
        self.table = table
        self.calibration = calibration
        self._outcomes = table.outcomes()
        self.runs: list[str] = []
        """Plan keys in the order they were looked up (one entry per run spent)."""
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
        """Look one plan up (one run spent)."""
        out = self.outcome(plan)
        self.runs.append(format_plan(plan))
        return measured_from_table(scenario, plan, out, evaluate(scenario, plan, self.calibration))

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


def measured_from_table(scenario: Scenario, plan: Plan, out: TableOutcome, prediction: Evaluation) -> Evaluation:
    """A measured Evaluation from a table row: tokens/s and peak as measured; the state blocks (weights,
    gradients, optimizer) from the prediction, the rest of the measured peak as activations; the step time
    (tokens per step / measured tokens/s) as `measurements["step_s"]`, which the calibration refit reads."""
    if out.status != "ok":
        return Evaluation(plan=plan, status=out.status, reason=out.reason or out.status, fidelity="measured",
                          prediction=prediction, provenance={"source": "table"})
    if out.tokens_per_s_per_gpu is None or out.peak_gib is None:
        raise StratagemError(f"table row {out.plan}: an ok run needs tokens_per_s_per_gpu and peak_gib")
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
    step_s = scenario.training.tokens_per_step / tokens
    return Evaluation(
        plan=plan, status="ok", fidelity="measured", memory=memory,
        throughput=Throughput(tokens_per_s=tokens, tokens_per_s_per_gpu=out.tokens_per_s_per_gpu, mfu=mfu),
        checkpoint=prediction.checkpoint, zones=zones, prediction=prediction,
        measurements={"step_s": step_s, "tokens_per_s": tokens}, provenance={"source": "table"},
    )
