import threading
import time

import pytest

from stratagem.errors import StratagemError
from stratagem.search.storage import default_storage, open_storage, parse_storage, storage_lock


def test_urls(tmp_path) -> None:
    sq = parse_storage(f"sqlite:///{tmp_path}/a.db")
    assert sq.kind == "sqlite" and sq.path == tmp_path / "a.db"
    assert sq.dashboard_command() == f"optuna-dashboard sqlite:///{tmp_path}/a.db"
    j = parse_storage(f"journal:{tmp_path}/a.log")
    assert j.kind == "journal" and j.path == tmp_path / "a.log"
    assert parse_storage(f"journal://{tmp_path}/a.log").path == tmp_path / "a.log"
    assert j.dashboard_command() == f"optuna-dashboard {tmp_path}/a.log"
    assert parse_storage("postgresql://u@db.example/optuna").kind == "rdb"
    assert default_storage(tmp_path / "x.yaml") == f"sqlite:///{tmp_path}/stratagem.db"


@pytest.mark.parametrize("url,words", [
    ("foo://x", "unknown database kind"),
    ("stratagem.db", "not a storage URL"),
    ("sqlite://", "in-memory"),
    ("sqlite:///:memory:", "in-memory"),
    ("sqlite:////no/such/dir/a.db", "does not exist"),
    ("journal:", "needs a file path"),
    ("journal:/no/such/dir/a.log", "does not exist"),
])
def test_bad_urls_are_one_line(url, words) -> None:
    with pytest.raises(StratagemError) as e:
        parse_storage(url)
    assert words in str(e.value) and "\n" not in str(e.value) and "storage" in str(e.value)


def test_directory_is_not_a_storage(tmp_path) -> None:
    (tmp_path / "d.db").mkdir()
    with pytest.raises(StratagemError, match="is a directory"):
        parse_storage(f"sqlite:///{tmp_path}/d.db")


def test_unreachable_database_is_one_line(tmp_path) -> None:
    with pytest.raises(StratagemError) as e:
        open_storage(parse_storage("mysql+pymysql://u@127.0.0.1:1/x"))
    assert "cannot open" in str(e.value)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_lock_is_exclusive(tmp_path, kind) -> None:
    spec = parse_storage(f"sqlite:///{tmp_path}/a.db" if kind == "sqlite" else f"journal:{tmp_path}/a.log")
    inside, overlap = [], []

    def work() -> None:
        with storage_lock(spec):
            if inside:
                overlap.append(1)
            inside.append(1)
            time.sleep(0.2)
            inside.pop()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not overlap


def test_lock_times_out(tmp_path) -> None:
    spec = parse_storage(f"journal:{tmp_path}/a.log")
    with storage_lock(spec):
        with pytest.raises(StratagemError, match="still held"):
            with storage_lock(spec, timeout=0.3):
                pass


def test_journal_lock_of_a_killed_writer_is_released_at_once(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from pathlib import Path; from stratagem.search.storage import FlockJournalLock; "
            "FlockJournalLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "j.log")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    from stratagem.search.storage import FlockJournalLock

    t0 = time.monotonic()
    lock = FlockJournalLock(tmp_path / "j.log")
    assert lock.acquire() and time.monotonic() - t0 < 2
    lock.release()
