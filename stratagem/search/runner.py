"""What a search stores and what it returns: `select_plans` (which screened plans become trials) and
`SearchResult` (what SearchSession.store did, search/session.py; resumable, and safe to run twice at once on
one storage; measured trials: SearchSession.measure).

What is stored: Optuna costs ~14 ms per trial written whole to SQLite (`study.add_trial`, one transaction
of ~37 statements, CPU-bound in SQLAlchemy; journal file ~0.7 ms) and 60-70 ms through ask/tell, so the
millions of screened plans stay in memory and only the feasible Pareto front, the pruned plans nearest the
memory limit and a random sample of the rest (search.stored_sample in all) become trials. Screening is
deterministic (seeded), so a rerun selects the same plans and stores only those still missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import optuna
from optuna.trial import FrozenTrial

from stratagem.search.screening import ScreenCounts, Screening
from stratagem.search.storage import StorageSpec

__all__ = ["SearchResult", "select_plans"]


@dataclass(frozen=True)
class SearchResult:
    """What a search did and what the study now holds."""

    study_name: str
    storage: StorageSpec
    counts: ScreenCounts
    """Plans valid / screened / pruned / feasible / on the predicted front (this run's screening)."""
    mode: str
    """exhaustive, or the sampler that explored a sampled space."""
    stored: int
    """Trials this call wrote."""
    already: int
    """Selected plans the study already held (a resumed or concurrent search stored them)."""
    front: list[FrozenTrial]
    """The study's Pareto front (feasible COMPLETE trials), highest tokens/s first."""
    trials: int
    """Trials in the study now."""
    seconds: float
    screening: Screening = field(repr=False)
    study: optuna.Study | None = field(default=None, repr=False, compare=False)
    """The study, open (callers reuse it rather than opening the storage again)."""
    backend: optuna.storages.BaseStorage | None = field(default=None, repr=False, compare=False)
    """The storage the study lives in, open (with `study`, what the session continues in)."""


def select_plans(screening: Screening, sample: int, seed: int) -> list[tuple[int, str]]:
    """(plan index, role) to store, in priority order: the front (highest tokens/s first), the pruned plans
    nearest the memory limit (sample // 2), then a seeded random sample of the rest."""
    cols = screening.columns
    front = screening.front[np.argsort(-cols.tokens_per_s[screening.front], kind="stable")]
    pruned = np.flatnonzero(~screening.feasible)
    over = cols.peak_gib[pruned] - screening.usable_gib
    boundary = pruned[np.argsort(over, kind="stable")][: sample // 2]
    taken = np.zeros(len(screening.plans), dtype=bool)
    taken[front] = True
    taken[boundary] = True
    rest = np.flatnonzero(~taken)
    k = min(sample - len(boundary), len(rest))
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(rest, size=k, replace=False)) if k > 0 else np.zeros(0, dtype=np.int64)
    return ([(int(i), "front") for i in front] + [(int(i), "boundary") for i in boundary]
            + [(int(i), "sample") for i in picked])
