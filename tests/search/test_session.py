"""A search session's results and exit rules (issue 22 item 6, issue 27 item 7): an OOM run is a result (the
study progressed), "nothing could be measured" only when no run of the call produced one, and the batch line of
an OOM-only batch says so instead of an unchanged 0% -> 0% error. One real case through Ray and the CLI is in
tests/search/test_cli_search.py."""

from __future__ import annotations

from pathlib import Path

from standin import SCENARIO, KnownConstants

from stratagem.reports.terminal import batch_line
from stratagem.search.events import BatchDone, Event
from stratagem.search.records import StudyKey
from stratagem.search.run_order import RankedOrder
from stratagem.search.session import SearchSession
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns

PLAN = Plan(dp=4)


def _measure(tmp_path: Path, evaluator: KnownConstants, events: list[Event]):
    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 's.db'}", "s", listener=events.append)
    s.screen()
    s.store()
    return s, s.measure(1, evaluator, RankedOrder(candidates=PlanColumns.from_plans([PLAN])))


def test_an_oom_run_is_a_result(tmp_path: Path) -> None:
    events: list[Event] = []
    s, mf = _measure(tmp_path, KnownConstants(oom={PLAN.short()}), events)
    assert mf.statuses == {"oom": 1} and mf.results == 1 and mf.ok_runs == 0
    assert mf.nothing_measured == ""  # exit 0: the study progressed
    (batch,) = [e for e in events if isinstance(e, BatchDone)]
    line = batch_line(batch)
    assert f"{PLAN.short()} oom" in line and "0% -> 0%" not in line and "no ok run to fit yet" in line
    assert batch.step.ooms == 1 and not batch.step.adopted
    assert s.study.user_attrs[StudyKey.CALIBRATION_HISTORY][0]["ooms"] == 1


def test_nothing_measured_says_why(tmp_path: Path) -> None:
    events: list[Event] = []
    _, mf = _measure(tmp_path, KnownConstants(fail={PLAN.short()}), events)
    assert mf.results == 0
    assert mf.nothing_measured.startswith("none of the 1 real run(s) of this call produced a result; first: ")
    assert f"{PLAN.short()}: failed" in mf.nothing_measured


def test_one_set_of_repredicted_trials_per_calibration(tmp_path: Path) -> None:
    """Issue 27 item 6: re-predicted trials are keyed by the calibration that made them; another call (worker,
    rerun) with the same calibration adds none, and every one carries the id of the study's latest calibration."""
    from stratagem.search.calibrate import calibration_history

    plans = PlanColumns.from_plans([Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)])
    url = f"sqlite:///{tmp_path / 'r.db'}"
    first = SearchSession(load_scenario(SCENARIO), url, "r", listener=lambda e: None)
    mf = first.measure(4, KnownConstants(), RankedOrder(candidates=plans))
    history = calibration_history(first.study.user_attrs[StudyKey.CALIBRATION_HISTORY])
    assert any(h.adopted for h in history) and mf.repredicted > 0  # the standin's constants are far from the defaults
    marks = {t.user_attrs["provenance"].get("calibration") for t in first.study.trials
             if t.user_attrs.get("role") == "recalibrated"}
    assert marks == {history[-1].calibration_id}
    again = SearchSession(load_scenario(SCENARIO), url, "r", listener=lambda e: None)
    assert again.measure(4, KnownConstants(), RankedOrder(candidates=plans)).repredicted == 0


def test_the_study_calibration_is_kept_in_a_file(tmp_path: Path) -> None:
    """After runs whose refit was adopted, the session's calibration file holds the study's calibration in force
    (constants and multipliers) and every measured run; loaded back it is the same calibration, so a rerun or
    `explain --calibration` predicts with it. A session with nothing adopted has none."""
    from stratagem.evaluators import Calibration
    from stratagem.evaluators.calibration_file import load_calibration, write_calibration

    plans = PlanColumns.from_plans([Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2),
                                    Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)])
    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 'c.db'}", "c", listener=lambda e: None)
    assert s.calibration_file() is None
    s.measure(4, KnownConstants(), RankedOrder(candidates=plans))
    cf = s.calibration_file()
    assert cf is not None and len(cf.runs) == 4
    assert cf.calibration == Calibration.model_validate(s.study.user_attrs[StudyKey.CALIBRATION])
    back = load_calibration(write_calibration(tmp_path / "calibration.yaml", cf))
    assert back.calibration == cf.calibration


def test_status_and_reports_say_what_the_runs_taught(tmp_path: Path) -> None:
    """A study whose calibration in force carries multipliers that moved: `status` and both reports print the same
    lines as `explain` (evaluators.taught.taught_lines), under the calibration line."""
    import math

    from stratagem.evaluators.calibration import default_calibration
    from stratagem.evaluators.priors import prior_for
    from stratagem.evaluators.step_parts import TIME_TERMS
    from stratagem.evaluators.taught import taught_lines
    from stratagem.reports import pareto_info, render_html, render_markdown
    from stratagem.search.status import study_status

    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 't.db'}", "t", listener=lambda e: None)
    s.screen()
    s.store()
    prior = prior_for("cpu").time()
    post = prior.model_copy(update={"mean": tuple(math.log(2.0) if t == "tp_comm_s" else 0.0 for t in TIME_TERMS),
                                    "runs": 5})
    cal = default_calibration("cpu").model_copy(update={"time_multipliers": post})
    s.study.set_user_attr(StudyKey.CALIBRATION, cal.model_dump(mode="json"))
    lines = taught_lines(cal, "cpu")
    assert len(lines) == 1 and lines[0].startswith("on this cluster: TP comm x")
    assert study_status(s.study).taught == lines
    info = pareto_info(s.study)
    assert info.taught == tuple(lines)
    assert f"- {lines[0]}" in render_markdown(info) and lines[0] in render_html(info)
