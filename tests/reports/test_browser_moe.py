"""One MoE plan in every view: the HTML report's card (a real headless Chromium, as test_browser), the CSV and
`stratagem explain` show the same step-time parts, the expert all-to-all among them (evaluators.step_parts)."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest
from report_studies import add, new_study
from test_browser import browser, load  # noqa: F401  (the browser fixture)

from stratagem import cli
from stratagem.evaluators import evaluate
from stratagem.evaluators.calibration_file import resolve_calibration
from stratagem.evaluators.step_parts import STEP_PARTS, TIME_KEYS, before_overlap
from stratagem.reports import capacity_plan, pareto_info, render_csv, render_html
from stratagem.spaces import load_scenario

MIXTRAL = Path(__file__).resolve().parents[2] / "examples" / "mixtral-8x7b-64xh200.yaml"


def _explain_rows(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """`stratagem explain` of the scenario's plan: the first cell of every table row -> its second cell."""
    monkeypatch.setattr(sys, "argv", ["stratagem", "explain", str(MIXTRAL)])
    monkeypatch.setenv("COLUMNS", "200")
    try:
        cli.main()
    except SystemExit as e:
        assert not e.code
    out = capsys.readouterr().out
    return {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}


def test_a_moe_plan_shows_ep_comm_alike_in_the_report_the_csv_and_explain(
        browser, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    scn = load_scenario(MIXTRAL)
    ev = evaluate(scn, scn.plan, resolve_calibration(scn)[0])
    assert ev.time is not None and ev.time.ep_comm_s > 0.02 * ev.time.step_s  # the expert all-to-all matters
    study = new_study(scn, f"sqlite:///{tmp_path / 's.db'}")
    add(study, ev)
    info = pareto_info(study)

    explain = _explain_rows(monkeypatch, capsys)
    row = next(csv.DictReader(io.StringIO(render_csv(info))))
    assert {k: float(row[k]) for k in TIME_KEYS} == {k: getattr(ev.time, k) for k in TIME_KEYS}

    path = tmp_path / "report.html"
    path.write_text(render_html(info, capacity_plan(info.scenario, [64])), encoding="utf-8")
    loaded = load(browser, path)
    page = loaded.page
    assert [m for m in loaded.console if m[0] in ("error", "pageerror")] == []
    card = page.locator("details.card").first
    if card.locator(".plan-view").count() == 0:
        card.locator("summary").click()
    shown = {}
    for tr in card.locator("table.step-parts tbody tr[data-part]").all():
        cells = tr.locator("td").all_inner_texts()
        shown[tr.get_attribute("data-part")] = (cells[0].strip(), cells[1].strip())
    terms = [p for p in STEP_PARTS if p.term and explain.get(p.label)]
    assert "ep_comm_s" in shown and "EP comm (exposed)" in explain
    # the card's rows are explain's rows: the same parts, labels and figures (3 significant figures, same unit)
    assert shown == {p.name: (p.label, explain[p.label]) for p in terms}
    # the card's traffic before overlap is explain's where overlap hid some, the exposed part elsewhere
    line = card.locator("p.comm-before-overlap")
    for p in STEP_PARTS:
        if p.meaning != "exposed":
            continue
        text = line.locator(f"span[data-part='{p.name}']").inner_text()
        assert text.startswith(p.group + " ")
        traffic = explain.get(f"{p.group} traffic before overlap")
        if traffic is not None:
            assert text == f"{p.group} {traffic} s"
        traffic_csv = float(before_overlap({k: float(row[k]) for k in TIME_KEYS}, p.name))
        assert float(text.split()[1]) == pytest.approx(traffic_csv, rel=5e-3, abs=5e-4)
    page.close()
