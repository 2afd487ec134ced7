"""ParetoInfo (and capacity) -> one self-contained HTML page that works offline.

The page holds plotly.js once (plotly's offline bundle), the report's own script and style (package data in
`reports/assets/`), and the data as gzip + base64 JSON that the script decodes. Tables and headings are
rendered here with every string escaped; plots, plan cards and the explorer are built by the script from
the data with text nodes only. A Content-Security-Policy forbids any network request.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
from functools import lru_cache
from html import escape
from importlib import resources
from typing import Any

from stratagem import quantities as q
from stratagem.evaluators.zones import bottleneck_label
from stratagem.reports.capacity import RISK_NOTE, CapacityInfo, CapacityRow, pick_lines, risk_cells
from stratagem.reports.counts import count_lines_of
from stratagem.reports.info import ParetoInfo, PlanResult, best_measured_line
from stratagem.reports.payload import PAYLOAD_VERSION, capacity_payload, report_payload, scenario_summary
from stratagem.reports.runs import RealRun, history_table, real_runs, runs_summary, runs_table

__all__ = ["render_html", "render_capacity_html", "encode_payload", "decode_payload"]

_CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; worker-src blob:")


@lru_cache(maxsize=1)
def _plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    js: str = get_plotlyjs()
    return js.replace("</script", "<\\/script")


@lru_cache(maxsize=2)
def _asset(name: str) -> str:
    return (resources.files("stratagem.reports") / "assets" / name).read_text(encoding="utf-8")


def encode_payload(payload: dict[str, Any]) -> str:
    """JSON -> gzip (deterministic, no timestamp) -> base64 text for the page."""
    raw = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def decode_payload(text: str) -> dict[str, Any]:
    """The inverse of encode_payload (tests and tools read a page's data with it)."""
    data: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(text)))
    return data


def _e(x: object) -> str:
    return escape(str(x), quote=True)


def fmt(x: float | None, digits: int = 0) -> str:
    """A number for a table cell, 3 significant figures (`stratagem.quantities.sig`; '–' when absent).
    `digits` is ignored (kept for callers of the earlier fixed-decimals form)."""
    return q.sig(x)


def pct(x: float | None, digits: int = 1) -> str:
    """A fraction as a percentage, 3 significant figures (`stratagem.quantities.percent`); `digits` ignored."""
    return q.percent(x)


def _td(x: float | None, digits: int = 0, percent: bool = False, unit: tuple[str, float] | None = None) -> str:
    """A numeric cell: the exact value in data-v (sorting), the shown text by the one rule; `unit`: a memory
    figure in GiB shown in that unit."""
    v = "" if x is None else f' data-v="{x!r}"'
    text = q.memory_in(x, unit) if unit is not None else pct(x) if percent else fmt(x)
    return f'<td class="num"{v}>{text}</td>'


def _page(title: str, body: str, payload: dict[str, Any]) -> str:
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="generator" content="stratagem">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_asset('report.css')}</style>",
        f'<script>{_plotly_js()}</script>',
        "</head><body>",
        body,
        f'<script type="application/octet-stream" id="stratagem-data">{encode_payload(payload)}</script>',
        f"<script>{_asset('report.js')}</script>",
        "</body></html>",
    ])


def _scenario_table(s: dict[str, Any]) -> str:
    rows = [
        ("model", f"{s['model']} ({q.count(s['params_b'] * 1e9)} parameters)"),
        ("cluster", f"{s['nodes']} node{'s' if s['nodes'] != 1 else ''} x {s['gpus_per_node']} {s['gpu']} "
                    f"({s['num_gpus']} GPUs, "
                    f"{q.memory(s['hbm_gib'])} HBM each)"),
        ("training", f"seq_len {s['seq_len']}, global batch {s['global_batch_size']} sequences, "
                     f"{s['optimizer']}, {s['stack']} memory conventions"),
        ("target", f"{q.count(s['training_tokens'])} tokens at {q.money(s['price_per_gpu_hour'])} per GPU-hour"),
    ]
    return '<table class="summary">' + "".join(
        f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</table>"


def _counts(info: ParetoInfo) -> str:
    out = '<ul class="counts">' + "".join(f"<li>{_e(line)}</li>" for line in count_lines_of(info)) + "</ul>"
    if info.not_run:
        out += "<ul>" + "".join(f"<li>{_e(line)}</li>" for line in info.not_run) + "</ul>"
    causes = info.infeasible_summary
    if causes:
        items = "".join(f"<li>{_e(c)}: {n}</li>" for c, n in causes)
        out += (f"<p>Stored plans that do not fit ({len(info.plans) - len(info.feasible):,}), by why:</p>"
                f"<ul>{items}</ul>")
    return out


_OBJECTIVE_TITLE = {"tokens_per_s": "highest tokens/s", "headroom_gib": "most memory headroom",
                    "goodput_loss": "lowest checkpoint risk"}


def _bottleneck(p: PlanResult) -> str:
    z = p.evaluation.zones if p.evaluation else None
    return bottleneck_label(z) if z else "–"


def _unit(info: ParetoInfo) -> tuple[str, float]:
    """The memory unit of the report's tables: the one HBM figure every plan is measured against."""
    return q.memory_unit(info.scenario.cluster.gpu.hbm_gib)


def _front_row(rank: int, p: PlanResult, unit: tuple[str, float]) -> str:
    ev = p.evaluation
    mem = ev.memory if ev else None
    tp = ev.throughput if ev else None
    ck = ev.checkpoint if ev else None
    return (
        f'<tr data-plan="{p.index}" data-rank="{rank}"><td class="num" data-v="{p.number}">{p.number}</td>'
        f'<td class="plan-label">{_e(p.label)}</td><td>{_e(p.fidelity)}</td>'
        + _td(p.value("tokens_per_s"))
        + _td(tp.tokens_per_s_per_gpu if tp else None)
        + _td(tp.mfu if tp else None, 1, percent=True)
        + _td(mem.peak_gib if mem else None, unit=unit)
        + _td(p.value("headroom_gib"), unit=unit)
        + _td(p.value("goodput_loss"), percent=True)
        + _td(ck.interval_s / 60 if ck else None)
        + f"<td>{_e(_bottleneck(p))}</td></tr>"
    )


def _front_table(info: ParetoInfo) -> str:
    if not info.front:
        return '<p class="why">No feasible plan: nothing is on the front.</p>'
    heads = [("trial", "num"), ("plan", "text"), ("fidelity", "text"), ("tokens/s", "num"), ("tokens/s/GPU", "num"),
             ("MFU", "num"), (f"peak {_unit(info)[0]}", "num"), (f"headroom {_unit(info)[0]}", "num"),
             ("checkpoint goodput loss", "num"),
             ("checkpoint every (min)", "num"), ("bottleneck", "text")]
    th = "".join(f'<th data-type="{t}" class="{"num" if t == "num" else ""}">{_e(h)}</th>' for h, t in heads)
    rows = "".join(_front_row(k + 1, info.plans[i], _unit(info)) for k, i in enumerate(info.front))
    return (f'<table class="data sortable front" id="front-table"><thead><tr>{th}</tr></thead>'
            f"<tbody>{rows}</tbody></table>"
            '<p class="note">Click a heading to sort; double-click a row to open the plan in the explorer.</p>')


def _best(info: ParetoInfo) -> str:
    if not info.best:
        return ""
    items = []
    for name, i in info.best.items():
        p = info.plans[i]
        v = p.value(name)
        shown = {"tokens_per_s": fmt(v), "headroom_gib": q.memory_in(v, _unit(info), True),
                 "goodput_loss": pct(v)}[name]
        items.append(f'<li>{_e(_OBJECTIVE_TITLE.get(name, name))}: <span class="plan-label">{_e(p.label)}</span>'
                     f" ({_e(shown)})</li>")
    note = f'<p class="note headline">Highest tokens/s: {_e(info.headline_note)}.</p>' if info.headline_note else ""
    return "<ul>" + "".join(items) + "</ul>" + note


def _cards(info: ParetoInfo, open_first: int = 3) -> str:
    out = []
    for k, i in enumerate(info.front):
        p = info.plans[i]
        bits = [f"{fmt(p.value('tokens_per_s'))} tokens/s",
                f"headroom {q.memory_in(p.value('headroom_gib'), _unit(info), True)}",
                f"goodput loss {pct(p.value('goodput_loss'))}", f"bottleneck {_bottleneck(p)}"]
        opened = " open" if k < open_first else ""
        out.append(f'<details class="card" data-plan="{p.index}"{opened}><summary><span class="plan-label">'
                   f"{_e(p.label)}</span> — {_e(', '.join(bits))}</summary></details>")
    return "".join(out)


def _plain_table(head: list[str], rows: list[list[str]], cls: str, ident: str) -> str:
    th = "".join(f"<th>{_e(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return (f'<div class="table-wrap"><table class="data {cls}" id="{ident}"><thead><tr>{th}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def _real_runs_section(info: ParetoInfo, runs: list[RealRun]) -> str:
    """Every measured run against its predictions (table and parity plot), the calibration's refits, and the
    plans the runs left out."""
    out = [f"<p>{_e(runs_summary(runs))}</p>"]
    if info.best_measured:
        out += [f"<p>{_e(best_measured_line(info))}.</p>"]
    if runs:
        head, rows = runs_table(runs)
        out += ['<p class="note">Predicted: the prediction each run was chosen on (the calibration in force then); '
                "re-predicted: the same plan with a later, refitted calibration. Errors are (predicted - measured) / "
                "measured, from the latest prediction. The plot puts each run's predicted step time against the "
                "measured one (the diagonal is a perfect prediction).</p>",
                _plain_table(head, rows, "runs", "runs-table"), '<div id="parity-plot" class="plot"></div>']
    if info.history:
        head, rows = history_table(info)
        out += ["<h3>Calibration refits</h3>",
                '<p class="note">One per batch of runs; median relative errors over the measured runs.</p>',
                _plain_table(head, rows, "history", "history-table")]
    if info.not_run:
        out += ["<h3>Plans the real runs left out</h3>",
                "<ul>" + "".join(f"<li>{_e(line)}</li>" for line in info.not_run) + "</ul>"]
    return "".join(out)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _runs_payload(runs: list[RealRun]) -> dict[str, Any]:
    """The runs for the page's script: the parity plot and the measured step of each measured plan's card."""
    return {
        "trial": [r.trial for r in runs], "label": [r.label for r in runs], "status": [r.status for r in runs],
        "plan": [r.plan_index for r in runs],
        "before": [_finite(r.step_s.before) for r in runs], "after": [_finite(r.step_s.after) for r in runs],
        "measured": [_finite(r.step_s.measured) for r in runs],
        "low": [_finite(r.spread.low_s) if r.spread else None for r in runs],
        "high": [_finite(r.spread.high_s) if r.spread else None for r in runs],
        "n": [r.spread.n if r.spread else None for r in runs],
    }


def capacity_table(cap: CapacityInfo) -> str:
    """The capacity rows as an HTML table: the chosen plan with its risk beside it (headroom, checkpoint loss:
    capacity.risk_cells), then speed, time and cost."""
    unit = q.memory_unit(cap.scenario.cluster.gpu.hbm_gib)
    heads = ["nodes", "GPUs", "best plan", f"headroom ({unit[0]}, share of HBM)", "checkpoint loss", "tokens/s",
             "days to train", "GPU-hours", f"cost (USD at {q.count(cap.price_per_gpu_hour)}/GPU-hour)",
             "checkpoint stall", "failure loss", "failure hours", "plans fitting / screened"]
    th = "".join(f"<th>{_e(h)}</th>" for h in heads)

    def row(r: CapacityRow) -> str:
        if r.best is None or r.hours is None:
            label = r.best.label if r.best else ""
            note = f'<td colspan="10" class="why">{_e(label + (": " if label else "") + r.note)}</td>'
            return (f'<tr><td class="num">{r.num_nodes}</td><td class="num">{r.num_gpus}</td>{note}'
                    f'<td class="num">{r.n_feasible:,} / {r.n_plans:,}</td></tr>')
        headroom, ckpt = risk_cells(r, unit)
        return (f'<tr><td class="num">{r.num_nodes}</td><td class="num">{r.num_gpus}</td>'
                f'<td class="plan-label">{_e(r.best.label)}</td>'
                f'<td class="num risk {_e(r.level("hbm"))}" data-v="{r.headroom_gib!r}">{_e(headroom)}</td>'
                f'<td class="num risk {_e(r.level("checkpoint"))}" data-v="{r.goodput_loss!r}">{_e(ckpt)}</td>'
                + _td(r.tokens_per_s) + _td(r.days) + _td(r.gpu_hours) + _td(r.cost_usd)
                + _td(r.checkpoint_overhead, percent=True) + _td(r.failure_loss, percent=True)
                + _td(r.failure_hours) + f'<td class="num">{r.n_feasible:,} / {r.n_plans:,}</td></tr>')

    return (f'<table class="data sortable capacity" id="capacity-table"><thead><tr>{th}</tr></thead><tbody>'
            + "".join(row(r) for r in cap.rows) + f'</tbody></table><p class="note">{_e(RISK_NOTE)}.</p>'
            + "".join(f'<p class="note pick">{_e(line)}</p>' for line in pick_lines(cap)))


def _capacity_section(cap: CapacityInfo | None) -> str:
    if cap is None:
        return ('<p class="note">Not computed for this report: add <code>--nodes 8,16,32</code> to '
                "<code>stratagem report</code>, or run <code>stratagem capacity SCENARIO.yaml --nodes ...</code>."
                "</p>")
    return (f"<p>Training {q.count(cap.training_tokens)} tokens at {q.money(cap.price_per_gpu_hour)} per GPU-hour. "
            "At each size the feasible plan with the most useful throughput, tokens/s x (1 - goodput loss), "
            "is chosen; time includes expected checkpoint stalls and failure losses.</p>"
            + capacity_table(cap) + '<div id="capacity-plot" class="plot"></div>')


def render_html(info: ParetoInfo, capacity: CapacityInfo | None = None) -> str:
    """The study's report as one offline HTML page."""
    s = scenario_summary(info.scenario)
    runs = real_runs(info)
    title = f"stratagem: {info.scenario.name}"
    body = f"""
<h1>{_e(title)}</h1>
<p class="note">Study <code>{_e(info.study_name)}</code>, scenario hash {_e(info.scenario_hash)}.
Calibration: {_e(info.calibration or "published defaults")}.{"".join("<br>" + _e(t) for t in info.taught)}</p>
<nav><a href="#pareto">Pareto plots</a><a href="#front">Front</a><a href="#cards">Plans</a><a href="#runs">Real runs</a><a href="#explore">Explorer</a><a href="#capacity">Capacity</a></nav>
<h2 id="scenario">Scenario</h2>
{_scenario_table(s)}
{_counts(info)}
<h3>Best plan per objective</h3>
{_best(info) or '<p class="why">No feasible plan.</p>'}
<h2 id="pareto">Pareto plots</h2>
<p class="note">Red: the Pareto front over tokens/s, memory headroom and checkpoint goodput loss; blue: other
feasible plans; grey: plans that do not fit or failed (hover for why), hidden at first so that the axes fit
the feasible plans: click "not feasible" in a plot's legend to show them. Diamonds are measured, circles
analytic. Click a point to open it in the explorer.</p>
<div class="plots">
<div id="plot-headroom" class="plot"></div>
<div id="plot-risk" class="plot"></div>
<div id="plot-3d" class="plot tall"></div>
</div>
<h2 id="front">Pareto front</h2>
{_front_table(info)}
<h2 id="cards">Plans on the front</h2>
<p class="note">Memory stack of the worst rank against HBM, step-time breakdown, the four zones and advice.</p>
{_cards(info)}
<h2 id="runs">Real runs</h2>
{_real_runs_section(info, runs)}
<h2 id="explore">Plan explorer</h2>
<p class="note">Move through the evaluated plans: the memory stack, zones and advice follow. Combinations the
study did not evaluate say so.</p>
<div id="explorer"></div>
<h2 id="capacity">Capacity planning</h2>
{_capacity_section(capacity)}
{_footer(info)}
"""
    payload = report_payload(info, capacity)
    payload["runs"] = _runs_payload(runs)
    _price(payload, capacity)
    return _page(title, body, payload)


def _footer(info: ParetoInfo) -> str:
    version = info.stratagem_version or "unknown"
    return (f"<footer>Made by stratagem {_e(version)} from study {_e(info.study_name)}; every figure is read "
            "from the study's stored evaluations (analytic formulas or measured runs).</footer>")


def _price(payload: dict[str, Any], cap: CapacityInfo | None) -> None:
    """The price per GPU-hour beside the capacity plot's data (the cost axis names it)."""
    if cap is not None and payload.get("capacity") is not None:
        payload["capacity"]["price"] = cap.price_per_gpu_hour


def render_capacity_html(cap: CapacityInfo) -> str:
    """Capacity planning alone, as one offline HTML page."""
    s = scenario_summary(cap.scenario)
    title = f"stratagem capacity: {s['model']} on {s['gpu']}"
    body = (f"<h1>{_e(title)}</h1>{_scenario_table(s)}<h2>Capacity planning</h2>{_capacity_section(cap)}"
            "<footer>Made by stratagem from analytic screening of every valid plan at each size.</footer>")
    payload = {"version": PAYLOAD_VERSION, "plans": None, "fields": None, "capacity": capacity_payload(cap)}
    _price(payload, cap)
    return _page(title, body, payload)
