"""Open a study from a storage URL, render a report in the format the output path asks for, and write it
atomically (a temporary file beside the target, renamed into place: never a half-written report)."""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.errors import StratagemError
from stratagem.reports.capacity import CapacityInfo, capacity_plan
from stratagem.reports.data import render_csv, render_json
from stratagem.reports.html import render_html
from stratagem.reports.info import DEFAULT_ADVICE_LIMIT, ParetoInfo, pareto_info
from stratagem.reports.markdown import render_markdown

if TYPE_CHECKING:
    import optuna

__all__ = ["FORMATS", "output_format", "check_output", "write_text_atomic", "open_study", "render_report",
           "write_report"]

FORMATS: tuple[str, ...] = ("html", "md", "json", "csv")
_SUFFIX = {".html": "html", ".htm": "html", ".md": "md", ".markdown": "md", ".json": "json", ".csv": "csv"}


def output_format(path: Path | None, fmt: str | None) -> str:
    """The format to write: --format when given, else from the output file's suffix, else html."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise StratagemError(f"--format ({fmt!r}): use one of {', '.join(FORMATS)}")
        return fmt
    if path is None:
        return "html"
    found = _SUFFIX.get(path.suffix.lower())
    if found is None:
        raise StratagemError(f"-o ({path}): unknown suffix {path.suffix!r}; name the file .html, .md, .json or "
                             ".csv, or give --format")
    return found


def check_output(path: Path, option: str = "-o") -> Path:
    """An output path whose directory exists and is writable and that is not a directory itself (`option`
    names the command-line option in the message)."""
    if path.is_dir():
        raise StratagemError(f"{option} ({path}): is a directory; give a file name such as {path / 'report.html'}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StratagemError(f"{option} ({path}): directory {parent} does not exist; create it or choose another "
                             "path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise StratagemError(f"{option} ({path}): directory {parent} is not writable; choose another path")
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """Write text to path through a temporary file in the same directory, renamed into place."""
    check_output(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _storage(url: str) -> optuna.storages.BaseStorage:
    """Open an existing storage for reading: the URL forms of `stratagem.search.storage`, but a file that does not
    exist (or a SQLite file that is not an Optuna storage) is an error, never created."""
    from stratagem.search.storage import open_storage, parse_storage

    spec = parse_storage(url)
    hint = "give the storage the search used, e.g. sqlite:///stratagem.db or journal:study.log"
    if spec.path is not None and not spec.path.is_file():
        raise StratagemError(f"--storage ({url}): file {spec.path} not found; {hint}")
    if spec.kind == "sqlite" and spec.path is not None:
        try:
            with sqlite3.connect(f"file:{spec.path}?mode=ro", uri=True) as con:
                tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        except sqlite3.DatabaseError:
            tables = set()
        if "studies" not in tables:
            raise StratagemError(f"--storage ({url}): {spec.path} is not an Optuna storage (no studies table)")
    return open_storage(spec, write=False)


def open_study(storage: str, study: str | None = None) -> optuna.Study:
    """Load an existing study (never create one): the only study in the storage when `study` is None."""
    import optuna

    st = _storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(st, include_best_trial=False)]
    if study is None:
        if len(names) == 1:
            study = names[0]
        else:
            listing = ", ".join(names) if names else "none"
            raise StratagemError(f"--study: {storage} holds {len(names)} studies ({listing}); name one with --study")
    if study not in names:
        listing = ", ".join(names) if names else "none"
        raise StratagemError(f"--study ({study!r}): no such study in {storage}; studies there: {listing}")
    return optuna.load_study(study_name=study, storage=st)


def render_report(info: ParetoInfo, fmt: str, capacity: CapacityInfo | None = None) -> str:
    """The report text in one of FORMATS."""
    if fmt == "html":
        return render_html(info, capacity)
    if fmt == "md":
        return render_markdown(info, capacity)
    if fmt == "json":
        return render_json(info)
    if fmt == "csv":
        return render_csv(info)
    raise StratagemError(f"--format ({fmt!r}): use one of {', '.join(FORMATS)}")


def write_report(
    study: optuna.Study, path: str | Path, fmt: str | None = None, capacity_nodes: Sequence[int] | None = None,
    advice_limit: int = DEFAULT_ADVICE_LIMIT,
) -> Path:
    """Write the study's report to `path` (format from --format or the suffix; HTML by default) and return it.

    `capacity_nodes` adds capacity planning across those node counts (HTML and Markdown).
    """
    out = Path(path)
    kind = output_format(out, fmt)
    check_output(out)
    info = pareto_info(study, advice_limit=advice_limit)
    cap = None
    if capacity_nodes and kind in ("html", "md"):
        # A study that measured real runs stores its refitted constants: plan capacity with them.
        from stratagem.evaluators.calibration import Calibration

        fitted = study.user_attrs.get("calibration")
        cap = capacity_plan(info.scenario, capacity_nodes, Calibration.model_validate(fitted) if fitted else None)
    return write_text_atomic(out, render_report(info, kind, cap))
