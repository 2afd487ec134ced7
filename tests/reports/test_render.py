"""Renderers read ParetoInfo: the HTML page's embedded data, escaping, Markdown, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest
from report_studies import EVIL, small_study

from stratagem.evaluators.evaluation import ZONE_NAMES
from stratagem.reports import (
    CSV_COLUMNS,
    decode_payload,
    pareto_info,
    render_csv,
    render_html,
    render_json,
    render_markdown,
    report_payload,
)


@pytest.fixture(scope="module")
def info():
    return pareto_info(small_study(name=EVIL))


@pytest.fixture(scope="module")
def page(info) -> str:
    return render_html(info)


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/octet-stream" id="stratagem-data">([^<]*)</script>', page)
    assert m
    return decode_payload(m.group(1))


def test_payload_is_the_info(info, page) -> None:
    data = embedded(page)
    runs = data.pop("runs")  # the real runs (html._runs_payload), beside the payload
    assert data == json.loads(json.dumps(report_payload(info)))
    assert len(runs["trial"]) == len(info.measured)
    plans = data["plans"]
    assert plans["label"] == [p.label for p in info.plans]
    assert data["front"] == list(info.front)
    assert [i for i, f in enumerate(plans["front"]) if f] == sorted(info.front)
    # The measured plan carries its prediction; memory rows follow the declared field order.
    (m,) = info.measured
    assert plans["prediction"][str(m)]["tput"][0] == 60_000
    mem = dict(zip(data["fields"]["mem"], plans["mem"][m], strict=True))
    assert mem["peak_gib"] == pytest.approx(info.plans[m].evaluation.memory.peak_gib)
    assert plans["why"][info.plans.index(next(p for p in info.plans if not p.feasible))] == "activations do not fit"


def test_page_is_self_contained_and_escaped(page) -> None:
    assert EVIL not in page, "the model name must never reach the page as markup"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 3, "plotly once, the data, the report script"
    assert re.search(r"<script[^>]+src=", page) is None and "<link" not in page
    assert page.count("Plotly.newPlot") <= 3, "figures are built by the report script, not embedded per figure"
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_front_table_and_cards(info, page) -> None:
    rows = re.findall(r'<tr data-plan="(\d+)" data-rank="\d+">', page)
    assert [int(r) for r in rows] == list(info.front)
    cards = re.findall(r'<details class="card" data-plan="(\d+)"', page)
    assert [int(c) for c in cards] == list(info.front)


def test_markdown(info) -> None:
    md = render_markdown(info)
    assert EVIL not in md and "&lt;script&gt;" in md
    front_rows = [ln for ln in md.splitlines() if re.match(r"\| \d+ \| `", ln)]
    assert len(front_rows) == len(info.front)
    assert "| highest tokens/s | `dp8 z1 mb1 bf16` | 100,000 |" in md
    assert "Predicted vs measured" in md and "| tokens/s | 60,000 | 95,000 | -36.8% |" in md
    assert "## Zones of the plans on the front" in md
    # a zone is named the bottleneck only where one is at warn or bad (issue 12 item 10)
    zones = [info.plans[i].evaluation.zones for i in info.front if info.plans[i].evaluation]
    strained = [z for z in zones if z and any(getattr(z, n).level != "ok" for n in ZONE_NAMES)]
    assert md.count("(bottleneck)") == len(strained)
    assert md.count("none (all zones ok)") >= len(zones) - len(strained) > 0


def test_json_has_every_trial(info) -> None:
    doc = json.loads(render_json(info))
    assert [t["trial"] for t in doc["trials"]] == [t.number for t in info.trials]
    superseded = [t for t in doc["trials"] if t["superseded_by"] is not None]
    assert len(superseded) == 1 and not superseded[0]["on_front"]
    assert sorted(doc["front"]) == sorted(info.plans[i].number for i in info.front)
    assert doc["trials"][0]["evaluation"]["memory"]["hbm_gib"] == 79.6
    assert doc["scenario"]["model"]["name"] == EVIL  # data formats keep the string as it is


def test_csv_has_every_trial(info) -> None:
    rows = list(csv.DictReader(io.StringIO(render_csv(info))))
    assert tuple(rows[0].keys()) == CSV_COLUMNS
    assert len(rows) == len(info.trials)
    on_front = [r for r in rows if r["on_front"] == "True"]
    assert len(on_front) == len(info.front)
    first = rows[0]
    assert float(first["tokens_per_s"]) == 100_000 and first["zero_stage"] == "1" and first["zone_hbm"] == "ok"
