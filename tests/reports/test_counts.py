"""Counts that add up (issue 26 item 4): one counting rule (`search.counts.study_counts`) printed the same way by
`stratagem search` (its end summary), `stratagem report` (HTML and Markdown) and `stratagem status`; where the
front now parts from the predicted front, the line says why."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
from report_studies import DISTRIBUTIONS, full_evaluation, new_study, plan, scenario
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.evaluators.evaluation import Evaluation
from stratagem.reports import pareto_info, render_markdown
from stratagem.reports.counts import count_lines
from stratagem.search.counts import study_counts
from stratagem.search.records import CONSTRAINT, objective_values, plan_params

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _add(study: optuna.Study, ev: Evaluation, role: str) -> None:
    """One trial as the search stores it (records.py), with its role."""
    ok = ev.status == "ok"
    study.add_trial(optuna.trial.create_trial(
        params=plan_params(ev.plan), distributions={k: DISTRIBUTIONS[k] for k in plan_params(ev.plan)},
        values=objective_values(ev) if ok else None,
        state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.PRUNED,
        constraints={CONSTRAINT: ev.memory.peak_gib - ev.memory.hbm_gib} if ev.memory else None,
        user_attrs={"plan": ev.plan.short(), "fidelity": ev.fidelity, "status": ev.status, "role": role,
                    "evaluation": ev.model_dump(mode="json")}))


def _study(storage: str) -> optuna.Study:
    """Four plans on the predicted front (A, B, C, G), one sampled (S); then C runs out of memory, G measures
    slower than B, and F (proposed by the sampler) measures fast enough to dominate A; F is re-measured."""
    study = new_study(scenario(), storage, "counts")
    study.set_user_attr("counts", {"valid": 100, "screened": 100, "pruned": 30, "feasible": 70, "front": 4,
                                   "pruned_by": {"activations": 20, "optimizer": 10}, "margin_gib": 2.0,
                                   "mode": "exhaustive"})
    a, b, c, g, s, f = (plan(zero_stage=z, micro_batch_size=m) for z, m in
                        ((1, 1), (3, 1), (0, 1), (2, 1), (2, 2), (3, 2)))
    for p, tps, room in ((a, 100_000, 10.0), (b, 90_000, 20.0), (c, 120_000, 2.0), (g, 95_000, 12.0)):
        _add(study, full_evaluation(p, tps=tps, headroom=room, loss=0.01), "front")
    _add(study, full_evaluation(s, tps=50_000, headroom=5.0, loss=0.01), "sample")
    _add(study, full_evaluation(c, tps=120_000, headroom=-1.0, loss=0.01, status="oom", fidelity="measured",
                                reason="OOM: activations"), "front")
    _add(study, full_evaluation(g, tps=85_000, headroom=12.0, loss=0.01, fidelity="measured"), "front")
    for role in ("sampler", "remeasured"):
        _add(study, full_evaluation(f, tps=110_000, headroom=15.0, loss=0.01, fidelity="measured"), role)
    return study


EXPECTED = [
    "space: 100 valid plans (distinct jobs), all screened; 30 pruned (predicted peak over HBM - 2.00 GiB margin; "
    "first block over it: activations 20, optimizer 10), 70 fit, 4 on the predicted front",
    "study 'counts': 9 in all: 5 screened plans, 4 measured runs; 6 distinct plans (4 from the predicted front, 1 "
    "sampled, 1 proposed by the sampler), 5 of them fit",
    "Pareto front now: 2 plans (1 measured, 1 predicted): of the 4 plans stored from the predicted front, 3 left it "
    "(1 measured oom, 1 dominated by plans measured or re-predicted since, 1 dominated on measured figures), 1 "
    "joined it; measured figures replace predictions, the rest are re-predicted with the calibration in force",
    "measured: 3 plans in 4 runs (1 re-measurement): ok 3, oom 1; 0 running (claimed)",
]


def test_the_counts_add_up_and_say_why_the_front_moved(tmp_path: Path) -> None:
    study = _study(f"sqlite:///{tmp_path / 's.db'}")
    c = study_counts(study)
    assert sum(c.kinds.values()) == c.trials and sum(c.roles.values()) == c.plans
    assert c.front == c.predicted_front - sum(c.off_front.values()) + c.joined_front
    assert c.measured == sum(c.measured_by.values()) == c.measured_plans + c.remeasured
    assert count_lines(c, "counts") == EXPECTED
    assert len(pareto_info(study).front) == c.front  # the report's front table has the counted rows


def _printed(lines: list[str]) -> list[str]:
    """The count lines among printed ones."""
    return [ln for ln in lines if ln.startswith(("space: ", "study '", "Pareto front now", "measured: "))]


def test_report_and_status_print_the_same_lines(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    _study(url)
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "counts"], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert _printed(res.output.splitlines()) == EXPECTED
    assert [ln.removeprefix("- ") for ln in _printed_md(render_markdown(pareto_info(optuna.load_study(
        study_name="counts", storage=url))))] == EXPECTED


def _printed_md(text: str) -> list[str]:
    return [ln.removeprefix("- ") for ln in text.splitlines()
            if ln.startswith(("- space: ", "- study '", "- Pareto front now", "- measured: "))]


def _html_lines(page: str) -> list[str]:
    block = re.search(r'<ul class="counts">(.*?)</ul>', page, re.S)
    assert block, "the HTML report has its counts list"
    return [html.unescape(li) for li in re.findall(r"<li>(.*?)</li>", block.group(1), re.S)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The demo scenario searched analytically (`stratagem search examples/demo-cpu.yaml`, no real runs)."""
    root = tmp_path_factory.mktemp("demo")
    for name in ("demo-cpu.yaml", "demo-cpu-calibration.yaml"):
        shutil.copy(EXAMPLES / name, root / name)
    url = f"journal:{root / 'study.log'}"
    runner = CliRunner()
    search = runner.invoke(app, ["search", str(root / "demo-cpu.yaml"), "--storage", url, "--study", "demo",
                                 "--report", str(root / "demo.html")], terminal_width=400)
    assert search.exit_code == 0, search.output
    report = runner.invoke(app, ["report", "--storage", url, "--study", "demo", "-o", str(root / "demo.md")])
    assert report.exit_code == 0, report.output
    status = runner.invoke(app, ["status", "--storage", url, "--study", "demo"], terminal_width=400)
    assert status.exit_code == 0, status.output
    return {"search": search.output, "status": status.output, "md": (root / "demo.md").read_text(),
            "html": (root / "demo.html").read_text(), "report": report.output}


def test_the_demo_prints_one_set_of_counts(demo: dict[str, Any]) -> None:
    """search's summary, status, the Markdown and the HTML report state the same count lines, and they add up."""
    lines = _printed(demo["search"].splitlines())
    assert len(lines) == 4, demo["search"]
    assert _printed(demo["status"].splitlines()) == lines
    assert _printed_md(demo["md"]) == lines
    assert _html_lines(demo["html"]) == lines
    space = re.match(r"space: ([\d,]+) valid plans \(distinct jobs\), all screened; ([\d,]+) pruned .*\), "
                     r"([\d,]+) fit, ([\d,]+) on the predicted front$", lines[0])
    assert space, lines[0]
    valid, pruned, fit, predicted = (int(x.replace(",", "")) for x in space.groups())
    assert pruned + fit == valid and 0 < predicted <= fit
    why = re.search(r"first block over it: ([^)]*)\)", lines[0])  # pruned and why, adding up
    assert why and sum(int(n.replace(",", "")) for n in re.findall(r" ([\d,]+)", why.group(1))) == pruned, lines[0]
    front = re.match(r"Pareto front now: ([\d,]+) plans \(all predicted\)$", lines[2])
    assert front and int(front.group(1)) == predicted, lines[2]  # nothing measured: the front is the predicted one
    title = re.search(r"Pareto front of study 'demo': ([\d,]+) plans", demo["search"])
    assert title and int(title.group(1)) == predicted, demo["search"]  # the table under the same count
    assert f"{predicted} on the Pareto front now" in demo["report"]
    assert lines[3] == "measured: none; 0 running (claimed)"


def test_a_measured_search_prints_one_set_of_counts(tmp_path: Path) -> None:
    """The real-run loop (a stand-in evaluator at known constants; one plan ends OOM): the counts add up, and
    search's summary, status and the Markdown report print the same lines."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "search"))
    from sessions import run_multifidelity
    from standin import SCENARIO, KnownConstants

    from stratagem.reports.terminal import summary_lines
    from stratagem.spaces import Plan, load_scenario
    from stratagem.spaces.columns import PlanColumns

    plans = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)]
    url = f"journal:{tmp_path / 's.log'}"
    mf = run_multifidelity(load_scenario(SCENARIO), url, "s", KnownConstants(oom={plans[0].short()}), real_runs=3,
                           candidates=PlanColumns.from_plans(plans))
    c = study_counts(mf.search.study)
    assert c.measured_by == {"ok": 2, "oom": 1} and c.measured == c.measured_plans + c.remeasured == 3
    assert sum(c.kinds.values()) == c.trials and sum(c.roles.values()) == c.plans
    assert c.front == c.predicted_front - sum(c.off_front.values()) + c.joined_front
    lines = count_lines(c, "s")
    assert _printed(summary_lines(mf.search)) == lines
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"], terminal_width=400)
    assert res.exit_code == 0 and _printed(res.output.splitlines()) == lines, res.output
    assert _printed_md(render_markdown(pareto_info(mf.search.study))) == lines
    assert lines[3] == "measured: 3 plans in 3 runs: ok 2, oom 1; 0 running (claimed)"
