"""ParetoInfo against hand-built studies: front membership, ties, infeasible trials, measured over predicted."""

from __future__ import annotations

import numpy as np
import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from report_studies import add, full_evaluation, new_study, plan, scenario, small_study

from stratagem.evaluators import evaluate
from stratagem.reports import advice_for, pareto_front, pareto_info
from stratagem.search.records import DIRECTIONS, objective_values


def by_label(info, **kw):
    want = plan(**kw).short()
    (p,) = [p for p in info.plans if p.label == want]
    return p


def test_front_membership_ties_and_dominated() -> None:
    info = pareto_info(small_study())
    a, b, c, d = (by_label(info, zero_stage=1), by_label(info, zero_stage=3), by_label(info, zero_stage=2),
                  by_label(info, zero_stage=1, micro_batch_size=2))
    assert a.on_front and b.on_front
    assert d.on_front, "a plan with exactly A's values ties A: neither dominates, both are on the front"
    assert not c.on_front and c.feasible, "C is dominated by A (more tokens/s, more headroom, less loss)"
    assert {info.plans[i].label for i in info.front} == {a.label, b.label, d.label,
                                                         plan(zero_stage=3, activation_checkpointing="full").short()}
    # Front order: tokens/s descending, ties by plan index.
    tps = [info.plans[i].value("tokens_per_s") for i in info.front]
    assert tps == sorted(tps, reverse=True)


def test_infeasible_plan_is_never_on_front_and_says_why() -> None:
    info = pareto_info(small_study())
    e = by_label(info, zero_stage=0)
    assert e.values is not None and e.values[0] == 150_000, "its figures are kept (plotted faintly)"
    assert not e.feasible and not e.on_front
    assert e.why_infeasible == "activations do not fit"
    assert e.constraint is not None and e.constraint > 0
    assert ("oom: activations breaks HBM first", 1) in info.infeasible_summary


def test_measured_overrides_predicted() -> None:
    info = pareto_info(small_study())
    f = by_label(info, zero_stage=3, activation_checkpointing="full")
    assert f.fidelity == "measured" and f.values == (95_000.0, 15.0, 0.005)
    assert f.prediction is not None and f.prediction.throughput is not None
    assert f.prediction.throughput.tokens_per_s == 60_000
    assert len(f.trial_numbers) == 2 and f.trial_number == max(f.trial_numbers)
    assert f.on_front, "measured 95k tokens/s with the lowest loss is not dominated"
    assert info.n_superseded == 1 and len(info.plans) == 6 and len(info.trials) == 7
    assert info.measured == [f.index]


def test_measured_oom_removes_a_predicted_front_plan() -> None:
    scn = scenario()
    study = new_study(scn)
    good = full_evaluation(plan(zero_stage=1), tps=100_000, headroom=10.0, loss=0.01)
    add(study, good)
    add(study, full_evaluation(plan(zero_stage=2), tps=50_000, headroom=5.0, loss=0.01))
    # Measured without a stored prediction: the analytic trial becomes its prediction.
    add(study, full_evaluation(plan(zero_stage=1), tps=100_000, headroom=-1.0, loss=0.01, status="oom",
                               fidelity="measured", reason="CUDA out of memory"))
    info = pareto_info(study)
    p1 = by_label(info, zero_stage=1)
    assert p1.fidelity == "measured" and not p1.feasible and not p1.on_front
    assert p1.prediction == good
    assert [info.plans[i].label for i in info.front] == [plan(zero_stage=2).short()]


def test_best_per_objective_and_ties_prefer_tokens() -> None:
    info = pareto_info(small_study())
    assert info.plans[info.best["tokens_per_s"]].value("tokens_per_s") == 100_000  # E (150k) does not fit
    assert info.plans[info.best["headroom_gib"]].label == plan(zero_stage=3).short()
    assert info.plans[info.best["goodput_loss"]].value("goodput_loss") == 0.005
    # A and D tie on tokens/s: the earlier plan wins deterministically.
    assert info.best["tokens_per_s"] == by_label(info, zero_stage=1).index


def test_unfinished_and_valueless_trials() -> None:
    scn = scenario()
    study = new_study(scn)
    add(study, full_evaluation(plan(zero_stage=1), tps=100_000, headroom=10.0, loss=0.01))
    add(study, None, p=plan(zero_stage=2), state=optuna.trial.TrialState.FAIL)  # crashed, nothing stored
    study.ask()  # a trial still running
    # Rule-infeasible plan: evaluation with no memory, pruned.
    bad = plan(dp=3)
    add(study, evaluate(scn, bad))
    info = pareto_info(study)
    assert info.n_trials == 4 and info.n_unfinished == 2
    (p,) = [p for p in info.plans if p.plan == bad]
    assert p.status == "infeasible" and p.values is None and not p.feasible and "dp*tp*pp*cp" in p.why_infeasible
    assert len(info.front) == 1


def test_empty_study_and_study_without_scenario() -> None:
    info = pareto_info(new_study(scenario()))
    assert info.plans == () and info.front == () and info.best == {}
    from stratagem.errors import StratagemError

    with pytest.raises(StratagemError, match="not made by stratagem"):
        pareto_info(optuna.create_study(directions=list(DIRECTIONS)))


def test_real_analytic_evaluations_round_trip(llama8b) -> None:
    """Trials stored from the real evaluator: the report reads back exactly what evaluate() gives."""
    study = new_study(llama8b)
    plans = [plan(zero_stage=z, micro_batch_size=m, activation_checkpointing=ac)
             for z in (0, 1, 3) for m in (1, 2) for ac in ("none", "full")]
    evs = [evaluate(llama8b, p) for p in plans]
    for ev in evs:
        add(study, ev)
    info = pareto_info(study)
    assert len(info.plans) == len(plans)
    for ev in evs:
        (p,) = [p for p in info.plans if p.plan == ev.plan]
        assert p.evaluation == ev
        try:
            assert p.values == tuple(objective_values(ev))
        except ValueError:  # the evaluator gives no throughput/checkpoint yet: no objective values
            assert p.values is None and not p.on_front


def brute_front(v: np.ndarray, directions) -> set[int]:
    sign = np.array([-1.0 if d == "maximize" else 1.0 for d in directions])
    m = v * sign
    out = set()
    for i in range(len(m)):
        if np.isnan(m[i]).any():
            continue
        dominated = any(
            not np.isnan(m[j]).any() and np.all(m[j] <= m[i]) and np.any(m[j] < m[i]) for j in range(len(m)))
        if not dominated:
            out.add(i)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.booleans()),
                min_size=0, max_size=40))
def test_pareto_front_matches_brute_force(rows) -> None:
    v = np.array([[a, b, c] if ok else [np.nan, b, c] for a, b, c, ok in rows], dtype=float).reshape(-1, 3)
    mask = pareto_front(v, DIRECTIONS)
    assert set(np.flatnonzero(mask).tolist()) == brute_front(v, DIRECTIONS)


def test_advice_front_first_and_bounded(llama8b) -> None:
    study = new_study(llama8b)
    evs = [evaluate(llama8b, plan(zero_stage=z, micro_batch_size=m)) for z in (0, 1, 2, 3) for m in (1, 2, 4)]
    for ev in evs:
        add(study, ev)
    full = pareto_info(study)
    assert all(p.advice is not None for p in full.plans if p.status != "infeasible")
    for p in full.plans:  # exactly what the decision tree says for that plan
        assert p.advice == advice_for(llama8b, p.evaluation)
    assert any(p.advice for p in full.plans), "some of these plans call for a change"
    bounded = pareto_info(study, advice_limit=3)
    rest = sorted((p for p in bounded.plans if p.feasible and not p.on_front),
                  key=lambda p: -p.value("tokens_per_s"))
    order = list(bounded.front) + [p.index for p in rest] + [p.index for p in bounded.plans if not p.feasible]
    assert sorted(p.index for p in bounded.plans if p.advice is not None) == sorted(order[:3])
    assert pareto_info(study, advice_limit=0).plans[0].advice is None
