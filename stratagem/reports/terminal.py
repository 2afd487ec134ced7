"""Terminal rendering, its one home: what `stratagem search` shows (a rich progress bar while it works, then the
Pareto front as a table, the counts and the real runs; or the same as JSON)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from stratagem.evaluators.zones import bottleneck_label
from stratagem.quantities import DASH, duration, memory_in, memory_unit, percent, sig
from stratagem.reports.counts import count_lines
from stratagem.search.counts import study_counts, trial_kinds
from stratagem.search.events import BatchDone, Event, Notice, Phase, WindowOpened
from stratagem.search.records import TrialKey, trial_evaluation, trial_fidelity, trial_key, trial_plan
from stratagem.search.runner import SearchResult
from stratagem.search.session import MeasureResult

__all__ = ["progress_bar", "front_table", "print_result", "summary_lines", "result_json", "print_measured",
           "measured_lines", "EventPrinter", "batch_line", "window_line", "traced_line"]

_PHASES = {"screen": "screening plans", "explore": "sampler exploring", "store": "storing trials",
           "evaluate": "measured runs", "real runs": "measured runs"}


@contextmanager
def progress_bar(console: Console, enabled: bool = True) -> Iterator[Any]:
    """A progress(phase, done, total) callback drawing one rich bar per phase."""
    if not enabled:
        yield None
        return
    bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=False)
    tasks: dict[str, Any] = {}

    def update(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(_PHASES.get(phase, phase), total=max(total, 1))
        bar.update(tasks[phase], completed=done, total=max(total, done, 1))

    with bar:
        yield update


def front_table(result: SearchResult, top: int) -> Table:
    """The study's Pareto front: plan, tokens/s/GPU, MFU, peak/HBM, headroom, checkpoint risk, bottleneck."""
    fidelity = sorted({trial_fidelity(t) for t in result.front[:top]})
    table = Table(title=f"Pareto front of study {result.study_name!r}: {len(result.front)} plans"
                        + (f", top {top} by tokens/s" if len(result.front) > top else "")
                        + f" ({'/'.join(fidelity) or 'no'} figures)", title_justify="left")
    table.box = box.SIMPLE_HEAD
    table.add_column("#", justify="right", no_wrap=True, min_width=2)
    table.add_column("plan", min_width=22)
    shown = [(t, trial_evaluation(t)) for t in result.front[:top]]
    numbers = _record_numbers(result)
    unit = memory_unit(*(ev.memory.hbm_gib for _, ev in shown if ev is not None and ev.memory is not None),
                       result.screening.space.scenario.cluster.gpu.hbm_gib)
    for col in ("tok/s/GPU", "MFU", f"peak/HBM {unit[0]}", f"free {unit[0]}", "ckpt loss", "bottleneck"):
        table.add_column(col, justify="left" if col == "bottleneck" else "right", no_wrap=True, min_width=len(col))
    for t, ev in shown:  # every row of the front, a missing figure as a dash (the title counts them all)
        m = ev.memory if ev is not None else None
        tp = ev.throughput if ev is not None else None
        ckpt = ev.checkpoint if ev is not None else None
        table.add_row(str(numbers.get(t.number, t.number)), trial_plan(t).short(),
                      sig(tp.tokens_per_s_per_gpu) if tp else DASH, percent(tp.mfu) if tp else DASH,
                      f"{memory_in(m.peak_gib, unit)}/{memory_in(m.hbm_gib, unit)}" if m else DASH,
                      memory_in(m.headroom_gib, unit) if m else DASH, percent(ckpt.goodput_loss) if ckpt else DASH,
                      bottleneck_label(ev.zones) if ev is not None and ev.zones else DASH)
    return table


def _record_numbers(result: SearchResult) -> dict[int, int]:
    """Trial number -> its record's number (records.record_numbers: a re-measured plan keeps its first measured
    trial's number), the `#` status, report and reproduce print."""
    from stratagem.search.records import record_numbers

    return {} if result.study is None else record_numbers(result.study.get_trials(deepcopy=False))


def print_result(console: Console, result: SearchResult, top: int) -> None:
    """The front table and the summary lines (at least 110 columns wide when not on a terminal)."""
    out = console if console.is_terminal else Console(width=max(console.width, 110))
    out.print(front_table(result, top))
    for line in summary_lines(result):
        out.print(line, markup=False, soft_wrap=True, highlight=False)


def summary_lines(result: SearchResult) -> list[str]:
    """The counts under the front table (`reports.counts.count_lines`: the one counting rule, as `report` and
    `status` print it), what this call stored, how to watch the study and report it (commands shell-quoted)."""
    notes = [f"note: {n}" for n in result.screening.space.notes]
    counts = (count_lines(study_counts(result.study), result.study_name) if result.study is not None
              else [f"{result.trials:,} trials in all"])
    report = shlex.join(["stratagem", "report", "--storage", result.storage.url, "--study", result.study_name])
    return notes + counts + [
        f"this call: {result.stored:,} screened plans stored, {result.already:,} already there "
        f"({duration(result.seconds)})",
        f"watch it: {result.storage.dashboard_command()}",
        f"report:   {report}",
    ]


def result_json(result: SearchResult) -> str:
    """The search's counts and front as JSON (`search --json`)."""
    c = result.counts
    front, numbers = [], _record_numbers(result)
    for t in result.front:
        ev = trial_evaluation(t)
        front.append({"number": numbers.get(t.number, t.number), "plan": trial_key(t), "params": t.params,
                      "values": t.values, "fidelity": trial_fidelity(t),
                      "bottleneck": bottleneck_label(ev.zones) if ev is not None and ev.zones else None})
    return json.dumps({
        "study": result.study_name, "storage": result.storage.url, "mode": result.mode,
        "counts": {"valid": c.valid, "screened": c.screened, "pruned": c.pruned, "feasible": c.feasible,
                   "front": c.front},
        "stored": result.stored, "already": result.already, "trials": result.trials,
        "kinds": trial_kinds(result.study.get_trials(deepcopy=False)) if result.study is not None else None,
        "study_counts": study_counts(result.study).as_dict() if result.study is not None else None,
        "seconds": round(result.seconds, 3), "front": front,
    }, indent=2)


def batch_line(event: BatchDone) -> str:
    """One line per batch of real runs: what each run became and the calibration step. A batch whose runs gave
    no step time (OOM, timeout) says so instead of an unchanged 0% -> 0% error."""
    runs = ", ".join(f"{r.plan} {r.status}" + (" (re-measured)" if r.remeasure else "") for r in event.runs)
    head = f"measured {event.measured}/{event.target}: {runs}"
    step = event.step
    if not step.runs_used:
        return f"{head}; calibration unchanged: no ok run to fit yet" + (
            f" ({step.ooms} OOM run(s) kept as memory lower bounds)" if step.ooms else "")
    line = (f"{head}; step-time error {percent(step.step_error_before)} -> {percent(step.step_error_after)}, "
            f"peak-memory error {percent(step.memory_error_before)} -> {percent(step.memory_error_after)} on "
            f"{step.runs_used} run(s)")
    return line + (f" ({step.note})" if step.note else "")


def window_line(event: WindowOpened) -> str:
    """The budget window this call counts against."""
    if event.joined:
        return (f"budget: joining window {event.index} ({event.minutes:g} min, {duration(event.left_s)} left) "
                "that another worker opened")
    return (f"budget: new window {event.index} of {event.minutes:g} min"
            + (" (the earlier windows are closed; stratagem status shows each)" if event.index > 1 else ""))


def traced_line(key: str, ev: Any, reason: str) -> str:
    """One traced plan: its traced peak beside the analytic one, or why it was not traced."""
    if ev is None or ev.memory is None:
        return f"traced {key}: not traced: {reason}"
    predicted = ev.prediction.memory.peak_gib if ev.prediction and ev.prediction.memory else float("nan")
    unit = memory_unit(ev.memory.peak_gib, predicted)
    return (f"traced {key}: peak {memory_in(ev.memory.peak_gib, unit, True)} (analytic "
            f"{memory_in(predicted, unit, True)}), {ev.status}")


class EventPrinter:
    """A session listener printing events: a progress bar per phase (stderr), one line per notice, batch and
    budget window. Use as a context manager around the session's steps."""

    def __init__(self, console: Console, progress: bool = True) -> None:
        self.console = console
        self._bar = progress_bar(Console(stderr=True), enabled=progress)
        self._update: Any = None

    def __enter__(self) -> EventPrinter:
        self._update = self._bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bar.__exit__(*exc)

    def __call__(self, event: Event) -> None:
        """Print one event."""
        if isinstance(event, Phase):
            if self._update is not None:
                self._update(event.phase, event.done, event.total)
            return
        if isinstance(event, Notice):
            text = event.text
        elif isinstance(event, BatchDone):
            text = batch_line(event)
        elif isinstance(event, WindowOpened):
            text = window_line(event)
        else:
            return
        self.console.print(text, markup=False, soft_wrap=True, highlight=False)


def _record_cells(figure: Any, tokens: float | None) -> list[str]:
    """tok/s measured and its 95 % interval as the record prints everywhere (search.noise.RecordFigure.parts:
    pooled over its runs, x<runs> when more than one; the interval widened to the run-to-run noise); a run
    without a record (oom, failed) shows its figure alone."""
    if figure is None:
        return [sig(tokens), DASH]
    value, interval = figure.parts()
    return [value, (interval.removeprefix("95% ") or DASH) + (f" x{figure.runs}" if figure.runs > 1 else "")]


def _run_figures(scenario: Any, t: Any, ev: Any, calibration: Any, number: int,
                 figure: Any) -> tuple[list[str], list[float | None]]:
    """One measured plan's cells before memory (its record's number: the first measured trial, kept through
    re-measurements; plan, role, status, tok/s measured, its interval (`figure`: its RecordFigure, None when
    it has none), predicted, calibrated) and its peaks in GiB (measured, predicted, calibrated)."""
    from stratagem.evaluators import evaluate

    pred = ev.prediction
    cal = evaluate(scenario, ev.plan, calibration)
    reason = ev.reason.splitlines()[0].replace("OOM: ", "") if ev.reason else ""  # "oom: rank 0: peak ..."
    status = ev.status if ev.status == "ok" else f"{ev.status}: {reason}"
    if len(status) > 48:  # the full reason is in the report and the run's log
        status = status[:47] + "…"
    tokens = [e.throughput.tokens_per_s if e is not None and e.throughput else None for e in (ev, pred, cal)]
    peaks = [e.memory.peak_gib if e is not None and e.memory else None for e in (ev, pred, cal)]
    cells = [str(number), ev.plan.short(), str(t.user_attrs.get(TrialKey.ROLE, "")), status,
             *_record_cells(figure, tokens[0]), sig(tokens[1]), sig(tokens[2])]
    return cells, peaks


def print_measured(console: Console, mf: MeasureResult) -> None:
    """The real runs of a multi-fidelity search: measured (with the 95 % interval of its step) vs predicted per
    plan, and the calibration; memory in one unit for the table (stratagem.quantities)."""
    from stratagem.search.noise import record_figures
    from stratagem.search.records import record_numbers, study_scenario
    from stratagem.search.run_order import measured_trials

    study = mf.search.study
    if study is None:
        return
    scenario = study_scenario(study)
    numbers = record_numbers(study.get_trials(deepcopy=False))
    figures = {f.standing.trial.number: f for f in record_figures(study)}
    rows = [_run_figures(scenario, t, ev, mf.calibration, numbers.get(t.number, t.number), figures.get(t.number))
            for t in sorted(measured_trials(study).values(), key=lambda t: t.number)
            if (ev := trial_evaluation(t)) is not None]
    unit = memory_unit(*(g for _, peaks in rows for g in peaks))
    table = Table(title=f"Real runs: {mf.plans} plans in {mf.measured} runs ({mf.runs} in this call, "
                        f"{duration(mf.seconds)})",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("#", "plan", "role", "status", "tok/s meas", "95%", "pred", "calibrated", f"peak {unit[0]} meas",
                "pred", "calibrated"):
        table.add_column(col, justify="left" if col in ("plan", "role", "status") else "right",
                         no_wrap=col != "plan", min_width=max(len(col), {"#": 3, "plan": 16, "role": 9}.get(col, 0)))
    for cells, peaks in rows:
        table.add_row(*cells, *(memory_in(g, unit) for g in peaks))
    out = console if console.is_terminal else Console(width=max(console.width, 160))
    out.print(table)
    for line in measured_lines(mf):
        console.print(line, markup=False, soft_wrap=True, highlight=False)


def measured_lines(mf: MeasureResult) -> list[str]:
    """The lines under the run table: plans not run, why the loop stopped, the calibration, the best plan."""
    lines = []
    if mf.skipped:
        lines.append(f"skipped {mf.skipped} plan(s) the harness cannot run, e.g. {mf.skipped_example}")
    if mf.traced_out:
        lines.append(f"not run: {mf.traced_out} plan(s) whose traced memory does not fit, e.g. {mf.traced_out_example}")
    if mf.ended:
        lines.append(f"real runs stopped: {mf.ended}")
    if mf.history and not mf.history[-1].runs_used:
        last = mf.history[-1]
        lines.append("calibration: the starting one, kept: no measured run with a step time to fit yet"
                     + (f" ({last.ooms} OOM run(s) kept as memory lower bounds)" if last.ooms else ""))
    elif mf.history:
        last = mf.history[-1]
        first = next(h for h in mf.history if h.runs_used)  # the first step that had a run to judge
        adopted = [h for h in mf.history if h.adopted]
        state = ("refitted on this study's runs" if adopted else
                 "the starting calibration, kept: no refit predicted held-out runs better")
        lines.append(
            f"calibration ({state}; id {last.calibration_id or '-'}, the latest of {len(mf.history)} step(s)): median "
            f"step-time error {percent(first.step_error_before)} at the start -> {percent(last.step_error_after)}, "
            f"peak memory {percent(first.memory_error_before)} -> {percent(last.memory_error_after)} on "
            f"{last.runs_used} run(s)"
            + (f"; last refit: {last.note}" if last.note else "")
            + " ('pred': the calibration the search started from; 'calibrated': the one in force; the front uses "
              "measured figures where they exist and the latest calibration's predictions elsewhere)")
    lines += mf.taught  # what the runs taught per term and block (evaluators.taught)
    if mf.best_note:
        lines.append(mf.best_note)
    return lines
