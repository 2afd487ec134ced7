"""A storage that rides out an outage: every call of the Optuna storage `open_storage` returns goes through
`RetryingStorage`, which retries a call that failed for a transient reason (the database server restarting
or failing over, a dropped connection, a locked SQLite file, an NFS hiccup under a journal) with exponential
backoff for a window (`--storage-retry-minutes`, default DEFAULT_RETRY_MINUTES). The caller blocks meanwhile,
so a finished run's result stays in the worker's memory until its write lands; claims are renewed as soon as
the storage answers again. One line when an outage starts, one when it ends; past the window the call raises
`StorageUnavailable` (a StratagemError: one line, exit 2).

What is not transient (no such study, a finished trial updated, disk full, a wrong URL) is raised at once.
"""

from __future__ import annotations

import errno
import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Container, Sequence
from typing import Any, TypeVar

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from stratagem.errors import StratagemError

__all__ = ["RetryingStorage", "StorageUnavailable", "Outages", "retry_minutes", "set_retry_minutes", "STOP",
           "RETRY_ENV", "DEFAULT_RETRY_MINUTES", "outage_grace_s", "check_minutes", "transient", "outages_for"]

RETRY_ENV = "STRATAGEM_STORAGE_RETRY_MINUTES"
"""Environment variable that sets the retry window (minutes) where no --storage-retry-minutes is given."""
DEFAULT_RETRY_MINUTES = 5.0
"""A managed database's restart or failover takes seconds to a minute or two; five minutes covers it."""
_FIRST_DELAY_S = 0.5
_MAX_DELAY_S = 10.0
_OS_TRANSIENT = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ENETDOWN,
                 errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EAGAIN}
_SQLITE_TRANSIENT = ("database is locked",)
"""A local SQLite file has no outages, only a lock another process holds; its "disk I/O error" is a full disk
or a file-size limit (EFBIG, ENOSPC), which waiting does not mend: one line at once."""
CONTENTION_QUIET_S = 10.0
"""SQLite's file lock held by another writer (another study's or worker's transaction: tens of ms each; a
transaction that read before writing gets SQLITE_BUSY at once when another writer is ahead of it, without
waiting: sqlite.org/lockingv3.html section 5) is retried without a line for this long; held longer (a stuck
program), it is an outage with its lines."""

T = TypeVar("T")
_window_minutes: float | None = None
STOP = threading.Event()
"""Set by a command that ends on Ctrl-C through its own SIGINT handler (`status --watch`): a retry in progress
stops waiting and raises KeyboardInterrupt, so Ctrl-C ends the command even during an outage."""


class StorageUnavailable(StratagemError):
    """The storage stayed unreachable for the whole retry window."""


def check_minutes(minutes: float) -> float:
    """A retry window in minutes: a finite number >= 0 (one-line error otherwise)."""
    if not (math.isfinite(minutes) and minutes >= 0):
        raise StratagemError(f"--storage-retry-minutes ({minutes}): give a number of minutes >= 0, e.g. "
                             f"{DEFAULT_RETRY_MINUTES:g}")
    return minutes


def set_retry_minutes(minutes: float | None) -> None:
    """Set this process's retry window (None: back to the environment / default; math.inf: wait however long,
    as `status --watch` does); the CLI's --storage-retry-minutes. One-line error for a negative or NaN value."""
    global _window_minutes
    _window_minutes = minutes if minutes is None or minutes == math.inf else check_minutes(minutes)


def retry_minutes() -> float:
    """The retry window in minutes: set_retry_minutes (the CLI option), else $STRATAGEM_STORAGE_RETRY_MINUTES,
    else DEFAULT_RETRY_MINUTES."""
    if _window_minutes is not None:
        return _window_minutes
    raw = os.environ.get(RETRY_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_RETRY_MINUTES
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise StratagemError(f"${RETRY_ENV} ({raw!r}): give a number of minutes >= 0, e.g. "
                             f"{DEFAULT_RETRY_MINUTES:g}")
    return value


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    todo: list[BaseException | None] = [e]
    while todo and len(out) < 8:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        orig = getattr(x, "orig", None)
        todo += [x.__cause__, x.__context__, orig if isinstance(orig, BaseException) else None]
    return out


def transient(e: BaseException, kind: str) -> bool:
    """Whether `e` (or what caused it) is a storage being briefly unreachable, so retrying can succeed: an
    RDB's lost or refused connection; SQLite's lock; a journal's NFS-style I/O error."""
    from sqlalchemy import exc as sa

    for x in _chain(e):
        if isinstance(x, StratagemError | KeyError | optuna.exceptions.DuplicatedStudyError |
                      optuna.exceptions.UpdateFinishedTrialError):
            return False
        if isinstance(x, OSError) and x.errno in _OS_TRANSIENT:
            return True
        if kind == "sqlite":
            if isinstance(x, sa.OperationalError) and any(m in str(x).lower() for m in _SQLITE_TRANSIENT):
                return True
            continue
        if isinstance(x, sa.DBAPIError) and x.connection_invalidated:
            return True
        if isinstance(x, sa.OperationalError | sa.InterfaceError | sa.DisconnectionError | sa.TimeoutError):
            return True
    return False


def _first_line(e: BaseException) -> str:
    """The line that names the problem: the root cause along explicit links first (`raise ... from`, SQLAlchemy's
    `orig`: optuna's wrapper only says "during the commit"), then what was met on the way (__context__: e.g. a
    KeyError(()) a lookup raised before the connection failed, whose text is "()"); a text without words is
    skipped; none with words: the error's type."""
    explicit: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and len(explicit) < 8 and not any(x is y for y in explicit):
        explicit.append(x)
        orig = getattr(x, "orig", None)
        x = orig if isinstance(orig, BaseException) else x.__cause__
    for x in [*reversed(explicit), *reversed(_chain(e))]:
        text = str(x).strip().splitlines()
        if text and any(c.isalpha() for c in text[0]):
            return text[0]
    return type(explicit[-1]).__name__


class Outages:
    """One process's outages of one storage, shared by the threads that meet them (the search loop, the
    claim renewals): the first failure opens an outage and prints one line, the first success after it closes
    it and prints one line; every caller gives up at the same deadline."""

    def __init__(self, url: str, window_s: float | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.url = url
        self._window_s = window_s
        self._say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the outage in progress
        self.last: tuple[float, float] | None = None
        """(monotonic end, seconds) of the last outage that ended."""
        self.count = 0

    @property
    def window_s(self) -> float:
        """Seconds callers retry through one outage: the window given, else this process's (retry_minutes)."""
        return 60.0 * retry_minutes() if self._window_s is None else self._window_s

    @window_s.setter
    def window_s(self, seconds: float | None) -> None:
        """Replace the window (None: this process's)."""
        self._window_s = seconds

    def failed(self, e: BaseException) -> float:
        """Record a transient failure; the monotonic deadline after which callers give up."""
        with self._lock:
            if self._since is None:
                self._since = time.monotonic()
                self.count += 1
                until = ("until it answers" if math.isinf(self.window_s) else
                         f"for up to {self.window_s / 60:.1f} min (--storage-retry-minutes)")
                self._say(f"storage ({self.url}): unreachable ({_first_line(e)}); retrying {until}")
            return self._since + self.window_s

    def recovered(self) -> None:
        """A call succeeded: close the outage in progress, if any."""
        if self._since is None:
            return
        with self._lock:
            if self._since is None:
                return
            now = time.monotonic()
            seconds, self._since = now - self._since, None
            self.last = (now, seconds)
            self._say(f"storage ({self.url}): reachable again after {seconds:.0f} s; continuing")

    def give_up(self, e: BaseException) -> StorageUnavailable:
        """The error every caller raises once the window has passed."""
        return StorageUnavailable(f"storage ({self.url}): unreachable for {self.window_s / 60:.1f} min "
                                  f"({_first_line(e)}); stopping. Its claims expire and other workers (or a "
                                  "rerun) take the plans over; give a longer --storage-retry-minutes to wait more")

    def run(self, kind: str, fn: Callable[[], T], replayed: Callable[[BaseException], T | None] | None = None) -> T:
        """fn(), retried through an outage. `replayed(e)`: for a call that is not idempotent, a non-None value
        when the error of a retry says the first try had landed after all (its result)."""
        delay = _FIRST_DELAY_S
        retried = False
        first_failure: float | None = None
        while True:
            try:
                out = fn()
            except Exception as e:
                if retried and replayed is not None:
                    landed = replayed(e)
                    if landed is not None:
                        self.recovered()
                        return landed
                first_failure = time.monotonic() if first_failure is None else first_failure
                if kind == "sqlite" and transient(e, kind) and time.monotonic() - first_failure < CONTENTION_QUIET_S:
                    time.sleep(random.uniform(0.005, 0.05))  # another writer's transaction: its turn, then ours
                    retried = True
                    continue
                if not transient(e, kind):
                    if isinstance(e, optuna.exceptions.StorageInternalError) or type(e).__module__.startswith(
                            "sqlalchemy"):  # disk full, a read-only file, a dropped table: one line, exit 2
                        text = _first_line(e)
                        fix = _fix_for(text)
                        raise StratagemError(f"storage ({self.url}): {text}; this write was rolled back.{fix}"
                                             ) from None
                    raise
                deadline = self.failed(e)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.give_up(e) from None
                if STOP.wait(min(delay, left)):  # Ctrl-C under a command's own handler: stop retrying
                    raise KeyboardInterrupt from None
                delay = min(2 * delay, _MAX_DELAY_S)
                retried = True
                continue
            self.recovered()
            return out


def _fix_for(text: str) -> str:
    """What to do after a storage write failed with `text`: free space only when the disk is full (SQLite's
    SQLITE_FULL "database or disk is full", ENOSPC, EFBIG, quota), never for a damaged file ("database disk
    image is malformed" names a disk too) or a locked one."""
    low = text.lower()
    if "malformed" in low or "not a database" in low:
        return " The database file is damaged: restore it from a copy, or give the search another file"
    if "locked" in low:
        return " Another process holds the database locked: wait for it, or stop it, and rerun"
    if any(w in low for w in ("is full", "disk full", "no space", "too large", "quota")):
        return " Free space (or raise the file-size limit) and rerun: the search resumes"
    if "disk i/o error" in low:  # SQLITE_IOERR: a write the disk refused (full, a size limit) or a failing device
        return (" Free space (or raise the file-size limit), or check the device, and rerun: the search resumes")
    return ""


_REGISTRY: dict[str, Outages] = {}
_REGISTRY_LOCK = threading.Lock()


def outages_for(url: str, window_s: float | None = None) -> Outages:
    """This process's outage record of the storage at `url` (shared by its storage object and its lock, so an
    outage is one line however many of them meet it); `window_s` (when given) replaces its window."""
    with _REGISTRY_LOCK:
        found = _REGISTRY.get(url)
        if found is None:
            found = _REGISTRY[url] = Outages(url, window_s)
        elif window_s is not None:
            found.window_s = window_s
        return found


def outage_grace_s(storage: object, within_s: float) -> float:
    """Seconds of the last storage outage this process saw when it ended less than `within_s` ago, else 0: a
    claim's expiry is pushed back by it (no worker could renew during the outage)."""
    outages = getattr(storage, "outages", None)
    if not isinstance(outages, Outages) or outages.last is None:
        return 0.0
    ended, seconds = outages.last
    return seconds if time.monotonic() - ended < within_s else 0.0


class RetryingStorage(BaseStorage, BaseHeartbeat):
    """An Optuna storage whose every call is retried through an outage (module docstring). `inner` is the real
    storage; `kind` is the storage kind ("sqlite", "rdb", "journal") deciding what counts as transient."""

    def __init__(self, inner: BaseStorage, kind: str, outages: Outages) -> None:
        self.inner = inner
        self.kind = kind
        self.outages = outages

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.inner, name)
        return self.outages.run(self.kind, lambda: method(*args, **kwargs))

    # studies
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        """Create a study (retried)."""
        return int(self._run("create_new_study", directions, study_name))

    def delete_study(self, study_id: int) -> None:
        """Delete a study (retried)."""
        self._run("delete_study", study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        """Set a study user attribute (retried)."""
        self._run("set_study_user_attr", study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        """Set a study system attribute (retried)."""
        self._run("set_study_system_attr", study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        """A study's id (retried; KeyError when there is none)."""
        return int(self._run("get_study_id_from_name", study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        """A study's name (retried)."""
        return str(self._run("get_study_name_from_id", study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        """A study's directions (retried)."""
        return list(self._run("get_study_directions", study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        """A study's user attributes (retried)."""
        return dict(self._run("get_study_user_attrs", study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        """A study's system attributes (retried)."""
        return dict(self._run("get_study_system_attrs", study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        """Every study (retried)."""
        return list(self._run("get_all_studies"))

    # trials
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        """Create a trial (retried; a commit lost with its connection may, rarely, store it twice)."""
        return int(self._run("create_new_trial", study_id, template_trial))

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: optuna.distributions.BaseDistribution) -> None:
        """Set a trial parameter (retried)."""
        self._run("set_trial_param", trial_id, param_name, param_value_internal, distribution)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        """A trial's id from its number (retried)."""
        return int(self._run("get_trial_id_from_study_id_trial_number", study_id, trial_number))

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        """Set a trial's state and values (retried; a retry that finds the first try landed returns True)."""
        inner = self.inner

        def replayed(e: BaseException) -> bool | None:
            if not isinstance(e, optuna.exceptions.UpdateFinishedTrialError) or not state.is_finished():
                return None
            return True if inner.get_trial(trial_id).state == state else None

        return bool(self.outages.run(self.kind, lambda: inner.set_trial_state_values(trial_id, state, values),
                                     replayed))

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        """Report an intermediate value (retried)."""
        self._run("set_trial_intermediate_value", trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        """Set a trial user attribute (retried)."""
        self._run("set_trial_user_attr", trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        """Set a trial system attribute (retried)."""
        self._run("set_trial_system_attr", trial_id, key, value)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        """A trial (retried)."""
        trial: FrozenTrial = self._run("get_trial", trial_id)
        return trial

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        """A study's trials (retried)."""
        return list(self._run("get_all_trials", study_id, deepcopy=deepcopy, states=states))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        """The best trial of a single-objective study (retried)."""
        trial: FrozenTrial = self._run("get_best_trial", study_id)
        return trial

    def remove_session(self) -> None:
        """Release the inner storage's session."""
        self.inner.remove_session()

    # heartbeat (RDB storages): forwarded when the inner storage has one
    def record_heartbeat(self, trial_id: int) -> None:
        """Record a trial's heartbeat (retried)."""
        if isinstance(self.inner, BaseHeartbeat):
            self._run("record_heartbeat", trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if isinstance(self.inner, BaseHeartbeat):
            return list(self._run("_get_stale_trial_ids", study_id))
        return []

    def get_heartbeat_interval(self) -> int | None:
        """The inner storage's heartbeat interval (None: it has none)."""
        return self.inner.get_heartbeat_interval() if isinstance(self.inner, BaseHeartbeat) else None

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        """The inner storage's stale-trial callback (None: none)."""
        if isinstance(self.inner, BaseHeartbeat):
            return self.inner.get_heartbeat_stale_trial_callback()
        return None
