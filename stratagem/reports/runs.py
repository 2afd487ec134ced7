"""The study's real runs as the report shows them: every measured trial (ok, oom, failed, timeout, infra) with
its plan, the prediction it was run on (the calibration in force then) and, once a refit was adopted, the plan
re-predicted with the calibration in force now (`ParetoInfo.in_force`: the refitted constants and per-term
multipliers the search writes to runs/STUDY/calibration.yaml), against what the run measured (step time with its
95 % interval, tokens/s, peak memory). The errors are taken against the re-prediction where there is one.

Read from `ParetoInfo.trials` (every finished trial, superseded ones included): a re-measured plan lists each
run. The measured step is the run's stored median (`measurements["step_s"]`), its spread the stored
`step_spread` (`evaluators.spread.spread_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem import quantities as q
from stratagem.evaluators import evaluate
from stratagem.evaluators.evaluation import Evaluation
from stratagem.evaluators.spread import StepSpread, spread_of
from stratagem.reports.info import ParetoInfo, TrialRecord

__all__ = ["RealRun", "real_runs", "measured_step_s", "Figure", "Table", "runs_table", "history_table", "runs_summary"]


@dataclass(frozen=True)
class Figure:
    """One figure of a run: predicted at run time, predicted with the latest calibration, measured."""

    before: float | None
    """The prediction the run was chosen on (the calibration in force when it ran)."""
    after: float | None
    """The plan re-predicted with the calibration in force (an adopted refit); None while none was adopted."""
    measured: float | None

    def error(self, which: str = "before") -> float | None:
        """Relative error (predicted - measured) / measured of one prediction, None when a figure is missing."""
        p = self.before if which == "before" else self.after
        if p is None or self.measured is None or self.measured == 0:
            return None
        return (p - self.measured) / self.measured


@dataclass(frozen=True)
class RealRun:
    """One measured trial."""

    trial: int
    label: str
    """The plan's label (parses as --plan)."""
    plan_index: int
    """The plan's row in ParetoInfo.plans."""
    status: str
    """ok, oom, failed, timeout, infra."""
    reason: str
    step_s: Figure
    tokens_per_s: Figure
    peak_gib: Figure
    spread: StepSpread | None
    """The measured step's 95 % interval (None when the run stored none)."""


def measured_step_s(ev: Evaluation | None) -> float | None:
    """The measured median step time of a measured evaluation (`measurements["step_s"]`, else the spread's
    median, else tokens per step / tokens/s, else a stored time breakdown's step); None for a run without one (oom, failed)."""
    if ev is None or ev.fidelity != "measured":
        return None
    m = ev.measurements or {}
    step = m.get("step_s")
    if isinstance(step, int | float) and step > 0:
        return float(step)
    spread = spread_of(m)
    if spread is not None:
        return spread.median_s
    tokens = m.get("tokens_per_step")
    if isinstance(tokens, int | float) and ev.throughput is not None and ev.throughput.tokens_per_s > 0:
        return float(tokens) / ev.throughput.tokens_per_s
    return ev.time.step_s if ev.time is not None else None


def _predicted(ev: Evaluation | None) -> tuple[float | None, float | None, float | None]:
    """(step s, tokens/s, peak GiB) of an analytic evaluation."""
    if ev is None:
        return None, None, None
    return (ev.time.step_s if ev.time else None, ev.throughput.tokens_per_s if ev.throughput else None,
            ev.memory.peak_gib if ev.memory else None)


def _repredicted(info: ParetoInfo, run: TrialRecord) -> Evaluation | None:
    """The run's plan predicted with the calibration in force (None while no refit was adopted)."""
    if info.in_force is None:
        return None
    return evaluate(info.scenario, run.plan, info.in_force)


def real_runs(info: ParetoInfo) -> list[RealRun]:
    """Every measured trial of the study, by trial number."""
    out = []
    for t in info.trials:
        if t.fidelity != "measured":
            continue
        ev = t.evaluation
        before = _predicted(ev.prediction if ev else None)
        after = _predicted(_repredicted(info, t))
        measured = (measured_step_s(ev), ev.throughput.tokens_per_s if ev and ev.throughput else None,
                    ev.memory.peak_gib if ev and ev.memory else None)
        figs = [Figure(b, a, m) for b, a, m in zip(before, after, measured, strict=True)]
        out.append(RealRun(
            trial=t.number, label=t.plan.short(), plan_index=info.plan_of_trial[t.number], status=t.status,
            reason=t.reason, step_s=figs[0], tokens_per_s=figs[1], peak_gib=figs[2],
            spread=spread_of(ev.measurements) if ev is not None and ev.measurements else None))
    return out


Table = tuple[list[str], list[list[str]]]
"""(column heads, rows of cells): the same cells for the HTML and the Markdown report."""


def _interval(spread: StepSpread | None, unit: tuple[str, float]) -> str:
    if spread is None:
        return ""
    return (f" ({q.duration_in(spread.low_s, unit, False)}–{q.duration_in(spread.high_s, unit, False)}, "
            f"n={spread.n}{'' if spread.confident else ', full range'})")


def runs_table(runs: list[RealRun]) -> Table:
    """The real-runs table: predicted (at run time, and with the latest calibration) vs measured. One time unit
    and one memory unit for the whole table (`stratagem.quantities`)."""
    t_unit = q.duration_unit(*(x for r in runs for x in (r.step_s.before, r.step_s.after, r.step_s.measured)))
    m_unit = q.memory_unit(*(x for r in runs for x in (r.peak_gib.before, r.peak_gib.after, r.peak_gib.measured)))
    head = ["trial", "plan", "status", f"step predicted ({t_unit[0]})", f"step re-predicted ({t_unit[0]})",
            f"step measured ({t_unit[0]}, 95% interval)", "step error", "tokens/s predicted", "tokens/s measured",
            f"peak predicted ({m_unit[0]})", f"peak measured ({m_unit[0]})", "peak error", "why"]
    rows = []
    for r in runs:
        err_s = r.step_s.error("after" if r.step_s.after is not None else "before")
        err_m = r.peak_gib.error("after" if r.peak_gib.after is not None else "before")
        rows.append([
            str(r.trial), r.label, r.status,
            q.duration_in(r.step_s.before, t_unit, False), q.duration_in(r.step_s.after, t_unit, False),
            q.duration_in(r.step_s.measured, t_unit, False) + _interval(r.spread, t_unit),
            _signed(err_s), q.sig(r.tokens_per_s.before), q.sig(r.tokens_per_s.measured),
            q.memory_in(r.peak_gib.before, m_unit), q.memory_in(r.peak_gib.measured, m_unit), _signed(err_m),
            r.reason if r.status != "ok" else "",
        ])
    return head, rows


def _signed(x: float | None) -> str:
    return q.DASH if x is None else ("+" if x >= 0 else "") + q.percent(x)


def history_table(info: ParetoInfo) -> Table:
    """One row per refit of the calibration: median step-time and peak-memory errors before and after, on
    held-out runs, and whether the refit was adopted."""
    head = ["refit", "measured runs", "runs fitted", "step error before → after", "held-out step error",
            "memory error before → after", "held-out memory error", "adopted", "calibration", "note"]
    rows = []
    for k, h in enumerate(info.history):
        rows.append([
            str(k + 1), str(h.measured), str(h.runs_used) + (f" (+{h.ooms} OOM as bounds)" if h.ooms else ""),
            f"{q.percent(h.step_error_before)} → {q.percent(h.step_error_after)}", q.percent(h.step_error_held_out),
            f"{q.percent(h.memory_error_before)} → {q.percent(h.memory_error_after)}",
            q.percent(h.memory_error_held_out), "yes" if h.adopted else "no", h.calibration_id or q.DASH, h.note,
        ])
    return head, rows


def runs_summary(runs: list[RealRun]) -> str:
    """'6 real runs: 4 ok, 1 oom, 1 failed.' (or that the study has none)."""
    if not runs:
        return "No real runs in this study (search with --real-runs N to measure the leading plans)."
    by: dict[str, int] = {}
    for r in runs:
        by[r.status] = by.get(r.status, 0) + 1
    parts = ", ".join(f"{n} {s}" for s, n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))
    plans = len({r.plan_index for r in runs})
    return f"{len(runs)} real run{'s' if len(runs) != 1 else ''} of {plans} plan{'s' if plans != 1 else ''}: {parts}."
