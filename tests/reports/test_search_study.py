"""The report of a study written by the real search (`run_search`): the same front, every plan explained."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.reports import open_study, pareto_info, render_markdown
from stratagem.search import front_trials, run_search
from stratagem.spaces import load_scenario

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3-8b-8xh100.yaml"


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    url = f"journal:{tmp_path_factory.mktemp('search') / 'study.log'}"
    run_search(load_scenario(EXAMPLE), url, "s")
    return url


def test_front_is_the_search_front(storage) -> None:
    study = open_study(storage, "s")
    info = pareto_info(study)
    assert sorted(info.plans[i].trial_number for i in info.front) == sorted(t.number for t in front_trials(study))
    assert len(info.plans) == len(study.trials) and info.n_unfinished == 0


def test_every_unfit_plan_says_why(storage) -> None:
    info = pareto_info(open_study(storage, "s"))
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
        pareto_info(open_study(storage, "s")).front)
    md = render_markdown(pareto_info(open_study(storage, "s")))
    assert "## Pareto front" in md and "Advice:" in md
