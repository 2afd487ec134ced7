"""`StudyView`: the read side report, export, status and reproduce share, on a study a stand-in real-run search
wrote (SQLite) and on a journal: the same front and standings as the study schema gives, the typed calibration
history, counts that add up; opening never creates a storage or a study."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from sessions import run_multifidelity
from standin import SCENARIO, KnownConstants

from stratagem.errors import StratagemError
from stratagem.search.calibrate import CalibrationStep
from stratagem.search.records import front_trials, standings
from stratagem.search.view import StudyView
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2)]


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_the_view_reads_what_the_search_wrote(tmp_path: Path, kind: str) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}" if kind == "sqlite" else f"journal:{tmp_path / 's.log'}"
    run_multifidelity(load_scenario(SCENARIO), url, "s", KnownConstants(), real_runs=2,
                      candidates=PlanColumns.from_plans(PLANS))
    before = sorted(p.name for p in tmp_path.iterdir())
    view = StudyView.open(url)  # the storage's only study
    assert view.name == "s" and view.spec.url == url
    study = optuna.load_study(study_name="s", storage=url if kind == "sqlite" else view.storage)
    assert [t.number for t in view.front()] == [t.number for t in front_trials(study)]
    assert set(view.standings()) == set(standings(study.get_trials(deepcopy=False)))
    history = view.calibration_history()
    assert history and all(isinstance(h, CalibrationStep) for h in history)
    assert history[-1].measured == 2 and view.calibration() is not None
    c = view.counts()
    status = view.status()
    assert c.measured == sum(status.measured.values()) == 2 and c.analytic == status.analytic
    assert c.trials == len(study.trials) and c.running == 0 and c.plans == len(view.standings())
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # reading wrote nothing new


def test_opening_names_what_is_there(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    for name in ("a", "b"):
        optuna.create_study(storage=url, study_name=name)
    with pytest.raises(StratagemError, match=r"holds 2 studies \(a, b\); name one with --study"):
        StudyView.open(url)
    with pytest.raises(StratagemError, match=r"--study \('c'\): no such study .* studies there: a, b"):
        StudyView.open(url, "c")
    assert StudyView.open(url, "b").name == "b"
    names = [s.study_name for s in optuna.get_all_study_summaries(url, include_best_trial=False)]
    assert names == ["a", "b"]  # no study created by a wrong name


def test_best_measured_is_the_one_rule(tmp_path: Path) -> None:
    from stratagem.search.noise import best_measured

    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(load_scenario(SCENARIO), url, "s", KnownConstants(noise=0.05), real_runs=2,
                      candidates=PlanColumns.from_plans(PLANS))
    view = StudyView.open(url, "s")
    best, rule = view.best_measured(), best_measured(view.study)
    assert best is not None and rule is not None and best.key == rule.key and best.note == rule.note
    assert best.note.removeprefix("best measured: ") in view.status().best_measured


def test_the_report_states_the_best_measured_plan_by_the_one_rule(tmp_path: Path) -> None:
    import json

    from stratagem.reports import build_report

    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(load_scenario(SCENARIO), url, "s", KnownConstants(noise=0.05), real_runs=2,
                      candidates=PlanColumns.from_plans(PLANS))
    view = StudyView.open(url, "s")
    best = view.best_measured()
    assert best is not None
    md = build_report(view.study, "md").text
    assert f"Best measured (trial {best.number}): {best.plan.short()}" in md
    doc = json.loads(build_report(view.study, "json").text)
    assert doc["best_measured"] == {"trial": best.number, "note": best.note}
    stored = {t.number: t.user_attrs["plan"] for t in view.trials() if "plan" in t.user_attrs}
    assert doc["trials"] and all(row["plan_key"] == stored[row["trial"]] for row in doc["trials"])  # the study's key


def test_the_report_says_when_no_refit_was_adopted(tmp_path: Path) -> None:
    from stratagem.reports import pareto_info
    from stratagem.search.records import StudyKey

    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(load_scenario(SCENARIO), url, "s", KnownConstants(), real_runs=2,
                      candidates=PlanColumns.from_plans(PLANS))
    view = StudyView.open(url, "s")
    history = view.calibration_history()
    assert history and view.calibration() is not None
    import optuna

    from stratagem.search.storage import open_storage, parse_storage

    writable = optuna.load_study(study_name="s", storage=open_storage(parse_storage(url)))  # the view reads only
    for adopted, words in ((True, "then refitted on this study's"), (False, "kept: no refit")):
        steps = [h.model_copy(update={"adopted": adopted}).model_dump(mode="json") for h in history]
        writable.set_user_attr(StudyKey.CALIBRATION_HISTORY, steps)
        text = pareto_info(StudyView.open(url, "s").study).calibration
        assert words in text and ("refitted on" in text) == adopted, text
