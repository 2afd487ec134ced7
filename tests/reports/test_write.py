"""Opening studies, writing reports atomically, and the `report` command (real SQLite studies)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from report_studies import small_study
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.errors import StratagemError
from stratagem.files import is_ours
from stratagem.reports import output_format, read_study, write_report, write_text_atomic


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> str:
    db = tmp_path_factory.mktemp("db") / "s.db"
    url = f"sqlite:///{db}"
    small_study(storage=url, study_name="alpha")
    small_study(storage=url, study_name="beta")
    return url


def test_open_study_by_name_and_errors(storage, tmp_path) -> None:
    assert read_study(storage, "alpha").study_name == "alpha"
    with pytest.raises(StratagemError, match=r"--study \('nope'\): no such study .*studies there: alpha, beta"):
        read_study(storage, "nope")
    with pytest.raises(StratagemError, match="holds 2 studies"):
        read_study(storage, None)
    missing = tmp_path / "missing.db"
    with pytest.raises(StratagemError, match="not found"):
        read_study(f"sqlite:///{missing}", "alpha")
    assert not missing.exists(), "reading a report must never create a storage"
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("create table t (x)").connection.commit()
    with pytest.raises(StratagemError, match="not an Optuna storage"):
        read_study(f"sqlite:///{other}", "alpha")
    with pytest.raises(StratagemError, match=r"storage \(.nosuch://x.\): unknown database kind"):
        read_study("nosuch://x", "alpha")
    with pytest.raises(StratagemError, match="journal.log not found"):
        read_study(f"journal:{tmp_path / 'journal.log'}", "alpha")
    assert not (tmp_path / "journal.log").exists()
    with pytest.raises(StratagemError, match="not a storage URL"):
        read_study(str(tmp_path / "plain.db"), "alpha")


def test_output_format_and_paths(tmp_path) -> None:
    assert output_format(Path("r.html"), None) == "html"
    assert output_format(Path("r.MD"), None) == "md"
    assert output_format(Path("r.txt"), "csv") == "csv"
    with pytest.raises(StratagemError, match=r"-o \(r.txt\): unknown suffix"):
        output_format(Path("r.txt"), None)
    with pytest.raises(StratagemError, match=r"--format \('pdf'\)"):
        output_format(None, "pdf")
    with pytest.raises(StratagemError, match="does not exist"):
        write_text_atomic(tmp_path / "no" / "r.md", "x")
    with pytest.raises(StratagemError, match="is a directory"):
        write_text_atomic(tmp_path, "x")


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch) -> None:
    target = tmp_path / "r.md"
    target.write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StratagemError, match="disk full"):  # one line (stratagem.files.write_owned)
        write_text_atomic(target, "new", force=True)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["r.md"], "no temporary file left behind"


def test_write_report_every_format(storage, tmp_path) -> None:
    study = read_study(storage, "alpha")
    for suffix in ("html", "md", "json", "csv"):
        out = write_report(study, tmp_path / f"r.{suffix}")
        assert out.stat().st_size > 0
    assert json.loads((tmp_path / "r.json").read_text())["study"] == "alpha"
    assert sorted(os.listdir(tmp_path)) == [".r.csv.stratagem", "r.csv", "r.html", "r.json", "r.md"], \
        "a CSV's digest lives beside it (CSV has no comments)"
    for suffix in ("html", "md", "json", "csv"):  # each one ours while unchanged: rewritten without --force
        assert is_ours(tmp_path / f"r.{suffix}")
        write_report(study, tmp_path / f"r.{suffix}")


def test_report_command(storage, tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "report.html"
    res = runner.invoke(app, ["report", "--storage", storage, "--study", "alpha", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "4 on the Pareto front" in res.output and out.stat().st_size > 1_000_000
    res = runner.invoke(app, ["report", "--storage", storage, "--study", "beta", "--format", "csv"])
    assert res.exit_code == 0 and res.output.count("\n") == 8  # header + 7 trials


def test_report_command_errors_are_one_line(storage, tmp_path) -> None:
    cmd = [sys.executable, "-m", "stratagem.cli", "report", "--storage", storage, "--study", "gamma",
           "-o", str(tmp_path / "r.html")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "--study ('gamma')" in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "r.html").exists()
