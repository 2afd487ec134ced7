"""`stratagem search`: parse the options, open one SearchSession (stratagem/search/session.py), print its events,
the front and the real runs, write the report. Exit status: 0 when the study progressed (every run produced a
result: ok, oom, timeout); 1 only when nothing could be measured (the line says why); 2 for a user error;
128 + N on signal N."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from stratagem.cli.app import RetryOpt, ScenarioArg, StorageOpt, StudyOpt, app, console, study_location
from stratagem.cli.calibrate import CalibrationOpt, scenario_calibration
from stratagem.errors import StratagemError
from stratagem.quantities import duration, sig
from stratagem.spaces import load_scenario

if TYPE_CHECKING:
    from stratagem.evaluators import Calibration
    from stratagem.search.runner import SearchResult
    from stratagem.search.screening import Mode
    from stratagem.search.session import MeasureResult, SearchSession
    from stratagem.spaces.scenario import Scenario


@app.command("search")
def search_cmd(
    scenario: ScenarioArg,
    storage: StorageOpt = None,
    study: StudyOpt = None,
    storage_retry_minutes: RetryOpt = None,
    sampler: Annotated[str, typer.Option("--sampler", help="auto | exhaustive | nsga2 | tpe | random.")] = "auto",
    n_trials: Annotated[int | None, typer.Option("--n-trials", min=0, help="Plans the sampler proposes when the "
                                                 "space is sampled (nsga2/random default 2000, tpe 300).")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="End this call after S seconds: screening, "
                                                  "then its real runs, on one clock.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Rows of the front to show.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print counts and the front as JSON.")] = False,
    real_runs: Annotated[int, typer.Option("--real-runs", min=0, help="After screening, measure up to K plans not "
                                           "measured before as short real training runs through Ray: on a resumed "
                                           "study, K more than it holds (0: analytic only).")] = 0,
    max_runs: Annotated[int | None, typer.Option("--max-runs", min=0, help="Start at most N real runs in this call "
                                                 "(re-measurements and retries included; default: as --real-runs "
                                                 "and --remeasure need).")] = None,
    remeasure: Annotated[int, typer.Option("--remeasure", min=0, help="Then up to R more runs re-measuring the "
                                           "best plan and those within its noise (0: never run a plan "
                                           "twice).")] = 2,  # search.session.DEFAULT_REMEASURE, not
    # imported here: the CLI imports the search package only when a command runs (tests/search/test_run_noise.py checks them equal)
    run_order: Annotated[str | None, typer.Option("--run-order", help="Which plan a real run measures next: "
                                                  "expected_improvement (default: the expected gain over the best "
                                                  "measured, times the chance to fit) or ranked (the fastest "
                                                  "predicted that may fit).")] = None,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join a running Ray cluster "
                                                    "('auto'); default: start a local one.")] = None,
    budget_minutes: Annotated[float | None, typer.Option(
        "--budget-minutes", help="Bound the real runs to a window of M minutes; a rerun opens a new window (a "
                                 "worker started with the same M while one is open joins it).")] = None,
    run_timeout: Annotated[float | None, typer.Option(
        "--run-timeout", help="Kill a real run after S seconds (default: 3x its predicted build + step time, at "
                              "least 180 s); stored with the study.")] = None,
    steps: Annotated[int | None, typer.Option("--steps", min=1, help="Timed steps per real run (default: as many "
                                              "as 6 s of steps take, 12-40: launch/harness/budget.py).")] = None,
    report: Annotated[Path | None, typer.Option("--report", help="HTML report path (default: <study>.html "
                                                "beside the scenario).")] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Do not write the HTML report.")] = False,
    calibration: CalibrationOpt = None,
    traced: Annotated[int, typer.Option("--traced", min=0, help="After screening, trace up to K plans (front "
                                        "first, then nearest the memory limit) at full size on fake tensors; "
                                        "before any real runs.")] = 0,
    runs_dir: Annotated[Path | None, typer.Option("--runs-dir", help="Folder of the real runs' logs, one "
                                                  "subfolder per worker (default: runs/STUDY beside the scenario; "
                                                  "under `ray job submit`, ~/stratagem-runs/STUDY).")] = None,
) -> None:
    """Search the plan space: screen it analytically, store the Pareto front in an Optuna study, optionally
    measure the best survivors as real runs through Ray (recalibrating the model), show the front and write
    the HTML report."""
    from stratagem.reports import terminal as view
    from stratagem.search.session import SearchSession

    # Everything a user can get wrong is checked here, before screening, Ray or any file is touched.
    _check_limits(timeout, budget_minutes, run_timeout)
    _check_run_order(run_order)
    setup = _setup(scenario, storage, study, sampler, calibration, runs_dir, report, no_report)
    if real_runs:
        from stratagem.cli.runs_dir import check_runs_root

        check_runs_root(setup.runs, "--runs-dir" if runs_dir is not None else "--real-runs (runs beside the scenario)")
    out = Console(stderr=True) if as_json else console
    with view.EventPrinter(out, progress=not as_json) as printer:
        session = SearchSession(setup.scenario, setup.url, setup.name, calibration=setup.calibration,
                                sampler=setup.sampler, listener=printer, calibration_source=setup.calibration_label,
                                host_noise=bool(real_runs))
        call_end = None if timeout is None else time.monotonic() + timeout  # one clock for the whole call
        session.screen(n_trials=n_trials, timeout=timeout)
        result = session.store()
        if traced:  # the traced fidelity (stratagem/search/traced.py): refits logits_bytes, re-screens
            result = _traced(session, traced, out)
        measured = _real_runs(session, setup.runs, (real_runs, remeasure), ray_address, steps, budget_minutes,
                              run_timeout, max_runs, call_end, out, run_order) if real_runs else None
    _show(session, result, measured, setup, out, as_json, top)


def _check_run_order(name: str | None) -> None:
    """--run-order names a policy of search.run_order.RUN_ORDERS."""
    from stratagem.search.run_order import RUN_ORDERS

    if name is not None and name not in RUN_ORDERS:
        raise StratagemError(f"--run-order ({name}): not a run order; choose one of {', '.join(RUN_ORDERS)}")


def _check_limits(timeout: float | None, budget_minutes: float | None, run_timeout: float | None) -> None:
    """--timeout and --budget-minutes above 0, --run-timeout as search.budget allows."""
    from stratagem.search.budget import check_run_timeout

    for option, value in (("--timeout", timeout), ("--budget-minutes", budget_minutes)):
        if value is not None and not value > 0:
            raise StratagemError(f"{option} ({value:g}): must be > 0")
    check_run_timeout(run_timeout)


@dataclass(frozen=True)
class _Setup:
    """What the search works with, settled before screening: the scenario, its study, where runs and report go."""

    scenario: Scenario
    """The scenario loaded."""
    calibration: Calibration | None
    """--calibration over cluster.calibration (None: the published constants)."""
    calibration_label: str
    """Which calibration, as the `calibration:` line says."""
    sampler: Mode
    """The --sampler mode."""
    url: str
    """The study's storage URL, absolute."""
    name: str
    """The study's name."""
    runs: Path
    """The real runs' logs folder (one subfolder per worker)."""
    report: Path | None
    """The HTML report's path; None with --no-report."""


def _setup(scenario: Path, storage: str | None, study: str | None, sampler: str, calibration: Path | None,
           runs_dir: Path | None, report: Path | None, no_report: bool) -> _Setup:
    """Load the scenario and its calibration, check the sampler, locate the study (a storage that outlives the
    job), the runs folder and the report (.html only), refusing what is wrong before anything is written."""
    from stratagem.cli.runs_dir import (
        absolute_storage,
        check_storage_outlives,
        in_ray_job_copy,
        make_default_dir,
        runs_root,
    )
    from stratagem.reports import check_output, output_format
    from stratagem.search import check_sampler

    scenario = scenario.resolve()  # paths fixed at start: a Ray job's cwd is a copy Ray may delete
    scn = load_scenario(scenario)
    cal, cal_label = scenario_calibration(scn, calibration)
    mode = check_sampler(sampler)
    url, found = study_location("search", scenario, storage, study)
    name = str(found)  # a scenario always names its study
    url = absolute_storage(url)
    check_storage_outlives(url)
    runs = runs_root(scenario, name, runs_dir)
    beside = runs.parent if in_ray_job_copy(scenario) else scenario.parent  # never into Ray's job copy
    if report is None and not no_report:
        make_default_dir(beside, "--report")  # ~/stratagem-runs on a fresh head: created, like the runs folder
    report_path = None if no_report else check_output((report or beside / f"{name}.html").resolve(), "--report")
    if report_path is not None and output_format(report_path, None) != "html":
        raise StratagemError(f"--report ({report_path}): the search writes an HTML report; name it .html (other "
                             "formats: stratagem report -o)")
    return _Setup(scn, cal, cal_label, mode, url, name, runs, report_path)


def _traced(session: SearchSession, k: int, out: Console) -> SearchResult:
    """Trace up to `k` plans (SearchSession.trace), a line per plan and one for the refit; the search after it."""
    from stratagem.launch.trace.run import trace_plan
    from stratagem.reports import terminal as view

    done = session.trace(k, trace_plan, lambda key, ev, why: out.print(
        view.traced_line(key, ev, why), markup=False, soft_wrap=True))
    out.print(f"traced {done.traced} plan(s) in {duration(done.seconds)}; logits_bytes refitted to "
              f"{sig(done.calibration.logits_bytes)}", markup=False)
    return done.search


def _show(session: SearchSession, result: SearchResult, measured: MeasureResult | None, setup: _Setup,
          out: Console, as_json: bool, top: int) -> None:
    """The measured runs, the calibration line, the front (a table, or JSON on stdout), the report written;
    exit 1 when real runs were asked for and nothing could be measured."""
    from stratagem.reports import terminal as view

    if measured is not None:
        view.print_measured(out, measured)
        result = measured.search
        _write_learnt(session, setup.runs, out)
    out.print(f"calibration: {setup.calibration_label}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print(view.result_json(result))
    else:
        view.print_result(console, result, top)
    if setup.report is not None:
        from stratagem.reports import write_report

        path = write_report(session.study, setup.report)
        out.print(f"report:   {path}", markup=False, soft_wrap=True)
    if measured is not None and measured.nothing_measured:
        Console(stderr=True).print(f"error: nothing could be measured: {measured.nothing_measured}", markup=False,
                                   soft_wrap=True)
        raise typer.Exit(1)


def _write_learnt(session: SearchSession, runs: Path, out: Console) -> None:
    """The study's calibration after its runs (what they taught) as a calibration file in the runs folder, for
    `--calibration` on explain or a later search; nothing while no refit was adopted."""
    from stratagem.evaluators.calibration_file import write_calibration

    cf = session.calibration_file()
    if cf is None:
        return
    runs.mkdir(parents=True, exist_ok=True)
    path = write_calibration(runs / "calibration.yaml", cf)
    out.print(f"calibration learnt: {path} (--calibration on explain or a later search)", markup=False,
              soft_wrap=True)


def _real_runs(session: SearchSession, runs: Path, k_r: tuple[int, int], ray_address: str | None,
               steps: int | None,
               budget_minutes: float | None, run_timeout: float | None, max_runs: int | None,
               call_end: float | None, out: Console, run_order: str | None = None) -> MeasureResult:
    """The real runs through Ray (SearchSession.measure); a signal: the runs in flight killed and released, exit
    128 + N. Run logs under `runs`/<this worker's folder> (stratagem/cli/runs_dir.py). `call_end`: when --timeout
    ends the call (time.monotonic()); the runs get what screening left of it."""
    from stratagem.cli.runs_dir import worker_folder
    from stratagem.launch.runners.real import open_ray_evaluator
    from stratagem.search.measure import Stopped
    from stratagem.search.run_order import DEFAULT_RUN_ORDER, RUN_ORDERS

    scn = session.scenario
    run_dir = worker_folder(runs)
    num_cpus = scn.cluster.num_gpus if scn.cluster.gpu.kind == "cpu" and ray_address is None else None
    out.print(f"starting Ray ({ray_address or 'local cluster'}); run logs under {run_dir}", markup=False)
    run_timeout = session.run_timeout(run_timeout)  # given, else stored with the study by an earlier call
    try:
        with open_ray_evaluator(run_dir, ray_address, num_cpus, steps, session.start_calibration,
                                run_timeout) as evaluator:
            order = RUN_ORDERS[run_order or DEFAULT_RUN_ORDER](candidates=None)
            left = None if call_end is None else max(call_end - time.monotonic(), 1e-3)  # (spent: no run starts)
            return session.measure(k_r[0], evaluator, order, budget_minutes=budget_minutes, max_runs=max_runs,
                                   timeout=left, run_timeout_s=run_timeout, remeasure=k_r[1])
    except Stopped as stop:
        raise typer.Exit(128 + stop.signum) from None
