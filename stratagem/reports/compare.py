"""Plans side by side (`stratagem compare`): the memory blocks of the worst rank, the step-time
parts, throughput, the four zones, and one sentence per plan on why the fastest beats it ("why not plan X?").

Every figure is the evaluation's (`evaluators.evaluate`, the same calibration for every plan); the sentence
names the step-time term whose difference is largest (evaluators.step_parts) or, for a plan that does not fit,
the block that breaks first. Numbers follow `stratagem.quantities` (one memory unit and one time unit per table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stratagem import quantities as q
from stratagem.evaluators.evaluation import BLOCKS, ZONE_NAMES, Evaluation
from stratagem.evaluators.risk_pick import RISK_RULE, risk_aware_best
from stratagem.evaluators.step_parts import STEP_PARTS
from stratagem.evaluators.zones import bottleneck_label

if TYPE_CHECKING:
    from stratagem.evaluators.calibration import Calibration
    from stratagem.spaces.scenario import Scenario

__all__ = ["Compared", "Comparison", "compare"]

@dataclass(frozen=True)
class Compared:
    """One plan in the comparison."""

    name: str
    """What the user gave (a --plan string, a label, trial:N)."""
    evaluation: Evaluation
    measured_tokens_per_s: float | None = None
    """A measured trial's tokens/s (trial:N of a measured run), shown beside the prediction."""

    @property
    def label(self) -> str:
        """The plan's label (parses as --plan)."""
        return self.evaluation.plan.short()

    @property
    def fits(self) -> bool:
        """Status ok with throughput figures."""
        return self.evaluation.status == "ok" and self.evaluation.throughput is not None

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens/s (0 when the plan does not fit)."""
        tp = self.evaluation.throughput
        return tp.tokens_per_s if tp is not None and self.fits else 0.0


@dataclass(frozen=True)
class Comparison:
    """The plans, the fastest that fits, and why it wins over each other plan."""

    plans: tuple[Compared, ...]
    winner: int | None
    """Index of the fastest plan that fits (None when none fits)."""
    why: tuple[str, ...]
    """One sentence per plan other than the winner."""

    def table(self) -> tuple[list[str], list[list[str]]]:
        """(head, rows): one column per plan; memory in one unit, times in one unit."""
        evs = [c.evaluation for c in self.plans]
        mems = [e.memory for e in evs]
        m_unit = q.memory_unit(*(m.hbm_gib for m in mems if m), *(m.peak_gib for m in mems if m))
        t_unit = q.duration_unit(*(e.time.step_s for e in evs if e.time))
        rows: list[list[str]] = [["status", *(e.status for e in evs)]]
        for b in BLOCKS:
            rows.append([f"{b} ({m_unit[0]})", *(q.memory_in(m.block_gib(b), m_unit) if m else q.DASH
                                                 for m in mems)])
        rows.append([f"peak ({m_unit[0]})", *(q.memory_in(m.peak_gib, m_unit) if m else q.DASH for m in mems)])
        rows.append([f"headroom ({m_unit[0]})", *(q.memory_in(m.headroom_gib, m_unit) if m else q.DASH
                                                  for m in mems)])
        rows.append(["first block to break", *((m.first_block_to_break or "none") if m else q.DASH for m in mems)])
        for p in (p for p in STEP_PARTS if p.term):  # each group's exposed communication its own row
            rows.append([f"{p.label} ({t_unit[0]})", *(q.duration_in(getattr(e.time, p.name), t_unit, False)
                                                    if e.time else q.DASH for e in evs)])
        rows.append([f"step ({t_unit[0]})", *(q.duration_in(e.time.step_s, t_unit, False) if e.time else q.DASH
                                              for e in evs)])
        rows.append(["tokens/s", *(q.sig(e.throughput.tokens_per_s) if e.throughput else q.DASH for e in evs)])
        if any(c.measured_tokens_per_s is not None for c in self.plans):
            rows.append(["tokens/s measured", *(q.sig(c.measured_tokens_per_s) for c in self.plans)])
        rows.append(["tokens/s per GPU", *(q.sig(e.throughput.tokens_per_s_per_gpu) if e.throughput else q.DASH
                                           for e in evs)])
        rows.append(["MFU", *(q.percent(e.throughput.mfu) if e.throughput else q.DASH for e in evs)])
        rows.append(["checkpoint goodput loss", *(q.percent(e.checkpoint.goodput_loss) if e.checkpoint else q.DASH
                                                  for e in evs)])
        for z in ZONE_NAMES:
            rows.append([f"zone {z}", *(getattr(e.zones, z).level if e.zones else q.DASH for e in evs)])
        rows.append(["bottleneck", *(bottleneck_label(e.zones) if e.zones else q.DASH for e in evs)])
        head = ["", *(f"{c.name}" + (f" ({c.label})" if c.label != c.name else "") for c in self.plans)]
        return head, rows

    def as_json(self) -> dict[str, Any]:
        """The comparison as JSON: each plan's name, label and full evaluation, the winner and the sentences."""
        return {"plans": [{"name": c.name, "label": c.label, "measured_tokens_per_s": c.measured_tokens_per_s,
                           "evaluation": c.evaluation.model_dump(mode="json")} for c in self.plans],
                "winner": None if self.winner is None else self.plans[self.winner].name, "why": list(self.why)}


def _why_not(win: Compared, other: Compared) -> str:
    """One sentence: why `win` beats `other`."""
    w, o = win.evaluation, other.evaluation
    name = f"{other.name}" + (f" ({other.label})" if other.label != other.name else "")
    if not other.fits:
        mem = o.memory
        if o.status == "oom" and mem is not None:
            unit = q.memory_unit(mem.peak_gib, mem.hbm_gib)
            return (f"why not {name}? it does not fit: peak {q.memory_in(mem.peak_gib, unit, True)} of "
                    f"{q.memory_in(mem.hbm_gib, unit, True)} HBM, {mem.first_block_to_break or 'the stack'} breaks "
                    "first.")
        return f"why not {name}? {o.status}: {o.reason or 'no throughput figures'}."
    assert w.time is not None and o.time is not None
    gap = win.tokens_per_s / other.tokens_per_s - 1.0 if other.tokens_per_s > 0 else float("inf")
    _, field, part = max((getattr(o.time, p.name) - getattr(w.time, p.name), p.name, p.label) for p in STEP_PARTS
                         if p.term)
    unit = q.duration_unit(o.time.step_s, w.time.step_s)
    bad = [z for z in ZONE_NAMES if o.zones is not None and getattr(o.zones, z).level == "bad"]
    if gap < 0 and bad:
        return (f"why not {name}? it is {q.percent(other.tokens_per_s / win.tokens_per_s - 1.0)} faster, but its "
                f"{', '.join(bad)} zone is bad and {win.label} is within the model's noise of it (risk-aware pick).")
    if gap <= 0:
        return f"{name} is as fast as {win.label} ({q.sig(other.tokens_per_s)} tokens/s)."
    because = (f"{other.label}'s step is {q.duration_in(o.time.step_s - w.time.step_s, unit)} longer "
               f"({q.duration_in(o.time.step_s, unit)} vs {q.duration_in(w.time.step_s, unit)}), most of all in "
               f"{part}: {q.duration_in(getattr(o.time, field), unit)} vs "
               f"{q.duration_in(getattr(w.time, field), unit)}")
    return (f"why not {name}? {win.label} is {q.percent(gap)} faster ({q.sig(win.tokens_per_s)} vs "
            f"{q.sig(other.tokens_per_s)} tokens/s): {because}.")


def _winner(plans: list[Compared], scenario: Scenario | None,
            calibration: Calibration | None) -> tuple[int | None, str]:
    """The fastest plan that fits (ties keep the first given), by RISK_RULE when `scenario` is given: a plan with
    a zone at bad loses to the fastest without one within the model's noise of it. With the line saying so."""
    fitting = [i for i, c in enumerate(plans) if c.fits]
    if not fitting:
        return None, ""
    fastest = max(fitting, key=lambda i: (plans[i].tokens_per_s, -i))
    if scenario is None:
        return fastest, ""
    import numpy as np
    from numpy.typing import NDArray

    from stratagem.evaluators.analytic import evaluate_many
    from stratagem.evaluators.posterior import predictive_from_figures

    fit = [plans[i] for i in fitting]  # only plans that fit have step-time shares
    figs = evaluate_many(scenario, [c.evaluation.plan for c in fit], calibration)
    pred = predictive_from_figures(scenario, figs, calibration).log_tokens
    bad: dict[str, NDArray[np.bool_]] = {
        z: np.array([c.evaluation.zones is not None and getattr(c.evaluation.zones, z).level == "bad" for c in fit],
                    dtype=bool) for z in ZONE_NAMES}
    values = np.array([c.tokens_per_s for c in fit], dtype=np.float64)  # argmax: ties keep the first given
    pick = risk_aware_best(values, np.ones(len(fit), dtype=bool), bad, pred.shares, pred.cov)
    if pick is None:
        return fastest, ""
    said = pick.note(fit[pick.fastest].label)
    return fitting[pick.index], (f"{fit[pick.index].label}: {said} ({RISK_RULE})." if said else "")


def compare(plans: list[Compared], scenario: Scenario | None = None,
            calibration: Calibration | None = None) -> Comparison:
    """The comparison of two or more evaluated plans. The winner: the highest predicted tokens/s among those that
    fit (ties keep the first given), risk-aware when `scenario` is given (`_winner`, evaluators.risk_pick)."""
    winner, rule = _winner(plans, scenario, calibration)
    if winner is None:
        why = tuple(_why_not(plans[0], c) for c in plans)
    else:
        why = tuple(_why_not(plans[winner], c) for i, c in enumerate(plans) if i != winner)
    return Comparison(plans=tuple(plans), winner=winner, why=((rule,) if rule else ()) + why)
