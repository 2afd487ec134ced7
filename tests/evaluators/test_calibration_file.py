"""The calibration file keeps what a study's runs taught (the per-term multipliers) and refuses what it cannot use."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stratagem.errors import StratagemError
from stratagem.evaluators.calibration import LogMultipliers, default_calibration
from stratagem.evaluators.calibration_file import load_calibration, study_calibration_file, write_calibration
from stratagem.evaluators.evaluation import BLOCKS, Evaluation
from stratagem.evaluators.step_parts import TIME_TERMS
from stratagem.spaces import Plan, load_scenario

SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


def _posterior(names: tuple[str, ...], moved: str, runs: int) -> LogMultipliers:
    k = len(names)
    return LogMultipliers(names=names, mean=tuple(0.34 if n == moved else 0.0 for n in names),
                          cov=tuple(tuple((0.02 if i == j else 0.003 if abs(i - j) == 1 else 0.0) for j in range(k))
                                    for i in range(k)), noise_sd=0.12, runs=runs, study="s")


def test_the_multipliers_round_trip_through_the_file(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    cal = default_calibration("cpu").model_copy(update={
        "time_multipliers": _posterior(TIME_TERMS, "tp_comm_s", 5),
        "memory_multipliers": _posterior(BLOCKS, "activations", 6)})
    runs = [Evaluation(plan=Plan(dp=4), status="ok", fidelity="measured", measurements={"step_s": 0.4}),
            Evaluation(plan=Plan(dp=2, tp=2, sequence_parallel=True), status="oom", fidelity="measured",
                       reason="peak over the cap\ntraceback")]
    cf = study_calibration_file(scn, cal, runs, "s", {"step_error_before": 0.3, "step_error_after": 0.1})
    path = write_calibration(tmp_path / "calibration.yaml", cf)
    back = load_calibration(path)
    assert back.calibration == cal and back.calibration.time_multipliers == cal.time_multipliers
    assert [r.status for r in back.runs] == ["ok", "oom"] and back.runs[1].reason == "peak over the cap"
    assert back.runs[0].measured_step_s == 0.4 and back.runs[0].predicted_step_s_after is not None
    assert back.provenance.gpu_preset == scn.cluster.gpu.name and back.errors["step_error_after"] == 0.1
    write_calibration(path, back)  # a file stratagem wrote is replaced in place
    assert load_calibration(path) == back


def test_a_file_with_an_unknown_term_is_one_line(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    cal = default_calibration("cpu").model_copy(update={"time_multipliers": _posterior(TIME_TERMS, "tp_comm_s", 5)})
    path = write_calibration(tmp_path / "c.yaml", study_calibration_file(scn, cal, [], "s"))
    data = yaml.safe_load(path.read_text())
    data["calibration"]["time_multipliers"]["names"][0] = "nccl_s"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(StratagemError, match=r"time_multipliers.names: \['nccl_s'\] are not step-time terms"):
        load_calibration(path)
    data["calibration"]["time_multipliers"]["names"][0] = "compute_s"
    data["calibration"]["time_multipliers"]["mean"] = [0.0]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(StratagemError, match="one entry per name"):
        load_calibration(path)
