"""Budgets a user controls (issue 27 item 4): a rerun with --budget-minutes opens a new window (recorded in the
study, spent and left per window), a worker with the same budget joins the open one, no run starts that could
not finish in what is left, runs in flight at the window's end are stopped and their claims released."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from standin import SCENARIO, KnownConstants

from stratagem.errors import StratagemError
from stratagem.search.budget import RUN_TIMEOUT_FLOOR_S, budget_windows, check_run_timeout, derived_timeout
from stratagem.search.claims import live_claims
from stratagem.search.events import BatchDone, Event, WindowOpened
from stratagem.search.records import StudyKey
from stratagem.search.run_order import RankedOrder
from stratagem.search.session import SearchSession
from stratagem.search.status import study_status
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = PlanColumns.from_plans([Plan(dp=4), Plan(dp=2, tp=2), Plan(dp=2, pp=2)])


def _session(url: str, events: list[Event]) -> SearchSession:
    s = SearchSession(load_scenario(SCENARIO), url, "b", listener=events.append)
    s.screen()
    s.store()
    return s


def test_a_rerun_opens_a_new_window_and_a_same_budget_worker_joins(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    events: list[Event] = []
    first = _session(url, events)
    done = first.measure(1, KnownConstants(), RankedOrder(candidates=PLANS), budget_minutes=30, run_timeout_s=90.0)
    assert done.measured == 1
    windows = budget_windows(first.study)
    assert len(windows) == 1 and windows[0].minutes == 30 and windows[0].ended is not None  # K reached: closed
    assert [e.index for e in events if isinstance(e, WindowOpened)] == [1]
    again = _session(url, events)  # "continue tonight with 2 more hours": one more plan, a new window
    assert again.run_timeout(None) == 90.0 and again.run_timeout(30.0) == 30.0  # --run-timeout kept with the study
    mf = again.measure(1, KnownConstants(), RankedOrder(candidates=PLANS), budget_minutes=120)
    assert mf.measured == 2 and mf.runs == 1
    opened = [e for e in events if isinstance(e, WindowOpened)]
    assert (opened[-1].index, opened[-1].joined, opened[-1].minutes) == (2, False, 120)
    windows = budget_windows(again.study)
    assert [w.minutes for w in windows] == [30, 120]
    assert all(w.spent_s() >= 0 and w.left_s() == 0 for w in windows)  # both closed: spent frozen, none left
    assert again.study.user_attrs[StudyKey.REAL_RUNS_BUDGET_MINUTES] == 120  # the current window, for status


def test_no_run_starts_that_cannot_finish_in_the_budget_left(tmp_path: Path) -> None:
    events: list[Event] = []
    s = _session(f"sqlite:///{tmp_path / 'b.db'}", events)
    mf = s.measure(3, KnownConstants(run_s=120.0), RankedOrder(candidates=PLANS), budget_minutes=1)
    assert mf.runs == 0 and "predicted to take 120 s" in mf.ended
    assert not mf.nothing_measured  # a budget too short is not a failure to measure


def test_runs_in_flight_stop_at_the_windows_end_with_claims_released(tmp_path: Path) -> None:
    events: list[Event] = []
    s = _session(f"sqlite:///{tmp_path / 'b.db'}", events)
    t0 = time.monotonic()
    mf = s.measure(3, KnownConstants(delay_s=600.0, run_s=1.0), RankedOrder(candidates=PLANS),
                   budget_minutes=0.05)  # 3 s: the stand-in's 600 s run is in flight at the end
    assert time.monotonic() - t0 < 60
    assert mf.measured == 0 and mf.runs == 1 and not live_claims(s.study)
    released = [t.user_attrs.get("released") for t in s.study.trials if t.user_attrs.get("fidelity") == "measured"]
    assert released == ["budget window ended"]
    assert "budget window is spent" in mf.ended and mf.stopped == 1 and not mf.nothing_measured
    # issue 36 item 5: the budget's end is not the cluster's failure, and status counts the run as lost to it
    runs = [r for e in events if isinstance(e, BatchDone) for r in e.runs]
    assert [(r.status, r.reason) for r in runs] == [("stopped", "budget window ended")]
    assert "infra" not in mf.statuses
    st = study_status(s.study)
    assert (st.budget_released, st.infra, st.retries_pending) == (1, 0, 1)


def test_run_timeout_is_derived_with_a_floor_or_given() -> None:
    assert derived_timeout(1.0) == RUN_TIMEOUT_FLOOR_S
    assert derived_timeout(1000.0) == 3000.0
    assert check_run_timeout(None) is None and check_run_timeout(30.0) == 30.0
    with pytest.raises(StratagemError, match=r"--run-timeout \(0\): must be > 0"):
        check_run_timeout(0.0)
