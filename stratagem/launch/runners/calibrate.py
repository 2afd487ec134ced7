"""Calibrate the analytic model on this node: a prepared set of short real runs, a fit, a calibration file.

    outcome = run_calibration(scenario, gpus=8, budget_s=360, out="calibration.yaml")

The run set (`calibration_plans`), on one node through the local launcher (launch.local, no Ray):
  - single device: bf16 micro-batch 1 / 2 / 4, bf16 mbs 2 with selective and with full recompute, fp32 mbs 1
    and fp32 mbs 2 with full recompute: the compute constants (matmul efficiency, small-GEMM half point,
    layer floor, step overhead) and memory (fragmentation, context);
  - `gpus` devices: DDP, ZeRO-1, FSDP2 (ZeRO-3), TP over the node, and dp x tp=2 where the node has 4+:
    the intra-node link efficiency and per-ring-step latency.
Single-device runs train a global batch of 4 sequences, node runs 2 per device.

The model is sized to the device (`size_model`): on CPU ranks the tiny Llama of examples/tiny-cpu.yaml
(seq 32); on a GPU the largest rung of a Llama-3 ladder (0.4B, 1.2B, 3.2B, 8.0B parameters, seq 2048) whose
predicted peak for every run is at most 45 % of the device's memory and whose predicted run time (warm-up +
timed steps of every run, published constants) is at most a third of the budget. The fitted file records it.

The runs themselves and what they measure (the launch, the peak on CUDA and on CPU) are calibrate_runs'
job; this module sizes, fits and writes. Runs that fail, OOM or would start after the deadline are recorded
and not fitted. Imports neither Ray nor Optuna; torch is imported by the runs.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem import quantities as q
from stratagem.errors import StratagemError
from stratagem.evaluators.analytic import evaluate_many
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.calibration_file import (
    CalibrationFile,
    CalibrationProvenance,
    CalibrationRunRecord,
    check_calibration_output,
    runs_dir,
    write_calibration,
)
from stratagem.evaluators.fit_hardware import COMPUTE_FIELDS, HardwareFit, HardwareRun, fit_hardware
from stratagem.evaluators.speed import kernel_efficiency
from stratagem.launch.harness.support import unsupported
from stratagem.launch.runners.calibrate_runs import Runner, device_facts, local_runner
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan, format_plan, parse_plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import KernelPath
from stratagem.spaces.training import TrainingSpec

__all__ = ["LADDER", "TINY", "SizedModel", "CalibrationOutcome", "size_model", "calibration_plans",
           "node_scenario", "run_calibration", "run_table",
           "check_options", "check_gpus", "node_devices", "HARNESS_KERNELS", "measured_path_base"]

HARNESS_KERNELS: KernelPath = "eager"
"""The kernel path the harness runs (launch/harness: eager torch.nn ops, no torch.compile): the calibration's compute
efficiencies are this path's, measured (Calibration.kernel_path)."""

MEMORY_SHARE = 0.45
"""A sized model's predicted peak stays under this share of device memory (the published constants can be
off by tens of percent on new hardware; a run that OOMs calibrates nothing)."""
TIME_SHARE = 1 / 3
"""A sized model's predicted run time stays under this share of the budget (model build, launches and the fit
take the rest)."""

TINY = ModelSpec(name="tiny-cpu", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                 ffn_hidden_size=128, vocab_size=256)
# Llama-3 shapes (Meta's published configs): 3.2-1B and 3.2-3B (tied embeddings), 3-8B; the first rung is 3.2-1B
# at half width and depth.
LADDER: tuple[ModelSpec, ...] = (
    ModelSpec(name="llama3-0.4b", num_layers=8, hidden_size=1024, num_attention_heads=16, num_kv_heads=8,
              ffn_hidden_size=4096, vocab_size=128256, tied_embeddings=True),
    ModelSpec(name="llama3.2-1b", num_layers=16, hidden_size=2048, num_attention_heads=32, num_kv_heads=8,
              ffn_hidden_size=8192, vocab_size=128256, tied_embeddings=True),
    ModelSpec(name="llama3.2-3b", num_layers=28, hidden_size=3072, num_attention_heads=24, num_kv_heads=8,
              ffn_hidden_size=8192, vocab_size=128256, tied_embeddings=True),
    ModelSpec(name="llama3-8b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_kv_heads=8,
              ffn_hidden_size=14336, vocab_size=128256),
)
DEVICE_PLANS: tuple[str, ...] = (
    "precision=bf16,mbs=1", "precision=bf16,mbs=2", "precision=bf16,mbs=4",
    "precision=bf16,mbs=2,ac=selective", "precision=bf16,mbs=2,ac=full",
    "precision=fp32,mbs=1", "precision=fp32,mbs=2,ac=full",
)
DEVICE_BATCH = 4
NODE_BATCH_PER_DEVICE = 2


@dataclass(frozen=True)
class SizedModel:
    """The calibration model and the two scenarios it runs in."""

    device: Scenario
    """One device, global batch DEVICE_BATCH."""
    node: Scenario | None
    """`gpus` devices on one node, global batch NODE_BATCH_PER_DEVICE * gpus (None for one device)."""
    sizing: str
    """How the model was chosen, one line."""


def node_scenario(base: Scenario, model: ModelSpec, world: int, seq_len: int, batch: int) -> Scenario:
    """`base`'s GPU, links and stack on one node of `world` devices, training `model` on `batch` sequences."""
    cluster = base.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": world, "calibration": None})
    # the harness's kernel path: eager PyTorch (launch/harness has no torch.compile); the fit measures it
    training = TrainingSpec(seq_len=seq_len, global_batch_size=batch, optimizer="adamw", stack="torch",
                            kernels=HARNESS_KERNELS)
    return base.model_copy(update={"model": model, "cluster": cluster, "training": training, "plan": None,
                                   "search": None})


def calibration_plans(sized: SizedModel) -> list[tuple[Scenario, Plan]]:
    """The run set: single-device plans, then node plans the node's scenario and the harness accept."""
    runs = [(sized.device, parse_plan(t)) for t in DEVICE_PLANS]
    if sized.node is not None:
        n = sized.node.cluster.num_gpus
        texts = [f"dp={n}", f"dp={n},zero=1", f"dp={n},zero=3", f"tp={n}"]
        if n >= 4:
            texts.append(f"dp={n // 2},tp=2")
        device_type = "cpu" if sized.node.cluster.gpu.kind == "cpu" else "cuda"
        for t in texts:
            plan = parse_plan(t)
            if unsupported(sized.node, plan, device_type) is None:
                runs.append((sized.node, plan))
    return runs


def _scenarios(base: Scenario, model: ModelSpec, gpus: int, seq_len: int) -> SizedModel:
    device = node_scenario(base, model, 1, seq_len, DEVICE_BATCH)
    node = node_scenario(base, model, gpus, seq_len, NODE_BATCH_PER_DEVICE * gpus) if gpus > 1 else None
    return SizedModel(device, node, "")


def _predicted(sized: SizedModel, steps: int, warmup: int) -> tuple[float, float]:
    """(worst predicted peak GiB, predicted seconds of all runs) with the published constants."""
    worst, seconds = 0.0, 0.0
    by_scenario: dict[int, tuple[Scenario, list[Plan]]] = {}
    for scn, plan in calibration_plans(sized):
        by_scenario.setdefault(id(scn), (scn, []))[1].append(plan)
    for scn, plans in by_scenario.values():
        cols = evaluate_many(scn, plans, Calibration())
        worst = max(worst, float(cols.peak_gib.max()))
        seconds += float(cols.step_s.sum()) * (steps + warmup)
    return worst, seconds


def size_model(base: Scenario, gpus: int, budget_s: float, steps: int, warmup: int) -> SizedModel:
    """The calibration model for `base`'s device (module docstring: the tiny model on CPU, else the largest
    LADDER rung within MEMORY_SHARE of memory and TIME_SHARE of the budget)."""
    gpu = base.cluster.gpu
    if gpu.kind == "cpu":
        sized = _scenarios(base, TINY, gpus, 32)
        return SizedModel(sized.device, sized.node, "cpu ranks: the tiny Llama (4 layers, hidden 64), seq 32")
    checked = []
    for model in reversed(LADDER):
        sized = _scenarios(base, model, gpus, 2048)
        peak, seconds = _predicted(sized, steps, warmup)
        checked.append(f"{model.name} {q.memory(peak)} / {q.duration(seconds)}")
        if peak <= MEMORY_SHARE * gpu.hbm_gib and seconds <= TIME_SHARE * budget_s:
            why = (f"{gpu.name}: largest Llama-3 rung with predicted peak <= {q.percent(MEMORY_SHARE)} of "
                   f"{q.memory(gpu.hbm_gib)} and predicted runs <= {q.percent(TIME_SHARE)} of {q.duration(budget_s)} "
                   f"({'; '.join(checked)}), seq 2048")
            return SizedModel(sized.device, sized.node, why)
    sized = _scenarios(base, LADDER[0], gpus, 2048)
    return SizedModel(sized.device, sized.node, f"{gpu.name}: no rung within the limits ({'; '.join(checked)}); "
                      f"the smallest, seq 2048")


# ---- the whole calibration -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CalibrationOutcome:
    """The runs, the fit, the file written and the table printed."""

    runs: tuple[HardwareRun, ...]
    fit: HardwareFit
    file: CalibrationFile
    path: Path | None
    table: str


def _revision() -> str:
    import stratagem

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
        rev = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{stratagem.__version__}" + (f" ({rev})" if rev else "")


def _err(pred: float | None, meas: float | None) -> str:
    """The prediction's signed relative error as a percentage (stratagem.quantities), '-' without a pair."""
    if not (pred and meas):
        return "-"
    x = pred / meas - 1
    return ("+" if x > 0 else "") + q.percent(x)


def run_table(records: Sequence[CalibrationRunRecord]) -> str:
    """Predicted vs measured step time and peak of every run, before and after the fit: one duration unit for
    the step columns and one memory unit for the peak columns (stratagem.quantities, by the largest figure)."""
    steps = [v for r in records for v in (r.measured_step_s, r.predicted_step_s_before, r.predicted_step_s_after)]
    peaks = [v for r in records for v in (r.measured_peak_gib, r.predicted_peak_gib_before, r.predicted_peak_gib_after)]
    t_unit, m_unit = q.duration_unit(*steps), q.memory_unit(*peaks)
    head = (f"{'plan':26} {'n':>2} {'status':8} {'step ' + t_unit[0]:>9} {'before':>9} {'err':>10} {'after':>9} "
            f"{'err':>10} {'peak ' + m_unit[0]:>9} {'before':>9} {'err':>10} {'after':>9} {'err':>10}")
    lines = [head, "-" * len(head)]

    def step(v: float | None) -> str:
        return f"{q.duration_in(v, t_unit, with_unit=False) if v is not None else '-':>9}"

    def peak(v: float | None) -> str:
        return f"{q.memory_in(v, m_unit) if v is not None else '-':>9}"

    for r in records:
        lines.append(
            f"{parse_plan(r.plan).short()[:26]:26} {r.world_size:>2} {r.status:8} {step(r.measured_step_s)} "
            f"{step(r.predicted_step_s_before)} {_err(r.predicted_step_s_before, r.measured_step_s):>10} "
            f"{step(r.predicted_step_s_after)} {_err(r.predicted_step_s_after, r.measured_step_s):>10} "
            f"{peak(r.measured_peak_gib)} {peak(r.predicted_peak_gib_before)} "
            f"{_err(r.predicted_peak_gib_before, r.measured_peak_gib):>10} {peak(r.predicted_peak_gib_after)} "
            f"{_err(r.predicted_peak_gib_after, r.measured_peak_gib):>10}")
    return "\n".join(lines)


def _label(plan: Plan) -> str:
    return plan.short().replace(" ", "_").replace("/", "-")


def _records(runs: Sequence[HardwareRun], fit: HardwareFit, files: dict[int, str]) -> list[CalibrationRunRecord]:
    index = {id(r): i for i, r in enumerate(fit.runs)}
    out = []
    for k, r in enumerate(runs):
        i = index.get(id(r))
        fitted: dict[str, Any] = {}
        if i is not None:
            fitted = {"measured_step_s": r.step_s, "measured_peak_gib": r.peak_gib,
                      "predicted_step_s_before": fit.step_before[i], "predicted_step_s_after": fit.step_after[i],
                      "predicted_peak_gib_before": fit.peak_before[i], "predicted_peak_gib_after": fit.peak_after[i]}
        out.append(CalibrationRunRecord(plan=format_plan(r.plan), world_size=r.plan.world_size,
                                        global_batch_size=r.scenario.training.global_batch_size, status=r.status,
                                        reason=r.reason, result_file=files.get(k), **fitted))
    return out


def measured_path_base(device: Scenario, base: Calibration) -> Calibration:
    """`base` restated on the harness's kernel path (Calibration.kernel_path = HARNESS_KERNELS): its efficiencies
    times that path's factor under `base` (evaluators.speed.kernel_efficiency), so it predicts every run as before
    and the fit's matmul / attention efficiencies are the measured path's own."""
    if base.kernel_path == HARNESS_KERNELS:
        return base
    f = kernel_efficiency(device, base)
    return base.model_copy(update={"kernel_path": HARNESS_KERNELS, "matmul_efficiency": base.matmul_efficiency * f,
                                   "attention_efficiency": base.attention_efficiency * f})


def check_options(gpus: int, budget_s: float, steps: int, warmup: int) -> None:
    """Every option of a calibration, checked before the first run (one line each)."""
    if gpus < 1:
        raise StratagemError(f"--gpus ({gpus}): must be at least 1")
    if not math.isfinite(budget_s) or budget_s <= 0:
        raise StratagemError(f"--budget-minutes ({budget_s / 60:g}): must be a positive number of minutes")
    if steps < 1 or warmup < 0:
        raise StratagemError(f"--steps ({steps}) must be >= 1 and --warmup ({warmup}) >= 0")


def _check_fit(runs: Sequence[HardwareRun]) -> None:
    """The fit needs at least as many ok single-device runs as compute constants it fits (fit_hardware.py
    COMPUTE_FIELDS: fewer leave them undetermined); else nothing is written."""
    single = [r for r in runs if r.plan.world_size == 1]
    ok = sum(r.ok for r in single)
    if ok < len(COMPUTE_FIELDS):
        why = next((f"{format_plan(r.plan)}: {r.status}" + (f" ({r.reason})" if r.reason else "")
                    for r in single if not r.ok), "no run")
        raise StratagemError(f"calibrate: {ok} of {len(single)} single-device runs succeeded; the fit needs "
                             f"{len(COMPUTE_FIELDS)} (first failure: {why[:300]}); nothing written, the previous "
                             "calibration is unchanged")


def _run_files(runs: Sequence[HardwareRun], out: Path) -> tuple[dict[str, str], dict[int, str]]:
    """Run JSONs (name -> text, marked "format": "stratagem-calibration-run/1") and, per run, its path
    relative to the calibration file."""
    texts: dict[str, str] = {}
    files: dict[int, str] = {}
    for k, r in enumerate(runs):
        name = f"{k:02d}-{_label(r.plan)}.json"
        texts[name] = json.dumps({
            "format": "stratagem-calibration-run/1", "plan": format_plan(r.plan), "world_size": r.plan.world_size,
            "status": r.status, "reason": r.reason, "scenario": r.scenario.model_dump(mode="json"),
            "measured_step_s": r.step_s, "measured_peak_gib": r.peak_gib, "result": r.result}, indent=1)
        files[k] = f"{runs_dir(out).name}/{name}"
    return texts, files


def run_calibration(scenario: Scenario, gpus: int, budget_s: float, out: str | Path | None = None,
                    steps: int = 5, warmup: int = 2, runner: Runner | None = None,
                    facts: dict[str, str] | None = None, base: Calibration | None = None,
                    log: Callable[[str], None] | None = None, command: str | None = None,
                    force: bool = False) -> CalibrationOutcome:
    """Size the model, run the set (single-device runs first), fit, write `out` (and `<out stem>-runs/*.json`).
    Options and the output are checked before the first run; the file is written (all or nothing,
    `write_calibration`) only when the runs the fit needs succeeded."""
    check_options(gpus, budget_s, steps, warmup)
    path = Path(out) if out is not None else None
    if path is not None:
        check_calibration_output(path, force)
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.time()
    sized = size_model(scenario, gpus, budget_s, steps, warmup)
    say(f"calibrate: {sized.sizing}")
    runner = runner or local_runner()
    deadline = t0 + budget_s
    runs: list[HardwareRun] = []
    groups: dict[int, tuple[Scenario, list[Plan]]] = {}
    for scn, plan in calibration_plans(sized):
        groups.setdefault(id(scn), (scn, []))[1].append(plan)
    for scn, plans in groups.values():
        say(f"calibrate: {len(plans)} run(s) on {plans[0].world_size} device(s) ...")
        done = runner(scn, plans, steps, warmup, deadline)
        for r in done:
            say(f"  {r.status:10} {format_plan(r.plan)}" + (f": {r.reason}" if r.reason else ""))
        runs.extend(done)
    _check_fit(runs)
    fit = fit_hardware(runs, measured_path_base(sized.device, base or Calibration()))
    texts, files = _run_files(runs, path) if path is not None else ({}, {})
    facts = facts or device_facts()
    model = sized.device.model
    memory = facts.get("gpu_memory_gib")
    prov = CalibrationProvenance(
        gpu_name=facts["gpu_name"], gpu_preset=scenario.cluster.gpu.name, gpus=gpus, driver=facts["driver"],
        gpu_memory_gib=float(memory) if memory else scenario.cluster.gpu.hbm_gib,
        torch=facts["torch"], cuda=facts["cuda"], python=facts["python"], stratagem=_revision(),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=f"{model.name} ({q.count(model.num_params())} parameters)", sizing=sized.sizing,
        seq_len=sized.device.training.seq_len, steps=steps, warmup=warmup,
        command=command or " ".join(shlex.quote(a) for a in sys.argv))
    records = _records(runs, fit, files)
    cf = CalibrationFile(calibration=fit.calibration, provenance=prov, errors=fit.errors(), runs=records)
    if path is not None:
        write_calibration(path, cf, texts, force)
    return CalibrationOutcome(runs=tuple(runs), fit=fit, file=cf, path=path, table=run_table(records))


def node_devices(scenario: Scenario) -> int:
    """The most devices one calibration can run on this node: its CUDA devices, or for CPU ranks the scenario's
    gpus_per_node capped by this machine's cores (each gloo rank needs a core; more only queue)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(scenario.cluster.gpus_per_node, os.cpu_count() or 1))


def check_gpus(gpus: int, scenario: Scenario) -> None:
    """--gpus fits this node (`node_devices`): a calibration measures one node, and ranks beyond its devices
    would only share them (the node runs' work grows with their number)."""
    most = node_devices(scenario)
    if gpus > most:
        raise StratagemError(f"--gpus ({gpus}): this node has {most} device(s) for the runs (CUDA devices, or "
                             "CPU cores capped by the scenario's gpus_per_node); give at most that")


def default_gpus(scenario: Scenario) -> int:
    """Devices on this node: CUDA devices, or for CPU ranks min(2, the scenario's gpus_per_node)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(1, min(2, scenario.cluster.gpus_per_node, os.cpu_count() or 1))
