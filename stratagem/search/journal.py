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
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock, get_lock_file

from stratagem.errors import StratagemError

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
    """Repair a journal where records were appended after a torn one (by stratagem before this fix): each line
    that is not a JSON record keeps the last whole record it ends with (the torn prefix was never applied by
    any reader), or is dropped when it holds none. Rewrites the file in place (call under its lock). Returns
    how many lines were repaired (0: nothing to do)."""
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # after the last newline: b"" or a torn last record
    fixed = 0
    out: list[bytes] = []
    for line in lines:
        if _record(line) is not None:
            out.append(line)
            continue
        fixed += 1
        start = line.rfind(_RECORD_START)
        if start > 0 and _record(line[start:]) is not None:
            out.append(line[start:])
    if tail:
        fixed += 1
    if fixed:
        data = b"".join(x + b"\n" for x in out)
        with open(path, "r+b") as f:  # same inode: other processes' open handles stay valid
            f.write(data)
            f.truncate(len(data))
            f.flush()
            os.fsync(f.fileno())
        say(f"storage ({url}): repaired {fixed} torn journal record(s) (a write cut short, then appended to); "
            f"{len(out)} records kept")
    return fixed


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
