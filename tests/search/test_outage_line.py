"""The outage line names the problem (issue 36 item 5: 13 of 14 lines read `unreachable (())`): the root cause
along explicit links, never the text of an exception met on the way (a KeyError(()) in __context__), never a
text without words."""

from __future__ import annotations

import optuna
import pytest
from sqlalchemy import exc as sa

from stratagem.search.retry import Outages


class DriverError(Exception):
    """Stands for the database driver's OperationalError (SQLAlchemy keeps it as `orig`)."""


def _wrapped(cause: BaseException) -> BaseException:
    """What optuna raises for a failed commit: StorageInternalError from SQLAlchemy's OperationalError from the
    driver's error, the driver's raised while a cache lookup's KeyError(()) was being handled."""
    try:
        try:
            try:
                {}[()]
            except KeyError:
                raise cause  # noqa: B904 - its __context__ is the KeyError, as in the outage
        except DriverError as d:
            raise sa.OperationalError("SELECT 1", (), d) from d
    except sa.OperationalError as s:
        try:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from s
        except optuna.exceptions.StorageInternalError as o:
            return o
    raise AssertionError("not raised")


@pytest.mark.parametrize(("cause", "want"), [
    (DriverError("connection failed: Connection refused"), "connection failed: Connection refused"),
    (DriverError(), "(test_outage_line.DriverError)"),  # no text of its own: SQLAlchemy's line names it
])
def test_the_outage_line_names_the_root_cause(cause: BaseException, want: str) -> None:
    said: list[str] = []
    Outages("postgresql://db/x", window_s=60, say=said.append).failed(_wrapped(cause))
    assert len(said) == 1 and "(())" not in said[0] and "unreachable (" in said[0]
    assert said[0].startswith(f"storage (postgresql://db/x): unreachable ({want}"), said


def test_no_text_with_words_is_the_type() -> None:
    said: list[str] = []
    Outages("u", window_s=60, say=said.append).failed(ConnectionResetError(()))
    assert said == ["storage (u): unreachable (ConnectionResetError); retrying for up to 1.0 min "
                    "(--storage-retry-minutes)"]
