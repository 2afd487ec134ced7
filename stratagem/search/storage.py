"""Where a study lives: an Optuna storage named by a URL, checked before anything is written, and a lock
that serialises the few writes that must not interleave (creating the study, storing the screened plans).

URLs:
  sqlite:///PATH.db              a SQLite file (the default: stratagem.db beside the scenario)
  postgresql://..., mysql://...  any SQLAlchemy RDB URL Optuna supports (a database shared by a cluster)
  journal:PATH                   an Optuna journal file (append-only; works on shared disks such as NFS)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import sqlite3
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

from optuna.storages.journal._file import BaseJournalFileLock  # the lock interface JournalFileBackend takes

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    import optuna

__all__ = ["FlockJournalLock", "StorageSpec", "parse_storage", "check_storage", "open_storage", "storage_lock",
           "default_storage", "LOCK_TIMEOUT_S"]

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
    """sqlite:///<scenario's directory>/stratagem.db"""
    return f"sqlite:///{Path(scenario_path).resolve().parent / 'stratagem.db'}"


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
    try:
        first = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        first = None
    if not isinstance(first, dict) or not isinstance(first.get("op_code"), int):
        raise StratagemError(f"storage ({url!r}): {path} is not an Optuna journal; give a new file name or the "
                             "journal a search wrote")


def _check_sqlite(url: str, path: Path) -> None:
    """An existing SQLite file is empty, or a database that is empty or holds Optuna's tables (read-only look)."""
    if path.stat().st_size == 0:
        return
    try:
        con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=5)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e) or "malformed" in str(e):
            raise StratagemError(f"storage ({url!r}): {path} is not an SQLite database; give a new file name or "
                                 "the database a search wrote") from None
        raise StratagemError(f"storage ({url!r}): cannot read {path}: {e}") from None
    if tables and not _OPTUNA_TABLES <= tables:
        raise StratagemError(f"storage ({url!r}): {path} is an SQLite database but not an Optuna storage; give "
                             "a new file name or the database a search wrote")


_OPTUNA_TABLES = {"studies", "trials", "version_info"}


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
            raise StratagemError(f"storage ({url!r}): {_first_line(e)}") from None
        raise
    try:
        with engine.connect():
            pass
    except Exception as e:
        if type(e).__module__.startswith("sqlalchemy"):
            raise StratagemError(f"storage ({url!r}): cannot connect: {_first_line(e)}") from None
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


def open_storage(spec: StorageSpec, *, write: bool = True) -> optuna.storages.BaseStorage:
    """The Optuna storage for `spec` (creates the file / tables if needed, never a study), after `check_storage`:
    a file that is not Optuna's is never touched. `write=False` (reports) skips the writable-directory check. A
    fresh database opened by several processes at once (workers, `stratagem status`, a dashboard): the collisions
    of their table creation are retried."""
    import optuna

    check_storage(spec, write=write)
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        if spec.kind == "journal":
            assert spec.path is not None
            return JournalStorage(JournalFileBackend(str(spec.path), lock_obj=FlockJournalLock(spec.path)))
        import warnings

        for attempt in range(_SCHEMA_TRIES):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # heartbeat_interval is "experimental"
                    return RDBStorage(spec.url, engine_kwargs={"connect_args": _connect_args(spec.url)},
                                      heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
            except Exception as e:
                if attempt == _SCHEMA_TRIES - 1 or not _schema_race(e):
                    raise
                time.sleep(0.1 * (attempt + 1))  # the other opener has created the tables (or soon will)
        raise AssertionError("unreachable")
    except (ImportError, OSError) as e:
        raise StratagemError(f"storage ({spec.url!r}): cannot open: {_first_line(e)}") from None
    except Exception as e:  # sqlalchemy OperationalError and friends: unreachable server, bad file
        if type(e).__module__.startswith(("sqlalchemy", "optuna")):
            raise StratagemError(f"storage ({spec.url!r}): cannot open: {_first_line(e)}") from None
        raise


_SCHEMA_TRIES = 5
"""Tries to open an RDB storage whose schema another process is creating at the same moment."""
_SCHEMA_RACE = ("duplicate key", "already exists", "duplicate entry")


def _schema_race(e: BaseException) -> bool:
    """Whether `e` is a collision with a concurrent creation of Optuna's tables (or its version row): several
    processes (workers, `stratagem status`, optuna-dashboard) opening a fresh database at once; retrying finds
    the tables made."""
    text = " ".join(str(x).lower() for x in (e, getattr(e, "orig", None), e.__cause__, e.__context__) if x)
    return type(e).__module__.startswith(("sqlalchemy", "optuna")) and any(m in text for m in _SCHEMA_RACE)


class FlockJournalLock(BaseJournalFileLock):
    """The journal's append lock as an flock on `<journal>.flock`: the kernel drops it when its holder dies.
    (Optuna's default symlink lock, left behind by a process killed while appending, stalls every later
    writer for its 30 s grace period.)"""

    def __init__(self, journal: Path) -> None:
        self._path = f"{journal}.flock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the journal's lock (flock, blocking); True when held."""
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        """Release the journal's lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "orig", None) or e).strip().splitlines()
    return text[0] if text else type(e).__name__


@contextlib.contextmanager
def storage_lock(spec: StorageSpec, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive across processes (and hosts sharing the file or database) for the block.

    Files (sqlite, journal): flock on `<file>.stratagem-lock`, released by the kernel if the holder dies.
    PostgreSQL: pg_advisory_lock; MySQL: GET_LOCK (both released when the holder's connection drops).
    Other databases have no lock: concurrent searches may then store a plan twice.
    """
    if spec.path is not None:
        with _file_lock(Path(f"{spec.path}.stratagem-lock"), timeout):
            yield
        return
    with _db_lock(spec.url, timeout):
        yield


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float) -> Iterator[None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise StratagemError(f"storage lock ({path}): cannot create it: {e.strerror}; the storage's directory "
                             "must be writable") from None
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise StratagemError(f"storage lock ({path}): still held by another search after "
                                         f"{timeout:.0f} s; wait for it or remove a stale lock holder") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    """SQLAlchemy errors (server gone, credentials) as one line."""
    try:
        yield
    except Exception as e:
        if type(e).__module__.startswith("sqlalchemy"):
            raise StratagemError(f"storage ({url!r}): {_first_line(e)}") from None
        raise


@contextlib.contextmanager
def _db_lock(url: str, timeout: float) -> Iterator[None]:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url, connect_args=_connect_args(url))
    except ImportError as e:
        raise StratagemError(f"storage lock ({url}): database driver {getattr(e, 'name', '?')!r} is not "
                             "installed") from None
    key = zlib.crc32(b"stratagem-search")
    try:
        with _translated(url), engine.connect() as conn:
            backend = engine.dialect.name
            if backend == "postgresql":
                conn.execute(text(f"SET lock_timeout = '{int(timeout * 1000)}ms'"))
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            elif backend in ("mysql", "mariadb"):
                got = conn.execute(text("SELECT GET_LOCK('stratagem-search', :t)"), {"t": int(timeout)}).scalar()
                if got != 1:
                    raise StratagemError(f"storage lock ({url}): not acquired within {timeout:.0f} s")
            try:
                yield
            finally:
                if backend == "postgresql":
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                elif backend in ("mysql", "mariadb"):
                    conn.execute(text("SELECT RELEASE_LOCK('stratagem-search')"))
    finally:
        engine.dispose()
