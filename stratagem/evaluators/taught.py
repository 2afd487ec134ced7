"""What a study's runs taught the model, in words: one line per step-time term or memory block whose multiplier
the runs moved or pinned down, e.g. "on this cluster: TP comm x1.4 +- 0.2 from 5 runs". The one source of these
lines for `explain`, `status` and the reports.

A term is shown when its posterior differs meaningfully from the device's prior (evaluators.priors): its mean
moved by more than one posterior sd, or its precision is at least twice the prior's (the runs told at least as
much as the prior knew). The figure is the log-normal posterior's mean multiplier exp(mu + s^2/2) and its sd
mean x sqrt(exp(s^2) - 1).
"""

from __future__ import annotations

import math

from stratagem.evaluators.calibration import Calibration, LogMultipliers
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.step_parts import STEP_PARTS

__all__ = ["LABELS", "taught_lines", "moved_terms"]

LABELS: dict[str, str] = {
    # a communication term's multiplier scales its traffic before overlap: named by its group alone
    **{p.name: f"{p.group} comm" if p.group else p.label for p in STEP_PARTS if p.term},
    "weights": "weights memory", "gradients": "gradients memory", "optimizer": "optimizer-state memory",
    "activations": "activations memory", "transient": "transient memory", "overhead": "memory overhead",
}
"""How a term or block is named in the lines."""


def moved_terms(post: LogMultipliers, prior: LogMultipliers) -> list[tuple[str, float, float]]:
    """(name, mean multiplier, its sd) of each term whose posterior moved or narrowed meaningfully (module
    docstring), the largest move first."""
    out: list[tuple[float, str, float, float]] = []
    for i, name in enumerate(post.names):
        if name not in prior.names:
            continue
        j = prior.names.index(name)
        mu, var = post.mean[i], post.cov[i][i]
        mu0, var0 = prior.mean[j], prior.cov[j][j]
        moved = abs(mu - mu0) > math.sqrt(var)
        narrowed = var0 > 0 and var <= 0.5 * var0
        if moved or narrowed:
            mean = math.exp(mu + var / 2)
            out.append((abs(mu - mu0), name, mean, mean * math.sqrt(math.expm1(var))))
    return [(name, mean, sd) for _, name, mean, sd in sorted(out, key=lambda x: -x[0])]


def taught_lines(cal: Calibration | None, gpu_name: str) -> list[str]:
    """One line per term and block the calibration's multipliers learnt (none without multipliers), e.g.
    "on this cluster: TP comm x1.4 +- 0.2 from 5 runs"."""
    if cal is None:
        return []
    prior = prior_for(gpu_name)
    lines = []
    for post, start in ((cal.time_multipliers, prior.time()), (cal.memory_multipliers, prior.memory())):
        if post is None:
            continue
        for name, mean, sd in moved_terms(post, start):
            lines.append(f"on this cluster: {LABELS.get(name, name)} x{_fig(mean)} +- {_fig(sd)} from {post.runs} "
                         f"run{'s' if post.runs != 1 else ''}")
    return lines


def _fig(x: float) -> str:
    """Two significant digits, at most two decimals (x1.4, x0.85, +- 0.05)."""
    return f"{x:.2f}".rstrip("0").rstrip(".") if x < 10 else f"{x:.2g}"
