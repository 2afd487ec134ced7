import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.search import run_search
from stratagem.search.storage import check_storage, default_storage, open_storage, parse_storage, storage_lock
from stratagem.spaces import load_scenario

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("url,module,fix", [
    ("postgresql://u@127.0.0.1:1/x", "psycopg", "stratagem[postgres]"),
    ("mysql://u@127.0.0.1:1/x", "MySQLdb", "stratagem[mysql]"),
])
def test_missing_driver_names_the_package_and_extra(monkeypatch, url, module, fix) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # the driver is not importable, installed or not
    for call in (lambda: check_storage(parse_storage(url)), lambda: open_storage(parse_storage(url))):
        with pytest.raises(StratagemError) as e:
            call()
        assert f"driver {module!r} is not installed" in str(e.value) and fix in str(e.value)
        assert "\n" not in str(e.value)


def test_unreachable_database_is_one_line() -> None:
    pytest.importorskip("psycopg", reason="the optional PostgreSQL driver (stratagem[postgres]) is not installed")
    t0 = time.monotonic()
    with pytest.raises(StratagemError) as e:
        check_storage(parse_storage("postgresql://u:p@127.0.0.1:1/x"))
    assert "cannot connect" in str(e.value) and "\n" not in str(e.value) and time.monotonic() - t0 < 15


def test_a_file_that_is_not_a_journal_is_never_touched(tmp_path) -> None:
    user = tmp_path / "notes.log"
    user.write_bytes(b"my own notes\n\x00\x01 binary too\n")
    before = user.read_bytes()
    for call in (check_storage, open_storage):
        with pytest.raises(StratagemError, match=f"{user} is not an Optuna journal"):
            call(parse_storage(f"journal:{user}"))
    with pytest.raises(StratagemError, match="not an Optuna journal"):
        run_search(load_scenario(ROOT / "examples" / "llama3-8b-8xh100.yaml"), f"journal:{user}", "s")
    assert user.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["notes.log"]


def test_an_sqlite_database_without_optuna_tables_is_never_touched(tmp_path) -> None:
    db = tmp_path / "mine.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE people (name TEXT)")
        con.execute("INSERT INTO people VALUES ('ada')")
    con.close()
    before = db.read_bytes()
    with pytest.raises(StratagemError, match=f"{db} is an SQLite database but not an Optuna storage"):
        open_storage(parse_storage(f"sqlite:///{db}"))
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(StratagemError, match="is not an SQLite database"):
        open_storage(parse_storage(f"sqlite:///{junk}"))
    assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["junk.db", "mine.db"]
    empty = tmp_path / "empty.db"
    empty.touch()
    open_storage(parse_storage(f"sqlite:///{empty}"))  # a new or empty file becomes a storage


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this process cannot write: a 0555 directory, or for root (who writes anywhere) /proc/sys, a
    read-only mount here."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):
        ro = Path("/proc/sys")
    if os.access(ro, os.W_OK):
        pytest.skip("no read-only directory for this user on this machine")
    before = sorted(os.listdir(ro))
    yield ro
    assert sorted(os.listdir(ro)) == before  # nothing left behind (no lock file)
    (tmp_path / "ro").chmod(0o755)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_read_only_directory_is_one_line_and_leaves_nothing(read_only_dir, kind) -> None:
    ro = read_only_dir
    spec = parse_storage(f"sqlite:///{ro}/s.db" if kind == "sqlite" else f"journal:{ro}/s.log")
    with pytest.raises(StratagemError, match="is not writable"):
        check_storage(spec)
    with pytest.raises(StratagemError, match="storage lock .*cannot create"):
        with storage_lock(spec):
            pass
    with pytest.raises(StratagemError, match="is not writable"):
        run_search(load_scenario(ROOT / "examples" / "llama3-8b-8xh100.yaml"), spec.url, "s")


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


def test_wrong_credentials_are_one_line_before_any_work(postgres_url) -> None:
    """Issue 12 item 4: a user the server does not know, or a database it does not have: one line naming the
    storage, before screening (run_search checks the storage first)."""
    host = postgres_url.split("@", 1)[1].rsplit("/", 1)[0]
    for url, words in ((f"postgresql+psycopg://nobody_here:secret@{host}/postgres", "nobody_here"),
                       (f"postgresql+psycopg://postgres@{host}/no_such_db", "no_such_db")):
        t0 = time.monotonic()
        with pytest.raises(StratagemError) as e:
            run_search(load_scenario(ROOT / "examples" / "llama3-8b-8xh100.yaml"), url, "s")
        msg = str(e.value)
        assert "cannot connect" in msg and words in msg and "\n" not in msg, msg
        assert time.monotonic() - t0 < 15


def test_opening_a_fresh_postgres_database_at_once_from_many_places(fresh_postgres) -> None:
    """Workers and dashboards may open a fresh database at the same moment: each creates Optuna's tables if
    missing, and concurrent CREATEs collide (duplicate key in pg_type); open_storage retries. A read-only open
    (`stratagem status`) of the fresh database creates nothing and says so in one line."""
    from sqlalchemy import create_engine, inspect

    with pytest.raises(StratagemError, match="holds no Optuna storage") as e:
        open_storage(parse_storage(fresh_postgres), write=False)
    assert "\n" not in str(e.value)
    engine = create_engine(fresh_postgres)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    n = 8
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def one() -> None:
        barrier.wait()
        try:
            open_storage(parse_storage(fresh_postgres))
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
