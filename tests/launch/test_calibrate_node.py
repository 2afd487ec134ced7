"""`stratagem calibrate`: the fit recovers known constants from a stand-in runner; a real CPU calibration
improves the model's errors on the runs it measured; the file it writes changes what every command predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from stratagem.errors import StratagemError
from stratagem.evaluators import Calibration, evaluate, evaluate_many
from stratagem.evaluators.calibration_file import load_calibration, resolve_calibration
from stratagem.evaluators.fit_hardware import HardwareRun, predict_runs
from stratagem.evaluators.speed import path_efficiency
from stratagem.launch.harness.collectives_bench import rate_tables_yaml, tables_from_samples
from stratagem.launch.runners.calibrate import HARNESS_KERNELS, run_calibration
from stratagem.spaces import Plan, Scenario, load_scenario
from stratagem.spaces.stacks import stack_record

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"
FACTS = {"gpu_name": "stand-in", "driver": "none", "torch": "n/a", "cuda": "none", "python": "3"}
# Known constants, far from the published ones (attention efficiency moves with matmul efficiency in the fit).
TRUTH = Calibration(matmul_efficiency=0.31, attention_efficiency=0.26 * 0.31 / 0.62, half_efficiency_gflop=0.004,
                    layer_floor_ms=0.9, step_overhead_s=0.02, fragmentation=0.12, context_gib=0.003,
                    overlap=0.25, link_efficiency=0.35, collective_step_us=400.0)


def stand_in(truth: Calibration):
    """A runner whose 'measurements' are the analytic model's predictions with `truth`."""

    def run(scenario: Scenario, plans: Sequence[Plan], steps: int, warmup: int, deadline: float) -> list[HardwareRun]:
        runs = [HardwareRun(plan=p, scenario=scenario, status="ok", step_s=1.0, peak_gib=1.0) for p in plans]
        step, peak = predict_runs(runs, truth)
        return [HardwareRun(plan=p, scenario=scenario, status="ok", step_s=float(s), peak_gib=float(m))
                for p, s, m in zip(plans, step, peak, strict=True)]

    return run


def test_stand_in_runner_recovers_known_constants(tmp_path: Path) -> None:
    out = run_calibration(load_scenario(TINY), gpus=2, budget_s=60, out=tmp_path / "cal.yaml",
                          runner=stand_in(TRUTH), facts=FACTS, log=lambda _: None)
    got = out.fit.calibration
    errors = out.file.errors
    print(out.table)
    print({k: (getattr(TRUTH, k), getattr(got, k)) for k in ("matmul_efficiency", "half_efficiency_gflop",
          "layer_floor_ms", "step_overhead_s", "fragmentation", "context_gib", "overlap", "link_efficiency",
          "collective_step_us")})
    assert len(out.fit.runs) == len(out.runs) >= 10  # 7 single-device + the node runs
    assert errors["step_error_before"] > 1.0 and errors["peak_error_before"] > 1.0
    assert errors["step_error_after"] < 0.01 and errors["peak_error_after"] < 0.01
    # layer_floor_ms, overlap and link_efficiency do not bind on these runs (compute above the floor, messages
    # latency-bound), so any value within the loss tolerance is a fit; the others are pinned down.
    for name in ("half_efficiency_gflop", "step_overhead_s", "fragmentation", "context_gib", "collective_step_us"):
        assert getattr(got, name) == pytest.approx(getattr(TRUTH, name), rel=0.05), name
    # the compute efficiency is the harness's kernel path's, measured (eager: TRUTH's fused-reference efficiency x
    # the torch record's eager factor), and the file says which path it is
    assert got.kernel_path == HARNESS_KERNELS == "eager"
    eager = path_efficiency(stack_record("torch"), "eager")
    assert got.matmul_efficiency == pytest.approx(TRUTH.matmul_efficiency * eager, rel=0.05)
    # other paths and stacks scale from the measured one by the records' ratios: the same predictions as TRUTH's
    scn = load_scenario(TINY)
    for kernels, stack in (("compiled", "torch"), ("fused", "megatron")):
        other = scn.model_copy(update={"training": scn.training.model_copy(update={"kernels": kernels,
                                                                                  "stack": stack})})
        plans = [Plan(dp=1, micro_batch_size=2)]
        assert evaluate_many(other, plans, got).compute_s[0] == pytest.approx(
            evaluate_many(other, plans, TRUTH).compute_s[0], rel=0.05)


def _cli(*args: str, block: bool = False, cwd: Path | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    """`stratagem ARGS` in a fresh interpreter; block=True makes `import ray` and `import optuna` fail."""
    guard = "import sys; sys.modules['ray'] = None; sys.modules['optuna'] = None; " if block else ""
    code = guard + f"from stratagem.cli import main; main({list(args)!r})"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or ROOT, check=False)


def _step(out: str) -> float:
    return float(json.loads(out)["evaluation"]["time"]["step_s"])


def test_real_cpu_calibration_improves_errors_and_is_used_by_explain(tmp_path: Path) -> None:
    scn = tmp_path / "tiny.yaml"
    scn.write_text(TINY.read_text())
    cal = tmp_path / "cal.yaml"
    # cross-node curves as a multi-node run of launch/harness/collectives_bench.py writes them (test_collectives_bench
    # measures them on two torchrun nodes): calibrate keeps them beside the node's own tables
    rates = tmp_path / "rates.yaml"
    rates.write_text(rate_tables_yaml(tables_from_samples(
        {"collectives": {("all_reduce", "inter_node", 16, 1 << 20): 30.0, ("all_reduce", "inter_node", 16, 1 << 26): 90.0},
         "gemms": {}}, 1.0, "fp32", "a 2-node bench")))
    # Single-device runs only here (one launch); the node runs are the slow test below. No Ray, no Optuna.
    run = _cli("calibrate", str(scn), "--gpus", "1", "--steps", "2", "--warmup", "1", "-o", str(cal),
               "--rate-tables", str(rates), block=True)
    print(run.stdout[-3000:], run.stderr[-2000:])
    assert run.returncode == 0, run.stderr
    assert "before" in run.stdout and "after" in run.stdout and "median step-time error" in run.stdout
    assert "kernel path measured: eager" in run.stdout
    cf = load_calibration(cal)
    e = cf.errors
    print(f"CPU calibrate (tiny, 7 single-device runs): median step-time error {e['step_error_before']:.1%} -> "
          f"{e['step_error_after']:.1%}, peak-memory error {e['peak_error_before']:.1%} -> {e['peak_error_after']:.1%}")
    assert sum(r.status == "ok" for r in cf.runs) == 7
    assert e["step_error_after"] < e["step_error_before"] and e["peak_error_after"] < e["peak_error_before"]
    assert cf.provenance.gpu_name == "cpu" and cf.provenance.torch and cf.provenance.date
    assert all((tmp_path / r.result_file).is_file() for r in cf.runs if r.result_file)
    # the node's GEMM tables (one rank: no collective of its own) and the file's cross-node curve are in the file,
    # and explain says they are in force
    tables = cf.calibration.rate_tables
    assert tables is not None and [g.kind for g in tables.gemms] == ["dense", "grouped"]
    assert [(c.collective, c.ranks, c.placement) for c in tables.collectives] == [("all_reduce", 16, "inter_node")]
    assert "a 2-node bench" in tables.source and f"with {rates}: a 2-node bench" in run.stdout
    assert "dense GEMM" in run.stdout

    # The file changes explain's prediction, by --calibration and by cluster.calibration (relative path).
    default = _cli("explain", str(scn), "--json")
    given = _cli("explain", str(scn), "--json", "--calibration", str(cal))
    data = yaml.safe_load(TINY.read_text())
    data["cluster"]["calibration"] = "cal.yaml"
    linked = tmp_path / "linked.yaml"
    linked.write_text(yaml.safe_dump(data))
    from_scenario = _cli("explain", str(linked), "--json", cwd=Path("/"))
    for r in (default, given, from_scenario):
        assert r.returncode == 0, r.stderr
    assert "defaults" in json.loads(default.stdout)["calibration"]
    assert str(cal) in json.loads(given.stdout)["calibration"]
    taught = json.loads(given.stdout)["taught"]
    assert any("dense GEMM efficiency: measured" in line for line in taught)
    assert any("all_reduce inter node: measured busbw at 1 group size(s) (16 ranks)" in line for line in taught)
    assert not any("measured tables" in line for line in json.loads(default.stdout)["taught"])
    assert str(cal) in json.loads(from_scenario.stdout)["calibration"]
    assert _step(given.stdout) == pytest.approx(_step(from_scenario.stdout))
    # explain predicted with the file's constants, and they move the prediction away from the published ones.
    tiny = load_scenario(scn)
    assert _step(given.stdout) == pytest.approx(evaluate(tiny, calibration=cf.calibration).time.step_s, rel=1e-6)
    assert _step(given.stdout) != pytest.approx(evaluate(tiny, calibration=Calibration()).time.step_s, rel=0.05)
    assert evaluate(load_scenario(linked)).time is not None
    assert load_scenario(linked).problem_hash() == load_scenario(scn).problem_hash()


@pytest.mark.slow
def test_real_cpu_calibration_with_node_runs(tmp_path: Path) -> None:
    scn = tmp_path / "tiny.yaml"
    scn.write_text(TINY.read_text())
    run = _cli("calibrate", str(scn), "--gpus", "2", "--steps", "2", "--warmup", "1", block=True, timeout=600)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stderr
    cf = load_calibration(tmp_path / "calibration.yaml")
    node = [r for r in cf.runs if r.world_size == 2]
    assert len(node) == 4 and all(r.status == "ok" for r in node)
    tables = cf.calibration.rate_tables
    assert tables is not None and {(c.collective, c.ranks) for c in tables.collectives} == {
        (c, 2) for c in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    assert cf.errors["step_error_after"] < cf.errors["step_error_before"]


def test_user_mistakes_are_one_line(tmp_path: Path) -> None:
    data = yaml.safe_load(TINY.read_text())
    data["cluster"]["gpu"] = "h100-sxm-80g"
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text(yaml.safe_dump(data))
    run = _cli("calibrate", str(gpu))
    assert run.returncode == 2 and "cluster.gpu (h100-sxm-80g): no CUDA device" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: stratagem-calibration/1\ncalibration: {matmul_efficiency: 3}\n")
    with pytest.raises(StratagemError, match=r"calibration \(.*bad.yaml\): calibration.matmul_efficiency"):
        load_calibration(bad)
    with pytest.raises(StratagemError, match="file not found"):
        resolve_calibration(load_scenario(TINY), tmp_path / "missing.yaml")
    cal, label = resolve_calibration(load_scenario(TINY))
    assert cal is None and "defaults" in label
    with pytest.raises(StratagemError, match="--gpus"):
        run_calibration(load_scenario(TINY), gpus=0, budget_s=60, runner=stand_in(TRUTH), facts=FACTS)


def test_search_starts_from_the_calibration_and_the_report_says_so(tmp_path: Path) -> None:
    scn = tmp_path / "tiny.yaml"
    scn.write_text(TINY.read_text())
    run_calibration(load_scenario(scn), gpus=2, budget_s=60, out=tmp_path / "cal.yaml", runner=stand_in(TRUTH),
                    facts=FACTS, log=lambda _: None)
    searched = _cli("search", str(scn), "--calibration", str(tmp_path / "cal.yaml"), "--no-report", "--top", "3")
    assert searched.returncode == 0, searched.stderr
    assert f"calibration: {tmp_path / 'cal.yaml'} (stand-in x2" in searched.stdout
    report = _cli("report", str(scn), "-f", "md")
    assert report.returncode == 0, report.stderr
    assert f"Calibration: {tmp_path / 'cal.yaml'} (stand-in x2" in report.stdout
