"""Where `stratagem search` writes what must outlive it when it runs as a Ray job (the job's working
directory is a copy that goes with the job).

`ray job submit --working-dir .` copies the directory into the head node's Ray session
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash>/`), runs the command there, and deletes that copy with
the session (or earlier, when its URI cache is trimmed); identical submissions share one copy. So a path "beside
the scenario" is a path into something Ray removes: run logs go to an explicit runs directory instead, each
worker in its own subfolder (several workers submitted at once from one directory never write the same folder).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from stratagem.errors import StratagemError

__all__ = ["in_ray_job_copy", "runs_root", "check_runs_root", "worker_folder", "make_default_dir",
           "absolute_storage", "check_storage_outlives"]

_RAY_COPY = "working_dir_files"
"""The folder Ray unpacks a job's --working-dir into (ray/_private/runtime_env/working_dir.py: its URI cache)."""


def in_ray_job_copy(path: Path) -> bool:
    """Whether `path` (absolute) lies in Ray's copy of a job's working directory (deleted by Ray, shared by
    identical submissions)."""
    parts = path.parts
    return any(a == _RAY_COPY and b.startswith("_ray_pkg_") for a, b in zip(parts, parts[1:], strict=False))


def runs_root(scenario: Path, study: str, runs_dir: Path | None) -> Path:
    """The absolute folder of this study's run logs: `runs_dir` when given (relative to the current directory,
    resolved now), else runs/STUDY beside the scenario, except inside Ray's job copy: ~/stratagem-runs/STUDY on
    the driver's host (the head node for `ray job submit`), which outlives the job."""
    if runs_dir is not None:
        root = runs_dir.expanduser().resolve()
        if root.exists() and not root.is_dir():
            raise StratagemError(f"--runs-dir ({runs_dir}): exists and is not a directory; name a directory")
        return root
    scenario = scenario.resolve()
    if in_ray_job_copy(scenario):
        return Path.home().resolve() / "stratagem-runs" / study
    return scenario.parent / "runs" / study


def check_runs_root(root: Path, option: str) -> None:
    """The runs folder `root` can be made and written: its nearest existing ancestor is a directory a file can
    be created in (probed: a read-only or immutable directory is found now, before the search writes
    anything, not when the first run starts). One line naming `option` otherwise."""
    from stratagem.files import check_dir

    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StratagemError(f"{option} ({root}): {existing} is not a directory; name a directory for the runs")
    check_dir(existing, root, option)


def worker_folder(root: Path) -> Path:
    """This worker's subfolder of `root`: start time, host and pid (sorts by start; two workers started at once,
    on one host or several, never share one)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return root / f"{stamp}-{socket.gethostname()}-{os.getpid()}"


def make_default_dir(path: Path, option: str) -> None:
    """Create the folder a default of `option` points into (with its parents: ~/stratagem-runs does not exist on
    a fresh head node); one line naming the option when it cannot be created."""
    from stratagem.files import disk_error

    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StratagemError(f"{option}: its default folder {path} cannot be created: {disk_error(e)}; give "
                             f"{option} a path in a writable folder") from None


def absolute_storage(url: str) -> str:
    """`url` with a relative SQLite or journal file path made absolute against the current directory now, so a
    later change of directory (or Ray's job copy as the cwd) cannot move the study; other URLs as given."""
    for prefix in ("sqlite:///", "journal:"):
        if url.startswith(prefix):
            rest = url.removeprefix(prefix)
            path, sep, query = rest.partition("?")
            if path and path != ":memory:" and not path.startswith("/"):
                return f"{prefix}{Path.cwd() / path}{sep}{query}"
    return url


def check_storage_outlives(url: str) -> None:
    """One line when the study would be stored in Ray's job copy (e.g. the default stratagem.db beside a
    scenario submitted with `ray job submit --working-dir`): Ray deletes it, and the next identical submission
    would silently share it."""
    for prefix in ("sqlite:///", "journal:"):
        if url.startswith(prefix) and in_ray_job_copy(Path(url.removeprefix(prefix).partition("?")[0])):
            raise StratagemError(f"--storage ({url}): lies in Ray's copy of the job's working directory, which Ray "
                                 "deletes; give a storage outside it (e.g. postgresql://user:pass@dbhost/stratagem, "
                                 "or sqlite:////ABS/PATH/stratagem.db on the head node)")
