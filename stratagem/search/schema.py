"""Whether an existing SQL database is an Optuna storage this Optuna can read, found by reading only (SQLite
opened `mode=ro`; an RDB through SQLAlchemy's inspector): before any command opens it, so a foreign database
(another program's tables that happen to be named studies, trials, version_info) or an Optuna storage of
another schema version is one line and is never written to (Optuna's RDBStorage creates its tables and stamps
its schema version on open).

A database is Optuna's when it records an Optuna schema: an `alembic_version` row and a `version_info` table
with Optuna's columns (optuna/storages/_rdb/models.py VersionInfoModel); it is this Optuna's when that
revision is the head of the migrations this Optuna ships (optuna/storages/_rdb/alembic/versions) and every
table of its models is there with its columns.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import quote

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["Layout", "sqlite_layout", "rdb_layout", "schema_verdict", "sqlite_readonly_url"]

_VERSION_COLUMNS = {"schema_version", "library_version"}


@dataclass(frozen=True)
class Layout:
    """What a database holds, as far as telling an Optuna storage goes."""

    columns: dict[str, set[str]]
    """Table name -> its column names."""
    revision: str | None
    """The alembic revision recorded (`alembic_version.version_num`), None when there is none."""
    library: str | None
    """The Optuna version that created it (`version_info.library_version`), None when unknown."""


def sqlite_readonly_url(path: Path) -> str:
    """A SQLAlchemy URL that opens the SQLite file `path` read-only (`mode=ro`: a write fails, a missing file is
    not created)."""
    return f"sqlite:///file:{quote(str(path.resolve()))}?mode=ro&uri=true"


def sqlite_layout(path: Path, timeout_s: float = 5.0) -> Layout:
    """The layout of the SQLite file at `path`, read through a read-only connection. sqlite3.DatabaseError
    when it is not a database or is locked (the caller words it)."""
    con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=timeout_s)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        columns = {n: {r[1] for r in con.execute(f'PRAGMA table_info("{n.replace(chr(34), chr(34) * 2)}")')}
                   for n in names}
        revision = library = None
        if "version_num" in columns.get("alembic_version", set()):
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
            revision = str(row[0]) if row else None
        if _VERSION_COLUMNS <= columns.get("version_info", set()):
            row = con.execute("SELECT library_version FROM version_info").fetchone()
            library = str(row[0]) if row else None
    finally:
        con.close()
    return Layout(columns, revision, library)


def rdb_layout(engine: Engine) -> Layout:
    """The layout of the database behind a SQLAlchemy engine (inspector and two SELECTs; nothing written)."""
    from sqlalchemy import inspect, text

    insp = inspect(engine)
    columns = {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()}
    revision = library = None
    with engine.connect() as con:
        if "version_num" in columns.get("alembic_version", set()):
            row = con.execute(text("SELECT version_num FROM alembic_version")).fetchone()
            revision = str(row[0]) if row else None
        if _VERSION_COLUMNS <= columns.get("version_info", set()):
            row = con.execute(text("SELECT library_version FROM version_info")).fetchone()
            library = str(row[0]) if row else None
    return Layout(columns, revision, library)


def _optuna_tables() -> dict[str, set[str]]:
    """Optuna's tables and their columns, from its models."""
    from optuna.storages._rdb import models

    return {t.name: {c.name for c in t.columns} for t in models.BaseModel.metadata.sorted_tables}


def _revisions() -> tuple[str, list[str]]:
    """(head revision, every revision) of the schema migrations this Optuna ships."""
    from alembic.script import ScriptDirectory
    from optuna.storages import _rdb

    scripts = ScriptDirectory(str(Path(_rdb.__file__).parent / "alembic"))
    return str(scripts.get_current_head()), [str(r.revision) for r in scripts.walk_revisions()]


def _being_created(layout: Layout) -> bool:
    """Whether every table present is one of Optuna's with exactly its columns (and no revision stamped yet): the
    schema another process's RDBStorage is creating this moment, not another program's database."""
    optuna_tables = _optuna_tables()
    return all(optuna_tables.get(t) == cols for t, cols in layout.columns.items())


def schema_verdict(layout: Layout, where: str, what: str = "a database") -> Literal["empty", "optuna"]:
    """"empty" (no table: Optuna may create its own), "optuna" (this Optuna's schema), else one-line
    StratagemError: another program's database, or an Optuna storage of another schema version (with the
    command that upgrades it). `where` names the storage in the message, `what` the kind of database."""
    if not layout.columns:
        return "empty"
    import optuna

    is_optuna = layout.revision is not None and _VERSION_COLUMNS <= layout.columns.get("version_info", set())
    if not is_optuna and _being_created(layout):
        return "empty"  # another worker's Optuna is creating its tables now (RDBStorage: create_all, then alembic)
    if not is_optuna:
        raise StratagemError(f"{where} is {what} but not an Optuna storage (its tables: "
                             f"{', '.join(sorted(layout.columns)[:6])}); stratagem leaves it untouched: give a new "
                             "file name or the storage a search wrote")
    head, known = _revisions()
    by = f"set up by optuna {layout.library}" if layout.library else "another optuna"
    if layout.revision != head:
        if layout.revision in known:
            raise StratagemError(f"{where} is an Optuna storage of an older schema ({layout.revision}, {by}); this "
                                 f"is optuna {optuna.__version__} (schema {head}): back it up, then run `optuna "
                                 "storage upgrade --storage URL`")
        raise StratagemError(f"{where} is an Optuna storage of a schema this optuna {optuna.__version__} does not "
                             f"know ({layout.revision}, {by}); install that optuna version or newer")
    missing = [f"{t}.{c}" for t, cols in _optuna_tables().items() for c in sorted(cols - layout.columns.get(t, set()))]
    if missing:
        raise StratagemError(f"{where} is an Optuna storage with parts of its schema missing (e.g. {missing[0]}); "
                             "stratagem leaves it untouched: give a new file name or a storage a search wrote")
    return "optuna"
