"""Read a study from a storage URL, render a report in the format the output path asks for, and write it
atomically (a temporary file beside the target, renamed into place: never a half-written report)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.errors import StratagemError
from stratagem.files import Style
from stratagem.reports.advice import study_calibration
from stratagem.reports.capacity import CapacityInfo, capacity_plan
from stratagem.reports.data import render_csv, render_json
from stratagem.reports.html import render_html
from stratagem.reports.info import DEFAULT_ADVICE_LIMIT, ParetoInfo, pareto_info
from stratagem.reports.markdown import render_markdown
from stratagem.search.records import StudyKey, TrialKey

if TYPE_CHECKING:
    import optuna

__all__ = ["FORMATS", "output_format", "check_output", "write_text_atomic", "read_study", "render_report",
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


def check_output(path: Path, option: str = "-o", force: bool = False) -> Path:
    """An output path whose directory exists and is writable, that is not a directory itself and that is new or
    stratagem's own earlier output unless `force` (stratagem.files.check_owned; `option` names the command-line
    option in the message)."""
    from stratagem.files import check_owned

    return check_owned(path, force, option)


_STYLE: dict[str, Style] = {"html": "html", "md": "html", "json": "json", "csv": "sidecar"}
"""Where each format keeps the digest that proves a file stratagem's (stratagem.files.stamp): an HTML comment
line, the first key of the JSON object, a `.NAME.stratagem` file beside a CSV (CSV has no comments)."""


def write_text_atomic(path: Path, text: str, force: bool = False, fmt: str | None = None) -> Path:
    """Write text to path through a temporary file in the same directory, renamed into place (stratagem.files.
    write_owned: with its digest, kept where `fmt` (one of FORMATS, else the suffix) keeps it; never over a file
    stratagem did not write, or one edited since, unless `force`; a failed write is one line)."""
    from stratagem.files import write_owned

    return write_owned(path, text, force, style=_STYLE.get(fmt) if fmt else None)


def read_study(storage: str, study: str | None = None) -> optuna.Study:
    """An existing study opened read-only through `stratagem.search.view.StudyView` (never creates a storage or
    a study): the only study in the storage when `study` is None."""
    from stratagem.search.view import StudyView

    return StudyView.open(storage, study).study


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
    return write_text_atomic(out, report.text, fmt=report.fmt)


_SCREENED_ROLES = ("front", "boundary", "sample")


def unfinished_note(study: optuna.Study) -> str | None:
    """A one-line notice when the search that writes this study stopped before storing what it planned (killed,
    interrupted), from the study attribute "search_state" the search keeps: None when it finished."""
    state = study.user_attrs.get(StudyKey.SEARCH_STATE)
    if not isinstance(state, dict) or state.get("finished", True):
        return None
    planned = state.get("planned", 0)
    planned = planned if isinstance(planned, int) and not isinstance(planned, bool) else "?"  # a foreign value
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
