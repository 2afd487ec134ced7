"""A researcher's path through the real CLI on the CPU demo, each step a subprocess in a copy of examples/:

    stratagem search demo-cpu.yaml --real-runs 2 --remeasure 1     (real runs through a local Ray cluster)
    stratagem status --storage URL --study NAME [--json]
    stratagem report --storage URL --study NAME -o report.html / -o report.json
    stratagem reproduce demo-cpu.yaml --trial N                     (N: the best measured record)
    stratagem search demo-cpu.yaml --real-runs 1 --remeasure 0      (resumed: one more plan)

Every command exits cleanly, and the commands agree on what they share: the best measured plan, its record number
and its figure with its interval (`search.noise.best_measured`'s note and `RecordFigure.text`, the one
formatting of a record) as search, status, report and reproduce print them. Timing figures move from run to run
on a loaded host, so only agreement between commands on the same stored record is asserted, never a speed.
"""

import html
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = "4"  # timed steps per real run: enough for an interval ("range" below 6 steps: evaluators/spread.py)

# RecordFigure.text (search/noise.py): `1,000 tok/s (95% 935-1,127, 2 runs, n=8` then `)` or `; <noise note>)`
FIGURE = r"[\d,.]+ tok/s \((?:95%|range) [\d,.]+-[\d,.]+, \d+ runs?, n=\d+"


def stratagem(cwd: Path, *args: str, timeout: float = 420) -> tuple[int, str]:
    """One CLI command as a user runs it; (exit status, stdout + stderr). No command may end in a traceback."""
    # os.environ at call time: tests/conftest.py points STRATAGEM_NOISE_DIR at this test's own noise file
    env = {**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "stratagem.cli", *args], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=timeout)
    out = res.stdout + res.stderr
    assert "Traceback" not in out, f"stratagem {' '.join(args)}:\n{out[-4000:]}"
    return res.returncode, out


def best_line(out: str) -> str:
    """The search's last `best measured: ...` line (reports/terminal.py measured_lines: the BestMeasured note)."""
    found = re.findall(r"^best measured: .*$", out, re.M)
    assert found, out[-4000:]
    return found[-1]


def status_json(cwd: Path, where: list[str]) -> dict:
    code, out = stratagem(cwd, "status", *where, "--json", timeout=180)
    assert code == 0, out[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def measured_trials(report: dict) -> dict[int, tuple[str, float | None]]:
    """Trial number -> (plan key, tokens/s) of every measured trial in a `report -o X.json` document."""
    return {t["trial"]: (t["plan_key"], (t["values"] or {}).get("tokens_per_s"))
            for t in report["trials"] if t["fidelity"] == "measured"}


def misnumbered_front(report: dict) -> dict[str, tuple[int, int]]:
    """Plan key -> (number on the front, record number) of each measured plan a `report -o X.json` front lists
    under another number than its record's (the plan's first measured trial)."""
    records: dict[str, int] = {}
    for n, (key, _) in sorted(measured_trials(report).items()):
        records.setdefault(key, n)
    keys = {t["trial"]: t["plan_key"] for t in report["trials"]}
    shown = {keys[n]: n for n in report["front"] if keys.get(n) in records}
    return {key: (n, records[key]) for key, n in shown.items() if n != records[key]}


@pytest.mark.timeout(1200)
def test_a_researchers_demo_path_agrees_across_status_report_reproduce_and_resume(tmp_path: Path) -> None:
    for name in ("demo-cpu.yaml", "demo-cpu-calibration.yaml"):  # the scenario names its calibration beside it
        shutil.copy(ROOT / "examples" / name, tmp_path / name)

    # 1. the demo, shortened: 2 plans, 1 re-measurement
    code, search = stratagem(tmp_path, "search", "demo-cpu.yaml", "--real-runs", "2", "--remeasure", "1",
                             "--steps", STEPS)
    assert code == 0, search[-4000:]
    # reports/terminal.py summary_lines: `report:   stratagem report --storage URL --study NAME` (shlex.join)
    command = re.search(r"^report:\s+(stratagem report --storage .*)$", search, re.M)
    assert command is not None, search[-4000:]
    words = shlex.split(command.group(1))
    where = words[2:6]
    assert where[0] == "--storage" and where[2] == "--study", words
    searched = best_line(search)

    # 2. status, JSON and text: the best measured plan with its record number (status.py _best_measured:
    # `trial N: ` + the note without its `best measured: ` head) is the search's line, figure and interval included
    status = status_json(tmp_path, where)
    best = status["best_measured"]
    head = re.match(rf"trial (\d+): (.+?): ({FIGURE})(?:\)|; )", best)
    assert head is not None, best
    number, label, figure = int(head.group(1)), head.group(2), head.group(3)
    note = best.removeprefix(f"trial {number}: ")
    # the search may add "; no re-measurement left to settle it (raise --remeasure)" (search/session.py)
    assert searched.startswith(f"best measured: {note}"), (searched, best)
    code, text = stratagem(tmp_path, "status", *where, timeout=180)
    assert code == 0, text[-4000:]
    assert f"best measured: {best}" in text.splitlines(), text
    plans_before = status["counts"]["measured_plans"]
    assert plans_before >= 1, status  # the best measured plan is one

    # the search's run table shows the record under the same number with the same figure and interval
    # (reports/terminal.py: `#  plan  role  status  tok/s meas  95%` where 95% is `lo-hi xR` or `range lo-hi`)
    interval = re.search(r"\((?:95%|range) ([\d,.]+-[\d,.]+),", figure)
    assert interval is not None, figure
    table = search[search.index("Real runs: "):]
    row = re.search(rf"^\s*{number}\s+{re.escape(label)}\s{{2,}}\S+\s+ok\s+([\d,.]+)\s+(?:range )?([\d,.]+-[\d,.]+)",
                    table, re.M)
    assert row is not None, table[:3000]
    assert (row.group(1), row.group(2)) == (figure.split(" tok/s")[0], interval.group(1)), (row.group(0), figure)

    # 3. report, HTML and JSON: the same record, note and number (reports/info.py best_measured_line,
    # reports/data.py render_json)
    code, out = stratagem(tmp_path, "report", *where, "-o", "report.json", timeout=240)
    assert code == 0, out[-4000:]
    code, out = stratagem(tmp_path, "report", *where, "-o", "report.html", timeout=240)
    assert code == 0, out[-4000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["best_measured"] == {"trial": number, "note": f"best measured: {note}"}, doc["best_measured"]
    page = (tmp_path / "report.html").read_text()
    assert f"Best measured (trial {number}): {note}." in html.unescape(page), note
    before = measured_trials(doc)
    assert number in before and before[number][0], before
    key = before[number][0]
    # the record's figure is its standing trial's (the plan's latest measured trial, pooled over its runs:
    # search/noise.py record_figures); the JSON holds it unrounded
    standing = [t for t in doc["trials"] if t["plan_key"] == key and t["fidelity"] == "measured"
                and t["superseded_by"] is None]
    assert len(standing) == 1, standing
    assert f"{standing[0]['values']['tokens_per_s']:,.0f}" == figure.split(" tok/s")[0], (standing, figure)
    # the runs table's re-predicted column (reports/runs.py runs_table) holds figures once a refit was adopted,
    # and only then; the search says which (reports/terminal.py measured_lines)
    runs_table = re.search(r'<table class="data runs" id="runs-table">.*?</table>', page, re.S)
    assert runs_table is not None
    heads = re.findall(r"<th>(.*?)</th>", runs_table.group(0))
    column = next(i for i, h in enumerate(heads) if h.startswith("step re-predicted"))
    rows = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", runs_table.group(0))]
    ok_cells = [html.unescape(r[column]) for r in rows if len(r) > column and r[2] == "ok"]
    assert ok_cells, runs_table.group(0)[:3000]
    if "calibration (refitted on this study's runs" in search:
        assert all(c not in ("", "–", "-") for c in ok_cells), ok_cells
    else:
        assert "calibration (the starting calibration, kept" in search or "calibration: the starting one" in search
        assert set(ok_cells) == {"–"}, ok_cells

    # 4. reproduce the best measured record: 0 reproduced or 1 not reproduced (a loaded host moves a rerun);
    # 3 (environment differs) or 4 (no verdict) fail. Its recorded cell is the record's figure as status prints
    # it, without the noise note (launch/reproduce.py _as_record: RecordFigure.text())
    code, repro = stratagem(tmp_path, "reproduce", "demo-cpu.yaml", *where, "--trial", str(number), timeout=420)
    assert code in (0, 1), repro[-4000:]
    assert re.search(rf"^trial #{number}\s", repro, re.M), repro[-4000:]  # the record: no "(its plan's record"
    if "Recorded vs now" in repro:
        cell = re.search(rf"tokens/s\s*│\s*({FIGURE}\))\s*│", repro)
        assert cell is not None, repro[-4000:]
        assert cell.group(1) == f"{figure})", (cell.group(1), best)
        assert ("reproduced" if code == 0 else "not reproduced") == repro.strip().splitlines()[-1], repro[-2000:]
    else:  # the rerun produced no figures (oom/failed/timeout under load): not reproduced, said so
        assert code == 1 and "the rerun ended " in repro, repro[-4000:]

    # 5. resume: one more plan, measured; the earlier runs keep their trial numbers and figures
    code, resumed = stratagem(tmp_path, "search", "demo-cpu.yaml", "--real-runs", "1", "--remeasure", "0",
                              "--steps", STEPS)
    assert code == 0, resumed[-4000:]
    # search/session.py _say_target
    said = (f"real runs: 1 more plan(s) (--real-runs 1): the study holds {plans_before} measured plan(s), its "
            f"target is now {plans_before + 1}")
    assert said in resumed, resumed[-4000:]
    after = status_json(tmp_path, where)
    assert after["counts"]["measured_plans"] == plans_before + 1, after["counts"]
    assert after["target"] == plans_before + 1 and after["k"] == 1, after
    assert best_line(resumed).startswith(f"best measured: {after['best_measured'].split(': ', 1)[1]}"), (
        best_line(resumed), after["best_measured"])
    code, out = stratagem(tmp_path, "report", *where, "-o", "resumed.json", timeout=240)
    assert code == 0, out[-4000:]
    resumed_doc = json.loads((tmp_path / "resumed.json").read_text())
    now = measured_trials(resumed_doc)
    assert {n: now.get(n) for n in before} == before, (before, now)
    new = {n: v for n, v in now.items() if n not in before}
    assert len(new) == 1 and min(new) > max(before), (before, now)

    # One number per record: a re-measured plan keeps its first measured trial's number (records.Standing.number)
    # in the run table, status, report and reproduce; the Pareto front (the report's JSON "front", built like the
    # HTML front table and the search's front table) must name a measured plan by that number too. Checked on both
    # reports; it bites only when a re-measured plan is on the front (measured figures against predictions).
    wrong = {**misnumbered_front(doc), **misnumbered_front(resumed_doc)}
    assert not wrong, ("the front names measured plans by another trial than their record's, plan key: "
                       f"(shown, record): {wrong}; best measured in status and report: {after['best_measured']}")
