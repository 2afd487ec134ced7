"""The data the HTML page embeds: ParetoInfo (and capacity) as one JSON-able dict the page's script reads.

Plans are stored row-wise as short arrays (field order in the *_FIELDS tuples below, which the script
mirrors); numbers are rounded to 6 significant digits. The page never receives anything it does not show
or compute from.
"""

from __future__ import annotations

import math
from typing import Any

from stratagem.evaluators.evaluation import (
    BLOCKS,
    ZONE_NAMES,
    CheckpointRisk,
    Evaluation,
    MemoryBreakdown,
    Throughput,
    TimeBreakdown,
    Zones,
)
from stratagem.evaluators.step_parts import STEP_PARTS
from stratagem.evaluators.zones import bottleneck_label
from stratagem.reports.advice import MEASURED_ADVICE_TITLE
from stratagem.reports.capacity import CapacityInfo
from stratagem.reports.info import ParetoInfo, PlanResult
from stratagem.spaces.plan import Plan

__all__ = ["report_payload", "capacity_payload", "scenario_summary", "EXPLORER_AXES", "PAYLOAD_VERSION"]

PAYLOAD_VERSION = 1
EXPLORER_AXES: tuple[str, ...] = ("dp", "tp", "pp", "zero_stage", "micro_batch_size", "activation_checkpointing",
                                  "precision")
"""The plan explorer's controls; the other Plan fields distinguish variants of one combination."""
MEMORY_FIELDS = (*[f"{b}_gib" for b in BLOCKS], "peak_gib", "hbm_gib", "headroom_gib")
TIME_FIELDS = tuple(TimeBreakdown.model_fields)
THROUGHPUT_FIELDS = tuple(Throughput.model_fields)
CHECKPOINT_FIELDS = tuple(CheckpointRisk.model_fields)


def _num(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.6g}")


def _memory(m: MemoryBreakdown | None) -> list[Any] | None:
    if m is None:
        return None
    row: list[Any] = [_num(getattr(m, f)) for f in MEMORY_FIELDS]
    return [*row, m.first_block_to_break, m.worst_stage]


def _fields(obj: TimeBreakdown | Throughput | CheckpointRisk | None, fields: tuple[str, ...]) -> list[Any] | None:
    return None if obj is None else [_num(getattr(obj, f)) for f in fields]


def _zones(z: Zones | None) -> list[Any] | None:
    if z is None:
        return None
    zones = [getattr(z, n) for n in ZONE_NAMES]
    return [[zone.level, _num(zone.value), zone.sentence] for zone in zones] + [bottleneck_label(z)]


def _evaluation(ev: Evaluation | None) -> dict[str, Any] | None:
    if ev is None:
        return None
    return {
        "status": ev.status, "reason": ev.reason, "mem": _memory(ev.memory),
        "time": _fields(ev.time, TIME_FIELDS), "tput": _fields(ev.throughput, THROUGHPUT_FIELDS),
        "ckpt": _fields(ev.checkpoint, CHECKPOINT_FIELDS),
    }


def scenario_summary(info_scenario: Any) -> dict[str, Any]:
    """The scenario's headline figures (names are user strings: the page shows them as text)."""
    s = info_scenario
    return {
        "name": s.name, "model": s.model.name, "params_b": _num(s.model.num_params() / 1e9),
        "gpu": s.cluster.gpu.name, "hbm_gib": s.cluster.gpu.hbm_gib, "nodes": s.cluster.num_nodes,
        "gpus_per_node": s.cluster.gpus_per_node, "num_gpus": s.cluster.num_gpus,
        "seq_len": s.training.seq_len, "global_batch_size": s.training.global_batch_size,
        "optimizer": s.training.optimizer, "stack": s.training.stack,
        "training_tokens": s.training.training_tokens, "price_per_gpu_hour": s.cluster.price_per_gpu_hour,
    }


def _plan_row(p: Plan) -> list[Any]:
    return [getattr(p, f) for f in Plan.model_fields]


def _plans(info: ParetoInfo) -> dict[str, Any]:
    rows: list[PlanResult] = list(info.plans)
    ev = [r.evaluation for r in rows]
    out: dict[str, Any] = {
        "label": [r.label for r in rows],
        "key": [r.key for r in rows],
        "trial": [r.number for r in rows],
        "measured": [int(r.fidelity == "measured") for r in rows],
        "status": [r.status for r in rows],
        "why": [r.why_infeasible for r in rows],
        "feasible": [int(r.feasible) for r in rows],
        "front": [int(r.on_front) for r in rows],
        "plan": [_plan_row(r.plan) for r in rows],
        "values": [None if r.values is None else [_num(v) for v in r.values] for r in rows],
        "mem": [_memory(e.memory) if e else None for e in ev],
        "time": [_fields(e.time, TIME_FIELDS) if e else None for e in ev],
        "tput": [_fields(e.throughput, THROUGHPUT_FIELDS) if e else None for e in ev],
        "ckpt": [_fields(e.checkpoint, CHECKPOINT_FIELDS) if e else None for e in ev],
        "zones": [_zones(e.zones) if e else None for e in ev],
        # Sparse maps keyed by plan index (as strings, JSON objects).
        "prediction": {str(r.index): _evaluation(r.prediction) for r in rows if r.prediction is not None},
        "advice": {str(r.index): [[a.zone, a.rationale, a.plan, a.effect] for a in r.advice]
                   for r in rows if r.advice is not None},
    }
    return out


def capacity_payload(cap: CapacityInfo | None) -> dict[str, Any] | None:
    """Capacity rows for the page's plot (the table is rendered in HTML)."""
    if cap is None:
        return None
    rows = [r for r in cap.rows if r.best is not None]
    return {
        "nodes": [r.num_nodes for r in rows],
        "gpus": [r.num_gpus for r in rows],
        "days": [_num(r.days) for r in rows],
        "cost": [_num(r.cost_usd) for r in rows],
        "gpu_hours": [_num(r.gpu_hours) for r in rows],
        "label": [r.best.label if r.best else "" for r in rows],
        "currency": "USD",
    }


def report_payload(info: ParetoInfo, capacity: CapacityInfo | None = None) -> dict[str, Any]:
    """Everything the page's script needs, JSON-able."""
    return {
        "version": PAYLOAD_VERSION,
        "study": info.study_name,
        "scenario": scenario_summary(info.scenario),
        "objectives": list(info.objectives),
        "directions": list(info.directions),
        "blocks": list(BLOCKS),
        "step_parts": [{"name": p.name, "meaning": p.meaning, "label": p.label, "group": p.group,
                        "hidden": p.hidden, "unit": p.unit} for p in STEP_PARTS],
        "fields": {
            "plan": list(Plan.model_fields), "mem": [*MEMORY_FIELDS, "first_block_to_break", "worst_stage"],
            "time": list(TIME_FIELDS), "tput": list(THROUGHPUT_FIELDS), "ckpt": list(CHECKPOINT_FIELDS),
            "zones": list(ZONE_NAMES),
        },
        "explorer_axes": list(EXPLORER_AXES),
        "advice_limit": info.advice_limit, "advice_measured_title": MEASURED_ADVICE_TITLE,
        "plans": _plans(info),
        "front": list(info.front),
        "best": dict(info.best),
        "capacity": capacity_payload(capacity),
    }
