"""The four zones a plan is judged in (HBM, communication, pipeline bubbles, checkpoint I/O risk), their
levels, the bottleneck, and one sentence of diagnosis each.

Thresholds (value -> level; documented here and in `THRESHOLDS`):
  hbm            headroom / HBM           ok >= 10%, warn 5-10%, bad < 5% (includes not fitting)
  communication  exposed comm / step      ok < 15%,  warn 15-30%, bad >= 30%
  bubbles        pipeline bubble / step   ok < 10%,  warn 10-25%, bad >= 25%
  checkpoint     expected goodput loss    ok < 3%,   warn 3-10%,  bad >= 10%
The bottleneck is the zone with the highest level. Among zones at warn or bad, the one losing the largest
fraction of wall time wins (communication, bubbles and checkpoint are all fractions of time lost); HBM loses no
time, so at warn it yields to a time zone, and at bad it always wins (a plan that does not fit is broken by
memory first, as the seed's decision tree says). When every zone is ok, the zone closest to its warn threshold
is named (value / warn; for HBM warn / headroom).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.checkpoint import failure_floor
from stratagem.evaluators.evaluation import (
    BLOCKS,
    LEVELS,
    ZONE_NAMES,
    CheckpointRisk,
    Level,
    MemoryBreakdown,
    TimeBreakdown,
    Zone,
    ZoneName,
    Zones,
)
from stratagem.evaluators.figures import PlanFigures
from stratagem.evaluators.step_parts import STEP_PARTS, before_overlap
from stratagem.quantities import duration, memory, memory_in, memory_unit, percent
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Threshold", "THRESHOLDS", "zone_columns", "build_zones", "measured_zones",
           "bottleneck_label", "ALL_OK", "group_placement", "placement_words"]

Array = NDArray[np.float64]

@dataclass(frozen=True)
class Threshold:
    """Where a zone turns warn and bad; `higher_is_worse` False for headroom (lower is worse)."""

    warn: float
    bad: float
    higher_is_worse: bool = True


THRESHOLDS: dict[ZoneName, Threshold] = {
    "hbm": Threshold(warn=0.10, bad=0.05, higher_is_worse=False),
    "communication": Threshold(warn=0.15, bad=0.30),
    "bubbles": Threshold(warn=0.10, bad=0.25),
    "checkpoint": Threshold(warn=0.03, bad=0.10),
}


def _level(name: ZoneName, value: Array) -> Array:
    th = THRESHOLDS[name]
    if th.higher_is_worse:
        return (value >= th.warn).astype(np.float64) + (value >= th.bad)
    return (value < th.warn).astype(np.float64) + (value < th.bad)


def zone_columns(cols: dict[str, Array]) -> dict[str, Array]:
    """`zone_<name>_value`, `zone_<name>_level` (0 ok, 1 warn, 2 bad) and `bottleneck` (index into
    ZONE_NAMES) from evaluate_many's memory, time and checkpoint columns."""
    step = cols["step_s"]
    values: dict[ZoneName, Array] = {
        "hbm": cols["headroom_gib"] / cols["hbm_gib"],
        "communication": cols["exposed_comm_s"] / step,
        "bubbles": cols["bubble_s"] / step,
        "checkpoint": cols["goodput_loss"],
    }
    out: dict[str, Array] = {}
    scores = []
    for name in ZONE_NAMES:
        level = _level(name, values[name])
        out[f"zone_{name}_value"] = values[name]
        out[f"zone_{name}_level"] = level
        th = THRESHOLDS[name]
        if name == "hbm":
            near = np.minimum(1.0, th.warn / np.maximum(values[name], 1e-12))
            within = np.select([level == 0, level == 2], [near, 1.5], 0.0)
        else:
            within = np.where(level == 0, values[name] / th.warn, values[name])
        scores.append(10.0 * level + within)
    out["bottleneck"] = np.argmax(np.stack(scores), axis=0).astype(np.float64)
    return out


# ---- sentences (one plan) ------------------------------------------------------------------------------------
ALL_OK = "none (all zones ok)"


def bottleneck_label(zones: Zones) -> str:
    """The bottleneck as a user reads it: the zone's name only when some zone is at warn or bad; ALL_OK
    otherwise (a plan using 0.2% of its memory has no HBM bottleneck, though hbm tops the ranking)."""
    if all(getattr(zones, name).level == "ok" for name in ZONE_NAMES):
        return ALL_OK
    return zones.bottleneck


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.01 else percent(x)  # below 1 %: 3 significant figures, never "0.0%"


def _duration(seconds: float) -> str:
    return duration(seconds)  # stratagem.quantities: 3 significant figures, ms to days


def _hbm_sentence(mem: MemoryBreakdown, level: Level) -> str:
    largest = max(BLOCKS, key=mem.block_gib)
    unit = memory_unit(mem.peak_gib, mem.hbm_gib)  # one unit for the sentence (quantities: MiB on the CPU demo)
    peak, hbm, big = (memory_in(x, unit, True) for x in (mem.peak_gib, mem.hbm_gib, mem.block_gib(largest)))
    if mem.first_block_to_break is not None:
        return (f"Does not fit: peak {peak} exceeds {hbm}; "
                f"{mem.first_block_to_break} is the first block that breaks HBM ({largest} is the largest).")
    head = f"Peak {peak.split()[0]} of {hbm} leaves {_pct(mem.headroom_fraction)} headroom"
    if level == "ok":
        return f"{head}; {largest} is the largest block ({big})."
    return f"{head}, too little for allocator spikes; {largest} is the largest block ({big})."


def group_placement(scn: Scenario, plan: Plan) -> list[tuple[str, int, int]]:
    """(group, size, nodes it spans) of every parallel group larger than 1, in the ranks' order (tp innermost,
    then cp, dp, pp; the expert grid etp x ep re-partitions the tp x cp x dp ranks: evaluators/comm.py topology,
    evaluators/experts.py): a group of n ranks `stride` apart has min(n, max(1, G / stride)) members per node."""
    g = scn.cluster.gpus_per_node
    groups = [("TP", plan.tp, 1), ("CP", plan.cp, plan.tp), ("EP", plan.ep, plan.etp),
              ("DP", plan.dp, plan.tp * plan.cp), ("PP", plan.pp, plan.tp * plan.cp * plan.dp)]
    out = []
    for name, n, stride in groups:
        if n > 1:
            per_node = min(n, max(1, g // stride))
            out.append((name, n, max(1, -(-n // per_node)) if scn.cluster.num_nodes > 1 else 1))
    return out


def placement_words(scn: Scenario, plan: Plan) -> list[str]:
    """`group_placement` in words: "EP 32 spans 4 nodes", "TP 8 inside a node"."""
    return [f"{name} {n} " + ("inside a node" if nodes == 1 else f"spans {nodes} nodes")
            for name, n, nodes in group_placement(scn, plan)]


def _comm_sentence(scn: Scenario, plan: Plan, tm: TimeBreakdown, value: float) -> str:
    parts = {p.group: float(getattr(tm, p.name)) for p in STEP_PARTS if p.meaning == "exposed"}
    shown = ", ".join(f"{k} {_pct(v / tm.step_s)}" for k, v in parts.items() if v / tm.step_s >= 0.005)
    where = [w for w in placement_words(scn, plan) if not w.startswith(("DP", "PP"))]
    dp_group = plan.dp * plan.cp
    if dp_group > 1:
        traffic = float(before_overlap(tm.model_dump(), "dp_comm_s"))
        where.append(f"DP traffic {_duration(traffic)} per step, {_duration(tm.dp_hidden_s)} of it hidden "
                     "behind backward")
    head = f"Exposed communication is {_pct(value)} of the step"
    if shown:
        head += f" ({shown})"
    return head + "".join(f"; {w}" for w in where) + "."


def _bubble_sentence(plan: Plan, micro: float, value: float) -> str:
    if plan.pp == 1:
        return "No pipeline parallelism, so no bubble."
    sched = plan.pp_schedule + (f" x{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (f"{plan.pp} stages ({sched}) over {micro:.0f} micro-batches per step idle {_pct(value)} of the step "
            "in warm-up and drain.")


def _ckpt_sentence(scn: Scenario, ck: CheckpointRisk) -> str:
    policy = scn.training.checkpoint
    mode = policy.mode
    stall = f"blocks {_duration(ck.stall_s)}" if mode == "blocking" else f"stalls {_duration(ck.stall_s)} (async)"
    head = (f"Saving {memory(ck.state_gib)} takes {_duration(ck.save_s)} and {stall} every "
            f"{_duration(ck.interval_s)}; with a job MTBF of {_duration(ck.job_mtbf_h * 3600)} the expected "
            f"goodput loss is {_pct(ck.goodput_loss)}")
    lag = ck.save_s - ck.stall_s if mode == "async" else 0.0
    restart = policy.restart_minutes * 60.0 + ck.load_s
    floor = failure_floor(ck.stall_s, lag, restart, ck.job_mtbf_h * 3600.0)
    if floor >= THRESHOLDS["checkpoint"].warn:  # no interval brings it to ok: the failures, not the saves
        return (f"{head}. Failures, not checkpoints: job MTBF {_duration(ck.job_mtbf_h * 3600)} against "
                f"{_duration(restart)} to restart and reload, so no interval gets below {_pct(floor)}; fewer "
                "nodes, faster restarts or a faster checkpoint store are the levers.")
    return head + "."


def build_zones(
    scn: Scenario, plan: Plan, mem: MemoryBreakdown, tm: TimeBreakdown, ck: CheckpointRisk,
    cols: PlanFigures, i: int = 0,
) -> Zones:
    """The Zones of row i of evaluate_many's figures, with a sentence per zone."""
    def lv(name: ZoneName) -> Level:
        return cols.level(name, i)

    def val(name: ZoneName) -> float:
        return float(cols.zone_value(name)[i])

    micro = float(cols.micro_batches[i])
    sentences: dict[ZoneName, str] = {
        "hbm": _hbm_sentence(mem, lv("hbm")),
        "communication": _comm_sentence(scn, plan, tm, val("communication")),
        "bubbles": _bubble_sentence(plan, micro, val("bubbles")),
        "checkpoint": _ckpt_sentence(scn, ck),
    }
    zones = {n: Zone(name=n, value=val(n), level=lv(n), sentence=sentences[n]) for n in ZONE_NAMES}
    return Zones(**zones, bottleneck=cols.bottleneck_name(i))


def measured_zones(predicted: Zones, mem: MemoryBreakdown, tm: TimeBreakdown, ck: CheckpointRisk) -> Zones:
    """Zones of a measured run: HBM from the measured memory, the time zones from the prediction (a short run
    measures the step, not its parts), the bottleneck recomputed by the same rule as `zone_columns`."""
    one = np.ones(1)
    cols = zone_columns({
        "headroom_gib": one * mem.headroom_gib, "hbm_gib": one * mem.hbm_gib, "step_s": one * tm.step_s,
        "exposed_comm_s": one * tm.exposed_comm_s, "bubble_s": one * tm.bubble_s, "goodput_loss": one * ck.goodput_loss,
    })
    level = LEVELS[int(cols["zone_hbm_level"][0])]
    hbm = Zone(name="hbm", value=float(cols["zone_hbm_value"][0]), level=level,
               sentence="Measured: " + _hbm_sentence(mem, level))
    others = {n: getattr(predicted, n).model_copy(update={"sentence": "Predicted: " + getattr(predicted, n).sentence})
              for n in ZONE_NAMES if n != "hbm"}
    return Zones(hbm=hbm, **others, bottleneck=ZONE_NAMES[int(cols["bottleneck"][0])])
