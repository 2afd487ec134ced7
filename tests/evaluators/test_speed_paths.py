"""Kernel path as a setting fitted by `stratagem calibrate` (issue 24 item 7): a calibration records the path its
efficiencies were measured on (Calibration.kernel_path); plans on that path run at the measured efficiency (x1),
other paths and stacks scale by the stack records' ratios (evaluators.speed)."""

from __future__ import annotations

import pytest

from stratagem.evaluators import Calibration, evaluate_many
from stratagem.evaluators.speed import kernel_efficiency, path_efficiency
from stratagem.evaluators.timing import speed_rows
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset
from stratagem.spaces.stacks import stack_record
from stratagem.spaces.training import TrainingSpec

TORCH = stack_record("torch")


def _scn(stack: str = "torch", kernels: str | None = None) -> Scenario:
    return Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8),
                    training=TrainingSpec(seq_len=4096, global_batch_size=64, stack=stack,  # type: ignore[arg-type]
                                          kernels=kernels))  # type: ignore[arg-type]


def test_measured_path_runs_at_its_measured_efficiency() -> None:
    eager_cal = Calibration(kernel_path="eager", matmul_efficiency=0.4)
    assert kernel_efficiency(_scn(kernels="eager"), eager_cal) == 1.0
    assert kernel_efficiency(_scn(kernels="compiled"), eager_cal) == pytest.approx(TORCH.compile_gain)
    assert kernel_efficiency(_scn("megatron"), eager_cal) == pytest.approx(1.0 / TORCH.kernel_efficiency)
    # published constants (no measured path): relative to the fused reference, as before
    assert kernel_efficiency(_scn(kernels="eager"), Calibration()) == pytest.approx(TORCH.kernel_efficiency)
    assert path_efficiency(TORCH, "compiled") == pytest.approx(TORCH.kernel_efficiency * TORCH.compile_gain)


def test_restating_the_constants_on_a_path_changes_no_prediction() -> None:
    """Published constants restated on the eager path (efficiencies x the eager factor) predict every path and
    stack the same: the kernel path moves what is measured, not the model."""
    pub = Calibration()
    f = path_efficiency(TORCH, "eager")
    eager = pub.model_copy(update={"kernel_path": "eager", "matmul_efficiency": pub.matmul_efficiency * f,
                                   "attention_efficiency": pub.attention_efficiency * f})
    plans = [Plan(dp=8, zero_stage=3, micro_batch_size=1), Plan(dp=4, tp=2, micro_batch_size=2)]
    for scn in (_scn(kernels="eager"), _scn(kernels="compiled"), _scn("megatron"), _scn("nanotron")):
        a, b = evaluate_many(scn, plans, pub), evaluate_many(scn, plans, eager)
        assert list(b.step_s) == pytest.approx(list(a.step_s), rel=1e-9)


def test_explain_says_the_path_was_measured() -> None:
    rows = {name: source for name, _, source in speed_rows(_scn(kernels="compiled"), Plan(dp=8),
                                                          Calibration(kernel_path="eager"))}
    assert "measured on this node on the eager path" in rows["kernels"]
    rows = {name: source for name, _, source in speed_rows(_scn(kernels="compiled"), Plan(dp=8), Calibration())}
    assert "measured on this node" not in rows["kernels"]
