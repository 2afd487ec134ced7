"""The calibration file `stratagem calibrate` writes and every command reads (`cluster.calibration:` in a
scenario, or `--calibration`): the fitted constants with their provenance and the runs behind them.

    format: stratagem-calibration/1
    calibration: {matmul_efficiency: ..., ...}     # a Calibration; fields not given keep the defaults
    provenance: {gpu_name, driver, torch, cuda, date, ...}
    errors: {step_error_before, step_error_after, peak_error_before, peak_error_after}
    runs: [{plan, world_size, status, measured_step_s, predicted_step_s_before, ...}]
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stratagem.errors import StratagemError
from stratagem.evaluators.calibration import Calibration, default_label
from stratagem.spaces.scenario import Scenario

__all__ = ["FORMAT", "CalibrationRunRecord", "CalibrationProvenance", "CalibrationFile", "load_calibration",
           "write_calibration", "resolve_calibration", "DEFAULT_LABEL"]

FORMAT = "stratagem-calibration/1"
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
    """Read a calibration file; errors are one line naming the file and the field."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise StratagemError(f"calibration ({p}): file not found; write one with `stratagem calibrate`") from None
    except IsADirectoryError:
        raise StratagemError(f"calibration ({p}): is a directory; give the YAML file") from None
    except yaml.YAMLError:
        raise StratagemError(f"calibration ({p}): not valid YAML") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise StratagemError(f"calibration ({p}): format is not {FORMAT}; write it with `stratagem calibrate`")
    try:
        return CalibrationFile(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"calibration ({p}): {loc}: {err['msg']}") from None


def write_calibration(path: str | Path, cf: CalibrationFile) -> Path:
    """Write `cf` as YAML (atomically: a temporary file renamed into place)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(cf.model_dump(mode="json"), sort_keys=False, width=120))
    tmp.replace(p)
    return p


def resolve_calibration(scenario: Scenario, override: str | Path | None = None) -> tuple[Calibration | None, str]:
    """The calibration a command uses and its label: `override` (--calibration) over the scenario's
    `cluster.calibration` over the published defaults (None, DEFAULT_LABEL)."""
    source = override if override is not None else getattr(scenario.cluster, "calibration", None)
    if source is None:
        return None, default_label(scenario.cluster.gpu.name)  # the device's defaults (calibration.py)
    cf = load_calibration(source)
    return cf.calibration, cf.label(source)
