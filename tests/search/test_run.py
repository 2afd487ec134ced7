from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState
from sessions import run_search

from stratagem.errors import StratagemError
from stratagem.evaluators import evaluate
from stratagem.search import (
    CONSTRAINT,
    front_trials,
    plan_key,
    screen,
    select_plans,
    study_scenario,
    trial_evaluation,
    trial_plan,
)
from stratagem.search.session import SearchSession
from stratagem.search.storage import open_storage, parse_storage
from stratagem.spaces import SearchConfig, load_scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def scenario(**search):
    s = load_scenario(EXAMPLES / "llama3-8b-8xh100.yaml")
    cfg = SearchConfig(precision=["bf16", "fp8"], activation_checkpointing=["none", "full"], stored_sample=20,
                       **search)
    return s.model_copy(update={"search": cfg})


def narrow():
    """A small space (front of 8) for the measured path, whose trials cost one storage write per field."""
    s = load_scenario(EXAMPLES / "llama3-8b-8xh100.yaml")
    cfg = SearchConfig(pp=1, cp=1, tp=[1, 2], precision=["bf16"], stored_sample=4)
    return s.model_copy(update={"search": cfg})


def load(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(parse_storage(url)))


@pytest.fixture(params=["sqlite", "journal"])
def url(request, tmp_path) -> str:
    return f"sqlite:///{tmp_path}/s.db" if request.param == "sqlite" else f"journal:{tmp_path}/s.log"


def test_stores_the_front_and_a_bounded_sample(url) -> None:
    s = scenario()
    r = run_search(s, url, "st")
    sc = r.screening
    chosen = select_plans(sc, 20, 0)
    assert r.stored == len(chosen) == sc.counts.front + 20 and r.already == 0
    study = load(url, "st")
    trials = study.trials
    assert len(trials) == len(chosen)
    keys = [t.user_attrs["plan"] for t in trials]
    assert len(set(keys)) == len(keys)
    assert keys == [plan_key(sc.plan(i)) for i, _ in chosen]
    # the study's own Pareto front is the screened front (the whole front is stored)
    front_keys = {t.user_attrs["plan"] for t in front_trials(study)}
    assert front_keys == {plan_key(sc.plan(i)) for i in sc.front}
    assert [t.user_attrs["plan"] for t in r.front] == [t.user_attrs["plan"] for t in front_trials(study)]
    for t, (i, role) in zip(trials, chosen, strict=True):
        plan = trial_plan(t)
        ev = trial_evaluation(t)
        assert plan == sc.plan(i) and ev is not None and ev.plan == plan
        assert t.user_attrs["role"] == role and t.user_attrs["fidelity"] == "analytic"
        assert t.user_attrs["provenance"]["scenario_hash"] == s.problem_hash()
        assert t.constraints[CONSTRAINT] == pytest.approx(ev.memory.peak_gib - sc.usable_gib)
        if sc.feasible[i]:
            assert t.state == TrialState.COMPLETE
            assert np.allclose(t.values, sc.objectives()[i], rtol=1e-12)
        else:
            assert t.state == TrialState.PRUNED and t.values is None
            assert "first block that does not fit" in t.user_attrs["pruned"]
    assert {role for _, role in chosen} == {"front", "boundary", "sample"}
    assert study_scenario(study) == s
    assert study.user_attrs["counts"]["front"] == sc.counts.front
    assert study.user_attrs["space_digest"] == sc.space.digest()


def test_rerun_resumes_without_repeating(url) -> None:
    s = scenario()
    first = run_search(s, url, "st")
    again = run_search(s, url, "st")
    assert again.stored == 0 and again.already == first.stored and again.trials == first.trials
    assert [t.number for t in again.front] == [t.number for t in first.front]


def test_study_of_another_scenario_is_refused(url) -> None:
    run_search(scenario(), url, "st")
    with pytest.raises(StratagemError, match="another search section"):
        run_search(scenario(memory_margin_gib=5.0), url, "st")
    other = load_scenario(EXAMPLES / "llama3-70b-64xh100.yaml")
    with pytest.raises(StratagemError, match="another scenario"):
        run_search(other, url, "st")
    assert len(load(url, "st").trials) == run_search(scenario(), url, "st").trials


def test_foreign_study_is_refused(url) -> None:
    storage = open_storage(parse_storage(url))
    foreign = optuna.create_study(storage=storage, study_name="theirs")
    foreign.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    with pytest.raises(StratagemError, match="did not make"):
        run_search(scenario(), url, "theirs")


def test_empty_study_left_by_a_kill_is_adopted(url) -> None:
    storage = open_storage(parse_storage(url))
    optuna.create_study(storage=storage, study_name="st", directions=["maximize", "maximize", "minimize"])
    r = run_search(scenario(), url, "st")
    assert r.stored == r.trials > 0


def test_bad_input_leaves_no_study(tmp_path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    with pytest.raises(StratagemError):
        run_search(scenario(tp=3), url, "st")
    with pytest.raises(StratagemError):
        run_search(scenario(), "sqlite:////no/such/dir/s.db", "st")
    with pytest.raises(StratagemError):
        run_search(scenario(), url, "st", timeout=-1)
    assert not (tmp_path / "s.db").exists()


class MeasuredAnalytic:
    """An evaluator reporting measured fidelity (judging with the analytic model)."""

    fidelity = "measured"

    def evaluate(self, scenario, plan):
        return evaluate(scenario, plan).model_copy(update={"fidelity": "measured"})


def test_measured_evaluators_go_through_the_one_real_run_path(url) -> None:
    # measured trials are written by SearchSession.measure only (claims, infra retries): test_multifidelity.py
    with pytest.raises(StratagemError, match="SearchSession.measure"):
        SearchSession(narrow(), url, "m").store(MeasuredAnalytic())


def test_screen_contract_for_reports() -> None:
    sc = screen(scenario())
    assert len(sc.plans) == len(sc.feasible) == len(sc.columns.peak_gib)
    assert sc.front.dtype.kind == "i" and sc.feasible[sc.front].all()
    assert (sc.counts.valid, sc.counts.pruned, sc.counts.front) == (
        len(sc.plans), int((~sc.feasible).sum()), len(sc.front))


def test_search_imports_neither_ray_nor_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, stratagem.search, stratagem.search.naming; "
            "bad = [m for m in ('ray', 'torch') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
