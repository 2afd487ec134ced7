"""ParetoInfo (and capacity) -> Markdown: front table, best plan per objective, zones, capacity."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from html import escape

from stratagem import quantities as q
from stratagem.evaluators.zones import bottleneck_label
from stratagem.reports.advice import MEASURED_ADVICE_TITLE
from stratagem.reports.capacity import RISK_NOTE, CapacityInfo, pick_lines, risk_cells, risk_text
from stratagem.reports.counts import count_lines_of
from stratagem.reports.html import fmt, pct
from stratagem.reports.info import ParetoInfo, PlanResult, best_measured_line
from stratagem.reports.payload import scenario_summary
from stratagem.reports.runs import history_table, measured_step_s, real_runs, runs_summary, runs_table

__all__ = ["render_markdown", "capacity_markdown", "MAX_ZONE_SECTIONS"]

MAX_ZONE_SECTIONS = 25
"""Front plans whose zones and advice are written out (the front table lists them all)."""

_TITLES = {"tokens_per_s": "highest tokens/s", "headroom_gib": "most memory headroom",
           "goodput_loss": "lowest checkpoint risk"}


def _md(x: object) -> str:
    """A user or data string made safe for a Markdown table cell (no HTML, no column breaks)."""
    return escape(" ".join(str(x).split()), quote=False).replace("|", "\\|")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if h.endswith("*") else "---" for h in head) + "|"]
    out[0] = out[0].replace("*", "")
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _scenario(info_scenario: object) -> list[str]:
    s = scenario_summary(info_scenario)
    return [
        f"- model: {_md(s['model'])} ({q.count(s['params_b'] * 1e9)} parameters)",
        f"- cluster: {s['nodes']} node{'s' if s['nodes'] != 1 else ''} x {s['gpus_per_node']} {_md(s['gpu'])} "
        f"({s['num_gpus']} GPUs, "
        f"{q.memory(s['hbm_gib'])} HBM each)",
        f"- training: seq_len {s['seq_len']}, global batch {s['global_batch_size']}, {_md(s['optimizer'])}, "
        f"{_md(s['stack'])} memory conventions",
        f"- target: {q.count(s['training_tokens'])} tokens at {q.money(s['price_per_gpu_hour'])} per GPU-hour",
    ]


def _unit(info: ParetoInfo) -> tuple[str, float]:
    """The memory unit of the report's tables: the one HBM figure every plan is measured against."""
    return q.memory_unit(info.scenario.cluster.gpu.hbm_gib)


def _front_rows(info: ParetoInfo) -> list[list[str]]:
    rows = []
    unit = _unit(info)
    for i in info.front:
        p = info.plans[i]
        ev = p.evaluation
        tp = ev.throughput if ev else None
        mem = ev.memory if ev else None
        z = ev.zones if ev else None
        rows.append([str(p.number), f"`{_md(p.label)}`", p.fidelity, fmt(p.value("tokens_per_s")),
                     fmt(tp.tokens_per_s_per_gpu if tp else None), pct(tp.mfu if tp else None),
                     q.memory_in(mem.peak_gib if mem else None, unit), q.memory_in(p.value("headroom_gib"), unit),
                     pct(p.value("goodput_loss")), bottleneck_label(z) if z else "–"])
    return rows


def _zones(p: PlanResult, unit: tuple[str, float]) -> list[str]:
    ev = p.evaluation
    out = [f"### `{_md(p.label)}`", ""]
    if ev is not None and ev.memory is not None:
        m = ev.memory
        blocks = ", ".join(f"{b} {q.memory_in(m.block_gib(b), unit)}"
                           for b in ("weights", "gradients", "optimizer", "activations", "transient", "overhead"))
        out += [f"Memory ({unit[0]}, worst rank): {blocks}; peak {q.memory_in(m.peak_gib, unit)} of "
                f"{q.memory_in(m.hbm_gib, unit)}, headroom {q.memory_in(m.headroom_gib, unit)}.", ""]
    if ev is not None and ev.zones is not None:
        z = ev.zones
        rows = [[n + (" (bottleneck)" if n == bottleneck_label(z) else ""), getattr(z, n).level,
                 q.sig(getattr(z, n).value), _md(getattr(z, n).sentence)]
                for n in ("hbm", "communication", "bubbles", "checkpoint")]
        out += _table(["zone", "level", "value*", "diagnosis"], rows) + [""]
    else:
        out += ["No zone verdicts stored for this plan.", ""]
    if p.advice:
        title = MEASURED_ADVICE_TITLE if p.fidelity == "measured" else "Advice"
        out += [f"{title}:"] + [f"- [{_md(a.zone)}] {_md(a.rationale)}" + (f" -> `{_md(a.plan)}`" if a.plan else "")
                                + (f" ({_md(a.effect)})" if a.effect else "") for a in p.advice] + [""]
    if p.fidelity == "measured" and p.prediction is not None and ev is not None:
        pr = p.prediction

        pairs: list[tuple[str, float | None, float | None, Callable[[float | None], str]]] = [(f"peak {unit[0]}", pr.memory.peak_gib if pr.memory else None,
                  ev.memory.peak_gib if ev.memory else None, partial(q.memory_in, unit=unit)),
                 ("step s", pr.time.step_s if pr.time else None, measured_step_s(ev), q.sig),
                 ("tokens/s", pr.throughput.tokens_per_s if pr.throughput else None,
                  ev.throughput.tokens_per_s if ev.throughput else None, q.sig)]
        rows = [[n, show(a), show(b), pct((a - b) / b) if a is not None and b else "–"] for n, a, b, show in pairs]
        out += ["Predicted vs measured:", ""] + _table(["figure", "predicted*", "measured*", "error*"], rows) + [""]
    return out


def _real_runs(info: ParetoInfo) -> list[str]:
    """The "Real runs" section: every measured run against its predictions, the calibration's refits, and
    which plans the runs left out and why."""
    runs = real_runs(info)
    out = ["## Real runs", "", runs_summary(runs), ""]
    if info.best_measured:
        out += [f"{_md(best_measured_line(info))}.", ""]
    if runs:
        head, rows = runs_table(runs)
        out += ["Predicted: the prediction each run was chosen on; re-predicted: the same plan with a later, "
                "refitted calibration. Errors are (predicted - measured) / measured, from the latest prediction.",
                ""]
        out += _table(head, [[_md(c) for c in r] for r in rows]) + [""]
    if info.history:
        head, rows = history_table(info)
        out += ["Calibration refits (one per batch of runs; median relative errors over the measured runs):", ""]
        out += _table(head, [[_md(c) for c in r] for r in rows]) + [""]
    if info.not_run:
        out += ["Plans the real runs left out:"] + [f"- {_md(line)}" for line in info.not_run] + [""]
    return out


def capacity_markdown(cap: CapacityInfo, heading: str = "##") -> str:
    """Capacity planning as a Markdown section: the chosen plan with its risk beside it (headroom, checkpoint
    loss: capacity.risk_cells), then speed, time and cost."""
    price = q.money(cap.price_per_gpu_hour)
    out = [f"{heading} Capacity planning", "",
           f"Training {q.count(cap.training_tokens)} tokens at {price} per GPU-hour; at each size the feasible plan "
           "with the most useful throughput, tokens/s x (1 - goodput loss). Time includes expected checkpoint "
           "stalls and failure losses.", ""]
    rows = []
    unit = q.memory_unit(cap.scenario.cluster.gpu.hbm_gib)
    for r in cap.rows:
        if r.best is None or r.hours is None:
            rows.append([str(r.num_nodes), str(r.num_gpus), _md(r.note)] + [q.DASH] * 10
                        + [f"{r.n_feasible:,} / {r.n_plans:,}"])
            continue
        rows.append([str(r.num_nodes), str(r.num_gpus), f"`{_md(r.best.label)}`", *risk_cells(r, unit),
                     fmt(r.tokens_per_s), fmt(r.days), fmt(r.gpu_hours), fmt(r.cost_usd), pct(r.checkpoint_overhead),
                     pct(r.failure_loss), fmt(r.failure_hours), f"{r.n_feasible:,} / {r.n_plans:,}"])
    out += _table(["nodes*", "GPUs*", "best plan", f"headroom {unit[0]} (share of HBM)*", "checkpoint loss*",
                   "tokens/s*", "days*", "GPU-hours*", f"cost USD at {q.count(cap.price_per_gpu_hour)}/GPU-hour*",
                   "checkpoint stall*",
                   "failure loss*", "failure hours*", "fit / screened*"], rows)
    out += ["", f"{RISK_NOTE}."]
    picked = pick_lines(cap)
    out += ["", *(f"- {_md(line)}" for line in picked)] if picked else []
    for name, row in (("Fastest", cap.fastest), ("Cheapest", cap.cheapest)):
        if row is not None and row.best is not None:
            out += ["", f"{name}: {row.num_nodes} nodes, `{_md(row.best.label)}`, {fmt(row.days)} days, "
                        f"{q.money(row.cost_usd)}; risk: {risk_text(row)}."]
    return "\n".join(out) + "\n"


def render_markdown(info: ParetoInfo, capacity: CapacityInfo | None = None) -> str:
    """The study's report as Markdown."""
    out = [f"# stratagem: {_md(info.scenario.name)}", "",
           f"Study `{_md(info.study_name)}`, scenario hash {_md(info.scenario_hash)}, "
           f"stratagem {_md(info.stratagem_version or 'unknown')}.", "",
           f"Calibration: {_md(info.calibration or 'published defaults')}.", ""]
    if info.taught:  # what the runs taught per term and block (evaluators.taught)
        out += [f"- {_md(line)}" for line in info.taught] + [""]
    out += ["## Scenario", ""]
    out += _scenario(info.scenario) + [""]
    out += ["## Counts", ""] + [f"- {_md(line)}" for line in count_lines_of(info)] + [""]
    if info.not_run:
        out += [f"- {_md(line)}" for line in info.not_run] + [""]
    if info.infeasible_summary:
        out += [f"Stored plans that do not fit ({len(info.plans) - len(info.feasible):,}), by why:"] + [
            f"- {_md(c)}: {n}" for c, n in info.infeasible_summary] + [""]
    out += ["## Best plan per objective", ""]
    if info.best:
        rows = [[_TITLES.get(k, k), f"`{_md(info.plans[i].label)}`", fmt(info.plans[i].value("tokens_per_s")),
                 q.memory_in(info.plans[i].value("headroom_gib"), _unit(info)), pct(info.plans[i].value("goodput_loss"))]
                for k, i in info.best.items()]
        out += _table(["objective", "plan", "tokens/s*", f"headroom {_unit(info)[0]}*", "goodput loss*"], rows) + [""]
        if info.headline_note:
            out += [f"Highest tokens/s: {_md(info.headline_note)}.", ""]
    else:
        out += ["No feasible plan.", ""]
    out += ["## Pareto front", ""]
    if info.front:
        out += _table(["trial*", "plan", "fidelity", "tokens/s*", "tokens/s/GPU*", "MFU*", f"peak {_unit(info)[0]}*",
                       f"headroom {_unit(info)[0]}*",
                       "goodput loss*", "bottleneck"], _front_rows(info)) + [""]
        out += ["## Zones of the plans on the front", ""]
        for i in info.front[:MAX_ZONE_SECTIONS]:
            out += _zones(info.plans[i], _unit(info))
        if len(info.front) > MAX_ZONE_SECTIONS:
            out += [f"({len(info.front) - MAX_ZONE_SECTIONS} more plans on the front: see the table above or the "
                    "HTML report.)", ""]
    else:
        out += ["No feasible plan: nothing is on the front.", ""]
    out += _real_runs(info)
    if capacity is not None:
        out += [capacity_markdown(capacity)]
    return "\n".join(out).rstrip() + "\n"
