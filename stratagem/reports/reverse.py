"""The reverse questions of `capacity`: --days D (the fewest GPUs that train in D days) and --budget USD (the fastest
size whose cost stays within the budget).

Sizes: powers of two and three times powers of two up to REVERSE_MAX_NODES (`reverse_nodes`); then the bracket
around the answer is bisected node by node (`refined`: the smallest passing size and the largest failing one
below it for --days; the fastest size within budget and the next larger size tried for --budget), so the answer
is not rounded to a power of two. Bisection assumes days fall and cost rises with size inside the bracket; every
size it names was screened.

When no size answers, `binding_limit` names the limit that binds, each found by relaxing it and recomputing:
  memory        no plan fits in HBM at any size tried
  checkpoint    the fastest size would train in time without its expected checkpoint stalls and failure losses
                (time x (1 - goodput loss))
  global batch  the scenario's global batch, larger by x2 ... x16 sequences (training tokens unchanged), lets a
                size tried train in time: data parallelism is capped by the batch, so more nodes stop helping
  nodes         tokens/s grew by r from the largest size with at most half the largest's nodes to the largest; at
                that rate up to EXTRAPOLATE_STEPS more steps of the same ratio in size would train in time (an
                extrapolation, stated)
  budget        the cheapest size tried costs more than the budget
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from stratagem import quantities as q
from stratagem.errors import StratagemError
from stratagem.reports.capacity import CapacityInfo, CapacityRow, capacity_plan, capacity_row, risk_text
from stratagem.spaces.scenario import Scenario

if TYPE_CHECKING:
    from stratagem.evaluators.calibration import Calibration

__all__ = ["REVERSE_MAX_NODES", "BATCH_FACTORS", "EXTRAPOLATE_STEPS", "reverse_nodes", "refined", "binding_limit", "answer_line",
           "reverse_answer"]

REVERSE_MAX_NODES = 1024
"""The largest cluster the reverse questions (--days, --budget) try without --nodes."""

EXTRAPOLATE_STEPS = 3
"""How many more steps of the largest sizes' ratio the nodes extrapolation tries (1,024 -> 8,192 nodes)."""

BATCH_FACTORS = (2, 4, 8, 16)
"""How much larger a global batch `binding_limit` tries before it says the batch is not what binds."""


def reverse_nodes(max_nodes: int = REVERSE_MAX_NODES) -> list[int]:
    """The node counts the reverse questions try without --nodes: powers of two and three times powers of two
    (1, 2, 3, 4, 6, 8, 12, ...) up to max_nodes."""
    out = {2**k for k in range(max_nodes.bit_length())} | {3 * 2**k for k in range(max_nodes.bit_length())}
    return sorted(n for n in out if n <= max_nodes)


def _passes(r: CapacityRow, days: float | None, budget_usd: float | None) -> bool:
    if days is not None:
        return r.days is not None and r.days <= days
    return r.cost_usd is not None and r.hours is not None and budget_usd is not None and r.cost_usd <= budget_usd


def _with(cap: CapacityInfo, rows: list[CapacityRow]) -> CapacityInfo:
    merged = {r.num_nodes: r for r in (*cap.rows, *rows)}
    return replace(cap, rows=tuple(merged[n] for n in sorted(merged)))


def refined(cap: CapacityInfo, calibration: Calibration | None, days: float | None = None,
            budget_usd: float | None = None) -> CapacityInfo:
    """`cap` with the sizes between its answer and the nearest size tried on the other side bisected (module
    docstring); `cap` itself when no size answers or the bracket has no size between."""
    scn = cap.scenario
    passing = [r.num_nodes for r in cap.rows if _passes(r, days, budget_usd)]
    if not passing:
        return cap
    if days is not None:  # fewest passing: between the largest failing size below it and it
        hi = min(passing)
        below = [r.num_nodes for r in cap.rows if r.num_nodes < hi]
        lo = max(below) if below else 0
    else:  # fastest within budget: between it and the next larger size tried (over budget)
        best = cap.fastest_within(budget_usd or 0.0)
        lo = best.num_nodes if best is not None else max(passing)
        above = [r.num_nodes for r in cap.rows if r.num_nodes > lo]
        if not above:
            return cap
        hi = min(above)
    rows: list[CapacityRow] = []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        row = capacity_row(scn, mid, calibration)
        rows.append(row)
        ok = _passes(row, days, budget_usd)
        if days is not None:
            lo, hi = (lo, mid) if ok else (mid, hi)
        else:
            lo, hi = (mid, hi) if ok else (lo, mid)
    return _with(cap, rows)


def _bigger_batch(cap: CapacityInfo, calibration: Calibration | None, days: float) -> str:
    """'with training.global_batch_size 512 (2x; ...): 1024 nodes in 53.7 days; 1024 (4x): 768 nodes in 58.0
    days' for each factor of BATCH_FACTORS with which a size tried trains in time (the fewest such nodes, scanning
    down from the largest), '' if none."""
    scn = cap.scenario
    sizes = sorted(r.num_nodes for r in cap.rows)
    gbs = scn.training.global_batch_size
    said: list[str] = []
    for factor in BATCH_FACTORS:
        bigger = scn.model_copy(update={"training": scn.training.model_copy(
            update={"global_batch_size": gbs * factor})})
        found: CapacityRow | None = None
        for n in reversed(sizes):
            row = capacity_row(bigger, n, calibration)
            if row.days is None or row.days > days:
                break
            found = row
        if found is not None and found.days is not None:
            said.append(f"{gbs * factor} ({factor}x): {found.num_nodes} nodes in {q.sig(found.days)} days")
    return ("with training.global_batch_size " + "; ".join(said) + " (the same tokens in fewer, larger steps)"
            if said else "")


def binding_limit(cap: CapacityInfo, calibration: Calibration | None, days: float | None = None,
                  budget_usd: float | None = None) -> str:
    """Which limit keeps every size tried from answering (module docstring), as the second half of the answer:
    'the limit is the global batch of 256 sequences (2.10M tokens): ...'."""
    fitted = [r for r in cap.rows if r.best is not None and r.hours is not None]
    if not fitted:
        return "the limit is memory: no plan fits in HBM at any size tried; give larger GPUs or a smaller model"
    if budget_usd is not None:
        cheapest = cap.cheapest
        assert cheapest is not None  # fitted rows have a cost
        return (f"the limit is the budget: the cheapest size tried, {cheapest.num_nodes} nodes, costs "
                f"{q.money(cheapest.cost_usd)}; raise --budget or lower the price per GPU-hour")
    assert days is not None
    fastest = cap.fastest
    assert fastest is not None and fastest.days is not None and fastest.goodput_loss is not None
    lossless = fastest.days * (1.0 - fastest.goodput_loss)
    if lossless <= days:
        return (f"the limit is checkpoint loss: {fastest.num_nodes} nodes lose {q.percent(fastest.goodput_loss)} "
                f"of the time to checkpoint stalls and failures ({q.sig(fastest.days)} days, {q.sig(lossless)} "
                "without); checkpoint more often or to faster storage (checkpoint section of the scenario)")
    tr = cap.scenario.training
    bigger = _bigger_batch(cap, calibration, days)
    growth = _growth(fitted)
    if bigger:
        return (f"the limit is the scenario's fixed global batch of {tr.global_batch_size} sequences "
                f"({q.count(tr.global_batch_size * tr.seq_len)} tokens){growth}; {bigger}")
    pair = _pair(fitted)
    if pair is not None and pair[1].days is not None:
        a, b = pair
        b_days = pair[1].days
        r = (b.tokens_per_s or 0.0) / (a.tokens_per_s or 1.0)
        for k in range(1, EXTRAPOLATE_STEPS + 1) if r > 1 else ():
            if b_days / r**k <= days:
                more = round(b.num_nodes * (b.num_nodes / a.num_nodes) ** k)
                return (f"the limit is the sizes tried{growth}; at that rate about {more:,} nodes would take "
                        f"{q.sig(b_days / r**k)} days (an extrapolation): try more nodes (--nodes ...,{more})")
    return (f"none of the limits tried binds alone{growth}; a global batch up to {BATCH_FACTORS[-1]}x larger and "
            f"{EXTRAPOLATE_STEPS} more steps of that growth do not reach it either: give a longer time")


def _pair(fitted: list[CapacityRow]) -> tuple[CapacityRow, CapacityRow] | None:
    """The largest size with a plan and the largest with at most half its nodes (else the next smaller)."""
    if len(fitted) < 2:
        return None
    b = fitted[-1]
    half = [r for r in fitted[:-1] if 2 * r.num_nodes <= b.num_nodes]
    a = half[-1] if half else fitted[-2]
    return (a, b) if a.tokens_per_s and b.tokens_per_s else None


def _growth(fitted: list[CapacityRow]) -> str:
    """'; tokens/s grew x1.27 from 512 to 1,024 nodes (x2.00 GPUs)' (`_pair`), '' without two sizes."""
    pair = _pair(fitted)
    if pair is None:
        return ""
    a, b = pair
    assert a.tokens_per_s is not None and b.tokens_per_s is not None
    return (f"; tokens/s grew x{b.tokens_per_s / a.tokens_per_s:.2f} from {a.num_nodes:,} to {b.num_nodes:,} nodes "
            f"(x{b.num_nodes / a.num_nodes:.2f} GPUs)")


def answer_line(cap: CapacityInfo, days: float | None = None, budget_usd: float | None = None,
                why: str = "") -> str:
    """The answer to `capacity --days D` (the fewest GPUs that train in D days) or `--budget USD` (the fastest
    size within the budget), one line with the chosen plan's risk (headroom, checkpoint and failure losses); when
    no size answers, `why` (binding_limit) says which limit binds."""
    if days is not None:
        row, ask = cap.fewest_within(days), f"in {q.sig(days)} days"
    elif budget_usd is not None:
        if cap.price_per_gpu_hour <= 0:
            raise StratagemError("--budget: the scenario has no price per GPU-hour; give --price USD or "
                                 "cluster.price_per_gpu_hour")
        row, ask = cap.fastest_within(budget_usd), f"within {q.money(budget_usd)}"
    else:
        raise StratagemError("answer_line: give days or budget_usd")
    sizes = f"{cap.rows[0].num_nodes}-{cap.rows[-1].num_nodes} nodes" if cap.rows else "no sizes"
    if row is None or row.best is None:
        return f"no size of {sizes} tried trains {ask}; " + (why or "try more nodes (--nodes) or a longer time / "
                                                                  "larger budget")
    verb = "fewest GPUs to train" if days is not None else "fastest training"
    return (f"{verb} {ask}: {row.num_nodes} nodes ({row.num_gpus} GPUs), {row.best.label}, {q.sig(row.days)} days, "
            f"{q.money(row.cost_usd)}; risk: {risk_text(row)} (checkpoint stall {q.percent(row.checkpoint_overhead)}, "
            f"failure loss {q.percent(row.failure_loss)})")


def reverse_answer(scenario: Scenario, nodes: list[int] | None, calibration: Calibration | None,
                   days: float | None = None, budget_usd: float | None = None) -> tuple[CapacityInfo, str]:
    """The rows and the answer line of a reverse question: `nodes` as given (no bisection), else reverse_nodes
    refined around the answer; the binding limit named when no size answers."""
    if days is not None and budget_usd is not None:
        raise StratagemError("--days and --budget: ask one question at a time")
    if budget_usd is not None and scenario.cluster.price_per_gpu_hour <= 0:
        raise StratagemError("--budget: the scenario has no price per GPU-hour; give --price USD or "
                             "cluster.price_per_gpu_hour")
    cap = capacity_plan(scenario, nodes or reverse_nodes(), calibration)
    if nodes is None:
        cap = refined(cap, calibration, days, budget_usd)
    answered = cap.fewest_within(days) if days is not None else cap.fastest_within(budget_usd or 0.0)
    why = "" if answered is not None else binding_limit(cap, calibration, days, budget_usd)
    return cap, answer_line(cap, days, budget_usd, why)
