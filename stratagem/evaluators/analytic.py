"""The analytic evaluator: formulas only, no torch, no ray.

`evaluate_many` computes every figure as numpy columns (screening); `evaluate` is the same computation on
one plan, wrapped in an `Evaluation`, so both agree exactly. Memory: evaluators.memory; step time:
evaluators.timing (+ comm); checkpoint risk: evaluators.checkpoint; zones: evaluators.zones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import DEFAULT_CALIBRATION, Calibration, default_calibration
from stratagem.evaluators.checkpoint import CHECKPOINT_KEYS, checkpoint_columns
from stratagem.evaluators.evaluation import (
    BLOCKS,
    CheckpointRisk,
    Evaluation,
    Fidelity,
    MemoryBreakdown,
    Status,
    Throughput,
    TimeBreakdown,
)
from stratagem.evaluators.figures import PlanFigures
from stratagem.evaluators.memory import memory_columns
from stratagem.evaluators.stages import trained_scenario
from stratagem.evaluators.timing import time_columns
from stratagem.evaluators.zones import build_zones, zone_columns
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import Plan
from stratagem.spaces.rules import violations
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["evaluate", "evaluate_many", "AnalyticEvaluator"]

Array = NDArray[np.float64]


def evaluate_many(
    scenario: Scenario, plans: Sequence[Plan] | PlanColumns, calibration: Calibration | None = None,
) -> PlanFigures:
    """Figures for many valid plans at once: a PlanFigures, one named array per figure (memory blocks, peak,
    headroom; step time by part; tokens/s, MFU, HFU; checkpoint cost and risk; zone values, levels and the
    bottleneck), with named predicates for the codes (`fits`, `broken_block`, `zone_is`, `bottleneck_name`).
    The plans must already satisfy the validity rules (the search space only yields valid plans).
    """
    pc = plans if isinstance(plans, PlanColumns) else PlanColumns.from_plans(plans)
    cal = calibration or default_calibration(scenario.cluster.gpu.name)  # the device's defaults (cpu: its own)
    scenario = trained_scenario(scenario)  # the model the stack's job trains (MTP modules only where built)
    mem = memory_columns(scenario, pc, cal)
    out: dict[str, Array] = {f"{b}_gib": mem[b] / GIB for b in BLOCKS}
    out["peak_gib"] = mem["peak"] / GIB
    out["hbm_gib"] = mem["hbm"] / GIB
    out["headroom_gib"] = out["hbm_gib"] - out["peak_gib"]
    out["worst_stage"] = mem["worst_stage"]
    cumulative = np.cumsum(np.stack([mem[b] for b in BLOCKS]), axis=0)
    over = cumulative > mem["hbm"]
    out["first_block_to_break"] = np.where(over.any(axis=0), over.argmax(axis=0), -1).astype(np.float64)
    out.update(time_columns(scenario, pc, cal))
    tr, gpu = scenario.training, scenario.cluster.gpu
    out["tokens_per_s"] = tr.global_batch_size * tr.seq_len / out["step_s"]
    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / scenario.cluster.num_gpus
    # MFU: model FLOPs (no recompute) over the dense bf16 peak, whatever the plan's precision (fp8's gain shows
    # as higher MFU: torchtitan's convention). HFU: FLOPs executed (recompute included: it runs at the compute
    # rate) over the peak of the dtype the matmuls run in (fp32, bf16 or fp8).
    out["mfu"] = out["model_flops"] * out["tokens_per_s_per_gpu"] / (gpu.peak_tflops("bf16") * 1e12)
    peak_used = np.select([pc.fp32, pc.fp8],
                          [gpu.peak_tflops("fp32"), gpu.peak_tflops("fp8")], gpu.peak_tflops("bf16")) * 1e12
    executed = out["model_flops"] * (1.0 + out["recompute_s"] / np.maximum(out["compute_s"], 1e-30))
    out["hfu"] = executed * out["tokens_per_s_per_gpu"] / peak_used
    out.update(checkpoint_columns(scenario, pc))
    out.update(zone_columns(out))
    return PlanFigures.from_columns(out)


def _memory(cols: PlanFigures, i: int = 0) -> MemoryBreakdown:
    return MemoryBreakdown(
        **{f"{b}_gib": float(cols.block_gib(b)[i]) for b in BLOCKS},
        peak_gib=float(cols.peak_gib[i]),
        hbm_gib=float(cols.hbm_gib[i]),
        headroom_gib=float(cols.headroom_gib[i]),
        first_block_to_break=cols.broken_block(i),
        worst_stage=int(cols.worst_stage[i]),
    )


def evaluate(scenario: Scenario, plan: Plan | None = None, calibration: Calibration | None = None) -> Evaluation:
    """Judge one plan analytically; the scenario's own plan when `plan` is None."""
    plan = plan or scenario.default_plan()
    broken = violations(scenario, plan)
    if broken:
        return Evaluation(plan=plan, status="infeasible", reason="; ".join(broken))
    cols = evaluate_many(scenario, [plan], calibration)
    memory = _memory(cols)
    status: Status = "ok"
    reason = ""
    if memory.first_block_to_break is not None:
        status = "oom"
        reason = (f"peak {memory.peak_gib:.1f} GiB exceeds {memory.hbm_gib:.1f} GiB; "
                  f"{memory.first_block_to_break} is the first block that does not fit")
    time = TimeBreakdown(**{k: float(getattr(cols, k)[0]) for k in TimeBreakdown.model_fields})
    throughput = Throughput(**{k: float(getattr(cols, k)[0]) for k in Throughput.model_fields})
    checkpoint = CheckpointRisk(**{k: float(getattr(cols, k)[0]) for k in CHECKPOINT_KEYS})
    zones = build_zones(scenario, plan, memory, time, checkpoint, cols)
    return Evaluation(plan=plan, status=status, reason=reason, memory=memory, time=time,
                      throughput=throughput, checkpoint=checkpoint, zones=zones)


class AnalyticEvaluator:
    """The analytic model behind the narrow evaluator interface: `evaluate(scenario, plan) -> Evaluation`."""

    fidelity: Fidelity = "analytic"

    def __init__(self, calibration: Calibration | None = None) -> None:
        self.calibration = calibration or DEFAULT_CALIBRATION
        self._given = calibration  # None: each scenario's device defaults (calibration.default_calibration)

    def evaluate(self, scenario: Scenario, plan: Plan) -> Evaluation:
        """The plan's analytic Evaluation with this evaluator's calibration."""
        return evaluate(scenario, plan, self._given)
