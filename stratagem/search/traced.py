"""The traced phase of a search: between the analytic screening and real runs, up to K plans are traced (the
harness's own training step on fake tensors at full size, `stratagem.launch.trace`) and stored as trials of
fidelity "traced" beside their analytic prediction.

Order: the predicted Pareto front (highest tokens/s first), then the plans nearest the memory limit (where the
analytic model decides whether a plan fits). A plan with a traced trial is never traced again, and each trace
is stored as soon as it is done: a killed driver loses at most the trace in flight and a rerun repeats none.
Memory of a traced trial: the traced blocks of its worst rank role (weights, gradients, optimizer,
activations; the traced rest stands in the transient block), plus the analytic overhead on top (fragmentation x
allocated + context: tracing has no allocator). Throughput and checkpoint figures stay the analytic ones.
Refit: `logits_bytes` (bytes per logit element alive at the loss), the one calibration constant of the memory
model a trace observes; fragmentation and context need an allocator and a device. The refitted value is the
median over traced last-stage roles of (traced activations - analytic activations without logits) / logit
elements, stored as the study attribute "traced_calibration"; the search is then re-screened with it.
Never imports torch or ray: the tracer is given (the CLI passes `stratagem.launch.trace.trace_plan`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np
import optuna

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import Evaluation, MemoryBreakdown
from stratagem.search.records import StudyKey, plan_key, standings
from stratagem.search.runner import SearchResult
from stratagem.search.screening import Screening
from stratagem.search.study import evaluation_trial, provenance
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

if TYPE_CHECKING:
    from stratagem.search.open_session import OpenSession

__all__ = ["TracedRoleLike", "Tracer", "TracedResult", "traced_order", "traced_evaluation", "refit_logits_bytes",
           "trace_session", "TRACED_CALIBRATION", "UNTRACEABLE"]

UNTRACEABLE = "not traced: the trace failed"
"""Key (and the reports' wording) of the study attribute "not_run" entry for plans whose trace failed."""
TRACED_CALIBRATION = StudyKey.TRACED_CALIBRATION
"""Study attribute: the Calibration refitted on the study's traced trials (model_dump)."""
_BLOCKS = (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer"),
           ("activations", "activations"), ("rest", "transient"))


class TracedRoleLike(Protocol):
    """What the search reads from one traced rank role (`stratagem.launch.trace.TracedRole`)."""

    role: str
    peak_bytes: int
    blocks: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        """The role as JSON (stored with the trial)."""
        ...


Tracer = Callable[[Scenario, Plan], Sequence[TracedRoleLike]]


@dataclass(frozen=True)
class TracedResult:
    """The analytic search and what the traced phase added."""

    search: SearchResult
    traced: int
    """Plans traced in this call."""
    skipped: dict[str, str]
    """Plan key -> the harness's reason for plans it cannot trace."""
    calibration: Calibration
    """The calibration after the refit (the screening's when nothing was traced)."""
    seconds: float


def traced_order(screening: Screening, done: set[str], limit: int) -> list[tuple[Plan, str]]:
    """Up to `limit` untraced plans: the predicted front by tokens/s, then by distance of the predicted peak
    to the usable memory (nearest first), roles "front" / "boundary"."""
    cols = screening.columns
    front = [int(i) for i in sorted(screening.front, key=lambda i: -cols.tokens_per_s[i])]
    on_front = set(front)
    distance = np.abs(cols.peak_gib - screening.usable_gib)
    rest = [int(i) for i in np.argsort(distance, kind="stable") if int(i) not in on_front]
    out: list[tuple[Plan, str]] = []
    for indices, role in ((front, "front"), (rest, "boundary")):
        for i in indices:
            if len(out) >= limit:
                return out
            plan = screening.plan(i)
            if plan_key(plan) not in done:
                out.append((plan, role))
    return out


def traced_evaluation(analytic: Evaluation, roles: Sequence[TracedRoleLike], calibration: Calibration) -> Evaluation:
    """The analytic evaluation with its memory replaced by the worst traced role's blocks (+ analytic overhead:
    fragmentation x allocated + context), fidelity "traced", status ok/oom against HBM."""
    if analytic.memory is None:
        raise ValueError(f"traced_evaluation: {plan_key(analytic.plan)} has no analytic memory")
    worst = max(roles, key=lambda r: r.peak_bytes)
    blocks = {name: worst.blocks[traced] / GIB for traced, name in _BLOCKS}
    allocated = sum(blocks.values())
    overhead = calibration.fragmentation * allocated + calibration.context_gib  # memory.py: overhead
    peak = allocated + overhead
    hbm = analytic.memory.hbm_gib
    order = [*blocks.items(), ("overhead", overhead)]
    running, broke = 0.0, None
    for name, gib in order:
        running += gib
        if broke is None and running > hbm:
            broke = name
    stage = 0 if worst.role in ("first", "only") else (analytic.plan.pp - 1 if worst.role == "last" else analytic.plan.pp // 2)
    memory = MemoryBreakdown(**{f"{k}_gib": v for k, v in blocks.items()}, overhead_gib=overhead, peak_gib=peak,
                             hbm_gib=hbm, headroom_gib=hbm - peak, first_block_to_break=broke,  # type: ignore[arg-type]
                             worst_stage=stage)
    status = "ok" if peak <= hbm else "oom"
    reason = "" if status == "ok" else f"traced peak {peak:.1f} GiB > {hbm:g} GiB HBM ({worst.role} stage)"
    return analytic.model_copy(update={
        "fidelity": "traced", "memory": memory, "status": status, "reason": reason, "prediction": analytic,
        "measurements": {"traced_roles": [r.to_json() for r in roles]}})


def refit_logits_bytes(scenario: Scenario, traced: Sequence[tuple[Plan, Sequence[TracedRoleLike]]],
                       calibration: Calibration) -> Calibration:
    """`logits_bytes` refitted on the traced last-stage (or only) roles; the calibration unchanged if none."""
    from stratagem.evaluators.memory import rank_memory_columns
    from stratagem.spaces.columns import PlanColumns

    no_logits = calibration.model_copy(update={"logits_bytes": 0.0})
    values = []
    for plan, roles in traced:
        for role in roles:
            if role.role not in ("last", "only"):
                continue
            pc = PlanColumns.from_plans([plan])
            stage: Literal["first", "last"] = "last" if role.role == "last" else "first"
            without = float(rank_memory_columns(scenario, pc, no_logits, stage)["activations"][0])
            elements = scenario.training.seq_len * plan.micro_batch_size * scenario.model.vocab_size / plan.tp
            values.append((role.blocks["activations"] - without) / elements)  # memory.py: logits term
    if not values:
        return calibration
    return calibration.model_copy(update={"logits_bytes": max(0.0, statistics.median(values))})


def trace_session(session: OpenSession, tracer: Tracer, traced: int,
                  on_trace: Callable[[str, Evaluation | None, str], None] | None = None) -> TracedResult:
    """The traced step of an open session: store the screening if not yet, trace up to `traced` plans (the
    study's count), refit logits_bytes, and re-screen and store with the refit (which becomes the session's
    calibration)."""
    from stratagem.errors import StratagemError

    t0 = time.perf_counter()
    if traced < 0:
        raise StratagemError(f"--traced ({traced}): must be >= 0")
    scenario, cal = session.scenario, session.start_calibration
    result = session.store() if session.screening is None else session.result()
    study, space = session.study, session.space
    prior = {k: s.latest("traced") for k, s in standings(study.get_trials(deepcopy=False)).items()}
    done = {k for k, t in prior.items() if t is not None}
    skipped: dict[str, str] = {}
    count = 0
    for plan, role in traced_order(result.screening, done, max(0, traced - len(done))):
        key = plan_key(plan)
        try:
            roles = tracer(scenario, plan)
        except StratagemError as e:  # the harness cannot run this plan: say why, trace the next one
            skipped[key] = str(e)
            if on_trace is not None:
                on_trace(key, None, str(e))
            continue
        from stratagem.evaluators.analytic import evaluate

        ev = traced_evaluation(evaluate(scenario, plan, cal), roles, cal)
        prov = provenance(scenario, space, tracer="stratagem.launch.trace")
        study.add_trial(evaluation_trial(space, ev, session.usable_gib, role, prov))
        count += 1
        if on_trace is not None:
            on_trace(key, ev, "")
    if skipped:  # reports and status say which plans could not be traced and why (study attribute "not_run")
        with session.lock():
            not_run = dict(study.user_attrs.get(StudyKey.NOT_RUN) or {})
            not_run[UNTRACEABLE] = {"count": len(skipped), "example": next(iter(skipped.values()))}
            study.set_user_attr(StudyKey.NOT_RUN, not_run)
    pairs = _traced_pairs(study)
    refit = refit_logits_bytes(scenario, pairs, cal) if pairs else cal
    if pairs:
        study.set_user_attr(TRACED_CALIBRATION, refit.model_dump(mode="json"))
        session.calibration = refit
        session.screen()
        result = session.store()
    return TracedResult(search=result, traced=count, skipped=skipped, calibration=refit,
                        seconds=time.perf_counter() - t0)


class _StoredRole:
    """A traced role read back from a trial's stored JSON."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.role = str(data["role"])
        self.peak_bytes = int(float(data["peak_gib"]) * GIB)
        self.blocks = {k: int(float(v) * GIB) for k, v in data["blocks_gib"].items()}
        self._data = data

    def to_json(self) -> dict[str, Any]:
        return self._data


def _traced_pairs(study: optuna.Study) -> list[tuple[Plan, Sequence[TracedRoleLike]]]:
    """(plan, traced roles) of every traced trial in the study (this call's and earlier ones')."""
    from stratagem.search.records import trial_evaluation, trial_fidelity, trial_plan

    out: list[tuple[Plan, Sequence[TracedRoleLike]]] = []
    for t in study.get_trials(deepcopy=False):
        if trial_fidelity(t) != "traced":
            continue
        ev = trial_evaluation(t)
        roles = (ev.measurements or {}).get("traced_roles") if ev is not None else None
        if roles:
            out.append((trial_plan(t), [_StoredRole(r) for r in roles]))
    return out
