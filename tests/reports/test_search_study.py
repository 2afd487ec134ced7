"""The report of a study written by the real search (`run_search`): the same front, every plan explained."""

from __future__ import annotations

from pathlib import Path

import pytest
from sessions import run_search
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.reports import pareto_info, read_study, render_markdown
from stratagem.search import front_trials
from stratagem.spaces import load_scenario

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3-8b-8xh100.yaml"


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    url = f"journal:{tmp_path_factory.mktemp('search') / 'study.log'}"
    run_search(load_scenario(EXAMPLE), url, "s")
    return url


def test_front_is_the_search_front(storage) -> None:
    study = read_study(storage, "s")
    info = pareto_info(study)
    assert sorted(info.plans[i].trial_number for i in info.front) == sorted(t.number for t in front_trials(study))
    assert len(info.plans) == len(study.trials) and info.n_unfinished == 0


def test_every_unfit_plan_says_why(storage) -> None:
    info = pareto_info(read_study(storage, "s"))
    unfit = [p for p in info.plans if not p.feasible]
    assert unfit, "the search stores the plans nearest the memory limit"
    for p in unfit:
        assert p.why_infeasible and p.why_infeasible != "ok"
    causes = dict(info.infeasible_summary)
    assert sum(causes.values()) == len(unfit) and not any(c.startswith("ok") for c in causes)


def test_report_command_on_search_study(storage, tmp_path) -> None:
    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", "--storage", storage, "-o", str(out), "--nodes", "1,2"])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert 'id="capacity-table"' in page and page.count("<tr data-plan=") == len(
        pareto_info(read_study(storage, "s")).front)
    md = render_markdown(pareto_info(read_study(storage, "s")))
    assert "## Pareto front" in md and "Advice:" in md


def test_report_uses_the_studys_refitted_calibration(tmp_path) -> None:
    """Issue 11 bug 1: `report --nodes` planned capacity and gave advice with the default calibration, though
    the study's real runs refitted one. The CLI now calls the library's one report flow."""
    from stratagem.evaluators import Calibration, advise
    from stratagem.reports import capacity_markdown, capacity_plan

    scenario = tmp_path / "scn.yaml"
    scenario.write_text(EXAMPLE.read_text())
    scn = load_scenario(scenario)
    result = run_search(scn, f"sqlite:///{tmp_path}/stratagem.db", "cal")
    cal = Calibration(matmul_efficiency=0.2, attention_efficiency=0.1, context_gib=6.0, layer_floor_ms=20.0)
    import optuna

    from stratagem.search.storage import open_storage, parse_storage

    study = optuna.load_study(study_name="cal", storage=open_storage(parse_storage(result.storage.url)))
    study.set_user_attr("calibration", cal.model_dump(mode="json"))  # read_study reads only
    # `report SCENARIO` finds the storage beside the scenario (as `search` defaults it) when named by --study
    res = CliRunner().invoke(app, ["report", str(scenario), "--study", "cal", "-f", "md", "--nodes", "1,2"])
    assert res.exit_code == 0, res.output
    calibrated = capacity_markdown(capacity_plan(scn, [1, 2], cal), heading="##")
    default = capacity_markdown(capacity_plan(scn, [1, 2]), heading="##")
    assert calibrated != default
    table = [ln for ln in calibrated.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 2 ")]
    assert table and all(ln in res.output for ln in table), res.output
    # issue 34 item 7: `report SCENARIO` writes where search writes (STUDY.html beside the scenario), not into
    # the working directory
    res = CliRunner().invoke(app, ["report", str(scenario), "--study", "cal"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "cal.html").is_file() and f"wrote {tmp_path / 'cal.html'}" in " ".join(res.output.split())
    info = pareto_info(study)
    # the front's fastest plan with advice (the very best may have none: nothing faster fits)
    best = next(info.plans[i] for i in info.front if info.plans[i].advice)
    assert best.evaluation is not None
    expected = [a.effect or a.change for a in advise(scn, best.plan, best.evaluation, cal)]
    assert [a.effect for a in best.advice] == expected
    assert expected != [a.effect or a.change for a in advise(scn, best.plan, best.evaluation)]
