"""Paths of `stratagem search` under `ray job submit` (stratagem/cli/runs_dir.py, issue 27 item 3): fixed at
start, never into Ray's copy of the job's working directory, one folder per worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from stratagem.cli import main
from stratagem.cli.runs_dir import (
    absolute_storage,
    check_storage_outlives,
    in_ray_job_copy,
    runs_root,
    worker_folder,
)
from stratagem.errors import StratagemError

COPY = Path("/tmp/ray/session_x/runtime_resources/working_dir_files/_ray_pkg_b971d738cd774e37")


def test_ray_job_copy_is_recognised_and_nothing_else() -> None:
    assert in_ray_job_copy(COPY / "s.yaml")
    assert not in_ray_job_copy(Path("/home/me/working_dir_files/s.yaml"))
    assert not in_ray_job_copy(Path("/home/me/_ray_pkg_1/s.yaml"))


def test_runs_root_beside_the_scenario_else_outside_rays_copy(tmp_path: Path, monkeypatch) -> None:
    assert runs_root(tmp_path / "s.yaml", "st", None) == tmp_path / "runs" / "st"
    assert runs_root(COPY / "s.yaml", "st", None) == Path.home().resolve() / "stratagem-runs" / "st"
    monkeypatch.chdir(tmp_path)
    assert runs_root(COPY / "s.yaml", "st", Path("logs")) == tmp_path / "logs"  # given: resolved now
    (tmp_path / "f").write_text("x")
    with pytest.raises(StratagemError, match="--runs-dir"):
        runs_root(tmp_path / "s.yaml", "st", Path("f"))


def test_workers_started_at_once_get_their_own_folders(tmp_path: Path) -> None:
    mine = worker_folder(tmp_path)
    assert mine.parent == tmp_path and mine.name.endswith(f"-{os.getpid()}")


def test_relative_file_storages_become_absolute_and_rays_copy_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert absolute_storage("sqlite:///a.db") == f"sqlite:///{tmp_path}/a.db"
    assert absolute_storage("sqlite:////abs/a.db") == "sqlite:////abs/a.db"
    assert absolute_storage("journal:j.log") == f"journal:{tmp_path}/j.log"
    assert absolute_storage("postgresql://u@h/db") == "postgresql://u@h/db"
    check_storage_outlives(f"sqlite:///{tmp_path}/a.db")
    with pytest.raises(StratagemError, match="Ray's copy"):
        check_storage_outlives(f"sqlite:///{COPY}/stratagem.db")


def test_search_from_rays_copy_without_storage_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    copy.mkdir(parents=True)
    scenario = {"model": {"name": "t", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                          "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256},
                "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
                "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"}}
    (copy / "s.yaml").write_text(yaml.safe_dump(scenario))
    monkeypatch.chdir(copy)
    with pytest.raises(SystemExit) as done:
        main(["search", "s.yaml", "--no-report"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "Ray's copy" in err and len(err.strip().splitlines()) == 1, err
    assert not (copy / "stratagem.db").exists()


def test_a_job_on_a_fresh_head_creates_the_default_report_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    """Issue 36 item 4: `ray job submit ... stratagem search ...` without --no-report on a head where
    ~/stratagem-runs does not exist yet: the search runs from Ray's copy with a fresh HOME and writes its report
    to ~/stratagem-runs/STUDY.html (the folder created), exit 0."""
    copy = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_4567"
    copy.mkdir(parents=True)
    home = tmp_path / "fresh-home"
    home.mkdir()
    scenario = {"model": {"name": "fresh", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                          "num_kv_heads": 2, "ffn_hidden_size": 128, "vocab_size": 256},
                "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 2},
                "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"}}
    (copy / "s.yaml").write_text(yaml.safe_dump(scenario))
    monkeypatch.chdir(copy)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SystemExit) as done:
        main(["search", "s.yaml", "--storage", f"sqlite:///{tmp_path / 'st.db'}", "--study", "fresh"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    report = home / "stratagem-runs" / "fresh.html"
    assert report.is_file() and f"report:   {report}" in out
    assert not list(copy.glob("*.html")) and not (copy / "runs").exists()  # nothing into Ray's copy


def test_a_default_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    from stratagem.cli.runs_dir import make_default_dir

    (tmp_path / "f").write_text("x")
    with pytest.raises(StratagemError, match=r"^--report: its default folder .*f/stratagem-runs cannot be created"):
        make_default_dir(tmp_path / "f" / "stratagem-runs", "--report")
