"""Open a study from a storage URL, render a report in the format the output path asks for, and write it
atomically (a temporary file beside the target, renamed into place: never a half-written report)."""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.errors import StratagemError
from stratagem.reports.advice import study_calibration
from stratagem.reports.capacity import CapacityInfo, capacity_plan
from stratagem.reports.data import render_csv, render_json
from stratagem.reports.html import render_html
from stratagem.reports.info import DEFAULT_ADVICE_LIMIT, ParetoInfo, pareto_info
from stratagem.reports.markdown import render_markdown
from stratagem.search.records import StudyKey, TrialKey

if TYPE_CHECKING:
    import optuna

__all__ = ["FORMATS", "output_format", "check_output", "write_text_atomic", "open_study", "render_report",
           "Report", "build_report", "write_report", "unfinished_note"]

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
    hint = ("give the scenario the search ran (stratagem report SCENARIO.yaml) or the storage it used, e.g. "
            "--storage sqlite:///path/stratagem.db or journal:study.log")
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


@dataclass(frozen=True)
class Report:
    """A rendered report and what the command tells the user about it."""

    text: str
    fmt: str
    info: ParetoInfo
    notes: tuple[str, ...]
    """One-line notices, e.g. that the study's search did not finish."""


def build_report(
    study: optuna.Study, fmt: str, capacity_nodes: Sequence[int] | None = None,
    advice_limit: int = DEFAULT_ADVICE_LIMIT,
) -> Report:
    """The one report flow (the `report` command and `search` both use it): read the study, plan capacity with
    the study's refitted calibration (its real runs'; the defaults before any), render in `fmt`."""
    if fmt not in FORMATS:
        raise StratagemError(f"--format ({fmt!r}): use one of {', '.join(FORMATS)}")
    info = pareto_info(study, advice_limit=advice_limit)
    cap = None
    if capacity_nodes and fmt in ("html", "md"):
        cap = capacity_plan(info.scenario, capacity_nodes, study_calibration(study))
    note = unfinished_note(study)
    return Report(text=render_report(info, fmt, cap), fmt=fmt, info=info, notes=(note,) if note else ())


def write_report(
    study: optuna.Study, path: str | Path, fmt: str | None = None, capacity_nodes: Sequence[int] | None = None,
    advice_limit: int = DEFAULT_ADVICE_LIMIT,
) -> Path:
    """Write the study's report to `path` (format from --format or the suffix; HTML by default) and return it.

    `capacity_nodes` adds capacity planning across those node counts (HTML and Markdown).
    """
    out = check_output(Path(path))
    report = build_report(study, output_format(out, fmt), capacity_nodes, advice_limit)
    return write_text_atomic(out, report.text)


_SCREENED_ROLES = ("front", "boundary", "sample")


def unfinished_note(study: optuna.Study) -> str | None:
    """A one-line notice when the search that writes this study stopped before storing what it planned (killed,
    interrupted), from the study attribute "search_state" the search keeps: None when it finished."""
    state = study.user_attrs.get(StudyKey.SEARCH_STATE)
    if not isinstance(state, dict) or state.get("finished", True):
        return None
    planned = int(state.get("planned", 0))
    what = str(state.get("what", "trials"))
    keys = set()
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if not t.state.is_finished() or "plan" not in attrs:
            continue
        if what == "measured runs" and attrs.get(TrialKey.FIDELITY) == "measured":
            keys.add(attrs[TrialKey.PLAN])
        elif what != "measured runs" and attrs.get(TrialKey.FIDELITY) == "analytic" and attrs.get(TrialKey.ROLE) in _SCREENED_ROLES:
            keys.add(attrs[TrialKey.PLAN])
    return (f"the search of this study did not finish: {len(keys)} of {planned} planned {what} stored; rerun the "
            "search to complete it")
