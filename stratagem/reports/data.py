"""Every trial of a study as JSON (full evaluations) or CSV (one flat row per trial)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from stratagem.evaluators.evaluation import BLOCKS, ZONE_NAMES
from stratagem.evaluators.step_parts import TIME_KEYS
from stratagem.evaluators.zones import bottleneck_label
from stratagem.reports.info import ParetoInfo, TrialRecord
from stratagem.spaces.plan import Plan

__all__ = ["trial_rows", "render_json", "render_csv", "CSV_COLUMNS"]

CSV_COLUMNS: tuple[str, ...] = (
    "trial", "plan_key", "label", "fidelity", "status", "feasible", "on_front", "superseded_by",
    "tokens_per_s", "headroom_gib", "goodput_loss", "constraint",
    *Plan.model_fields,
    *(f"{b}_gib" for b in BLOCKS), "peak_gib", "hbm_gib", "first_block_to_break",
    *TIME_KEYS,
    "tokens_per_s_per_gpu", "mfu",
    "checkpoint_state_gib", "checkpoint_save_s", "checkpoint_stall_s", "checkpoint_interval_s", "job_mtbf_h",
    *(f"zone_{z}" for z in ZONE_NAMES), "bottleneck", "reason",
)


def _superseded_by(info: ParetoInfo, t: TrialRecord) -> int | None:
    chosen = info.plans[info.plan_of_trial[t.number]].trial_number
    return None if chosen == t.number else chosen


def _flat(info: ParetoInfo, t: TrialRecord) -> dict[str, Any]:
    plan = info.plans[info.plan_of_trial[t.number]]
    sup = _superseded_by(info, t)
    row: dict[str, Any] = {
        "trial": t.number, "plan_key": plan.key, "label": t.plan.short(), "fidelity": t.fidelity,
        "status": t.status, "feasible": t.feasible, "on_front": plan.on_front and sup is None,
        "superseded_by": sup, "constraint": t.constraint, "reason": t.reason,
    }
    for name, v in zip(info.objectives, t.values or (None,) * len(info.objectives), strict=True):
        row[name] = v
    row.update(t.plan.model_dump(mode="json"))
    ev = t.evaluation
    if ev is not None and ev.memory is not None:
        m = ev.memory
        row.update({f"{b}_gib": m.block_gib(b) for b in BLOCKS})
        row.update(peak_gib=m.peak_gib, hbm_gib=m.hbm_gib, first_block_to_break=m.first_block_to_break)
    if ev is not None and ev.time is not None:
        row.update({k: getattr(ev.time, k) for k in TIME_KEYS})
    if ev is not None and ev.throughput is not None:
        row.update(tokens_per_s_per_gpu=ev.throughput.tokens_per_s_per_gpu, mfu=ev.throughput.mfu)
    if ev is not None and ev.checkpoint is not None:
        c = ev.checkpoint
        row.update(checkpoint_state_gib=c.state_gib, checkpoint_save_s=c.save_s, checkpoint_stall_s=c.stall_s,
                   checkpoint_interval_s=c.interval_s, job_mtbf_h=c.job_mtbf_h)
    if ev is not None and ev.zones is not None:
        row.update({f"zone_{z}": getattr(ev.zones, z).level for z in ZONE_NAMES}, bottleneck=bottleneck_label(ev.zones))
    return row


def trial_rows(info: ParetoInfo) -> list[dict[str, Any]]:
    """One flat dict per finished trial (CSV_COLUMNS keys; missing figures are absent)."""
    return [_flat(info, t) for t in info.trials]


def render_csv(info: ParetoInfo) -> str:
    """All trials as CSV with the CSV_COLUMNS header (empty cells where a figure is missing)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(CSV_COLUMNS), lineterminator="\n", extrasaction="raise")
    writer.writeheader()
    for row in trial_rows(info):
        writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_COLUMNS})
    return out.getvalue()


def render_json(info: ParetoInfo) -> str:
    """The study, its front and every trial with its full stored evaluation, as JSON."""
    trials = []
    for t in info.trials:
        flat = _flat(info, t)
        trials.append({
            "trial": t.number, "plan": t.plan.model_dump(mode="json"), "plan_key": flat["plan_key"],
            "label": flat["label"], "fidelity": t.fidelity, "status": t.status, "reason": t.reason,
            "values": None if t.values is None else dict(zip(info.objectives, t.values, strict=True)),
            "constraint": t.constraint, "feasible": t.feasible, "on_front": flat["on_front"],
            "superseded_by": flat["superseded_by"],
            "evaluation": t.evaluation.model_dump(mode="json") if t.evaluation else None,
        })
    doc = {
        "study": info.study_name, "stratagem_version": info.stratagem_version,
        "scenario_hash": info.scenario_hash, "scenario": info.scenario.model_dump(mode="json"),
        "objectives": list(info.objectives), "directions": list(info.directions),
        "front": [info.plans[i].number for i in info.front],
        "best": {k: info.plans[i].number for k, i in info.best.items()},
        "best_measured": None if info.best_measured_trial is None else {"trial": info.best_measured_trial,
                                                                        "note": info.best_measured},
        "trials": trials,
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n"
