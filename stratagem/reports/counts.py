"""The counts in words, one home: `count_lines(counts, study)` is what `stratagem search` prints under its front,
what the HTML and Markdown reports show under "Counts" and what `stratagem status` starts with (one
counting rule, `stratagem.search.counts`, printed the same way everywhere). Where two numbers legitimately
differ (the predicted front and the front now; the plans that fit in the space and those stored), the line
says why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.quantities import memory
from stratagem.search.counts import KINDS, SpaceCounts, StudyCounts

if TYPE_CHECKING:
    from stratagem.reports.info import ParetoInfo

__all__ = ["count_lines", "count_lines_of", "space_line", "study_line", "front_line", "measured_line"]

_ROLES = {"front": "from the predicted front", "boundary": "nearest the memory limit", "sample": "sampled",
          "sampler": "proposed by the sampler", "candidate": "measured as candidates",
          "recalibrated": "re-predicted", "remeasured": "re-measured", "unrecorded": "stored by hand"}


def _parts(counts: dict[str, int], names: dict[str, str] | None = None, count_first: bool = True) -> str:
    names = names or {}
    return ", ".join(f"{n:,} {names.get(k, k)}" if count_first else f"{names.get(k, k)} {n:,}"
                     for k, n in counts.items())


def space_line(s: SpaceCounts) -> str:
    """The space as the last screening judged it: valid, screened, pruned and why, fit, the predicted front."""
    screened = "all screened" if s.screened == s.valid else f"{s.screened:,} screened ({s.mode or 'sampled'})"
    limit = "HBM" if not s.margin_gib else f"HBM - {memory(s.margin_gib)} margin"
    why = f"; first block over it: {_parts(s.pruned_by, count_first=False)}" if s.pruned_by else ""
    return (f"space: {s.valid:,} valid plans (distinct jobs), {screened}; {s.pruned:,} pruned (predicted peak over "
            f"{limit}{why}), {s.fit:,} fit, {s.front:,} on the predicted front")


def study_line(c: StudyCounts, study: str) -> str:
    """The study's trials by kind (adding up), its distinct plans by why they were stored, and how many fit."""
    kinds = _parts(c.kinds, KINDS)
    held = f"{c.trials:,} in all: {kinds}" if kinds else f"{c.trials:,} in all"
    roles = f" ({_parts(c.roles, _ROLES)})" if c.roles else ""
    return f"study {study!r}: {held}; {c.plans:,} distinct plans{roles}, {c.plans_fit:,} of them fit"


def front_line(c: StudyCounts) -> str:
    """The front now and, where it is not the predicted front, why (front = predicted - left + joined)."""
    if not c.front:
        return "Pareto front now: no plan (none of the stored plans fits)"
    figures = ("all predicted" if not c.front_measured else "all measured" if c.front_measured == c.front
               else f"{c.front_measured:,} measured, {c.front - c.front_measured:,} predicted")
    line = f"Pareto front now: {c.front:,} plans ({figures})"
    left = sum(c.off_front.values())
    if not left and not c.joined_front:
        return line
    moved = []
    if left:
        moved.append(f"{left:,} left it ({_parts(c.off_front)})")
    if c.joined_front:
        moved.append(f"{c.joined_front:,} joined it")
    earlier = (f" (the last screening's front has {c.space.front:,}; the others were on another screening's "
               "front: re-ranked candidates or another calibration)"
               if c.space is not None and c.space.front != c.predicted_front else "")
    return (f"{line}: of the {c.predicted_front:,} plans stored from the predicted front{earlier}, "
            + ", ".join(moved) + "; measured figures replace predictions, the rest are re-predicted with the "
            "calibration in force")


def measured_line(c: StudyCounts) -> str:
    """Measured plans, the runs that measured them (re-measurements among them) by status, runs in flight."""
    if not c.measured:
        return f"measured: none; {c.running:,} running (claimed)"
    plans = f"{c.measured_plans:,} plan" + ("s" if c.measured_plans != 1 else "")
    runs = f"{c.measured:,} run" + ("s" if c.measured != 1 else "")
    again = f" ({c.remeasured:,} re-measurement{'s' if c.remeasured != 1 else ''})" if c.remeasured else ""
    return (f"measured: {plans} in {runs}{again}: {_parts(c.measured_by, count_first=False)}; "
            f"{c.running:,} running (claimed)")


def count_lines(c: StudyCounts, study: str) -> list[str]:
    """Every count line, in order: the space (when a search stored it), the study, the front now, the
    measured runs."""
    return ([space_line(c.space)] if c.space is not None else []) + [study_line(c, study), front_line(c),
                                                                     measured_line(c)]


def count_lines_of(info: ParetoInfo) -> list[str]:
    """A report's count lines (`count_lines` of the counts `pareto_info` read from the study)."""
    if info.counts is None:
        return [f"{info.n_trials:,} trials, {len(info.plans):,} distinct plans, {len(info.front):,} on the front"]
    return count_lines(info.counts, info.study_name)
