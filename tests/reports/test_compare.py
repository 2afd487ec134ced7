"""`stratagem compare SCENARIO A B [C ...]` through the real entry point (issue 26 item 5): plans by key=value,
label or trial of a stored study, side by side, with why the fastest wins; mistakes exit 2 with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from report_studies import plan, small_study

from stratagem import cli
from stratagem.evaluators import evaluate
from stratagem.spaces import load_scenario, resolve_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama3-8b-8xh100.yaml"


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["stratagem", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


def test_two_plans_side_by_side_and_why(monkeypatch, capsys) -> None:
    scn = load_scenario(EXAMPLE)
    a, b = "dp=8,zero=3,mbs=1,ac=full", "dp=8,zero=3,mbs=1,ac=selective"
    label_b = resolve_plan(scn, b).short()
    code, out, err = run(monkeypatch, capsys, "compare", str(EXAMPLE), a, label_b, "--json")
    assert code == 0, err
    doc = json.loads(out)
    ev = {p["name"]: p for p in doc["plans"]}
    assert set(ev) == {a, label_b}
    # the figures are the analytic model's for each plan (the same calibration: the scenario's)
    tps = {name: evaluate(scn, resolve_plan(scn, name)).throughput.tokens_per_s for name in (a, label_b)}
    for name in (a, label_b):
        assert ev[name]["evaluation"]["throughput"]["tokens_per_s"] == pytest.approx(tps[name])
    assert all(evaluate(scn, resolve_plan(scn, n)).status == "ok" for n in (a, label_b))  # both fit
    winner = max(tps, key=lambda n: tps[n])
    loser = a if winner == label_b else label_b
    assert doc["winner"] == winner
    (why,) = doc["why"]
    assert why.startswith(f"why not {loser}") and "faster" in why and "most of all in" in why

    code, out, err = run(monkeypatch, capsys, "compare", str(EXAMPLE), a, label_b)
    assert code == 0, err
    for row in ("weights (GiB)", "peak (GiB)", "compute (", "pipeline bubble", "zone hbm", "bottleneck", "MFU"):
        assert row in out, row
    assert f"why not {loser}" in out


def test_trials_from_a_study(monkeypatch, capsys, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    study = small_study(storage=url, study_name="cmp")
    measured = next(t for t in study.get_trials() if t.user_attrs["fidelity"] == "measured")
    code, out, err = run(monkeypatch, capsys, "compare", str(EXAMPLE), f"trial:{measured.number}", "0",
                         "dp=8,zero=0", "--storage", url, "--study", "cmp", "--json")
    assert code == 0, err
    doc = json.loads(out)
    names = [p["name"] for p in doc["plans"]]
    assert names == [f"trial:{measured.number}", "trial:0", "dp=8,zero=0"]
    assert doc["plans"][0]["label"] == plan(zero_stage=3, activation_checkpointing="full").short()
    assert doc["plans"][0]["measured_tokens_per_s"] == pytest.approx(95_000)
    assert doc["plans"][1]["measured_tokens_per_s"] is None
    assert len(doc["why"]) == 2


def test_mistakes_are_one_line(monkeypatch, capsys, tmp_path) -> None:
    one_line_error(*run(monkeypatch, capsys, "compare", str(EXAMPLE), "dp=8")[::2], "two or more plans")
    one_line_error(*run(monkeypatch, capsys, "compare", str(EXAMPLE), "dp=8", "dpp=8")[::2], "plan.dpp")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    small_study(storage=url, study_name="cmp")
    one_line_error(*run(monkeypatch, capsys, "compare", str(EXAMPLE), "trial:999", "dp=8", "--storage", url,
                        "--study", "cmp")[::2], "trial:999", "no such trial")
