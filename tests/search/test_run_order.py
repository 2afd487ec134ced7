"""The run-order policies (search/run_order.py) apart from the loop: lost plans first, refused plans skipped and
remembered, infra retries bounded (every policy of RUN_ORDERS), re-measurements only after the K new plans (or
when none is left) and only when the best measured plan ran once or is within noise (search/noise.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from standin import SCENARIO, KnownConstants

from stratagem.evaluators import Evaluation
from stratagem.search.calibrate import calibration_id
from stratagem.search.claims import claim, release
from stratagem.search.events import Event
from stratagem.search.records import plan_key
from stratagem.search.run_order import INFRA_RETRIES, RUN_ORDERS, RankedOrder, RunState
from stratagem.search.session import SearchSession
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, zero_stage=3)]


def _session(tmp_path: Path, name: str = "o") -> SearchSession:
    events: list[Event] = []
    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 'o.db'}", name, listener=events.append)
    s.screen()
    s.store()
    return s


def _state(s: SearchSession, runs_left: int = 4, excluded: frozenset[str] = frozenset()) -> RunState:
    return RunState(scenario=s.scenario, space=s.space, study=s.study, calibration=s.start_calibration,
                    excluded=excluded, measured_runs=0, runs_left=runs_left,
                    unsupported=KnownConstants().unsupported)


@pytest.mark.parametrize("policy", list(RUN_ORDERS))
def test_refused_plans_are_skipped_and_the_rest_ranked(tmp_path: Path, policy: str) -> None:
    s = _session(tmp_path)
    order = RUN_ORDERS[policy](candidates=PlanColumns.from_plans(PLANS))
    picks = order.next_batch(_state(s), 10)
    keys = [plan_key(p) for p, _ in picks]
    assert sorted(keys) == sorted(plan_key(p) for p in PLANS if p.zero_stage != 3)
    assert list(order.skipped) == [plan_key(Plan(dp=4, zero_stage=3))]
    assert "ZeRO-3 is not in this harness" in order.skipped[plan_key(Plan(dp=4, zero_stage=3))]
    fewer = order.next_batch(_state(s, excluded=frozenset(keys[:1])), 10)
    assert keys[0] not in [plan_key(p) for p, _ in fewer]  # excluded plans are never proposed


@pytest.mark.parametrize("policy", list(RUN_ORDERS))
def test_a_lost_plan_runs_first(tmp_path: Path, policy: str) -> None:
    s = _session(tmp_path)
    order = RUN_ORDERS[policy](candidates=PlanColumns.from_plans(PLANS))
    last = order.next_batch(_state(s), 10)[-1][0]  # the ranking's last choice
    release(s.backend, claim(s.backend, s.study, s.space, last, "candidate"), "infra: node lost")
    assert plan_key(order.next_batch(_state(s), 1)[0][0]) == plan_key(last)


@pytest.mark.parametrize("policy", list(RUN_ORDERS))
def test_infra_failures_are_retried_a_bounded_number_of_times(tmp_path: Path, policy: str) -> None:
    s = _session(tmp_path)
    order = RUN_ORDERS[policy](candidates=PlanColumns.from_plans(PLANS))
    first = order.next_batch(_state(s), 1)[0][0]
    lost = Evaluation(plan=first, status="infra", reason="ActorUnavailableError", fidelity="measured")
    for _ in range(INFRA_RETRIES):
        order.update([lost])
        assert plan_key(order.next_batch(_state(s), 1)[0][0]) == plan_key(first)
    order.update([lost])
    assert plan_key(first) not in [plan_key(p) for p, _ in order.next_batch(_state(s), 10)]


def test_no_remeasure_without_a_spread(tmp_path: Path) -> None:
    """Runs without a spread (a table, the stand-in without noise) are of unknown spread: never re-measured,
    whatever the budget left."""
    s = _session(tmp_path)
    cands = PlanColumns.from_plans(PLANS[:3])
    mf = s.measure(5, KnownConstants(), RankedOrder(candidates=cands))
    roles = [t.user_attrs.get("role") for t in s.study.trials if t.user_attrs.get("fidelity") == "measured"]
    assert mf.measured == 3 and "remeasured" not in roles
    assert "spread unknown" in mf.best_note


def test_the_last_runs_settle_a_ranking_within_noise(tmp_path: Path) -> None:
    """With a 40 % step-time noise every interval overlaps: the runs beyond the candidates' count re-measure the
    best plan and its rivals, and each re-measured trial holds the plan's runs pooled."""
    s = _session(tmp_path)
    cands = PlanColumns.from_plans(PLANS[:3])
    mf = s.measure(5, KnownConstants(noise=0.4, seed=1), RankedOrder(candidates=cands))
    measured = [t for t in s.study.trials if t.user_attrs.get("fidelity") == "measured"]
    again = [t for t in measured if t.user_attrs.get("role") == "remeasured"]
    assert mf.measured == 5 and len(again) == 2
    assert len({t.user_attrs["plan"] for t in measured}) == 3  # no new plan for the last two runs
    from stratagem.search.records import trial_evaluation

    pooled = trial_evaluation(again[-1])
    assert pooled.provenance["pooled"]["runs"] >= 2 and pooled.measurements["step_spread"]["n"] >= 16  # 8 steps a run
    assert mf.best_note.startswith("best measured: ")
    assert calibration_id(s.start_calibration)  # the session's calibration is resolved once


def test_the_memory_band_is_how_far_the_model_over_predicts(tmp_path: Path) -> None:
    """A plan predicted over the limit may fit only when the model over-predicts: the stand-in's true peaks are
    above the starting calibration's predictions (more fragmentation), so the band stays at its 2 % floor; with a
    calibration that predicts 10 % more fragmentation than the truth it widens to that over-prediction."""
    from standin import TRUTH

    from stratagem.evaluators import evaluate_many
    from stratagem.search.run_order import DEFAULT_MEMORY_BAND, memory_band

    s = _session(tmp_path)
    assert memory_band(s.study, s.scenario, s.start_calibration) == DEFAULT_MEMORY_BAND  # nothing measured yet
    s.measure(2, KnownConstants(), RankedOrder(candidates=PlanColumns.from_plans(PLANS[:2])), recalibrate=False,
              remeasure=0)
    assert memory_band(s.study, s.scenario, s.start_calibration) == 0.02
    high = TRUTH.model_copy(update={"fragmentation": TRUTH.fragmentation + 0.1})
    over = evaluate_many(s.scenario, PlanColumns.from_plans(PLANS[:2]), high).peak_gib
    true = evaluate_many(s.scenario, PlanColumns.from_plans(PLANS[:2]), TRUTH).peak_gib
    expected = max(0.02, float(np.median(over / true - 1.0)))
    assert abs(memory_band(s.study, s.scenario, high) - expected) < 1e-9 and expected > 0.02


class _EveryStage(KnownConstants):
    """The stand-in with ZeRO-3 in its harness (torch runs `dp2 pp2 z3` as ZeRO-2's job: spaces/canonical.py)."""

    def unsupported(self, scenario: object, plan: Plan) -> str | None:
        return None


@pytest.mark.parametrize("policy", list(RUN_ORDERS))
def test_a_candidate_in_another_form_of_a_measured_job_is_not_run_again(tmp_path: Path, policy: str) -> None:
    """A user's candidate not in canonical form (torch with pp > 1: ZeRO-3 keeps parameters gathered, ZeRO-2's job)
    is stored under its job's key; the run order compares by job, so the job runs once and K beyond the distinct
    jobs runs nothing new."""
    from stratagem.search.run_order import job_key

    s = _session(tmp_path)
    z3 = Plan(dp=2, pp=2, zero_stage=3)
    assert job_key(s.scenario, z3) == plan_key(Plan(dp=2, pp=2, zero_stage=2)) != plan_key(z3)
    runs = _EveryStage()
    mf = s.measure(3, runs, RUN_ORDERS[policy](candidates=PlanColumns.from_plans([z3, Plan(dp=4)])),
                   recalibrate=False, remeasure=0)
    jobs = [job_key(s.scenario, p) for p in runs.ran]
    assert sorted(jobs) == sorted({job_key(s.scenario, z3), plan_key(Plan(dp=4))}) and mf.measured == 2


@pytest.mark.parametrize("policy", list(RUN_ORDERS))
def test_two_candidates_of_one_job_run_once(tmp_path: Path, policy: str) -> None:
    """Candidates naming one job in two forms are one plan to the run order: one of them runs, in one batch."""
    s = _session(tmp_path)
    order = RUN_ORDERS[policy](candidates=PlanColumns.from_plans([Plan(dp=2, pp=2, zero_stage=3),
                                                                  Plan(dp=2, pp=2, zero_stage=2)]))
    state = RunState(scenario=s.scenario, space=s.space, study=s.study, calibration=s.start_calibration,
                     excluded=frozenset(), measured_runs=0, runs_left=4, unsupported=_EveryStage().unsupported)
    assert len(order.next_batch(state, 4)) == 1
