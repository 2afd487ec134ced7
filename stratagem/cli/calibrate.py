"""`stratagem calibrate`: measure this node with a prepared set of short runs and write a calibration file.

Imports neither Ray nor Optuna (an offline GPU box may have neither); torch is needed for the runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from stratagem import quantities as q
from stratagem.cli.app import ScenarioArg, app, console
from stratagem.errors import StratagemError
from stratagem.evaluators import Calibration
from stratagem.evaluators.calibration import default_calibration
from stratagem.evaluators.calibration_file import resolve_calibration, runs_dir
from stratagem.evaluators.rate_defaults import published_tables
from stratagem.evaluators.rate_tables import RateTables, joined
from stratagem.spaces import Scenario, load_scenario

__all__ = ["calibrate_cmd", "check_device", "check_room", "CalibrationOpt", "scenario_calibration", "errors_line",
           "moved_constants", "node_rate_tables", "node_grid_sizes", "rates_lines"]

CalibrationOpt = Annotated[Path | None, typer.Option(
    "--calibration", help="Calibration file from `stratagem calibrate` (default: the scenario's "
    "cluster.calibration, else the published constants).")]


def scenario_calibration(scn: Scenario, override: Path | None) -> tuple[Calibration | None, str]:
    """The calibration a command uses (--calibration over cluster.calibration over the defaults) and its label;
    one fitted on another device is refused unless the scenario allows it (then a warning on stderr)."""
    from rich.console import Console

    def warn(line: str) -> None:
        Console(stderr=True).print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)

    return resolve_calibration(scn, override, warn=warn)

_SHOWN = ("matmul_efficiency", "attention_efficiency", "half_efficiency_gflop", "layer_floor_ms", "step_overhead_s",
          "fragmentation", "context_gib", "overlap", "link_efficiency", "collective_step_us")


def errors_line(errors: dict[str, float], fitted: int, runs: int) -> str:
    """The median prediction errors before -> after the fit, as percentages (stratagem.quantities)."""
    return (f"median step-time error {q.percent(errors['step_error_before'])} -> "
            f"{q.percent(errors['step_error_after'])}, peak-memory error {q.percent(errors['peak_error_before'])} "
            f"-> {q.percent(errors['peak_error_after'])} ({fitted} of {runs} runs fitted)")


def moved_constants(base: Calibration, fitted: Calibration) -> list[str]:
    """`name before -> after` for each shown constant the fit moved, 3 significant figures (more where 3 would
    print the same figure twice)."""
    moved = []
    for k in _SHOWN:
        a, b = getattr(base, k), getattr(fitted, k)
        if a == b:
            continue
        digits = next((d for d in range(3, 10) if q.sig(a, d) != q.sig(b, d)), 10)
        moved.append(f"{k} {q.sig(a, digits)} -> {q.sig(b, digits)}")
    return moved


def check_device(scn: Scenario) -> None:
    """The scenario's device must be this machine's: a GPU preset needs CUDA, the cpu preset needs none."""
    import torch

    has_cuda = torch.cuda.is_available()
    if scn.cluster.gpu.kind == "cpu" and has_cuda:
        raise StratagemError(f"cluster.gpu (cpu): this machine has {torch.cuda.get_device_name(0)}; calibrate the "
                             "GPU preset that matches it (e.g. gpu: h100-sxm-80g)")
    if scn.cluster.gpu.kind != "cpu" and not has_cuda:
        raise StratagemError(f"cluster.gpu ({scn.cluster.gpu.name}): no CUDA device on this machine (torch "
                             f"{torch.__version__}); calibrate runs on the hardware it measures, or use gpu: cpu")


def check_room(out: Path, scn: Scenario, option: str = "-o") -> None:
    """Before the runs: `out`'s directory and its runs folder (or the folder it will be made in) take a file of
    one run record's size, tried by writing a probe of that many bytes and removing it. A full disk (ENOSPC),
    a file size limit (EFBIG, `ulimit -f`) or a read-only directory is one line now, not after every run. A run
    record embeds the run's scenario (launch/runners/calibrate._run_files), so the scenario's JSON is its
    lower bound."""
    from stratagem.files import disk_error

    need = len(json.dumps(scn.model_dump(mode="json"), indent=1).encode())
    runs = runs_dir(out)
    while not runs.exists() and runs != runs.parent:
        runs = runs.parent
    for d in dict.fromkeys([out.parent if str(out.parent) else Path("."), runs]):
        try:
            fd, probe = tempfile.mkstemp(dir=d, prefix=".stratagem-probe.", suffix=".tmp")
        except OSError as e:
            raise StratagemError(f"{option} ({out}): cannot write in {d}: {disk_error(e)}; choose another "
                                 "path") from None
        try:
            data = b"\0" * need
            while data:
                data = data[os.write(fd, data):]
        except OSError as e:
            raise StratagemError(f"{option} ({out}): cannot write a {need}-byte run record in {d}: "
                                 f"{disk_error(e)}; free space or choose another path (no run started)") from None
        finally:
            os.close(fd)
            os.unlink(probe)


def node_rate_tables(scn: Scenario, gpus: int) -> RateTables:
    """This node's collective and GEMM tables (launch/harness/collectives_bench.py): every collective at each group
    size of `gpus` ranks (none on one rank) over the node's grid of message sizes, and the GEMM grid, efficiencies
    against the GPU preset's datasheet peak."""
    import datetime as dt

    import torch

    from stratagem.launch.harness.collectives_bench import group_sizes, measure_rate_tables, node_grid
    from stratagem.launch.runners.local import LocalRunError

    on_gpu = torch.cuda.is_available()
    sizes, shapes, dtype = node_grid(on_gpu)
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    source = (f"stratagem calibrate on {gpus} {scn.cluster.gpu.name} rank(s) of one node, "
              f"{'nccl' if on_gpu else 'gloo'}, torch {torch.__version__}, {when}")
    try:
        return measure_rate_tables(gpus, group_sizes(gpus), sizes, shapes, scn.cluster.gpu.peak_tflops(dtype), dtype,
                                   source)
    except LocalRunError as e:
        raise StratagemError(f"calibrate: measuring collectives and GEMMs on {gpus} rank(s) failed: "
                             f"{str(e).strip().splitlines()[-1][:300]}; rerun, or check the node") from None


def node_grid_sizes(tables: RateTables) -> tuple[float, ...]:
    """The message sizes the tables' collective curves were measured at (the first curve's; all share them)."""
    return tables.collectives[0].sizes_bytes if tables.collectives else ()


def rates_lines(tables: RateTables, published: RateTables | None = None) -> list[str]:
    """What the measured tables hold, one line per collective curve (bus bandwidth at the smallest and largest
    size, beside the model default's (evaluators.rate_defaults) at the largest where `published` has the curve) and per GEMM table
    (efficiency at the smallest and largest shape)."""
    shipped = {(c.collective, c.ranks, c.placement): c for c in (published.collectives if published else ())}
    lines = []
    for c in tables.collectives:
        p = shipped.get((c.collective, c.ranks, c.placement))
        versus = f" (model default {q.sig(p.busbw_gbps[-1], 3)})" if p and p.sizes_bytes == c.sizes_bytes else ""
        lines.append(f"  {c.collective:15} {c.ranks:3} ranks {c.placement}: busbw {q.sig(c.busbw_gbps[0], 3)} GB/s at "
                     f"{int(c.sizes_bytes[0]):,} B .. {q.sig(c.busbw_gbps[-1], 3)} GB/s at {int(c.sizes_bytes[-1]):,} B"
                     f"{versus}")
    for g in tables.gemms:
        lines.append(f"  {g.kind} GEMM {g.dtype}: efficiency {q.sig(g.efficiency[0], 3)} at {g.shapes[0]} .. "
                     f"{q.sig(g.efficiency[-1], 3)} at {g.shapes[-1]} (vs {g.peak_tflops:g} TFLOP/s)")
    return lines


@app.command("calibrate")
def calibrate_cmd(
    scenario: ScenarioArg,
    gpus: Annotated[int | None, typer.Option("--gpus", help="Devices for the node runs (default: every CUDA "
                                             "device; CPU ranks: 2).")] = None,
    budget_minutes: Annotated[float, typer.Option("--budget-minutes", help="Wall-clock budget of the runs; a "
                                                  "run not started by then is skipped.")] = 6.0,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Calibration file (default: "
                                                "calibration.yaml beside the scenario); runs go to "
                                                "<name>-runs/.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="Timed steps per run.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per run.")] = 2,
    force: Annotated[bool, typer.Option("--force", help="Replace -o (and its runs directory) even if stratagem "
                                        "did not write them.")] = False,
    rate_tables: Annotated[Path | None, typer.Option("--rate-tables", help="Collective curves measured across "
                                                     "nodes (torchrun ... -m stratagem.launch.harness."
                                                     "collectives_bench --out FILE), kept beside this node's "
                                                     "own.")] = None,
) -> None:
    """Measure this node (the scenario's GPU preset): single-device runs across micro-batch, recompute and
    precision, then node runs across dp/zero/tp; fit the model's constants and write them with provenance.
    Prints predicted vs measured for every run before and after the fit."""
    from stratagem.evaluators.calibration_file import check_calibration_output
    from stratagem.launch.harness.collectives_bench import read_rate_tables
    from stratagem.launch.runners.calibrate import check_gpus, check_options, default_gpus, run_calibration

    scn = load_scenario(scenario)
    extra = read_rate_tables(rate_tables) if rate_tables is not None else None  # a bad file stops before any run
    check_options(gpus if gpus is not None else 1, budget_minutes * 60.0, steps, warmup)
    if gpus is not None:
        check_gpus(gpus, scn)
    out = output or scenario.with_name("calibration.yaml")
    check_calibration_output(out, force)  # before the runs: a path it cannot or must not write is found now
    check_room(out, scn)
    check_device(scn)
    n = gpus if gpus is not None else default_gpus(scn)

    def say(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)  # a path is never broken across lines

    say(f"calibrate: collectives and GEMMs on {n} rank(s) (nccl-tests / cuBLAS conventions) ...")
    tables = node_rate_tables(scn, n)
    if extra is not None:
        tables = joined(tables, extra)
        say(f"  with {rate_tables}: {extra.source}")
    published = published_tables(scn.cluster, default_calibration(scn.cluster.gpu.name),
                                 sorted({c.ranks for c in tables.collectives}), node_grid_sizes(tables))
    for line in rates_lines(tables, published):
        say(line)
    # the runs are predicted (and the constants fitted) with the measured tables in force
    outcome = run_calibration(scn, n, budget_minutes * 60.0, out, steps=steps, warmup=warmup, force=force,
                              log=say, base=Calibration(rate_tables=tables))
    cf = outcome.file
    console.print(outcome.table, markup=False, highlight=False, soft_wrap=True)
    console.print(errors_line(cf.errors, len(outcome.fit.runs), len(outcome.runs)), markup=False)
    moved = moved_constants(outcome.fit.base, outcome.fit.calibration)
    fitted = outcome.fit.calibration
    console.print("fitted: " + ("; ".join(moved) if moved else "nothing moved"), markup=False, soft_wrap=True)
    console.print(f"kernel path measured: {fitted.kernel_path} (the harness's; the efficiencies above are its own, "
                  "other training.kernels paths scale from it by the stack records)", markup=False, soft_wrap=True)
    console.print(f"wrote {outcome.path}  (use it: cluster.calibration: {outcome.path} in a scenario, or "
                  f"--calibration {outcome.path})", markup=False, soft_wrap=True)

