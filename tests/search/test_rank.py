"""The real-run order of the multi-fidelity loop (`rank_candidates`): fastest predicted plans that may fit first,
a boundary plan only when it is within the memory model's error of the limit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from stratagem.search.run_order import rank_candidates
from stratagem.search.screening import ScreenCounts, Screening
from stratagem.spaces import Plan, SearchSpace, load_scenario
from stratagem.spaces.columns import PlanColumns

ROOT = Path(__file__).resolve().parents[2]
PLANS = [Plan(dp=4, zero_stage=z, micro_batch_size=m) for z, m in ((0, 1), (1, 2), (2, 1), (3, 2), (3, 1))]


def _screening(tokens: list[float], peak: list[float], usable: float = 10.0) -> Screening:
    scn = load_scenario(ROOT / "examples" / "tiny-cpu.yaml")
    plans = PlanColumns.from_plans(PLANS[: len(tokens)])
    t, p = np.array(tokens, dtype=float), np.array(peak, dtype=float)
    feasible = p <= usable
    # front: here simply the feasible plan with the most tokens/s and the one with the most headroom
    fi = np.flatnonzero(feasible)
    front = np.unique([fi[np.argmax(t[fi])], fi[np.argmin(p[fi])]]).astype(np.intp)
    cols = SimpleNamespace(tokens_per_s=t, peak_gib=p, headroom_gib=usable - p)  # the PlanFigures it reads
    return Screening(space=SearchSpace(scn), plans=plans, columns=cols, feasible=feasible, front=front,  # type: ignore[arg-type]
                     counts=ScreenCounts(valid=len(t), screened=len(t), pruned=int((~feasible).sum()),
                                         feasible=int(feasible.sum()), front=len(front)),
                     usable_gib=usable, broke=np.where(feasible, -1, 3), mode="candidates", seconds=0.0)


def test_fastest_that_may_fit_first_boundary_only_within_the_band() -> None:
    #              0      1      2      3      4
    tokens = [100.0, 300.0, 200.0, 400.0, 500.0]
    peak = [1.0, 9.0, 5.0, 10.3, 12.0]  # usable 10: plan 3 is 3 % over, plan 4 is 20 % over
    s = _screening(tokens, peak)
    order = rank_candidates(s, set(), 10, include_infeasible=True, memory_band=0.05)
    labels = [(s.plans.plan(i).model_dump(), None) for i in range(5)]
    idx = [next(i for i, (d, _) in enumerate(labels) if d == p.model_dump()) for p, _ in order]
    assert idx == [3, 1, 2, 0, 4]  # 3 (within the band, fastest), then fitting by tokens/s, 4 last
    roles = dict(zip(idx, (r for _, r in order), strict=True))
    assert roles[3] == "boundary" and roles[1] == "front" and roles[4] == "candidate"
    # with a tight band (the memory model proved accurate) the over-limit plan waits until the fitting ones ran
    tight = rank_candidates(s, set(), 10, include_infeasible=True, memory_band=0.02)
    tidx = [next(i for i, (d, _) in enumerate(labels) if d == p.model_dump()) for p, _ in tight]
    assert tidx[:3] == [1, 2, 0] and set(tidx[3:]) == {3, 4}
    # without include_infeasible nothing beyond the band is ever proposed; measured plans are skipped
    from stratagem.search.records import plan_key

    some = rank_candidates(s, {plan_key(s.plans.plan(1))}, 10, memory_band=0.05)
    assert [plan_key(p) for p, _ in some] == [plan_key(s.plans.plan(i)) for i in (3, 2, 0)]
