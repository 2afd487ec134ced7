"""Capacity planning: for each cluster size, the best plan and what training the scenario's tokens costs.

For each node count the scenario's cluster is resized, every plan is screened analytically
(`stratagem.search.screen`), and the feasible plan with the highest effective throughput,
tokens/s x (1 - expected goodput loss), is chosen by the risk-aware rule (evaluators.risk_pick.RISK_RULE: a plan
with a zone at bad loses to one without within the model's noise of it). Then:
  time to train  = training_tokens / (tokens/s x (1 - goodput_loss))     (wall clock, losses included)
  GPU-hours      = time x GPUs;  cost = GPU-hours x price per GPU-hour
  checkpoint overhead = stall / interval (time blocked saving); failure loss = goodput_loss - overhead
  (the expected rework and restarts, (T/2 + R)/MTBF).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stratagem.errors import StratagemError
from stratagem.evaluators.analytic import evaluate
from stratagem.evaluators.evaluation import Evaluation
from stratagem.evaluators.posterior import predictive_from_figures
from stratagem.evaluators.risk_pick import RISK_RULE, bad_zones, risk_aware_best
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

if TYPE_CHECKING:
    from stratagem.evaluators.calibration import Calibration

__all__ = ["CapacityRow", "CapacityInfo", "capacity_plan", "capacity_row", "resized", "parse_nodes", "default_nodes",
           "risk_cells", "risk_text", "RISK_NOTE", "pick_lines"]

RISK_NOTE = ("headroom: HBM left over the chosen plan's predicted peak (its share of HBM; warn under 10%, bad under "
             "5%); checkpoint loss: the checkpoint zone's expected goodput loss, stalls saving plus rework and "
             "restarts after failures (warn from 3%, bad from 10%); levels from stratagem.evaluators.zones; "
             f"{RISK_RULE}")
"""What the risk columns beside the chosen plan mean (every capacity table's note)."""

@dataclass(frozen=True)
class BestPlan:
    """The chosen plan at one cluster size, fully evaluated."""

    plan: Plan
    label: str
    evaluation: Evaluation


@dataclass(frozen=True)
class CapacityRow:
    """One cluster size."""

    num_nodes: int
    num_gpus: int
    n_plans: int
    """Valid plans screened."""
    n_feasible: int
    """Plans predicted to fit."""
    best: BestPlan | None
    tokens_per_s: float | None
    goodput_loss: float | None
    checkpoint_overhead: float | None
    """Fraction of time stalled by checkpoint saves (stall / interval)."""
    failure_loss: float | None
    """Fraction of time lost to failures: rework since the last checkpoint and restarts."""
    hours: float | None
    """Wall-clock hours to train the scenario's training_tokens, expected losses included."""
    gpu_hours: float | None
    cost_usd: float | None
    failure_hours: float | None
    """Expected hours of the run lost to failures."""
    note: str = ""
    """Why there is no plan at this size."""
    pick_note: str = ""
    """What the risk-aware rule did at this size (RiskPick.note: the faster plan with a bad zone it replaced), ''
    when the fastest plan has no zone at bad."""

    @property
    def days(self) -> float | None:
        """Training time in days, None when the plan does not fit."""
        return None if self.hours is None else self.hours / 24.0

    @property
    def headroom_gib(self) -> float | None:
        """HBM left over the chosen plan's predicted peak (worst rank), None without a plan."""
        mem = self.best.evaluation.memory if self.best is not None else None
        return None if mem is None else mem.headroom_gib

    @property
    def headroom_fraction(self) -> float | None:
        """headroom_gib as a share of HBM (a plan chosen at 94 % of HBM has 0.06), None without a plan."""
        mem = self.best.evaluation.memory if self.best is not None else None
        return None if mem is None or mem.hbm_gib <= 0 else mem.headroom_gib / mem.hbm_gib

    def level(self, zone: str) -> str:
        """The chosen plan's level in one zone ("hbm", "checkpoint": ok, warn, bad; evaluators/zones.py
        THRESHOLDS), '' without a plan."""
        zones = self.best.evaluation.zones if self.best is not None else None
        return "" if zones is None else str(getattr(zones, zone).level)


@dataclass(frozen=True)
class CapacityInfo:
    """Capacity planning across cluster sizes for one scenario."""

    scenario: Scenario
    training_tokens: float
    price_per_gpu_hour: float
    rows: tuple[CapacityRow, ...]

    @property
    def cheapest(self) -> CapacityRow | None:
        """The row with the lowest cost (then fewer nodes), None when none has a cost."""
        rows = [r for r in self.rows if r.cost_usd is not None]
        return min(rows, key=lambda r: (r.cost_usd, r.num_nodes)) if rows else None

    def fewest_within(self, days: float) -> CapacityRow | None:
        """The row with the fewest GPUs that trains within `days` (then the faster), None when none does."""
        rows = [r for r in self.rows if r.days is not None and r.days <= days]
        return min(rows, key=lambda r: (r.num_gpus, r.days or 0.0)) if rows else None

    def fastest_within(self, budget_usd: float) -> CapacityRow | None:
        """The fastest row whose cost stays within `budget_usd` (then the cheaper), None when none does."""
        rows = [r for r in self.rows if r.cost_usd is not None and r.hours is not None and r.cost_usd <= budget_usd]
        return min(rows, key=lambda r: (r.hours or 0.0, r.cost_usd or 0.0)) if rows else None

    @property
    def fastest(self) -> CapacityRow | None:
        """The row with the shortest training time (then fewer nodes), None when none fits."""
        rows = [r for r in self.rows if r.hours is not None]
        return min(rows, key=lambda r: (r.hours, r.num_nodes)) if rows else None


def parse_nodes(text: str) -> list[int]:
    """`"8,16,32"` -> [8, 16, 32] (sorted, unique), or a one-line error naming --nodes."""
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    try:
        nodes = sorted({int(p) for p in parts})
    except ValueError:
        nodes = []
    if not nodes or nodes[0] < 1:
        raise StratagemError(f"--nodes ({text!r}): give positive node counts separated by commas, e.g. 8,16,32")
    return nodes


def default_nodes(scenario: Scenario) -> list[int]:
    """Half, the same and twice the scenario's node count."""
    n = scenario.cluster.num_nodes
    return sorted({max(1, n // 2), n, 2 * n})


def risk_cells(row: CapacityRow, unit: tuple[str, float]) -> tuple[str, str]:
    """The chosen plan's risk, shown beside it: headroom in `unit` with its share of HBM, and the checkpoint
    zone's goodput loss as a percentage, each followed by its zone level when it is not ok ('5.10 (6.41%) warn',
    '0.357%')."""
    from stratagem import quantities as q

    def flag(zone: str) -> str:
        level = row.level(zone)
        return f" {level}" if level and level != "ok" else ""

    return (f"{q.memory_in(row.headroom_gib, unit)} ({q.percent(row.headroom_fraction)}){flag('hbm')}",
            f"{q.percent(row.goodput_loss)}{flag('checkpoint')}")


def risk_text(row: CapacityRow) -> str:
    """The chosen plan's risk in words: 'headroom 5.10 GiB (6.41% of HBM, warn), checkpoint loss 0.357%'."""
    from stratagem import quantities as q

    def level(zone: str) -> str:
        found = row.level(zone)
        return f", {found}" if found and found != "ok" else ""

    return (f"headroom {q.memory(row.headroom_gib)} ({q.percent(row.headroom_fraction)} of HBM{level('hbm')}), "
            f"checkpoint loss {q.percent(row.goodput_loss)}" + (f" ({row.level('checkpoint')})"
                                                                 if level("checkpoint") else ""))


def pick_lines(cap: CapacityInfo) -> list[str]:
    """One line per size where the risk-aware rule acted ('32 nodes: chosen over ... (hbm bad), 3.6% faster,
    within the model's noise ...'), empty when no size's fastest plan has a zone at bad."""
    return [f"{r.num_nodes} nodes: {r.pick_note}" for r in cap.rows if r.pick_note]


def resized(scenario: Scenario, num_nodes: int) -> Scenario:
    """The scenario on `num_nodes` nodes, its plan: section dropped (every plan is screened)."""
    cluster = scenario.cluster.model_copy(update={"num_nodes": num_nodes})
    return scenario.model_copy(update={"cluster": cluster, "plan": None})


def _no_plan(num_nodes: int, gpus: int, n_plans: int, n_feasible: int, note: str,
             best: BestPlan | None = None) -> CapacityRow:
    return CapacityRow(num_nodes=num_nodes, num_gpus=gpus, n_plans=n_plans, n_feasible=n_feasible, best=best,
                       tokens_per_s=None, goodput_loss=None, checkpoint_overhead=None, failure_loss=None,
                       hours=None, gpu_hours=None, cost_usd=None, failure_hours=None, note=note)


def capacity_row(scenario: Scenario, num_nodes: int, calibration: Calibration | None) -> CapacityRow:
    """One cluster size: its plans screened, the risk-aware best (module docstring) and what training costs."""
    from stratagem.search.screening import screen  # every valid plan of the resized cluster, vectorised

    scn = resized(scenario, num_nodes)
    gpus = scn.cluster.num_gpus
    try:
        scr = screen(scn, calibration=calibration)
    except StratagemError as e:
        return _no_plan(num_nodes, gpus, 0, 0, str(e))
    n_plans = len(scr.plans)
    feasible = np.asarray(scr.feasible, dtype=bool)
    n_fit = int(feasible.sum())
    if not n_fit:
        return _no_plan(num_nodes, gpus, n_plans, 0,
                        "no valid plan" if n_plans == 0 else f"none of {n_plans:,} plans fits in HBM")
    tps = np.asarray(scr.columns.tokens_per_s, dtype=np.float64)
    loss = np.asarray(scr.columns.goodput_loss, dtype=np.float64)
    pred = predictive_from_figures(scn, scr.columns, calibration).log_tokens
    pick = risk_aware_best(tps * (1.0 - loss), feasible, bad_zones(scr.columns), pred.shares, pred.cov)
    if pick is None:
        return _no_plan(num_nodes, gpus, n_plans, n_fit, "zero throughput")
    plan = scr.plans.plan(pick.index)
    pick_note = pick.note(scr.plans.plan(pick.fastest).short())
    ev = evaluate(scn, plan, calibration)
    if ev.throughput is None or ev.checkpoint is None:
        return _no_plan(num_nodes, gpus, n_plans, n_fit, "the evaluator gave no throughput or checkpoint figures")
    t, ck = ev.throughput.tokens_per_s, ev.checkpoint
    best = BestPlan(plan=plan, label=plan.short(), evaluation=ev)
    overhead = ck.stall_s / ck.interval_s if ck.interval_s > 0 else 0.0
    useful = 1.0 - ck.goodput_loss
    if t <= 0 or useful <= 0:
        why = "expected losses leave no useful time" if useful <= 0 else "zero throughput"
        return _no_plan(num_nodes, gpus, n_plans, n_fit, why, best)
    hours = scenario.training.training_tokens / (t * useful) / 3600.0
    gpu_hours = hours * gpus
    return CapacityRow(
        num_nodes=num_nodes, num_gpus=gpus, n_plans=n_plans, n_feasible=n_fit, best=best,
        tokens_per_s=t, goodput_loss=ck.goodput_loss, checkpoint_overhead=overhead,
        failure_loss=ck.goodput_loss - overhead, hours=hours, gpu_hours=gpu_hours,
        cost_usd=gpu_hours * scenario.cluster.price_per_gpu_hour,
        failure_hours=hours * (ck.goodput_loss - overhead), pick_note=pick_note,
    )


def capacity_plan(
    scenario: Scenario, nodes: Sequence[int], calibration: Calibration | None = None,
) -> CapacityInfo:
    """The best plan and the cost of training `training.training_tokens` at each node count."""
    if not nodes:
        raise StratagemError("--nodes: give at least one node count, e.g. 8,16,32")
    rows = tuple(capacity_row(scenario, n, calibration) for n in sorted(set(nodes)))
    return CapacityInfo(scenario=scenario, training_tokens=scenario.training.training_tokens,
                        price_per_gpu_hour=scenario.cluster.price_per_gpu_hour, rows=rows)
