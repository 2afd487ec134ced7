"""Storage locks are as narrow as the data they guard: one per study (and one for the storage's own tables), so a
writer of one study never waits on another study's lock, while two writers of one study still exclude each other.
Real processes on real SQLite / journal files and a real PostgreSQL (tests/search/conftest.py); no timing
assertions: one process holds study A's lock (until told to let go) while others write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from stratagem.errors import StratagemError
from stratagem.search.locks import lock_waits
from stratagem.search.storage import open_storage, parse_storage, storage_lock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SCENARIO = ROOT / "examples" / "tiny-cpu.yaml"

_HOLD = ("import sys\nfrom stratagem.search.storage import parse_storage, storage_lock\n"
         "with storage_lock(parse_storage(sys.argv[1]), sys.argv[2]):\n"
         "    print('held', flush=True)\n    sys.stdin.read()\n")
_STORE = ("import sys\nfrom stratagem.search.session import SearchSession\n"
          "from stratagem.spaces.scenario import load_scenario\n"
          "s = SearchSession(load_scenario(sys.argv[3]), sys.argv[1], sys.argv[2], listener=lambda e: None)\n"
          "print('stored', s.store().stored)\n")
_TRY = ("import sys\nfrom stratagem.errors import StratagemError\n"
        "from stratagem.search.storage import parse_storage, storage_lock\n"
        "try:\n    with storage_lock(parse_storage(sys.argv[1]), sys.argv[2], timeout=float(sys.argv[3])):\n"
        "        print('taken')\nexcept StratagemError as e:\n    print(e)\n")


@pytest.fixture(params=["sqlite", "journal", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage shared by the processes of a test."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 's.db'}"
    if request.param == "journal":
        return f"journal:{tmp_path / 's.log'}"
    return str(request.getfixturevalue("fresh_postgres"))


def _py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=240)


@pytest.mark.timeout(300)
def test_a_study_writer_does_not_wait_on_another_studys_lock(url: str) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, url, "A"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held", holder.stderr
        other = _py(_STORE, url, "B", str(SCENARIO))  # a whole search's store into study B, storage opened too
        assert other.returncode == 0, other.stderr
        assert int(other.stdout.split("stored")[-1]) > 0
        same = _py(_TRY, url, "A", "0.5")  # study A's own lock is still exclusive across processes
        assert "still held by another search" in same.stdout, same
        assert holder.poll() is None  # all of the above happened while A's lock was held
    finally:
        holder.communicate(input="", timeout=60)
    assert holder.returncode == 0
    after = _py(_STORE, url, "A", str(SCENARIO))  # A's writer goes ahead once its lock is free
    assert after.returncode == 0, after.stderr
    storage = open_storage(parse_storage(url), write=False)
    counts = {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage)}
    assert counts["A"] == counts["B"] > 0


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_scopes_of_one_process_exclude_like_processes(tmp_path: Path, kind: str) -> None:
    """Within one process too: study A's lock held, B's and the storage's own are free, A's is not (an OFD lock
    belongs to the open file, not the process); each lock taken is counted."""
    spec = parse_storage(f"sqlite:///{tmp_path}/a.db" if kind == "sqlite" else f"journal:{tmp_path}/a.log")
    before = lock_waits().taken
    with storage_lock(spec, "A"):
        with storage_lock(spec, "B", timeout=0.3), storage_lock(spec, timeout=0.3):
            pass
        with pytest.raises(StratagemError, match="still held"):
            with storage_lock(spec, "A", timeout=0.3):
                pass
    with storage_lock(spec, "A", timeout=0.3):  # released: free again
        pass
    assert lock_waits().taken == before + 4
