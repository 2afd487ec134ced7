"""The cross-process locks behind `stratagem.search.storage.storage_lock`: flock on a file beside a file
storage (sqlite, journal), the database's advisory lock (pg_advisory_lock, GET_LOCK) for an RDB one; and
SQLAlchemy errors as one line (`first_line`, `sqlalchemy_errors`), which the storage's checks share."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError
from stratagem.search.retry import outages_for, transient

__all__ = ["file_lock", "db_lock", "first_line", "sqlalchemy_errors", "LockWaits", "lock_waits"]


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


@contextlib.contextmanager
def file_lock(path: Path, timeout: float) -> Iterator[None]:
    """flock on `path` (created if missing) for the block, polled until `timeout` s; released by the kernel if
    the holder dies."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise StratagemError(f"storage lock ({path}): cannot create it: {e.strerror}; the storage's directory "
                             "must be writable") from None
    try:
        t0 = time.monotonic()
        deadline = t0 + timeout
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
        _waited(time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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
def db_lock(url: str, timeout: float, connect_args: dict[str, int]) -> Iterator[None]:
    """The database's advisory lock on its own connection, taken through an outage (retried like the storage's calls).
    A lock whose connection died in the block died with it on the server: releasing it is then skipped."""
    from sqlalchemy import create_engine

    try:
        engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
    except ImportError as e:
        raise StratagemError(f"storage lock ({url}): database driver {getattr(e, 'name', '?')!r} is not "
                             "installed") from None
    try:
        t0 = time.monotonic()
        with sqlalchemy_errors(url):
            conn = outages_for(url).run("rdb", lambda: _acquire_db_lock(engine, url, timeout))
        _waited(time.monotonic() - t0)
        try:
            yield
        finally:
            try:
                _release_db_lock(conn)
            except Exception as e:
                if not transient(e, "rdb"):
                    raise
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
    finally:
        engine.dispose()


_DB_LOCK_KEY = zlib.crc32(b"stratagem-search")


def _acquire_db_lock(engine: Any, url: str, timeout: float) -> Any:
    from sqlalchemy import text

    conn = engine.connect()
    try:
        if engine.dialect.name == "postgresql":
            conn.execute(text(f"SET lock_timeout = '{int(timeout * 1000)}ms'"))
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _DB_LOCK_KEY})
        elif engine.dialect.name in ("mysql", "mariadb"):
            got = conn.execute(text("SELECT GET_LOCK('stratagem-search', :t)"), {"t": int(timeout)}).scalar()
            if got != 1:
                raise StratagemError(f"storage lock ({url}): not acquired within {timeout:.0f} s")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.close()
        raise
    return conn


def _release_db_lock(conn: Any) -> None:
    from sqlalchemy import text

    name = conn.engine.dialect.name
    if name == "postgresql":
        conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _DB_LOCK_KEY})
    elif name in ("mysql", "mariadb"):
        conn.execute(text("SELECT RELEASE_LOCK('stratagem-search')"))
