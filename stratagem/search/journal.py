"""The journal storage's file, safe against a torn write: Optuna's JournalFileBackend with an flock lock, a
torn last record (a write cut short: disk full, quota, `File too large`, a killed writer) cut off before the
next append, a failed append undone (the file back to its size before it: nothing half-written), and a
journal an older version appended after a torn record repaired.

Why: Optuna's reader skips a torn last line, but an append after it glues the next record onto it and from
then on every reader fails on that line.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file

from stratagem.errors import StratagemError
from stratagem.search.records import JOURNAL_DAMAGED

__all__ = ["FlockJournalLock", "SafeJournalBackend", "repair_journal", "JournalDamaged"]

_CHUNK = 1 << 16
_RECORD_START = b'{"op_code":'


class JournalDamaged(StratagemError):
    """A journal record in the middle of the file cannot be read."""


class FlockJournalLock(BaseJournalFileLock):
    """The journal's append lock as an flock on `<journal>.flock`: the kernel drops it when its holder dies.
    (Optuna's default symlink lock, left behind by a process killed while appending, stalls every later
    writer for its 30 s grace period.)"""

    def __init__(self, journal: Path) -> None:
        self._path = f"{journal}.flock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """Take the journal's lock (flock, blocking); True when held."""
        import fcntl

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
        import fcntl

        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _complete_size(path: Path) -> tuple[int, int]:
    """(size of the file's complete records, size of the file): the offset just past its last newline."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - _CHUNK)
            f.seek(start)
            chunk = f.read(end - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                return start + nl + 1, size
            end = start
        return 0, size


def _last_record_whole(path: Path, size: int) -> bool:
    """Whether the journal's last line (the file ends with a newline, `size` bytes) is one whole record."""
    with open(path, "rb") as f:
        end = size - 1
        start = end
        while start > 0:
            step = min(_CHUNK, start)
            f.seek(start - step)
            nl = f.read(step).rfind(b"\n")
            if nl >= 0:
                start = start - step + nl + 1
                break
            start -= step
        f.seek(start)
        return _record(f.read(end - start)) is not None


def cut_torn_tail(path: Path, url: str, say: Callable[[str], None] = _say) -> int:
    """Cut a torn last record off the journal (call under its lock); the size of the complete records."""
    complete, size = _complete_size(path)
    if complete < size:
        os.truncate(path, complete)
        say(f"storage ({url}): the journal's last record was torn ({size - complete} bytes of a write cut "
            "short: disk full or a killed writer); removed it, the records before it are intact")
    return complete


def repair_journal(path: Path, url: str, say: Callable[[str], None] = _say) -> int:
    """Repair a journal holding lines a reader cannot replay, keeping every trial's number (call under its
    lock): a line with a whole record glued after a torn one (appended after a torn write) keeps that record
    (the torn prefix was never applied by any reader); a damaged line that created a trial (its op_code still
    readable, or a later record naming a trial not created yet) becomes a placeholder CREATE_TRIAL marked with
    the system attribute records.JOURNAL_DAMAGED, so the trials after it keep their ids and numbers (Optuna
    numbers trials by creation order: optuna/storages/journal/_storage.py _apply_create_trial); any other line,
    damaged or valid JSON that is not an operation Optuna can apply, is dropped. Rewrites the file in place. Returns how
    many lines were repaired (0: nothing to do)."""
    from optuna.storages.journal._storage import JournalStorageReplayResult

    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # after the last newline: b"" or a torn last record
    parsed = [_record(line) for line in lines]
    replay = JournalStorageReplayResult(f"stratagem-repair-{os.getpid()}-")
    fixed = marked = 0
    out: list[bytes] = []
    for i, line in enumerate(lines):
        rec = parsed[i]
        if rec is not None and _applies(replay, rec):
            out.append(line)
            continue
        fixed += 1
        start = line.rfind(_RECORD_START)
        glued = _record(line[start:]) if start > 0 else None
        if glued is not None and _applies(replay, glued):
            out.append(line[start:])
        elif _created_a_trial(line, parsed[i + 1:], len(replay._trials)):
            holder = {"op_code": _CREATE_TRIAL, "worker_id": "stratagem-repair", "datetime_start": None,
                      "study_id": _study_of(line, parsed[:i], parsed[i + 1:]),
                      "system_attrs": {JOURNAL_DAMAGED: f"line {i + 1} of the journal was damaged; its trial kept "
                                                     "only for its number"}}
            if not _referenced(parsed[i + 1:], len(replay._trials)):
                holder["state"] = 4  # TrialState.FAIL: nothing later completes it
            if _applies(replay, holder):
                out.append(json.dumps(holder, separators=(",", ":")).encode())
                marked += 1
    if tail:
        fixed += 1
    if fixed:
        data = b"".join(x + b"\n" for x in out)
        with open(path, "r+b") as f:  # same inode: other processes' open handles stay valid
            f.write(data)
            f.truncate(len(data))
            f.flush()
            os.fsync(f.fileno())
        kept = f", {marked} kept as a failed placeholder trial so every trial keeps its number" if marked else ""
        say(f"storage ({url}): repaired {fixed} damaged journal record(s){kept}; {len(out)} records kept")
    return fixed


_CREATE_TRIAL = 4  # optuna.storages.journal._storage.JournalOperation.CREATE_TRIAL
_OP_CODE = re.compile(rb'^\{\s*"op_code"\s*:\s*(\d+)')
_STUDY_ID = re.compile(rb'"study_id"\s*:\s*(\d+)')


def _applies(replay: Any, rec: dict[str, Any]) -> bool:
    """Whether Optuna's own replay applies `rec` (valid JSON that is not a well-formed operation raises there:
    a missing key, an unknown op_code, a bad state or distribution)."""
    try:
        replay.apply_logs([rec])
    except Exception:
        return False
    return True


def _created_a_trial(line: bytes, later: list[dict[str, Any] | None], created: int) -> bool:
    """Whether a damaged line created a trial: its op_code is still readable, or a later record (before the
    next damaged line) names a trial id not created by then (ids follow creation order)."""
    m = _OP_CODE.match(line)
    if m is not None:
        return int(m.group(1)) == _CREATE_TRIAL
    return _referenced(later, created, missing_only=True)


def _referenced(later: list[dict[str, Any] | None], created: int, missing_only: bool = False) -> bool:
    """Whether a later record names trial id `created` (the next id) before it is created again; with
    `missing_only`, any id not yet created (stops at the next damaged line)."""
    next_id = created
    for rec in later:
        if rec is None:
            if missing_only:
                return False
            continue
        if rec.get("op_code") == _CREATE_TRIAL:
            next_id += 1
            continue
        tid = rec.get("trial_id")
        if isinstance(tid, int) and (tid >= next_id if missing_only else tid == created):
            return True
    return False


def _study_of(line: bytes, before: list[dict[str, Any] | None], after: list[dict[str, Any] | None]) -> int:
    """The study a damaged CREATE_TRIAL was in: its readable study_id, else the nearest trial creation's."""
    m = _STUDY_ID.search(line)
    if m is not None:
        return int(m.group(1))
    for rec in [*reversed(before), *after]:
        if rec is not None and rec.get("op_code") == _CREATE_TRIAL and isinstance(rec.get("study_id"), int):
            return int(rec["study_id"])
    return 0


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("op_code"), int) else None


class SafeJournalBackend(JournalFileBackend):
    """JournalFileBackend that cuts a torn last record before appending and undoes a failed append (module
    docstring). `url` names the storage in messages."""

    def __init__(self, path: Path, url: str) -> None:
        super().__init__(str(path), lock_obj=FlockJournalLock(path))
        self._journal = path
        self._url = url

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        """Append `logs` under the lock, after cutting a torn last record; on failure (disk full, file-size
        limit) truncate back and raise one line."""
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode("utf-8")
        with get_lock_file(self._lock):
            size = cut_torn_tail(self._journal, self._url)
            if size and not _last_record_whole(self._journal, size):  # glued to a torn one by an older writer
                repair_journal(self._journal, self._url)
                size = self._journal.stat().st_size
            try:
                with open(self._journal, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                try:
                    os.truncate(self._journal, size)
                    undone = "nothing was written"
                except OSError:
                    undone = "a torn record may remain (the next write removes it)"
                raise StratagemError(f"storage ({self._url}): cannot append to {self._journal}: "
                                     f"{e.strerror or e}; {undone}. Free space (or raise the file-size limit) "
                                     "and rerun: the search resumes") from None

    def damaged(self) -> JournalDamaged:
        """The one-line error for a journal a reader cannot replay."""
        return JournalDamaged(f"storage ({self._url}): {self._journal} has a damaged record in the middle (a "
                              "torn write appended to by an older stratagem); rerun the search on it (it repairs "
                              "the journal, keeping every whole record) or give another file")
