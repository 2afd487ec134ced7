"""The cross-process locks behind `stratagem.search.storage.storage_lock`, one per scope (a study, or the
storage's own for creating its tables), so writers of different studies never wait on each other: a byte-range
lock on one file beside a file storage (sqlite, journal: the scope's key is the byte), the database's advisory
lock keyed by the scope (pg_advisory_lock, GET_LOCK) for an RDB one; what waiting for them cost this process
(`lock_waits`); and SQLAlchemy errors as one line (`first_line`, `sqlalchemy_errors`), which the storage's
checks share."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.search.retry import outages_for, transient

__all__ = ["file_lock", "db_lock", "lock_key", "first_line", "sqlalchemy_errors", "LockWaits", "lock_waits"]


@dataclass(frozen=True)
class LockWaits:
    """This process's waits for storage locks so far (what another holder of the same lock cost it)."""

    taken: int
    """Locks taken."""
    seconds: float
    """Seconds spent waiting to take them, in all."""
    longest: float
    """The longest single wait, seconds."""


_waits = {"taken": 0, "seconds": 0.0, "longest": 0.0}
_waits_guard = threading.Lock()


def lock_waits() -> LockWaits:
    """This process's lock waits so far."""
    with _waits_guard:
        return LockWaits(taken=int(_waits["taken"]), seconds=_waits["seconds"], longest=_waits["longest"])


def _waited(seconds: float) -> None:
    with _waits_guard:
        _waits["taken"] += 1
        _waits["seconds"] += seconds
        _waits["longest"] = max(_waits["longest"], seconds)


def first_line(e: BaseException) -> str:
    """The first line of a (SQLAlchemy) error's message: the driver's own (`orig`) where it has one."""
    text = str(getattr(e, "orig", None) or e).strip().splitlines()
    return text[0] if text else type(e).__name__


def lock_key(scope: str) -> int:
    """The 32-bit key of a lock scope (CRC-32 of its name): the byte a file lock takes, the database lock's key.
    Two scopes whose keys collide share one lock: they serialise, never exclude less."""
    return zlib.crc32(scope.encode("utf-8"))


_OFD = getattr(fcntl, "F_OFD_SETLK", None)  # Linux >= 3.15: byte-range locks owned by the open file (fcntl(2))


@contextlib.contextmanager
def file_lock(path: Path, timeout: float, key: int = 0) -> Iterator[None]:
    """An exclusive lock on byte `key` of `path` (created if missing) for the block, polled until `timeout` s;
    released by the kernel if the holder dies. Locks on other bytes of the file (other scopes) do not wait for
    it. An open-file-description lock (F_OFD_SETLK, fcntl(2)): owned by this open of the file, so two threads or
    two scopes of one process exclude each other like two processes, and closing another descriptor of the
    file releases nothing. Where the kernel has none, flock on the whole file (every scope serialised)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise StratagemError(f"storage lock ({path}): cannot create it: {e.strerror}; the storage's directory "
                             "must be writable") from None
    try:
        t0 = time.monotonic()
        deadline = t0 + timeout
        delay = 0.001
        while not _try_lock(fd, key):
            if time.monotonic() > deadline:
                raise StratagemError(f"storage lock ({path}): still held by another search after "
                                     f"{timeout:.0f} s; wait for it or remove a stale lock holder")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        _waited(time.monotonic() - t0)
        yield  # closing the descriptor releases the lock (either kind)
    finally:
        os.close(fd)


def _try_lock(fd: int, key: int) -> bool:
    """Take the lock without waiting; False when another holder has it."""
    try:
        if _OFD is None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:  # struct flock {short l_type, l_whence; off_t l_start, l_len; pid_t l_pid (0 for OFD)}
            fcntl.fcntl(fd, _OFD, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, key, 1, 0))
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


@contextlib.contextmanager
def sqlalchemy_errors(url: str) -> Iterator[None]:
    """SQLAlchemy errors (server gone, credentials) as one line."""
    try:
        yield
    except Exception as e:
        if type(e).__module__.startswith("sqlalchemy"):
            raise StratagemError(f"storage ({url!r}): {first_line(e)}") from None
        raise


@contextlib.contextmanager
def db_lock(url: str, timeout: float, connect_args: dict[str, int], key: int = 0) -> Iterator[None]:
    """The database's advisory lock `key` on a pooled connection of this process, taken through an outage
    (retried like the storage's calls): other keys (other scopes) do not wait for it. A lock whose connection
    died in the block died with it on the server: releasing it is then skipped, and a connection whose release
    failed is discarded, never pooled holding a lock."""
    engine = _engine(url, connect_args)
    t0 = time.monotonic()
    with sqlalchemy_errors(url):
        conn = outages_for(url).run("rdb", lambda: _acquire_db_lock(engine, url, timeout, key))
    _waited(time.monotonic() - t0)
    try:
        yield
    finally:
        try:
            _release_db_lock(conn, key)
            conn.close()
        except Exception as e:
            with contextlib.suppress(Exception):
                conn.invalidate()
            if not transient(e, "rdb"):
                raise


_ENGINES: dict[tuple[int, str], Any] = {}
_ENGINES_GUARD = threading.Lock()


def _engine(url: str, connect_args: dict[str, int]) -> Any:
    """This process's engine for the locks of `url` (one pool per process: a lock costs no new connection)."""
    from sqlalchemy import create_engine

    with _ENGINES_GUARD:
        found = _ENGINES.get((os.getpid(), url))  # a forked child builds its own: a pool is not shared across fork
        if found is None:
            try:
                found = create_engine(url, connect_args=connect_args, pool_pre_ping=True,
                                      isolation_level="AUTOCOMMIT")  # the locks are the session's: no transaction
            except ImportError as e:
                raise StratagemError(f"storage lock ({url}): database driver {getattr(e, 'name', '?')!r} is not "
                                     "installed") from None
            _ENGINES[(os.getpid(), url)] = found
        return found


_DB_LOCK_SPACE = zlib.crc32(b"stratagem-search") - (1 << 31)
"""PostgreSQL's two-int4 advisory lock key space: (this, the scope's key), apart from other applications'."""


def _int4(key: int) -> int:
    return key - (1 << 32) if key >= 1 << 31 else key


def _mysql_name(key: int) -> str:
    return f"stratagem-search-{key:08x}"


def _acquire_db_lock(engine: Any, url: str, timeout: float, key: int) -> Any:
    from sqlalchemy import text

    conn = engine.connect()
    try:
        if engine.dialect.name == "postgresql":  # one round trip (an autocommit connection: no BEGIN/COMMIT)
            try:
                conn.execute(text("SELECT set_config('lock_timeout', :t, false), pg_advisory_lock(:s, :k)"),
                             {"t": f"{int(timeout * 1000)}ms", "s": _DB_LOCK_SPACE, "k": _int4(key)})
            except Exception as e:
                if getattr(getattr(e, "orig", None), "sqlstate", None) == "55P03":  # lock_not_available
                    raise StratagemError(f"storage lock ({url}): still held by another search after {timeout:.0f} s; "
                                         "wait for it or stop the search holding it") from None
                raise
        elif engine.dialect.name in ("mysql", "mariadb"):
            got = conn.execute(text("SELECT GET_LOCK(:n, :t)"), {"n": _mysql_name(key), "t": int(timeout)}).scalar()
            if got != 1:
                raise StratagemError(f"storage lock ({url}): not acquired within {timeout:.0f} s")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.invalidate()
        raise
    return conn


def _release_db_lock(conn: Any, key: int) -> None:
    from sqlalchemy import text

    name = conn.engine.dialect.name
    if name == "postgresql":
        conn.execute(text("SELECT pg_advisory_unlock(:s, :k)"), {"s": _DB_LOCK_SPACE, "k": _int4(key)})
    elif name in ("mysql", "mariadb"):
        conn.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": _mysql_name(key)})
