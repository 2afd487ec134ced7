"""A throw-away PostgreSQL server for the storage, concurrency and claims tests (`postgres_url`).

Started once per session when it can be: Debian's server binaries (/usr/lib/postgresql/*/bin; `make postgres`
installs them as root; a test never runs apt), `initdb --auth=trust` into a temp dir owned by the postgres user, `pg_ctl
start` on a free port listening on 127.0.0.1 only, stopped and removed at the end. Otherwise the tests that need
it skip saying why (no driver: pip install 'stratagem[postgres]'; no server binaries and not root).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def _bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """postgresql+psycopg://postgres@127.0.0.1:PORT/postgres of a server that lives for the test session."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("no PostgreSQL driver: pip install 'stratagem[postgres]'")
    bindir = _bin_dir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries not found: `make postgres` (as root) installs Debian's postgresql")
    root = Path(tempfile.mkdtemp(prefix="stratagem-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres",
                                        "--no-sync"]), capture_output=True, text=True, timeout=120)
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"initdb failed: {init.stderr.strip().splitlines()[-1:]}")
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    start = subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l",
                                         str(root / "server.log"), "-w", "start"]),
                           capture_output=True, text=True, timeout=120)
    if start.returncode != 0:
        log = (root / "server.log").read_text(errors="replace") if (root / "server.log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"pg_ctl start failed: {(start.stderr + log).strip().splitlines()[-1:]}")
    _SERVER.update(pg_ctl=str(bindir / "pg_ctl"), data=str(data), opts=opts, log=str(root / "server.log"))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


_SERVER: dict[str, str] = {}


@pytest.fixture
def postgres_outage(postgres_url: str) -> Iterator[Callable[[float], None]]:
    """outage(seconds): stop the session's server at once (`pg_ctl stop -m immediate`, as a crash or a managed
    database's failover does), wait, start it again."""
    import time

    def ctl(*args: str) -> None:
        subprocess.run(_as_postgres([_SERVER["pg_ctl"], "-D", _SERVER["data"], *args]), capture_output=True,
                       timeout=120, check=True)

    def outage(seconds: float) -> None:
        ctl("-m", "immediate", "stop")
        time.sleep(seconds)
        ctl("-o", _SERVER["opts"], "-l", _SERVER["log"], "-w", "start")

    yield outage
    if subprocess.run(_as_postgres([_SERVER["pg_ctl"], "-D", _SERVER["data"], "status"]),
                      capture_output=True).returncode != 0:  # a test that failed mid-outage: the server back up
        ctl("-o", _SERVER["opts"], "-l", _SERVER["log"], "-w", "start")


@pytest.fixture
def fresh_postgres(postgres_url: str) -> str:
    """A new, empty database on the session's server (each test its own)."""
    import uuid

    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url.replace("+psycopg", ""), autocommit=True) as con:
        con.execute(f'CREATE DATABASE "{name}"')
    return postgres_url.rsplit("/", 1)[0] + f"/{name}"
