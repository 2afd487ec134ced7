"""The calibration file `stratagem calibrate` writes and every command reads (`cluster.calibration:` in a
scenario, or `--calibration`): the fitted constants with their provenance and the runs behind them.

    format: stratagem-calibration/1
    calibration: {matmul_efficiency: ..., ...}     # a Calibration; fields not given keep the defaults
    provenance: {gpu_name, driver, torch, cuda, date, ...}
    errors: {step_error_before, step_error_after, peak_error_before, peak_error_after}
    runs: [{plan, world_size, status, measured_step_s, predicted_step_s_before, ...}]

A search with real runs writes one too (`study_calibration_file`): the study's calibration in force (its refitted
constants and the per-term multipliers its runs taught, Calibration.time_multipliers / memory_multipliers) with
the runs behind it, so a rerun or `explain --calibration` predicts with what the runs taught.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import stratagem
from stratagem.errors import StratagemError
from stratagem.evaluators.analytic import evaluate
from stratagem.evaluators.calibration import Calibration, default_label
from stratagem.evaluators.evaluation import Evaluation
from stratagem.evaluators.step_parts import TIME_TERMS
from stratagem.files import check_dir, check_owned, disk_error, is_ours, read_yaml, stamp
from stratagem.spaces.plan import format_plan
from stratagem.spaces.scenario import Scenario

__all__ = ["FORMAT", "CalibrationRunRecord", "CalibrationProvenance", "CalibrationFile", "load_calibration",
           "write_calibration", "resolve_calibration", "DEFAULT_LABEL", "runs_dir", "check_calibration_output",
           "check_device", "study_calibration_file"]

FORMAT = "stratagem-calibration/1"
CALIBRATION_MAX_BYTES = 1 << 20
"""Largest calibration file read: one with a dozen runs is about 10 KB."""
DEFAULT_LABEL = "published defaults (fitted on bench/reference, H100)"
_FROZEN = ConfigDict(frozen=True, extra="forbid")


class CalibrationRunRecord(BaseModel):
    """One calibration run: what it measured and what the model predicted before and after the fit."""

    model_config = _FROZEN

    plan: str
    """The plan, as `format_plan` writes it."""
    world_size: int = Field(ge=1)
    """Devices the run used (one node)."""
    global_batch_size: int = Field(ge=1)
    """Sequences per optimizer step in this run."""
    status: str
    """ok | oom | failed | infeasible | skipped."""
    reason: str = ""
    """Why a run that is not ok did not count."""
    measured_step_s: float | None = None
    """Median measured step time, s."""
    measured_peak_gib: float | None = None
    """Measured peak memory of the worst rank, GiB (CUDA: reserved + context; CPU: tracked live tensors)."""
    predicted_step_s_before: float | None = None
    """Predicted step time with the starting calibration, s."""
    predicted_step_s_after: float | None = None
    """Predicted step time with the fitted calibration, s."""
    predicted_peak_gib_before: float | None = None
    """Predicted peak with the starting calibration, GiB."""
    predicted_peak_gib_after: float | None = None
    """Predicted peak with the fitted calibration, GiB."""
    result_file: str | None = None
    """The run's JSON (harness result) relative to the calibration file, when written."""


class CalibrationProvenance(BaseModel):
    """Where and how the constants were measured."""

    model_config = _FROZEN

    gpu_name: str
    """Device name as the driver reports it ("cpu" for CPU ranks)."""
    gpu_preset: str
    """The GPU preset the predictions used (datasheet peaks and links)."""
    gpu_memory_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Memory of the device fitted on, GiB (CUDA: the device's total memory; CPU ranks: the preset's hbm_gib);
    None in files written before it was recorded."""
    gpus: int = Field(ge=1)
    """Devices used for the node runs."""
    driver: str
    """NVIDIA/ROCm driver version, or "none"."""
    torch: str
    """torch version."""
    cuda: str
    """CUDA (or HIP) version torch was built with, or "none"."""
    python: str
    """Python version."""
    stratagem: str
    """stratagem version and git revision."""
    date: str
    """When the runs finished, ISO 8601 UTC."""
    model: str
    """The calibration model: name and parameter count."""
    sizing: str
    """How the model was sized to the device."""
    seq_len: int = Field(ge=1)
    """Sequence length of every run."""
    steps: int = Field(ge=1)
    """Timed steps per run."""
    warmup: int = Field(ge=0)
    """Untimed warm-up steps per run."""
    command: str
    """The command that produced the file."""


class CalibrationFile(BaseModel):
    """A calibration file: constants, provenance, the fit's errors and the runs."""

    model_config = _FROZEN

    format: Literal["stratagem-calibration/1"] = "stratagem-calibration/1"
    """File format and version."""
    calibration: Calibration
    """The fitted constants (fields the runs cannot inform keep the published defaults)."""
    provenance: CalibrationProvenance
    """Where and how they were measured."""
    errors: dict[str, float] = Field(default_factory=dict)
    """Median |predicted / measured - 1| of step time and peak memory before and after the fit."""
    runs: list[CalibrationRunRecord] = Field(default_factory=list)
    """Every run, fitted or not."""

    def label(self, path: str | Path | None = None) -> str:
        """One line naming this calibration: file, device, torch, date, runs."""
        p = self.provenance
        ok = sum(r.status == "ok" for r in self.runs)
        where = f"{path} " if path is not None else ""
        return f"{where}({p.gpu_name} x{p.gpus}, torch {p.torch}, {p.date[:10]}, {ok} runs)"


def load_calibration(path: str | Path) -> CalibrationFile:
    """Read a calibration file (bounded: stratagem.files.read_yaml); errors are one line naming the file and the
    field."""
    p = Path(path)
    data = read_yaml(p, "calibration", CALIBRATION_MAX_BYTES, hint="write one with `stratagem calibrate`")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StratagemError(f"calibration ({p}): format is not {FORMAT}; write it with `stratagem calibrate`")
    try:
        cf = CalibrationFile(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"calibration ({p}): {loc}: {err['msg']}") from None
    tm = cf.calibration.time_multipliers
    unknown = [n for n in tm.names if n not in TIME_TERMS] if tm is not None else []
    if unknown:
        raise StratagemError(f"calibration ({p}): calibration.time_multipliers.names: {unknown} are not step-time "
                             f"terms ({', '.join(TIME_TERMS)}); remove them")
    return cf


def runs_dir(path: str | Path) -> Path:
    """The directory of a calibration file's run JSONs: `<stem>-runs/` beside it."""
    p = Path(path)
    return p.with_name(p.stem + "-runs")


def check_calibration_output(path: str | Path, force: bool = False, option: str = "-o") -> Path:
    """Refuse now (before any run) an output the calibration could not write or must not replace: the file
    (stratagem.files.check_owned) and its runs directory (a real directory whose files stratagem wrote; never a
    link; anything else unless `force`)."""
    p = check_owned(path, force, option)
    d = runs_dir(p)
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        raise StratagemError(f"{option} ({p}): {d} exists and is not a directory stratagem made; choose another "
                             "output name")
    if d.is_dir() and not force:
        foreign = [e.name for e in d.iterdir() if not is_ours(e)]
        if foreign:
            raise StratagemError(f"{option} ({p}): {d} holds {len(foreign)} file(s) stratagem did not write (e.g. "
                                 f"{foreign[0]}); choose another output name, or pass --force")
    if d.is_dir():
        check_dir(d, p, option)
    return p


def write_calibration(path: str | Path, cf: CalibrationFile, runs: dict[str, str] | None = None,
                      force: bool = False) -> Path:
    """Write `cf` as YAML and its run JSONs (name -> text) into `runs_dir(path)`, all or nothing: every file is
    staged under a temporary name first and renamed into place only when all were written (the calibration
    file last), so a failure (disk full) leaves the previous calibration byte-identical. Run files of an earlier
    calibration that this one does not rewrite are removed when stratagem wrote them."""
    p = check_calibration_output(path, force)
    d = runs_dir(p)
    staged: list[tuple[str, Path]] = []
    made = False
    try:
        if runs:
            if not d.exists():
                d.mkdir()
                made = True
            for name, text in runs.items():
                fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{name}.", suffix=".tmp")
                staged.append((tmp, d / name))
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(stamp(text, "json"))  # with its digest (stratagem.files): ours while unchanged
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        staged.append((tmp, p))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(stamp(yaml.safe_dump(cf.model_dump(mode="json"), sort_keys=False, width=120), "hash"))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        if made:
            shutil.rmtree(d, ignore_errors=True)
        raise StratagemError(f"-o ({p}): cannot write: {disk_error(e)}; the previous calibration is unchanged") \
            from None
    for tmp, dest in staged:
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    if d.is_dir():
        for old in d.iterdir():
            if old.name not in (runs or {}) and is_ours(old):
                old.unlink()
    return p


def check_device(scenario: Scenario, cf: CalibrationFile, source: str | Path) -> str | None:
    """None when `cf` was fitted on the scenario's GPU preset; a warning line when it was not and the scenario
    says `cluster.calibration_device_mismatch: allow`; else StratagemError naming both devices."""
    fitted, used = cf.provenance.gpu_preset, scenario.cluster.gpu.name
    if fitted == used:
        return None
    memory = f", {cf.provenance.gpu_memory_gib:g} GiB" if cf.provenance.gpu_memory_gib else ""
    what = (f"calibration ({source}) was fitted on {fitted} ({cf.provenance.gpu_name}{memory}), the scenario "
            f"runs on {used} ({scenario.cluster.gpu.hbm_gib:g} GiB)")
    if scenario.cluster.calibration_device_mismatch == "allow":
        return f"{what}; used anyway (cluster.calibration_device_mismatch: allow): its constants may not hold"
    raise StratagemError(f"{what}: calibrate on {used}, drop the calibration, or set "
                         "cluster.calibration_device_mismatch: allow")


def resolve_calibration(scenario: Scenario, override: str | Path | None = None,
                        warn: Callable[[str], None] | None = None) -> tuple[Calibration | None, str]:
    """The calibration a command uses and its label: `override` (--calibration) over the scenario's
    `cluster.calibration` over the published defaults (None, DEFAULT_LABEL). A file fitted on another GPU
    preset is refused unless the scenario allows it (`check_device`; the warning goes to `warn`)."""
    source = override if override is not None else getattr(scenario.cluster, "calibration", None)
    if source is None:
        return None, default_label(scenario.cluster.gpu.name)  # the device's defaults (calibration.py)
    cf = load_calibration(source)
    warning = check_device(scenario, cf, source)
    if warning and warn is not None:
        warn(warning)
    return cf.calibration, cf.label(source)


def _run_record(ev: Evaluation, gbs: int, cal_step: float | None, cal_peak: float | None) -> CalibrationRunRecord:
    """One measured run of a study as a calibration run: measured figures, its prediction when run (before) and
    with the study's calibration (after)."""
    m, before = ev.measurements or {}, ev.prediction
    return CalibrationRunRecord(
        plan=format_plan(ev.plan), world_size=ev.plan.world_size, global_batch_size=gbs,
        status=ev.status, reason=ev.reason.splitlines()[0] if ev.reason else "",
        measured_step_s=float(m["step_s"]) if ev.status == "ok" and "step_s" in m else None,
        measured_peak_gib=ev.memory.peak_gib if ev.status == "ok" and ev.memory is not None else None,
        predicted_step_s_before=before.time.step_s if before is not None and before.time is not None else None,
        predicted_peak_gib_before=before.memory.peak_gib if before is not None and before.memory is not None else None,
        predicted_step_s_after=cal_step, predicted_peak_gib_after=cal_peak)


def study_calibration_file(scenario: Scenario, calibration: Calibration, measured: list[Evaluation], study: str,
                           errors: dict[str, float] | None = None) -> CalibrationFile:
    """The calibration file of a search's study: `calibration` (the study's in force after its runs) with the
    measured runs behind it, the versions the runs recorded, and the command that made them."""
    prov = next((e.provenance for e in reversed(measured) if e.provenance and e.provenance.get("torch")), None) or {}
    model, tr = scenario.model, scenario.training
    after = [evaluate(scenario, e.plan, calibration) for e in measured]
    records = [_run_record(e, tr.global_batch_size, a.time.step_s if a.time else None, a.memory.peak_gib if a.memory else None)
               for e, a in zip(measured, after, strict=True)]
    provenance = CalibrationProvenance(
        gpu_name=scenario.cluster.gpu.name, gpu_preset=scenario.cluster.gpu.name,
        gpu_memory_gib=scenario.cluster.gpu.hbm_gib, gpus=scenario.cluster.num_gpus,
        driver=str(prov.get("driver") or "unknown"), torch=str(prov.get("torch") or "unknown"),
        cuda=str(prov.get("cuda") or "none"), python=str(prov.get("python") or "unknown"),
        stratagem=str(prov.get("stratagem_version") or stratagem.__version__),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        model=f"{model.name} ({model.num_params():,} parameters)", sizing=f"the scenario's model (study {study})",
        seq_len=tr.seq_len, steps=int((measured[-1].measurements or {}).get("steps") or 1) if measured else 1,
        warmup=int((measured[-1].measurements or {}).get("warmup") or 0) if measured else 0,
        command=str(prov.get("command") or f"stratagem search (study {study})"))
    return CalibrationFile(calibration=calibration, provenance=provenance, errors=errors or {}, runs=records)
