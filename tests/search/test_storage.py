import os
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest
from sessions import run_search

from stratagem.errors import StratagemError
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

    code = ("import sys, time; from pathlib import Path; from stratagem.search.journal import FlockJournalLock; "
            "FlockJournalLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "j.log")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    from stratagem.search.journal import FlockJournalLock

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


# --- outages (issue 27 item 2) -------------------------------------------------------------------------------


def _study_on(url: str, name: str):  # noqa: ANN202 - optuna.Study
    import optuna

    from stratagem.search.records import DIRECTIONS

    return optuna.create_study(storage=open_storage(parse_storage(url)), study_name=name,
                               directions=list(DIRECTIONS))


@pytest.mark.timeout(120)
def test_a_storage_call_waits_out_a_database_restart(fresh_postgres, postgres_outage, capfd) -> None:
    """A call made while PostgreSQL is down blocks, retries with backoff and lands when the server is back: one
    line when the outage starts, one when it ends; the storage lock is taken through the outage too."""
    study = _study_on(fresh_postgres, "o")
    outage = threading.Thread(target=postgres_outage, args=(6.0,))
    outage.start()
    time.sleep(1.0)  # the server is down now
    t0 = time.monotonic()
    study.set_user_attr("written_during_the_outage", 1)
    with storage_lock(parse_storage(fresh_postgres)):
        study.set_user_attr("under_the_lock", 2)
    outage.join()
    assert time.monotonic() - t0 > 3.0  # it did wait
    again = open_storage(parse_storage(fresh_postgres), write=False)
    import optuna

    attrs = optuna.load_study(study_name="o", storage=again).user_attrs
    assert attrs["written_during_the_outage"] == 1 and attrs["under_the_lock"] == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert [line for line in err if "unreachable" in line][:1] and len([x for x in err if "unreachable" in x]) == 1, err
    assert len([line for line in err if "reachable again after" in line]) == 1, err


@pytest.mark.timeout(120)
def test_past_the_window_an_outage_is_one_line(fresh_postgres, postgres_outage, monkeypatch) -> None:
    from stratagem.search.retry import RETRY_ENV, StorageUnavailable

    monkeypatch.setenv(RETRY_ENV, "0.05")  # 3 s
    study = _study_on(fresh_postgres, "w")
    outage = threading.Thread(target=postgres_outage, args=(8.0,))
    outage.start()
    time.sleep(1.0)
    try:
        with pytest.raises(StorageUnavailable) as e:
            study.set_user_attr("x", 1)
    finally:
        outage.join()
    msg = str(e.value)
    assert "unreachable for 0.1 min" in msg and "--storage-retry-minutes" in msg and "\n" not in msg


def test_errors_that_are_not_an_outage_are_not_retried(tmp_path) -> None:
    """No such study, a finished trial: raised at once (no 5-minute wait)."""
    import optuna

    url = f"sqlite:///{tmp_path / 'n.db'}"
    study = _study_on(url, "n")
    t0 = time.monotonic()
    with pytest.raises(KeyError):
        study._storage.get_study_id_from_name("nope")
    trial = study.ask()
    study.tell(trial, [1.0, 1.0, 1.0])
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        study._storage.set_trial_user_attr(trial._trial_id, "k", 1)
    assert time.monotonic() - t0 < 5


# --- read-only opens create nothing (issue 27 item 5, 28 item 7) ----------------------------------------------


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_read_only_open_of_a_mistyped_path_creates_nothing(tmp_path, kind) -> None:
    url = f"sqlite:///{tmp_path / 'typo.db'}" if kind == "sqlite" else f"journal:{tmp_path / 'typo.log'}"
    with pytest.raises(StratagemError, match="not found") as e:
        open_storage(parse_storage(url), write=False)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_open_of_an_empty_sqlite_file_creates_no_tables(tmp_path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(StratagemError, match="not an Optuna storage"):
        open_storage(parse_storage(f"sqlite:///{empty}"), write=False)
    assert empty.stat().st_size == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["empty.db"]


def test_question_mark_and_hash_in_a_sqlite_path(tmp_path) -> None:
    """'?' would cut the path (SQLAlchemy reads a query): refused with the fix; default_storage encodes it, so
    the storage beside a scenario in such a directory is that file; '#' needs nothing."""
    odd = tmp_path / "a?b#c"
    odd.mkdir()
    with pytest.raises(StratagemError, match="%3F"):
        parse_storage(f"sqlite:///{odd}/s.db")
    url = default_storage(odd / "s.yaml")
    spec = parse_storage(url)
    assert spec.path == odd / "stratagem.db"
    open_storage(spec)
    assert (odd / "stratagem.db").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["a?b#c"]


# --- a torn journal (issue 28 item 2) -------------------------------------------------------------------------


def _journal_with_trials(path: Path, n: int):  # noqa: ANN202
    study = _study_on(f"journal:{path}", "j")
    for i in range(n):
        study.add_trial(__import__("optuna").trial.create_trial(values=[float(i), 1.0, 1.0]))
    return study


def _trials(path: Path) -> int:
    import optuna

    return len(optuna.load_study(study_name="j", storage=open_storage(parse_storage(f"journal:{path}"),
                                                                      write=False)).trials)


def test_a_torn_last_record_is_cut_before_the_next_append(tmp_path, capfd) -> None:
    log = tmp_path / "j.log"
    _journal_with_trials(log, 3)
    whole = log.read_bytes()
    with open(log, "ab") as f:  # a write cut short: half a record, no newline (disk full, killed writer)
        f.write(b'{"op_code":5,"worker_id":"x","trial_id":0,"user_attr":{"half')
    assert _trials(log) == 3  # readers skip a torn last record
    again = _study_on_existing(log)
    again.set_user_attr("after", 1)
    err = capfd.readouterr().err
    assert err.count("last record was torn") == 1 and "removed it" in err, err
    data = log.read_bytes()
    assert data.startswith(whole) and data.endswith(b"\n") and b"half" not in data
    assert _trials(log) == 3


def _study_on_existing(path: Path):  # noqa: ANN202
    import optuna

    return optuna.load_study(study_name="j", storage=open_storage(parse_storage(f"journal:{path}")))


def test_a_journal_appended_after_a_torn_record_is_repaired(tmp_path, capfd) -> None:
    """What an older stratagem left: a torn record glued to the next one, more records after it. Reading it
    is one line naming the fix; opening it to write repairs it, keeping every whole record."""
    log = tmp_path / "j.log"
    _journal_with_trials(log, 2)
    lines = log.read_bytes().splitlines(keepends=True)
    torn = b'{"op_code":6,"worker_id":"x","trial_id":1,"sta'
    log.write_bytes(b"".join(lines[:-2]) + torn + b"".join(lines[-2:]))
    kept = lines[-2]
    with pytest.raises(StratagemError, match="damaged record") as e:
        open_storage(parse_storage(f"journal:{log}"), write=False)
    assert "\n" not in str(e.value)
    _study_on_existing(log).set_user_attr("repaired", 1)
    assert "repaired 1 damaged journal record" in capfd.readouterr().err
    assert torn not in log.read_bytes() and kept in log.read_bytes()
    assert _trials(log) == 2


def test_a_whole_last_record_glued_to_a_torn_one_is_repaired_before_appending(tmp_path, capfd) -> None:
    log = tmp_path / "j.log"
    _journal_with_trials(log, 2)
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(lines[:-1]) + b'{"op_code":6,"wor' + lines[-1])
    _study_on_existing(log).set_user_attr("after", 1)
    assert "repaired 1 damaged journal record" in capfd.readouterr().err
    assert _trials(log) == 2 and _study_on_existing(log).user_attrs["after"] == 1


@pytest.mark.skipif(sys.platform != "linux", reason="ulimit -f through bash")
def test_a_failed_append_is_one_line_and_changes_nothing(tmp_path) -> None:
    """Disk full, by the file-size limit (EFBIG, "File too large"): one line, exit 2, the journal byte-identical;
    the search resumes from it when the space is back."""
    import hashlib
    import subprocess

    scenario = tmp_path / "s.yaml"
    scenario.write_text((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    log = tmp_path / "s.log"
    cli = f"{sys.executable} -m stratagem.cli search {scenario} --storage journal:{log} --study j --no-report"
    limited = subprocess.run(["bash", "-c", f"ulimit -f 64; exec {cli}"], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
    assert limited.returncode == 2, limited.stderr[-2000:]
    err = limited.stderr.strip().splitlines()
    assert "Traceback" not in limited.stderr and err[-1].startswith("error: storage (journal:"), err[-3:]
    assert "File too large" in err[-1] and "nothing was written" in err[-1]
    data = log.read_bytes()
    assert data.endswith(b"\n") and 0 < len(data) <= 64 * 1024
    digest = hashlib.sha256(data).hexdigest()
    assert _study_count(log) >= 0 and hashlib.sha256(log.read_bytes()).hexdigest() == digest  # reading changes nothing
    done = subprocess.run(cli.split(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]


def _study_count(path: Path) -> int:
    return len(open_storage(parse_storage(f"journal:{path}"), write=False).get_all_studies())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_survive_a_20_s_database_outage(fresh_postgres, postgres_outage) -> None:
    """PostgreSQL stopped (`pg_ctl stop -m immediate`) for 20 s while two workers hold claims and their runs
    finish during the outage (issue 27 item 2): both wait it out (one line when it starts, one when it ends),
    store the finished results when the database is back, finish K together; nothing lost, no claim left
    RUNNING, each plan measured once."""
    import subprocess

    import optuna
    from optuna.trial import TrialState

    from stratagem.spaces import Plan
    from stratagem.spaces.plan import format_plan

    url, k = fresh_postgres, 4
    plans = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)]
    open_storage(parse_storage(url))  # Optuna's tables first
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([sys.executable, str(Path(__file__).with_name("standin.py")), url, "out", str(k),
                                 "12", *[format_plan(p) for p in plans]], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True) for _ in range(2)]
    try:
        poller = open_storage(parse_storage(url), write=False) if _wait_for_study(url) else None
        assert poller is not None, "no study after 180 s"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # both workers hold a claim
            running = optuna.load_study(study_name="out", storage=poller).get_trials(states=(TrialState.RUNNING,))
            if len(running) >= 2:
                break
            time.sleep(0.5)
        assert len(running) >= 2, "the workers never held two claims at once"
        postgres_outage(20.0)  # the 12 s runs finish while the database is down
        outs = [w.communicate(timeout=400) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    for w, (_, err) in zip(workers, outs, strict=True):
        assert w.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert err.count("unreachable (") == 1 and err.count("reachable again after") == 1, err[-3000:]
    study = optuna.load_study(study_name="out", storage=open_storage(parse_storage(url), write=False))
    measured = [t for t in study.trials if t.user_attrs.get("fidelity") == "measured"
                and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    keys = [t.user_attrs["plan"] for t in measured]
    assert len(keys) == k == len(set(keys)), keys
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert not [t for t in study.trials if "expired" in t.user_attrs]  # the outage did not cost a claim
    runs = [int(out.split("runs=")[1].split()[0]) for out, _ in outs]
    assert sum(runs) == k and all(r > 0 for r in runs), outs


def _wait_for_study(url: str, timeout: float = 180, name: str = "out") -> bool:
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if "studies" in inspect(engine).get_table_names():
                with engine.connect() as con:
                    if con.execute(text("SELECT count(*) FROM studies WHERE study_name = :n"), {"n": name}).scalar():
                        return True
            time.sleep(0.5)
        return False
    finally:
        engine.dispose()


@pytest.mark.skipif(sys.platform != "linux", reason="ulimit -f through bash")
def test_a_full_disk_under_a_sqlite_storage_is_one_line_and_the_search_resumes(tmp_path) -> None:
    """A second study into an existing database with no room left (the file-size limit at its size): one line
    at once (no retrying a full disk), exit 2; the first study is intact and the second resumes later."""
    import subprocess

    scenario = tmp_path / "s.yaml"
    scenario.write_text((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    db = tmp_path / "stratagem.db"
    cli = [sys.executable, "-m", "stratagem.cli", "search", str(scenario), "--no-report", "--study"]
    first = _study_on(f"sqlite:///{db}", "a")  # an existing database (another study in it)
    for i in range(3):
        first.add_trial(__import__("optuna").trial.create_trial(values=[float(i), 1.0, 1.0]))
    limit_kib = db.stat().st_size // 1024 + 4
    t0 = time.monotonic()
    full = subprocess.run(["bash", "-c", f"ulimit -f {limit_kib}; exec \"$@\"", "bash", *cli, "b"],
                          capture_output=True, text=True, timeout=300)
    assert time.monotonic() - t0 < 120  # not the 5-minute outage window
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-2000:]
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("error: storage (sqlite:") and "rolled back" in last and "Free space" in last, last
    import optuna

    assert len(optuna.load_study(study_name="a", storage=f"sqlite:///{db}").trials) > 0
    again = subprocess.run([*cli, "b"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


def test_one_storage_opener() -> None:
    """Issue 23 item 2: Optuna storages are built and studies loaded only in search/storage.py (through the
    retrying, torn-write-safe opener): no `optuna.load_study`, RDBStorage or JournalStorage elsewhere."""
    import re

    pattern = re.compile(r"optuna\.load_study\(|\bRDBStorage\(|\bJournalStorage\(|JournalFileBackend\(")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "stratagem").rglob("*.py"))
             if p.name not in ("storage.py", "journal.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_a_journal_whose_first_record_is_torn_is_still_ours(tmp_path, capfd) -> None:
    log = tmp_path / "j.log"
    log.write_bytes(b'{"op_code":0,"worker_id":"x","study_name":"j","dir')  # the disk filled at once
    study = _study_on(f"journal:{log}", "j")
    study.set_user_attr("ok", 1)
    assert "last record was torn" in capfd.readouterr().err
    assert _study_on_existing(log).user_attrs == {"ok": 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_exits_2_in_one_line_when_the_outage_outlasts_the_window(fresh_postgres, postgres_outage) -> None:
    """Past --storage-retry-minutes (here 0.1 min via the environment) the worker stops with StorageUnavailable
    (a StratagemError: the CLI prints its one line and exits 2; this stand-in worker calls the library, so it
    ends on the exception); a rerun after the database is back finishes K without a duplicate."""
    import subprocess

    import optuna
    from optuna.trial import TrialState

    from stratagem.spaces import Plan
    from stratagem.spaces.plan import format_plan

    url = fresh_postgres
    plans = [format_plan(p) for p in (Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2))]
    open_storage(parse_storage(url))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STRATAGEM_STORAGE_RETRY_MINUTES": "0.1"}
    cmd = [sys.executable, str(Path(__file__).with_name("standin.py")), url, "win", "2", "8", *plans]
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for_study(url, name="win")
        poller = open_storage(parse_storage(url), write=False)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not optuna.load_study(
                study_name="win", storage=poller).get_trials(states=(TrialState.RUNNING,)):
            time.sleep(0.5)
        postgres_outage(25.0)
        _, err = worker.communicate(timeout=300)
    finally:
        if worker.poll() is None:
            worker.kill()
    last = err.strip().splitlines()[-1]
    assert worker.returncode != 0 and last.startswith("stratagem.search.retry.StorageUnavailable: storage ("), err[-3000:]
    assert "unreachable for 0.1 min" in last and "--storage-retry-minutes" in last, err[-3000:]
    assert err.count("retrying for up to 0.1 min") == 1, err[-3000:]  # one line per outage, from every thread
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    study = optuna.load_study(study_name="win", storage=open_storage(parse_storage(url), write=False))
    keys = [t.user_attrs["plan"] for t in study.trials if t.user_attrs.get("fidelity") == "measured"
            and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(keys) == 2 == len(set(keys)) and not study.get_trials(states=(TrialState.RUNNING,))
