"""A finished study becomes a report: compute first (`pareto_info`, `capacity_plan`), then render (HTML,
Markdown, JSON, CSV). `write_report(study, path)` does both and writes atomically."""

from stratagem.reports.advice import AdviceView, advice_for, study_calibration
from stratagem.reports.capacity import CapacityInfo, CapacityRow, capacity_plan, default_nodes, parse_nodes
from stratagem.reports.data import CSV_COLUMNS, render_csv, render_json, trial_rows
from stratagem.reports.html import decode_payload, render_capacity_html, render_html
from stratagem.reports.info import (
    DEFAULT_ADVICE_LIMIT,
    ParetoInfo,
    PlanResult,
    TrialRecord,
    pareto_front,
    pareto_info,
)
from stratagem.reports.markdown import capacity_markdown, render_markdown
from stratagem.reports.payload import EXPLORER_AXES, report_payload
from stratagem.reports.reverse import reverse_answer
from stratagem.reports.terminal import (
    front_table,
    print_measured,
    print_result,
    progress_bar,
    result_json,
    summary_lines,
)
from stratagem.reports.write import (
    FORMATS,
    Report,
    build_report,
    check_output,
    output_format,
    read_study,
    render_report,
    unfinished_note,
    write_report,
    write_text_atomic,
)

__all__ = [
    "AdviceView", "advice_for", "study_calibration",
    "CapacityInfo", "CapacityRow", "capacity_plan", "default_nodes", "parse_nodes",
    "CSV_COLUMNS", "render_csv", "render_json", "trial_rows",
    "decode_payload", "render_capacity_html", "render_html",
    "DEFAULT_ADVICE_LIMIT", "ParetoInfo", "PlanResult", "TrialRecord", "pareto_front", "pareto_info",
    "capacity_markdown", "render_markdown", "reverse_answer",
    "EXPLORER_AXES", "report_payload",
    "front_table", "print_measured", "print_result", "progress_bar", "result_json", "summary_lines",
    "FORMATS", "Report", "build_report", "unfinished_note", "check_output", "read_study", "output_format", "render_report", "write_report", "write_text_atomic",
]
