"""The cpu preset's own default calibration (issue 12 item 13): fitted on measured CPU harness runs, it predicts
them (and the demo's best plan) within a small factor, where the published H100 defaults are 30-70x off."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from stratagem.evaluators import evaluate
from stratagem.evaluators.calibration import DEFAULT_CALIBRATION, default_calibration, default_label
from stratagem.evaluators.calibration_file import resolve_calibration
from stratagem.spaces import parse_plan, scenario_from_dict

DATA = json.loads((Path(__file__).parent / "data" / "cpu_harness_runs.json").read_text())


def _predict(cal: object) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    step, peak, m_step, m_peak = [], [], [], []
    for r in DATA["runs"]:
        scn = scenario_from_dict({**r["scenario"], "plan": None})
        ev = evaluate(scn, parse_plan(r["plan"]), cal)  # type: ignore[arg-type]
        assert ev.time is not None and ev.memory is not None, ev.reason
        step.append(ev.time.step_s)
        peak.append(ev.memory.peak_gib)
        m_step.append(r["step_s"])
        m_peak.append(r["peak_gib"])
    return np.array(step), np.array(peak), np.array(m_step), np.array(m_peak)


def test_cpu_defaults_predict_the_measured_cpu_runs() -> None:
    step, peak, m_step, m_peak = _predict(None)  # None: the scenario's device defaults (cpu)
    ratio = step / m_step
    assert np.median(np.abs(ratio - 1)) < 0.35
    assert np.all((ratio > 1 / 3) & (ratio < 3)), ratio
    assert np.median(np.abs(peak / m_peak - 1)) < 0.15
    # the published H100 constants are more than an order of magnitude off on this device
    h100_step, _, _, _ = _predict(DEFAULT_CALIBRATION)
    assert np.median(h100_step / m_step) > 10


def test_demo_runs_within_2x() -> None:
    """The demo model's measured runs (4 gloo ranks; the data holds the demo search's predicted best plans at the
    time they were measured) with the cpu defaults: 70% within 2x, none beyond 3x (the machine is shared)."""
    demo = [r for r in DATA["runs"] if "demo" in r["source"]]
    assert len(demo) >= 5
    ratios = []
    for r in demo:
        scn = scenario_from_dict({**r["scenario"], "plan": None})
        ev = evaluate(scn, parse_plan(r["plan"]))
        assert ev.time is not None
        ratios.append(ev.time.step_s / r["step_s"])
    within = [0.5 < x < 2.0 for x in ratios]
    assert sum(within) >= 0.7 * len(ratios), ratios  # measured: 5 of 7 (pp2 and dp4 z0 over-predicted 2.4-2.8x)
    assert all(1 / 3 < x < 3 for x in ratios), ratios


def test_defaults_are_per_device_and_labelled() -> None:
    assert default_calibration("h100-sxm-80g") is DEFAULT_CALIBRATION
    assert default_calibration("cpu") is not DEFAULT_CALIBRATION
    scn = scenario_from_dict({**DATA["runs"][0]["scenario"], "plan": None})  # a cpu scenario without a file
    cal, label = resolve_calibration(scn)
    assert cal is None and label == default_label("cpu") and "cpu defaults" in label
