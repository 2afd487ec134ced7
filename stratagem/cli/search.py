"""`stratagem search`: screen, store the front, optionally measure real runs, report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from stratagem.cli.app import ScenarioArg, app, console
from stratagem.cli.calibrate import CalibrationOpt, scenario_calibration
from stratagem.errors import StratagemError
from stratagem.spaces import Scenario, load_scenario

if TYPE_CHECKING:
    from stratagem.evaluators import Calibration
    from stratagem.search.screening import Mode


@app.command("search")
def search_cmd(
    scenario: ScenarioArg,
    storage: Annotated[str | None, typer.Option("--storage", help="Optuna storage URL: sqlite:///F.db (default: "
                                                "stratagem.db beside the scenario), postgresql://..., journal:F.log")]
    = None,
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: <scenario>-<space hash>); "
                                              "rerunning with the same name resumes.")] = None,
    sampler: Annotated[str, typer.Option("--sampler", help="auto | exhaustive | nsga2 | tpe | random.")] = "auto",
    n_trials: Annotated[int | None, typer.Option("--n-trials", min=0, help="Plans the sampler proposes (nsga2/random "
                                                 "default 2000, tpe 300); measured runs: runs in this call.")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Stop the sampler / measured runs after S "
                                                  "seconds.")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="Rows of the front to show.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print counts and the front as JSON.")] = False,
    real_runs: Annotated[int, typer.Option("--real-runs", min=0, help="After screening, measure up to K plans as "
                                           "short real training runs through Ray (0: analytic only).")] = 0,
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="Join a running Ray cluster "
                                                    "('auto'); default: start a local one.")] = None,
    budget_minutes: Annotated[float | None, typer.Option("--budget-minutes", help="Bound the real-run "
                                                         "phase (minutes).")] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per real run.")] = 4,
    report: Annotated[Path | None, typer.Option("--report", help="HTML report path (default: <study>.html "
                                                "beside the scenario).")] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Do not write the HTML report.")] = False,
    calibration: CalibrationOpt = None,
    traced: Annotated[int, typer.Option("--traced", min=0, help="After screening, trace up to K plans (front "
                                        "first, then nearest the memory limit) at full size on fake tensors; "
                                        "before any real runs.")] = 0,
) -> None:
    """Search the plan space: screen it analytically, store the Pareto front in an Optuna study, optionally
    measure the best survivors as real runs through Ray (recalibrating the model), show the front and write
    the HTML report."""
    from stratagem.reports import check_output, output_format
    from stratagem.reports import terminal as view
    from stratagem.search import (
        check_sampler,
        check_storage,
        default_storage,
        default_study_name,
        parse_storage,
        run_search,
    )

    # Everything a user can get wrong is checked here, before screening, Ray or any file is touched.
    for option, value in (("--timeout", timeout), ("--budget-minutes", budget_minutes)):
        if value is not None and not value > 0:
            raise StratagemError(f"{option} ({value:g}): must be > 0")
    scn = load_scenario(scenario)
    cal, cal_label = scenario_calibration(scn, calibration)
    mode = check_sampler(sampler)
    name = study or default_study_name(scenario, scn)
    spec = parse_storage(storage or default_storage(scenario))
    check_storage(spec)
    report_path = None if no_report else check_output(report or scenario.with_name(f"{name}.html"), "--report")
    if report_path is not None and output_format(report_path, None) != "html":
        raise StratagemError(f"--report ({report_path}): the search writes an HTML report; name it .html (other "
                             "formats: stratagem report -o)")
    traced_result = None
    if traced:  # the traced fidelity (stratagem/search/traced.py): refits logits_bytes, re-screens
        from stratagem.cli.trace import traced_phase

        traced_result = traced_phase(scn, spec.url, name, mode, traced, cal, as_json)
        cal = traced_result.calibration
    if real_runs:
        result = _search_with_real_runs(scn, scenario, spec.url, name, mode, real_runs, ray_address, budget_minutes,
                                        steps, as_json, cal, n_trials=n_trials, timeout=timeout)
    elif traced_result is not None:
        result = traced_result.search
    else:
        with view.progress_bar(Console(stderr=True), enabled=not as_json) as progress:
            result = run_search(scn, spec.url, name, sampler=mode, n_trials=n_trials, timeout=timeout,
                                progress=progress, calibration=cal)
    _record_calibration(result, cal_label)
    (Console(stderr=True) if as_json else console).print(f"calibration: {cal_label}", markup=False,
                                                         highlight=False, soft_wrap=True)
    if as_json:
        print(view.result_json(result))
    else:
        view.print_result(console, result, top)
    if report_path is not None:
        from stratagem.reports import open_study as load_study
        from stratagem.reports import write_report

        opened = result.study if result.study is not None else load_study(result.storage.url, result.study_name)
        path = write_report(opened, report_path)
        (Console(stderr=True) if as_json else console).print(f"report:   {path}", markup=False, soft_wrap=True)


def _search_with_real_runs(scn: Scenario, scenario_path: Path, url: str, name: str, mode: Mode, real_runs: int,
                           ray_address: str | None, budget_minutes: float | None, steps: int,
                           quiet: bool, calibration: Calibration | None = None, n_trials: int | None = None,
                           timeout: float | None = None) -> Any:
    """The multi-fidelity search: screening, real runs through Ray, calibration; prints the measured runs.
    SIGINT/SIGTERM: the in-flight runs are killed and released, exit 130/143; every run of this call failed:
    exit 1 with the first reason."""
    from stratagem.launch.runners.real import RayRunEvaluator
    from stratagem.reports import terminal as view
    from stratagem.search.multifidelity import Stopped, run_multifidelity

    run_dir = scenario_path.parent / "runs" / name
    num_cpus = scn.cluster.num_gpus if scn.cluster.gpu.kind == "cpu" and ray_address is None else None
    out = Console(stderr=True) if quiet else console
    out.print(f"starting Ray ({ray_address or 'local cluster'}); run logs under {run_dir}", markup=False)
    fresh = [d for d in (run_dir, run_dir.parent) if not d.exists()]  # created by this call
    try:
        # its predictions ('pred' beside each run) use the calibration the search starts from (a calibration file,
        # the traced refit), as the screening did, not the device's defaults
        evaluator = RayRunEvaluator(run_dir, address=ray_address, num_cpus=num_cpus, steps=steps, warmup=2,
                                    calibration=calibration)
    except BaseException as e:
        _remove_empty(fresh)
        if isinstance(e, Exception) and _raised_by_ray(e):  # e.g. "node timed out during startup" on a busy host
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StratagemError(f"--real-runs: Ray did not start ({ray_address or 'local cluster'}): {first}; "
                                 "retry when the machine is less loaded, or join a running cluster with "
                                 "--ray-address") from None
        raise
    try:
        def on_batch(entry: dict[str, Any]) -> None:
            out.print(f"measured {entry['measured']}/{real_runs}: step-time error {entry['step_error_before']:.0%}"
                      f" -> {entry['step_error_after']:.0%} after calibration, peak-memory error "
                      f"{entry['memory_error_before']:.0%} -> {entry['memory_error_after']:.0%}", markup=False,
                      soft_wrap=True)

        with view.progress_bar(Console(stderr=True), enabled=not quiet) as progress:
            mf = run_multifidelity(scn, url, name, evaluator, real_runs, budget_minutes, sampler=mode,
                                   progress=progress, on_batch=on_batch, initial_calibration=calibration,
                                   n_trials=n_trials, timeout=timeout,
                                   on_message=lambda text: out.print(text, markup=False, soft_wrap=True))
    except Stopped as stop:
        evaluator.close()
        _remove_empty(fresh)
        raise typer.Exit(128 + stop.signum) from None
    except BaseException:
        evaluator.close()
        _remove_empty(fresh)  # a failed command leaves no empty runs/ folder behind
        raise
    evaluator.close()
    view.print_measured(out, mf)
    if mf.runs and mf.first_failure and not mf.ok_runs:
        Console(stderr=True).print(f"error: all {mf.runs} real run(s) of this call failed; first: "
                                   f"{mf.first_failure}", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    return mf.search


def _record_calibration(result: Any, label: str) -> None:
    """The study attribute "calibration_source": which calibration the search's predictions started from."""
    study = getattr(result, "study", None)
    if study is None:
        import optuna

        study = optuna.load_study(study_name=result.study_name, storage=result.storage.url)
    from stratagem.search.records import StudyKey

    study.set_user_attr(StudyKey.CALIBRATION_SOURCE, label)


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this call created when no file was written under them (deepest first)."""
    import shutil

    for d in dirs:
        if d.is_dir() and not any(p.is_file() or p.is_symlink() for p in d.rglob("*")):
            shutil.rmtree(d)


def _raised_by_ray(e: BaseException) -> bool:
    """Whether the innermost frame of e's traceback is Ray's own code (Ray's start-up failures are plain
    Exceptions: the frame, not the type, says where they come from)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}ray{os.sep}" in tb.tb_frame.f_code.co_filename
