"""Advice: the seed's decision tree, each step a concrete neighbouring plan, evaluated, with its effect.

Order (the seed's "mini decision tree"): memory first (precision, then micro-batch and recomputation, then
sharding), then communication (fewer all-gather/reduce-scatter: ZeRO-2 instead of 3, a bigger micro-batch,
sharding inside a node; TP inside a node; pipeline instead of data/tensor parallelism across nodes), then
pipeline bubbles (more micro-batches, interleaving, zero-bubble, fewer stages), then checkpoint risk (async
save, the Young/Daly interval). A zone is advised on when it is at warn or bad. When every zone is ok, the
bottleneck zone's neighbours and ways to spend HBM headroom (less recomputation, a bigger micro-batch, less
sharding) are offered if they make the step at least 3% faster and keep HBM at ok. A neighbour is kept only if
it is valid (stratagem.spaces.violations) and its predicted figures improve what the advice is about.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from stratagem.evaluators.analytic import evaluate, evaluate_many
from stratagem.evaluators.calibration import Calibration, default_calibration
from stratagem.evaluators.evaluation import LEVELS, ZONE_NAMES, Evaluation, Status, ZoneName
from stratagem.evaluators.figures import PlanFigures
from stratagem.evaluators.zones import THRESHOLDS
from stratagem.quantities import memory_in, memory_unit
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.factors import divisors
from stratagem.spaces.groups import shard_group
from stratagem.spaces.plan import Plan
from stratagem.spaces.rules import violations
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.training import CheckpointPolicy

__all__ = ["Advice", "NeighbourSummary", "advise"]

Array = NDArray[np.float64]
_FROZEN = ConfigDict(frozen=True, extra="forbid")
MAX_PER_ZONE = 3
FASTER_WHEN_OK = 0.03  # step must shrink by this fraction for advice on a zone that is already ok


class NeighbourSummary(BaseModel):
    """The predicted figures of an advised neighbour."""

    model_config = _FROZEN

    status: Status
    """ok or oom (predicted)."""
    peak_gib: float
    """Peak memory of the worst rank, GiB."""
    headroom_gib: float
    """HBM minus peak, GiB."""
    step_s: float
    """Seconds per optimizer step."""
    tokens_per_s_per_gpu: float
    """Tokens per second per GPU."""
    mfu: float
    """Model FLOP utilisation."""
    exposed_comm_fraction: float
    """Exposed communication / step."""
    bubble_fraction: float
    """Pipeline bubble / step."""
    goodput_loss: float
    """Expected fraction of wall time lost to checkpoints and failures."""
    bottleneck: ZoneName
    """The neighbour's own bottleneck zone."""


class Advice(BaseModel):
    """One step of the decision tree: what to change, why, and what the model predicts it does."""

    model_config = _FROZEN

    zone: ZoneName
    """The zone this advice addresses."""
    rationale: str
    """Why this change helps, in one sentence."""
    change: str
    """The change, e.g. `zero_stage 1 -> 3` or `checkpoint.mode blocking -> async`."""
    plan: Plan
    """The neighbouring plan (the same plan when only the checkpoint policy changes)."""
    checkpoint_policy: CheckpointPolicy | None = None
    """The changed checkpoint policy, when the advice is about the policy rather than the plan."""
    training: dict[str, str] | None = None
    """Training settings changed (e.g. {"grad_dtype": "bf16"}), when the advice is about them rather than the
    plan."""
    neighbour: NeighbourSummary
    """The neighbour's predicted figures."""
    effect: str
    """Predicted effect, e.g. `zero_stage 1 -> 3: peak 92.1 -> 61.3 GiB, step +4%`."""


@dataclass(frozen=True)
class _Candidate:
    zone: ZoneName
    plan: Plan
    rationale: str
    policy: CheckpointPolicy | None = None
    settings: tuple[tuple[str, str], ...] = ()


# ---- candidate neighbours, per zone, in the decision tree's order -------------------------------------------
def _with(plan: Plan, **update: Any) -> Plan:
    return plan.model_copy(update=update)


def _memory(scn: Scenario, p: Plan) -> Iterator[_Candidate]:
    if p.precision == "fp32":
        yield _Candidate("hbm", _with(p, precision="bf16"),
                         "fp32 keeps 4-byte weights, gradients and activations; bf16 mixed precision halves the "
                         "activations and the compute copies.")
    if p.micro_batch_size > 1:
        yield _Candidate("hbm", _with(p, micro_batch_size=p.micro_batch_size // 2),
                         "Activations grow with the micro-batch; halving it frees them at a small cost in "
                         "matmul efficiency.")
    nxt = {"none": "selective", "selective": "full"}.get(p.activation_checkpointing)
    if nxt:
        yield _Candidate("hbm", _with(p, activation_checkpointing=nxt),
                         f"{nxt.capitalize()} recomputation keeps fewer activations and recomputes the rest in "
                         "backward.")
    tr = scn.training
    if p.precision != "fp32" and tr.grad_bytes > 2.0:
        # the stack's fp32 gradient buffers (Megatron --accumulate-allreduce-grads-in-fp32, nanotron
        # accumulate_grad_in_fp32, FSDP2 fp32 params): the stack's lighter gradient dtype halves them
        yield _Candidate("hbm", p, "Gradients accumulate in fp32 by the stack's default; "
                         "training.grad_dtype bf16 halves the gradient buffers (Megatron: drop "
                         "--accumulate-allreduce-grads-in-fp32), at some cost in accumulation precision.",
                         settings=(("grad_dtype", "bf16"),))
    if p.tp > 1 and not p.sequence_parallel:
        yield _Candidate("hbm", _with(p, sequence_parallel=True),
                         "Sequence parallelism shards the norm and dropout activations over the TP group at no "
                         "extra traffic.")
    if p.zero_stage < 3:
        what = {0: "optimizer states", 1: "gradients too", 2: "the weights too"}[p.zero_stage]
        yield _Candidate("hbm", _with(p, zero_stage=p.zero_stage + 1),
                         f"ZeRO-{p.zero_stage + 1} shards {what} over the data-parallel ranks.")
    if p.zero_stage == 3 and p.dp_replicate > 1:
        yield _Candidate("hbm", _with(p, dp_replicate=1),
                         "Full sharding over all data-parallel ranks instead of HSDP replicas divides the "
                         "model states by more ranks.")
    if p.zero_stage >= 1 and p.optimizer_offload == "none":
        master = " and the fp32 master weights" if scn.training.record.master_weights else ""
        yield _Candidate("hbm", _with(p, optimizer_offload="cpu"),
                         f"ZeRO-Offload moves the optimizer states{master} to host memory.")


def _largest_divisor_at_most(n: int, cap: int, ok: Callable[[int], bool]) -> int | None:
    found = [d for d in divisors(n) if d <= cap and ok(d)]
    return max(found) if found else None


def _communication(scn: Scenario, p: Plan) -> Iterator[_Candidate]:
    g = scn.cluster.gpus_per_node
    rec = scn.training.record
    if p.zero_stage == 3:
        if not rec.master_weights:  # FSDP2: zero 2 = fully_shard(reshard_after_forward=False)
            if p.pp > 1 and not rec.reshard_after_forward_with_pp:
                why = ("ZeRO-2 reduce-scatters gradients every micro-batch but keeps the optimizer-step gather "
                       "pattern; with PP this stack already gathers ZeRO-3's weights once per step.")
            else:
                why = ("ZeRO-2 keeps the gathered weights through backward: one all-gather per FSDP unit per "
                       "micro-batch instead of two.")
        else:
            why = ("ZeRO-2 keeps the full weights on every rank: no per-micro-batch all-gathers, one gather of the "
                   "updated weights per step.")
        yield _Candidate("communication", _with(p, zero_stage=2), why)
    if p.zero_stage == 2:
        yield _Candidate("communication", _with(p, zero_stage=1),
                         "ZeRO-1 reduces gradients once per step instead of reduce-scattering every micro-batch.")
    fewer = ", fewer ZeRO-2/3 gathers per step" if p.zero_stage >= 2 else ""
    yield _Candidate("communication", _with(p, micro_batch_size=p.micro_batch_size * 2),
                     f"A bigger micro-batch means fewer, larger collectives (less latency per byte){fewer}, and "
                     "more compute to hide traffic behind.")
    shard = shard_group(p)
    if p.zero_stage >= 2 and shard * p.tp > g and scn.cluster.num_nodes > 1:
        need = -(-p.dp * p.cp * p.tp // g)
        reps = [r for r in divisors(p.dp) if r >= need and (p.dp * p.cp // r) * p.tp <= g]
        if reps:
            r = min(reps)
            inside = (p.dp * p.cp // r) * p.tp <= g  # the shard group's ranks (tp apart) fit in one node
            where = "inside a node over NVLink" if inside else f"over {p.dp * p.cp // r} ranks"
            yield _Candidate("communication", _with(p, dp_replicate=r),
                             f"HSDP shards {where} and only all-reduces gradients across the {r} replicas.")
    if p.tp > g:
        tp = _largest_divisor_at_most(p.tp, g, lambda d: True)
        if tp:
            f = p.tp // tp
            yield _Candidate("communication", _with(p, tp=tp, dp=p.dp * f),
                             "Tensor parallelism across nodes puts four activation all-reduces per layer on the "
                             "network; keep TP inside a node.")
            yield _Candidate("communication", _with(p, tp=tp, pp=p.pp * f),
                             "Pipeline parallelism across nodes sends one activation per micro-batch per stage "
                             "instead of TP's four all-reduces per layer.")
    elif p.tp > 1:
        yield _Candidate("communication", _with(p, tp=p.tp // 2, dp=p.dp * 2),
                         "Half the tensor parallelism runs the per-layer activation all-reduces over fewer ranks "
                         "and gives each GPU larger matmuls.")
    if p.dp > 1 and p.dp % 2 == 0 and scn.cluster.num_nodes > 1:
        yield _Candidate("communication", _with(p, dp=p.dp // 2, pp=p.pp * 2),
                         "Moving a factor of data parallelism into pipeline stages across nodes shrinks the "
                         "gradient traffic each rank sends over the network.")
    if p.cp > 1:
        yield _Candidate("communication", _with(p, cp=p.cp // 2, dp=p.dp * 2),
                         "Less context parallelism means less KV exchanged per layer.")


def _bubbles(scn: Scenario, p: Plan) -> Iterator[_Candidate]:
    if p.pp == 1:
        return
    if p.micro_batch_size > 1:
        yield _Candidate("bubbles", _with(p, micro_batch_size=p.micro_batch_size // 2),
                         "Twice the micro-batches per step halves the bubble (p-1)/m.")
    if p.pp_schedule in ("gpipe", "1f1b"):
        yield _Candidate("bubbles", _with(p, pp_schedule="interleaved", virtual_stages=2),
                         "Interleaving two model chunks per stage halves the bubble (p-1)/(v m).")
        yield _Candidate("bubbles", _with(p, pp_schedule="zero_bubble"),
                         "The zero-bubble schedule (ZB-H1) fills the drain with weight-gradient work: about a "
                         "third of 1F1B's bubble.")
    elif p.pp_schedule == "interleaved":
        yield _Candidate("bubbles", _with(p, virtual_stages=p.virtual_stages * 2),
                         "More model chunks per stage shrink the bubble (p-1)/(v m) further.")
    yield _Candidate("bubbles", _with(p, pp=p.pp // 2, dp=p.dp * 2),
                     "Fewer pipeline stages means fewer warm-up and drain slots.")


def _checkpoint(scn: Scenario, p: Plan) -> Iterator[_Candidate]:
    policy = scn.training.checkpoint
    if policy.mode == "blocking":
        yield _Candidate("checkpoint", p, "An async save stalls training only for the copy to host memory, "
                         "then writes in the background.", policy.model_copy(update={"mode": "async"}))
    if policy.interval_minutes is not None:
        yield _Candidate("checkpoint", p, "The Young/Daly interval balances time spent saving against work lost "
                         "at each failure for this job's MTBF.",
                         policy.model_copy(update={"interval_minutes": None}))


def _spend_headroom(scn: Scenario, p: Plan) -> Iterator[_Candidate]:
    """Neighbours that trade memory headroom for speed (offered only when every zone is ok)."""
    less = {"full": "selective", "selective": "none"}.get(p.activation_checkpointing)
    if less:
        yield _Candidate("hbm", _with(p, activation_checkpointing=less),
                         f"There is headroom to keep more activations: {less} recomputation repeats less of the "
                         "forward pass.")
    yield _Candidate("hbm", _with(p, micro_batch_size=p.micro_batch_size * 2),
                     "There is headroom for a bigger micro-batch: larger matmuls run closer to peak and there are "
                     "fewer micro-batches to launch.")
    if p.zero_stage > 0:
        yield _Candidate("hbm", _with(p, zero_stage=p.zero_stage - 1),
                         f"There is headroom to shard less: ZeRO-{p.zero_stage - 1} moves fewer bytes per step.")
    if p.optimizer_offload == "cpu":
        yield _Candidate("hbm", _with(p, optimizer_offload="none"),
                         "There is headroom to keep the optimizer on the GPU and skip the host round trip.")


GENERATORS: dict[ZoneName, Callable[[Scenario, Plan], Iterator[_Candidate]]] = {
    "hbm": _memory, "communication": _communication, "bubbles": _bubbles, "checkpoint": _checkpoint,
}


# ---- evaluation and selection --------------------------------------------------------------------------------
def _summary(cols: PlanFigures, i: int) -> NeighbourSummary:
    return NeighbourSummary(
        status="ok" if cols.fits[i] else "oom",
        peak_gib=float(cols.peak_gib[i]), headroom_gib=float(cols.headroom_gib[i]),
        step_s=float(cols.step_s[i]), tokens_per_s_per_gpu=float(cols.tokens_per_s_per_gpu[i]),
        mfu=float(cols.mfu[i]), exposed_comm_fraction=float(cols.zone_communication_value[i]),
        bubble_fraction=float(cols.zone_bubbles_value[i]), goodput_loss=float(cols.goodput_loss[i]),
        bottleneck=cols.bottleneck_name(i),
    )


def _change(base: Plan, new: Plan, policy: CheckpointPolicy | None, scn: Scenario,
            settings: tuple[tuple[str, str], ...] = ()) -> str:
    if settings:
        tr = scn.training
        return ", ".join(f"training.{k} {getattr(tr, k) or tr.record.grad_dtype} -> {v}" for k, v in settings)
    if policy is not None:
        old = scn.training.checkpoint
        parts = [f"checkpoint.{k} {getattr(old, k)} -> {getattr(policy, k)}" for k in CheckpointPolicy.model_fields
                 if getattr(old, k) != getattr(policy, k)]
        return ", ".join(p.replace("None", "Young/Daly") for p in parts)
    return ", ".join(f"{k} {getattr(base, k)} -> {getattr(new, k)}" for k in Plan.model_fields
                     if getattr(base, k) != getattr(new, k))


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.01 else f"{x:.1%}"


def _effect(zone: ZoneName, change: str, old: NeighbourSummary, new: NeighbourSummary) -> str:
    step = new.step_s / old.step_s - 1
    step_txt = f"step {step:+.0%}" if abs(step) >= 0.005 else "step unchanged"
    if zone == "hbm":
        unit = memory_unit(old.peak_gib, new.peak_gib)  # one unit for both (quantities: MiB on the CPU demo)
        what = f"peak {memory_in(old.peak_gib, unit)} -> {memory_in(new.peak_gib, unit, True)}"
    elif zone == "communication":
        what = f"exposed comm {_pct(old.exposed_comm_fraction)} -> {_pct(new.exposed_comm_fraction)}"
    elif zone == "bubbles":
        what = f"bubble {_pct(old.bubble_fraction)} -> {_pct(new.bubble_fraction)}"
    else:
        what = f"goodput loss {_pct(old.goodput_loss)} -> {_pct(new.goodput_loss)}"
    return f"{change}: {what}, {step_txt}"


def _helps(zone: ZoneName, old: NeighbourSummary, new: NeighbourSummary, strict: bool) -> bool:
    faster = new.step_s < old.step_s * (1 - (FASTER_WHEN_OK if strict else 0.005))
    if zone == "hbm" and strict:  # spending headroom: faster, and the neighbour keeps HBM at ok
        return faster and new.headroom_gib >= THRESHOLDS["hbm"].warn * (new.peak_gib + new.headroom_gib)
    if zone == "hbm":
        # a plan that does not fit gets only neighbours that fit: advice to a plan that runs out of memory must run
        return new.peak_gib < old.peak_gib * 0.99 and (old.status == "ok" or new.status == "ok")
    if new.status != "ok":
        return False  # never advise a plan that does not fit (a fitting one, or a plan that does not fit itself)
    if zone == "communication":
        return new.exposed_comm_fraction < old.exposed_comm_fraction and faster
    if zone == "bubbles":
        return new.bubble_fraction < old.bubble_fraction and faster
    return new.goodput_loss < old.goodput_loss * 0.95


def _advise_zone(
    scn: Scenario, plan: Plan, zone: ZoneName, base: NeighbourSummary, cal: Calibration, strict: bool,
) -> list[Advice]:
    seen: set[str] = set()
    cands: list[_Candidate] = []
    generate = _spend_headroom if (zone == "hbm" and strict) else GENERATORS[zone]
    for c in generate(scn, plan):
        key = c.plan.model_dump_json() + (c.policy.model_dump_json() if c.policy else "") + repr(c.settings)
        if key in seen or (c.policy is None and not c.settings and c.plan == plan) or violations(scn, c.plan):
            continue
        seen.add(key)
        cands.append(c)
    out: list[Advice] = []
    plain = [c for c in cands if c.policy is None and not c.settings]
    summaries: dict[int, NeighbourSummary] = {}
    if plain:
        cols = evaluate_many(scn, PlanColumns.from_plans([c.plan for c in plain]), cal)
        summaries = {id(c): _summary(cols, i) for i, c in enumerate(plain)}
    for c in cands:
        if c.policy is not None or c.settings:
            update: dict[str, Any] = dict(c.settings)
            if c.policy is not None:
                update["checkpoint"] = c.policy
            s2 = scn.model_copy(update={"training": scn.training.model_copy(update=update)})
            summaries[id(c)] = _summary(evaluate_many(s2, PlanColumns.from_plans([c.plan]), cal), 0)
        new = summaries[id(c)]
        if not _helps(zone, base, new, strict):
            continue
        change = _change(plan, c.plan, c.policy, scn, c.settings)
        out.append(Advice(zone=zone, rationale=c.rationale, change=change, plan=c.plan, checkpoint_policy=c.policy,
                          training=dict(c.settings) or None, neighbour=new,
                          effect=_effect(zone, change, base, new)))
    if zone == "hbm" and not strict:  # the decision tree's order, but plans that fit first
        out.sort(key=lambda a: a.neighbour.status != "ok")
    else:
        out.sort(key=lambda a: a.neighbour.step_s if zone != "checkpoint" else a.neighbour.goodput_loss)
    return out[:MAX_PER_ZONE]


def _memory_path(scn: Scenario, plan: Plan, base: NeighbourSummary, cal: Calibration) -> Advice | None:
    """When no single step fits: walk the memory branch of the tree, taking at each step the first neighbour (in
    the tree's order) that lowers the peak, until HBM is at ok (or, failing that, until the plan fits at all);
    None if it never fits."""
    current, summary = plan, base
    order: dict[str, None] = {}  # fields in the order the walk changed them
    found: tuple[Plan, NeighbourSummary] | None = None
    for _ in range(8):
        cands = [c for c in _memory(scn, current) if not violations(scn, c.plan)]
        if not cands:
            break
        cols = evaluate_many(scn, PlanColumns.from_plans([c.plan for c in cands]), cal)
        lower = [i for i in range(len(cands)) if cols.peak_gib[i] < summary.peak_gib * 0.99]
        if not lower:
            break
        i = lower[0]
        order.update({k: None for k in Plan.model_fields if getattr(cands[i].plan, k) != getattr(current, k)})
        current, summary = cands[i].plan, _summary(cols, i)
        if summary.status == "ok":
            found = (current, summary)
            if summary.headroom_gib >= THRESHOLDS["hbm"].warn * (summary.peak_gib + summary.headroom_gib):
                break
    if found is None:
        return None
    end, end_summary = found
    change = ", ".join(f"{k} {getattr(plan, k)} -> {getattr(end, k)}" for k in order
                       if getattr(plan, k) != getattr(end, k))
    return Advice(zone="hbm", rationale="No single step fits; following the tree (precision, then micro-batch and "
                  "recomputation, then sharding) until the plan fits with headroom.", change=change, plan=end,
                  neighbour=end_summary, effect=_effect("hbm", change, base, end_summary))


def _nearest(scn: Scenario, plan: Plan, base: NeighbourSummary, cal: Calibration) -> Advice | None:
    """When neither a single step nor the memory walk fits: say so and name the neighbour with the lowest peak."""
    cands = [c for c in _memory(scn, plan) if not violations(scn, c.plan)]
    if not cands:
        return None
    cols = evaluate_many(scn, PlanColumns.from_plans([c.plan for c in cands]), cal)
    i = int(np.argmin(cols.peak_gib))
    summary = _summary(cols, i)
    change = _change(plan, cands[i].plan, None, scn)
    return Advice(zone="hbm", rationale=f"No single step fits, nor the memory branch of the tree; the nearest "
                  f"neighbour still needs {-summary.headroom_gib:.1f} GiB more than the GPU has: more GPUs, a "
                  "larger GPU or a smaller model.", change=change, plan=cands[i].plan, neighbour=summary,
                  effect=_effect("hbm", change, base, summary))


def advise(
    scenario: Scenario, plan: Plan, evaluation: Evaluation | None = None, calibration: Calibration | None = None,
) -> list[Advice]:
    """Advice for `plan`, zone by zone in the decision tree's order (see the module docstring).

    `evaluation` is the plan's analytic Evaluation (computed when None); an infeasible plan gets no advice.
    """
    cal = calibration or default_calibration(scenario.cluster.gpu.name)
    ev = evaluation if evaluation is not None and evaluation.zones is not None else evaluate(scenario, plan, cal)
    if ev.zones is None:
        return []
    base = _summary(evaluate_many(scenario, PlanColumns.from_plans([plan]), cal), 0)
    zones = ev.zones
    flagged = [z for z in ZONE_NAMES if LEVELS.index(getattr(zones, z).level) >= 1]
    out: list[Advice] = []
    for zone in flagged:
        advice = _advise_zone(scenario, plan, zone, base, cal, strict=False)
        if zone == "hbm" and base.status != "ok" and not any(a.neighbour.status == "ok" for a in advice):
            path = _memory_path(scenario, plan, base, cal)
            nearest = path if path is not None else _nearest(scenario, plan, base, cal)
            advice += [nearest] if nearest is not None else []
        out += advice
    if not flagged:
        out += _advise_zone(scenario, plan, zones.bottleneck, base, cal, strict=True)
        if zones.bottleneck != "hbm":
            out += _advise_zone(scenario, plan, "hbm", base, cal, strict=True)
    # the bottleneck's advice first, each zone's items by their effect on that zone (stable: ties keep the tree's
    # order)
    return sorted(out, key=lambda a: (a.zone != zones.bottleneck, -_gain(a.zone, base, a.neighbour)))


def _gain(zone: ZoneName, old: NeighbourSummary, new: NeighbourSummary) -> float:
    """How much an advised neighbour improves `zone`'s figure (fraction of the step, or GiB freed for HBM; a
    neighbour that fits an OOM plan ranks above any that does not)."""
    if zone == "hbm":
        return (1e6 if new.status == "ok" and old.status != "ok" else 0.0) + new.headroom_gib - old.headroom_gib
    if zone == "communication":
        return old.exposed_comm_fraction - new.exposed_comm_fraction
    if zone == "bubbles":
        return old.bubble_fraction - new.bubble_fraction
    return old.goodput_loss - new.goodput_loss
