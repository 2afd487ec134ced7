"""What the runs taught, in one line per term: only terms the posterior moved or pinned down."""

from __future__ import annotations

import math

from stratagem.evaluators.calibration import LogMultipliers, default_calibration
from stratagem.evaluators.priors import prior_for
from stratagem.evaluators.step_parts import TIME_TERMS
from stratagem.evaluators.taught import moved_terms, taught_lines


def _post(changes: dict[str, tuple[float, float]], runs: int = 5) -> LogMultipliers:
    """The cpu prior with (mean, sd) of some terms replaced."""
    prior = prior_for("cpu").time()
    k = len(TIME_TERMS)
    mean = [changes.get(n, (0.0, 0.0))[0] for n in TIME_TERMS]
    sd = [changes[n][1] if n in changes else math.sqrt(prior.cov[i][i]) for i, n in enumerate(TIME_TERMS)]
    return LogMultipliers(names=TIME_TERMS, mean=tuple(mean),
                          cov=tuple(tuple(sd[i] ** 2 if i == j else 0.0 for j in range(k)) for i in range(k)),
                          noise_sd=0.1, runs=runs)


def test_one_line_per_term_the_runs_moved_or_narrowed() -> None:
    post = _post({"tp_comm_s": (math.log(1.4), 0.14), "compute_s": (0.01, 0.1), "bubble_s": (0.05, 0.3)})
    cal = default_calibration("cpu").model_copy(update={"time_multipliers": post})
    lines = taught_lines(cal, "cpu")
    # TP moved by more than its sd (first: the largest move); compute barely moved but its sd fell from 0.37 to 0.1
    # (precision x13); the bubble neither moved beyond its sd nor narrowed to half the prior's variance
    assert lines == ["on this cluster: TP comm x1.41 +- 0.2 from 5 runs",
                     "on this cluster: compute x1.02 +- 0.1 from 5 runs"], lines
    mean, sd = moved_terms(post, prior_for("cpu").time())[0][1:]
    assert mean == math.exp(math.log(1.4) + 0.14**2 / 2) and sd == mean * math.sqrt(math.expm1(0.14**2))


def test_nothing_to_say_without_multipliers_or_without_a_move() -> None:
    assert taught_lines(None, "cpu") == [] and taught_lines(default_calibration("cpu"), "cpu") == []
    prior = prior_for("cpu").time()
    assert taught_lines(default_calibration("cpu").model_copy(update={"time_multipliers": prior}), "cpu") == []
