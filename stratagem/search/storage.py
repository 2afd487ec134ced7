"""Where a study lives: an Optuna storage named by a URL, checked before anything is written, and a lock per
study that serialises the few writes of that study that must not interleave (creating it, claims, slices of
its analytic store); writers of different studies never wait on each other.

URLs:
  sqlite:///PATH.db              a SQLite file (the default: stratagem.db beside the scenario)
  postgresql://..., mysql://...  any SQLAlchemy RDB URL Optuna supports (a database shared by a cluster)
  journal:PATH                   an Optuna journal file (append-only; works on shared disks such as NFS)
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from stratagem.errors import StratagemError
from stratagem.search.journal import FlockJournalLock, SafeJournalBackend, repair_journal
from stratagem.search.locks import db_lock, file_lock, first_line, lock_key, sqlalchemy_errors
from stratagem.search.retry import RetryingStorage, check_minutes, outages_for
from stratagem.search.schema import rdb_layout, schema_verdict, sqlite_layout, sqlite_readonly_url

if TYPE_CHECKING:
    import optuna

__all__ = ["StorageSpec", "parse_storage", "check_storage", "open_storage", "storage_lock",
           "default_storage", "load_study", "study_names", "LOCK_TIMEOUT_S"]

LOCK_TIMEOUT_S = 600.0
HEARTBEAT_S = 30  # RDB heartbeat of running (measured) trials; stale after GRACE_S without one
GRACE_S = 120
_HINT = "use sqlite:///FILE.db, journal:FILE.log or an RDB URL such as postgresql://user@host/db"
_PROBE_BYTES = 1 << 20  # a journal's first line (one JSON operation) is far below this
CONNECT_TIMEOUT_S = 10
# Driver module -> what to install. The extras are declared in pyproject.toml.
_DRIVERS = {"psycopg": "pip install 'stratagem[postgres]' (psycopg[binary])",
            "psycopg2": "pip install psycopg2-binary",
            "MySQLdb": "pip install 'stratagem[mysql]' (mysqlclient)",
            "pymysql": "pip install pymysql"}


@dataclass(frozen=True)
class StorageSpec:
    """A parsed storage URL."""

    url: str
    kind: Literal["sqlite", "rdb", "journal"]
    path: Path | None
    """The file of a sqlite or journal storage."""

    def dashboard_command(self) -> str:
        """The optuna-dashboard command that watches this storage."""
        target = str(self.path) if self.kind == "journal" else self.url
        return shlex.join(["optuna-dashboard", target])  # printed for pasting: shell-quoted


def default_storage(scenario_path: str | Path) -> str:
    """sqlite:///<scenario's directory>/stratagem.db: the one default every command uses (search writes the
    study there, status/report/export/reproduce read it from there). '%' and '?' in the path are
    percent-encoded, so the URL names that file (SQLAlchemy reads '?' as the start of a query)."""
    return f"sqlite:///{_encode_path(Path(scenario_path).resolve().parent / 'stratagem.db')}"


def _encode_path(path: Path) -> str:
    return str(path).replace("%", "%25").replace("?", "%3F")


def parse_storage(url: str) -> StorageSpec:
    """Check a storage URL without touching anything; one-line StratagemError when it is wrong."""
    url = url.strip()
    if url.startswith("journal:"):
        rest = url.removeprefix("journal:")
        rest = rest[2:] if rest.startswith("//") else rest
        if not rest:
            raise StratagemError(f"storage ({url!r}): journal: needs a file path, e.g. journal:study.log")
        path = Path(rest)
        _check_dir(url, path)
        return StorageSpec(url=f"journal:{path}", kind="journal", path=path)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StratagemError(f"storage ({url!r}): not a storage URL; {_HINT}") from None
    try:
        parsed.get_dialect()
    except NoSuchModuleError:
        raise StratagemError(f"storage ({url!r}): unknown database kind {parsed.drivername!r}; {_HINT}") from None
    if parsed.get_backend_name() == "sqlite":
        if "?" in url:
            raise StratagemError(f"storage ({url!r}): SQLAlchemy reads '?' as the start of URL options, so the "
                                 "study would go to another file; write a '?' in the path as %3F (and '%' as %25)")
        if not parsed.database or parsed.database == ":memory:":
            raise StratagemError(f"storage ({url!r}): an in-memory SQLite database cannot be resumed; give a "
                                 "file, e.g. sqlite:///stratagem.db")
        path = Path(parsed.database)
        _check_dir(url, path)
        return StorageSpec(url=url, kind="sqlite", path=path)
    return StorageSpec(url=url, kind="rdb", path=None)


def _check_dir(url: str, path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StratagemError(f"storage ({url!r}): directory {parent} does not exist; create it or give another path")
    if path.is_dir():
        raise StratagemError(f"storage ({url!r}): {path} is a directory; give a file path")


def check_storage(spec: StorageSpec, *, write: bool = True) -> None:
    """Everything knowable about a storage before any work, without writing anything: an existing file must be
    Optuna's (a journal of Optuna operations; an SQLite database that is empty or holds Optuna's tables), its
    directory writable when `write` (the file, its lock and SQLite's journal live there), an RDB's driver
    installed and its server reachable with the given credentials. One-line StratagemError otherwise."""
    if spec.kind == "rdb":
        _check_rdb(spec.url)
        return
    assert spec.path is not None  # file kinds always carry their path (parse_storage)
    path = spec.path
    if path.exists():
        if not path.is_file():
            raise StratagemError(f"storage ({spec.url!r}): {path} is not a regular file; give a file path")
        if not os.access(path, os.R_OK):
            raise StratagemError(f"storage ({spec.url!r}): {path} is not readable; fix its permissions")
        if spec.kind == "journal":
            _check_journal(spec.url, path)
        else:
            _check_sqlite(spec.url, path)
    if write:
        parent = path.parent if str(path.parent) else Path(".")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise StratagemError(f"storage ({spec.url!r}): directory {parent} is not writable (the storage and "
                                 "its lock file live there); choose a writable directory")
        if path.exists() and not os.access(path, os.W_OK):
            raise StratagemError(f"storage ({spec.url!r}): {path} is read-only; make it writable or give "
                                 "another file")


def _check_journal(url: str, path: Path) -> None:
    """An existing journal is empty or starts with an Optuna operation: a JSON object with an op_code."""
    with open(path, "rb") as f:
        head = f.read(_PROBE_BYTES)
    if not head:
        return
    line = head.split(b"\n", 1)[0]
    if b"\n" not in head and line.startswith(b'{"op_code":'):
        return  # its first record torn (the disk filled during the first write): the next append cuts it
    try:
        first = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        first = None
    if not isinstance(first, dict) or not isinstance(first.get("op_code"), int):
        raise StratagemError(f"storage ({url!r}): {path} is not an Optuna journal; give a new file name or the "
                             "journal a search wrote")


def _check_sqlite(url: str, path: Path) -> str:
    """An existing SQLite file is empty, or a database that is empty or holds this Optuna's schema (read-only
    look: search.schema); "empty" or "optuna", else one-line StratagemError."""
    if path.stat().st_size == 0:
        return "empty"
    try:
        layout = sqlite_layout(path)
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e) or "malformed" in str(e):
            raise StratagemError(f"storage ({url!r}): {path} is not an SQLite database; give a new file name or "
                                 "the database a search wrote") from None
        if "locked" in str(e):
            raise StratagemError(f"storage ({url!r}): {path} is locked by another process (a write in progress "
                                 "or a stuck program holding it); wait for it, or stop that program") from None
        raise StratagemError(f"storage ({url!r}): cannot read {path}: {e}") from None
    return schema_verdict(layout, f"storage ({url!r}): {path}", "an SQLite database")


def _check_rdb(url: str) -> None:
    """The driver is importable and a connection (with the URL's credentials) opens within CONNECT_TIMEOUT_S."""
    from sqlalchemy import create_engine

    try:
        engine = create_engine(url, connect_args=_connect_args(url))
    except ImportError as e:
        module = getattr(e, "name", None) or "?"
        fix = _DRIVERS.get(module.split(".")[0], f"pip install the package that provides {module!r}")
        raise StratagemError(f"storage ({url!r}): the database driver {module!r} is not installed; {fix}") from None
    except Exception as e:
        if type(e).__module__.startswith("sqlalchemy"):
            raise StratagemError(f"storage ({url!r}): {first_line(e)}") from None
        raise
    try:
        with engine.connect():
            pass
        schema_verdict(rdb_layout(engine), f"storage ({url!r})")
    except Exception as e:
        if type(e).__module__.startswith("sqlalchemy"):
            raise StratagemError(f"storage ({url!r}): cannot connect: {first_line(e)}") from None
        raise
    finally:
        engine.dispose()


def _connect_args(url: str) -> dict[str, int]:
    """A connect timeout where the driver takes one, so an unreachable host fails in seconds."""
    from sqlalchemy.engine import make_url

    backend = make_url(url).get_backend_name()
    if backend == "postgresql":
        return {"connect_timeout": CONNECT_TIMEOUT_S}
    if backend in ("mysql", "mariadb"):
        return {"connect_timeout": CONNECT_TIMEOUT_S}
    return {}


def open_storage(spec: StorageSpec, *, write: bool = True,
                 retry_minutes: float | None = None) -> optuna.storages.BaseStorage:
    """The Optuna storage for `spec`, after `check_storage` (a file that is not Optuna's is never touched),
    wrapped in `RetryingStorage`: every later call rides out an outage for `retry_minutes` (default: the
    --storage-retry-minutes window, `stratagem.search.retry.retry_minutes`).

    `write=True` (a search) creates the file / tables if needed (never a study); a fresh database opened by
    several processes at once has the collisions of their table creation retried; a journal with torn records
    is repaired. `write=False` (status, report, export, reproduce) creates nothing: the file must exist and
    hold Optuna's tables / records, an RDB must hold Optuna's tables; one-line StratagemError otherwise."""
    import optuna

    check_storage(spec, write=write)
    if not write:
        _check_readable(spec)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    window_s = None if retry_minutes is None else 60.0 * check_minutes(retry_minutes)
    outages = outages_for(spec.url, window_s)
    try:
        inner = _open_journal(spec, write) if spec.kind == "journal" else _open_rdb(spec, outages, write)
    except StratagemError:
        raise
    except (ImportError, OSError) as e:
        raise StratagemError(f"storage ({spec.url!r}): cannot open: {first_line(e)}") from None
    except Exception as e:  # sqlalchemy OperationalError and friends: unreachable server, bad file
        if type(e).__module__.startswith(("sqlalchemy", "optuna")):
            raise StratagemError(f"storage ({spec.url!r}): cannot open: {first_line(e)}") from None
        raise
    return RetryingStorage(inner, spec.kind, outages)


def _open_journal(spec: StorageSpec, write: bool) -> optuna.storages.BaseStorage:
    """Optuna's JournalStorage on the torn-write-safe backend; a journal an older version appended after a torn
    record is repaired when opened to write (a one-line error when opened to read)."""
    from optuna.storages import JournalStorage

    assert spec.path is not None
    backend = SafeJournalBackend(spec.path, spec.url)
    try:
        return JournalStorage(backend)
    except OSError:
        raise
    except Exception:  # Optuna's replay: a damaged record mid-file (JSONDecodeError, "Invalid log format."), or
        if not write:  # valid JSON that is no operation (KeyError, AssertionError on an unknown op_code, ...)
            raise backend.damaged() from None
    lock = FlockJournalLock(spec.path)
    lock.acquire()
    try:
        repair_journal(spec.path, spec.url)
    finally:
        lock.release()
    try:
        return JournalStorage(SafeJournalBackend(spec.path, spec.url))
    except OSError:
        raise
    except Exception:
        raise backend.damaged() from None


def _open_rdb(spec: StorageSpec, outages: Any, write: bool = True) -> optuna.storages.BaseStorage:
    """Optuna's RDBStorage (heartbeat on, stale pooled connections pre-pinged) behind its cache, as
    `optuna.load_study(storage=URL)` builds it; the table creation race and an outage at this moment retried.
    To read (`write=False`) it creates no table, and a SQLite file is opened `mode=ro`: nothing can be written."""
    import warnings

    from optuna.storages import RDBStorage
    from optuna.storages._cached_storage import _CachedStorage

    url = sqlite_readonly_url(spec.path) if not write and spec.kind == "sqlite" and spec.path else spec.url

    def build() -> RDBStorage:
        for attempt in range(_SCHEMA_TRIES):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # heartbeat_interval is "experimental"
                    return RDBStorage(url, engine_kwargs={"connect_args": _connect_args(spec.url),
                                                          "pool_pre_ping": True},
                                      heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                      skip_table_creation=not write)
            except Exception as e:
                if attempt == _SCHEMA_TRIES - 1 or not _schema_race(e):
                    raise
                time.sleep(0.1 * (attempt + 1))  # the other opener has created the tables (or soon will)
        raise AssertionError("unreachable")

    return _CachedStorage(outages.run(spec.kind, build))


def _check_readable(spec: StorageSpec) -> None:
    """For a read-only open: the storage exists and holds Optuna's data; nothing is created (no SQLite file or
    tables, no journal file, no RDB tables). One-line StratagemError naming what to give instead."""
    hint = ("give the scenario the search ran (its storage is beside it) or the --storage it used, e.g. "
            "sqlite:///path/stratagem.db or journal:path/study.log")
    if spec.path is not None:
        if not spec.path.is_file():
            raise StratagemError(f"--storage ({spec.url}): file {spec.path} not found; {hint}")
        if spec.kind == "sqlite" and _check_sqlite(spec.url, spec.path) == "empty":
            raise StratagemError(f"--storage ({spec.url}): {spec.path} is not an Optuna storage (an empty database); "
                                 f"{hint}")
        return
    from sqlalchemy import create_engine

    engine = create_engine(spec.url, connect_args=_connect_args(spec.url))
    try:
        with sqlalchemy_errors(spec.url):
            verdict = schema_verdict(rdb_layout(engine), f"--storage ({spec.url})")
    finally:
        engine.dispose()
    if verdict == "empty":
        raise StratagemError(f"--storage ({spec.url}): the database holds no Optuna storage (no studies table); "
                             f"{hint}")


def study_names(storage: optuna.storages.BaseStorage) -> list[str]:
    """The names of the studies in an opened storage."""
    return [s.study_name for s in storage.get_all_studies()]


def load_study(storage: optuna.storages.BaseStorage, study_name: str, url: str = "") -> optuna.Study:
    """The existing study `study_name` in an opened storage (never creates one): the package's one
    `optuna.load_study`. One-line StratagemError listing the studies there when it does not exist."""
    import optuna

    try:
        return optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        names = [s.study_name for s in storage.get_all_studies()]
        where = url or "the storage"
        raise StratagemError(f"--study ({study_name!r}): no such study in {where}; studies there: "
                             f"{', '.join(names) or 'none'}") from None


_SCHEMA_TRIES = 5
"""Tries to open an RDB storage whose schema another process is creating at the same moment."""
_SCHEMA_RACE = ("duplicate key", "already exists", "duplicate entry")


def _schema_race(e: BaseException) -> bool:
    """Whether `e` is a collision with a concurrent creation of Optuna's tables (or its version row): several
    processes (workers, `stratagem status`, optuna-dashboard) opening a fresh database at once; retrying finds
    the tables made."""
    text = " ".join(str(x).lower() for x in (e, getattr(e, "orig", None), e.__cause__, e.__context__) if x)
    return type(e).__module__.startswith(("sqlalchemy", "optuna")) and any(m in text for m in _SCHEMA_RACE)


@contextlib.contextmanager
def storage_lock(spec: StorageSpec, study: str | None = None, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive across processes (and hosts sharing the file or database) for the block, for one scope:
    `study` names a study (its claims, counts, attribute read-modify-writes and each slice of its analytic
    store take it; writers of other studies do not wait); None: the storage's own (creating its tables).

    Files (sqlite, journal): a byte-range lock on `<file>.stratagem-lock`, released by the kernel if the holder
    dies. PostgreSQL: pg_advisory_lock; MySQL: GET_LOCK (both released when the holder's connection drops).
    Other databases have no lock: concurrent searches may then store a plan twice.
    """
    key = lock_key("storage" if study is None else f"study:{study}")
    if spec.path is not None:
        with file_lock(Path(f"{spec.path}.stratagem-lock"), timeout, key):
            yield
        return
    with db_lock(spec.url, timeout, _connect_args(spec.url), key):
        yield
