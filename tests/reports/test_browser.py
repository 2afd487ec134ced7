"""The HTML report in a real headless Chromium (Debian's `chromium`, driven by playwright-python).

Checks: no console errors, no network request, the plots render (points in the DOM, non-blank pixels), hover
shows the plan, the front table sorts, the explorer's controls change the memory figures, plans not
evaluated say so, and a model called `<script>alert(1)</script>` shows as text.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path

import pytest
from report_studies import EVIL, add_many, small_study

from stratagem.quantities import sig
from stratagem.reports import capacity_plan, pareto_info, render_html
from stratagem.reports.advice import MEASURED_ADVICE_TITLE

CHROMIUM = os.environ.get("STRATAGEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("chromium is not installed (apt-get install -y chromium); browser checks skipped",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
expect = sync_api.expect

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def info():
    return pareto_info(small_study(name=EVIL))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS, viewport={"width": 1280, "height": 900})
        yield ctx
        ctx.close()


class Loaded:
    def __init__(self, page, console, requests, dialogs) -> None:
        self.page, self.console, self.requests, self.dialogs = page, console, requests, dialogs


def load(browser, path: Path) -> Loaded:
    page = browser.new_page()
    console: list[tuple[str, str]] = []
    requests: list[str] = []
    dialogs: list[str] = []
    page.on("console", lambda m: console.append((m.type, m.text)))
    page.on("pageerror", lambda e: console.append(("pageerror", str(e))))
    page.on("request", lambda r: requests.append(r.url))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    page.wait_for_timeout(300)
    return Loaded(page, console, requests, dialogs)


@pytest.fixture(scope="module")
def report(browser, info, tmp_path_factory) -> Loaded:
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(render_html(info, capacity_plan(info.scenario, [1, 2])), encoding="utf-8")
    return load(browser, path)


def non_white_fraction(browser, png: bytes) -> float:
    """Share of the screenshot's pixels that are not white, measured by the browser's own decoder."""
    page = browser.new_page()
    page.set_content("<canvas id=c></canvas>")
    frac = page.evaluate("""async (b64) => {
        const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
        const c = document.getElementById('c'); c.width = img.width; c.height = img.height;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        const d = g.getImageData(0, 0, c.width, c.height).data; let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] < 240 || d[i+1] < 240 || d[i+2] < 240) n++;
        return n / (d.length / 4);
    }""", base64.b64encode(png).decode())
    page.close()
    return float(frac)


def test_no_console_errors_no_network_no_script_execution(report) -> None:
    errors = [m for m in report.console if m[0] in ("error", "pageerror")]
    assert errors == []
    assert report.requests == [report.page.url], "the page must load nothing but itself"
    assert report.dialogs == [], "the model name must never run as script"


def test_model_name_shows_as_text(report) -> None:
    assert EVIL in report.page.locator("h1").inner_text()
    assert EVIL in report.page.locator("table.summary").inner_text()
    assert report.page.locator("body script:not([id]):not([type])").count() == 1  # only the report's script


def test_plots_render_with_every_point(report, info, browser) -> None:
    plotted = sum(1 for p in info.plans if p.values is not None)
    feasible = sum(1 for p in info.plans if p.values is not None and p.feasible)
    page = report.page
    # plans that do not fit start hidden (issue 12 item 11); their legend entry shows them
    assert page.locator("#plot-headroom .scatterlayer .point").count() == feasible < plotted
    assert page.locator("#plot-risk .scatterlayer .point").count() == feasible
    page.locator("#plot-risk").scroll_into_view_if_needed()
    page.locator("#plot-risk .legend .traces .legendtoggle").first.click(force=True)
    expect(page.locator("#plot-risk .scatterlayer .point")).to_have_count(plotted, timeout=10_000)
    page.locator("#plot-3d").scroll_into_view_if_needed()  # the 3D view is drawn when it comes into view
    page.wait_for_selector("#plot-3d[data-drawn='1'] canvas", timeout=30_000)
    for sel in ("#plot-headroom", "#plot-3d"):
        frac = non_white_fraction(browser, page.locator(sel).screenshot())
        assert frac > 0.01, f"{sel} looks blank ({frac:.4f} non-white)"


def test_hover_shows_the_plan(report, info) -> None:
    page = report.page
    page.locator("#plot-headroom").scroll_into_view_if_needed()
    front_points = page.locator("#plot-headroom .scatterlayer .trace").last.locator(".point")
    front_points.first.hover(force=True)
    page.wait_for_selector("#plot-headroom .hoverlayer .hovertext", timeout=5_000)
    text = page.eval_on_selector("#plot-headroom .hoverlayer", "e => e.textContent")
    assert any(info.plans[i].label in text for i in info.front) and "tokens/s" in text


def column(page, n: int) -> list[str]:
    return page.eval_on_selector_all(
        f"#front-table tbody tr td:nth-child({n})", "els => els.map(e => e.dataset.v ?? e.textContent)")


def test_front_table_sorts(report) -> None:
    page = report.page
    head = page.locator("#front-table th", has_text="tokens/s").first
    head.click()
    asc = [float(x) for x in column(page, 4)]
    assert asc == sorted(asc) and head.get_attribute("aria-sort") == "ascending"
    head.click()
    desc = [float(x) for x in column(page, 4)]
    assert desc == sorted(desc, reverse=True) and asc != desc
    page.locator("#front-table th", has_text="headroom").click()
    head_room = [float(x) for x in column(page, 8)]
    assert head_room == sorted(head_room)


def test_explorer_moves_among_evaluated_plans(report, info) -> None:
    page = report.page
    start = info.plans[info.front[0]]
    peak = page.locator("#explorer-plan .mem-peak")
    assert peak.inner_text() == sig(start.evaluation.memory.peak_gib)  # GiB, 3 significant figures
    target = next(p for p in info.plans if p.plan == start.plan.model_copy(update={"zero_stage": 3}))
    page.select_option("#ex-zero_stage", "3")
    assert peak.inner_text() == sig(target.evaluation.memory.peak_gib) != sig(start.evaluation.memory.peak_gib)
    assert target.label in page.locator("#explorer-plan .plan-label").first.inner_text()
    zones = page.locator("#explorer-plan tr[data-zone='checkpoint']").inner_text()
    assert target.evaluation.zones.checkpoint.sentence in zones
    advice = page.locator("#explorer-plan ul.advice li")
    assert target.advice is not None and advice.count() == len(target.advice)
    for shown, a in zip(advice.all_inner_texts(), target.advice, strict=True):
        assert a.rationale in shown and a.effect in shown


def test_explorer_says_when_not_evaluated(report, info) -> None:
    page = report.page
    page.select_option("#ex-zero_stage", "2")
    page.select_option("#ex-micro_batch_size", "2")
    assert "not evaluated" in page.locator("#explorer-status").inner_text()
    assert page.locator("#explorer-plan .mem-peak").count() == 0
    near = page.locator("#explorer-status button.near")
    assert near.count() >= 1
    label = near.first.inner_text()
    near.first.click()
    assert label in page.locator("#explorer-plan .plan-label").first.inner_text()
    assert page.locator("#explorer-plan .mem-peak").count() == 1


def test_cards_render_when_opened(report, info) -> None:
    page = report.page
    cards = page.locator("details.card")
    assert cards.count() == len(info.front)
    last = cards.nth(len(info.front) - 1)
    assert last.locator(".plan-view").count() == 0
    last.locator("summary").click()
    expect(last.locator(".plan-view .mem-peak")).to_have_count(1)  # rendered on the toggle event
    measured = page.locator(f"details.card[data-plan='{info.measured[0]}'] table.pvm")
    if measured.count() == 0:
        page.locator(f"details.card[data-plan='{info.measured[0]}'] summary").click()
    expect(measured).to_contain_text("60,000")
    expect(measured).to_contain_text("95,000")
    # advice reasons from the model: a measured card says its effects start from the prediction, not the runs
    card = page.locator(f"details.card[data-plan='{info.measured[0]}']")
    expect(card.locator("h4", has_text="Advice")).to_have_text(MEASURED_ADVICE_TITLE)


def test_capacity_section(report) -> None:
    page = report.page
    assert page.locator("#capacity-table tbody tr").count() == 2
    assert page.locator("#capacity-plot .scatterlayer .point").count() == 4  # days and cost at 2 sizes
    # issue 26 item 7: both axes start at zero (a 39% rise in cost must not fill the chart); the price is named
    ranges = page.evaluate("() => { const l = document.getElementById('capacity-plot')._fullLayout; "
                           "return [l.yaxis.range[0], l.yaxis2.range[0], l.yaxis2.title.text]; }")
    assert ranges[0] == 0 and ranges[1] == 0 and "per GPU-hour" in ranges[2]


def test_axes_fit_the_feasible_plans(browser, tmp_path) -> None:
    """Issue 12 item 11: a plan 2,500 GiB over HBM no longer squashes the front into a line at 0 headroom; it
    stays reachable through the legend."""
    from report_studies import add, full_evaluation, plan

    study = small_study()
    add(study, full_evaluation(plan(zero_stage=0, tp=1, micro_batch_size=8), tps=200_000, headroom=-2500.0,
                               loss=0.01, status="oom", reason="activations do not fit"))
    info = pareto_info(study)
    path = tmp_path / "far.html"
    path.write_text(render_html(info), encoding="utf-8")
    page = load(browser, path).page
    heads = [p.values[1] for p in info.plans if p.values is not None and p.feasible]
    lo, hi = page.evaluate("() => document.getElementById('plot-headroom')._fullLayout.xaxis.range")
    assert lo > -10 and lo <= min(heads) and hi >= max(heads) and hi - lo < 3 * (max(heads) - min(heads)), (lo, hi)
    page.locator("#plot-headroom .legend .traces .legendtoggle").first.click(force=True)  # "not feasible": on demand
    page.wait_for_function("() => document.getElementById('plot-headroom')._fullLayout.xaxis.range[0] < -2500",
                           timeout=10_000)
    page.close()


def test_large_study_draws_with_webgl(browser, tmp_path) -> None:
    """Above 2,000 points the 2D views switch to WebGL; still no errors, every point drawn."""
    info = pareto_info(add_many(2100), advice_limit=5)
    path = tmp_path / "big.html"
    path.write_text(render_html(info), encoding="utf-8")
    big = load(browser, path)
    assert [m for m in big.console if m[0] in ("error", "pageerror")] == []
    assert big.requests == [big.page.url]
    n = big.page.evaluate("() => document.getElementById('plot-headroom').data.reduce((s, t) => s + t.x.length, 0)")
    assert n == 2100
    assert big.page.evaluate("() => document.getElementById('plot-headroom').data.every(t => t.type === 'scattergl')")
    assert non_white_fraction(browser, big.page.locator("#plot-headroom").screenshot()) > 0.01
    big.page.close()


def test_empty_study_and_capacity_page(browser, tmp_path) -> None:
    """A study with no plans and a capacity-only page load cleanly too."""
    from report_studies import new_study, scenario

    from stratagem.reports import render_capacity_html

    pages = {"empty.html": render_html(pareto_info(new_study(scenario()))),
             "capacity.html": render_capacity_html(capacity_plan(scenario(EVIL), [1, 2]))}
    for name, text in pages.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        loaded = load(browser, tmp_path / name)
        assert [m for m in loaded.console if m[0] in ("error", "pageerror")] == [], name
        assert loaded.requests == [loaded.page.url] and loaded.dialogs == []
        if name == "capacity.html":
            assert EVIL in loaded.page.locator("h1").inner_text()
            assert loaded.page.locator("#capacity-plot .scatterlayer .point").count() == 4
        else:
            assert loaded.page.locator("#front + p.why").inner_text() == "No feasible plan: nothing is on the front."
            assert loaded.page.locator("#explorer select").count() == 0
        loaded.page.close()


def test_real_runs_in_the_browser(browser, tmp_path) -> None:
    """Issue 26 item 1: the real-runs table and the parity plot render; a measured plan's card shows its
    measured step (median, 95 % interval, n) instead of 'No step-time figures'."""
    from test_real_runs import STEPS, runs_study

    from stratagem.evaluators.spread import spread_of_samples

    info = pareto_info(runs_study())
    path = tmp_path / "runs.html"
    path.write_text(render_html(info), encoding="utf-8")
    loaded = load(browser, path)
    page = loaded.page
    assert [m for m in loaded.console if m[0] in ("error", "pageerror")] == []
    assert page.locator("#runs-table tbody tr").count() == 3
    assert page.locator("#history-table tbody tr").count() == 2
    # parity plot: one point per ok run in each prediction trace (before, after) plus the diagonal
    assert page.locator("#parity-plot[data-drawn='1'] .scatterlayer .point").count() == 2
    ok = next(p for p in info.plans if p.fidelity == "measured" and p.status == "ok")
    card = page.locator(f"details.card[data-plan='{ok.index}']")
    if card.count() == 0:  # not on the front: open it in the explorer
        page.evaluate("document.getElementById('explorer').scrollIntoView()")
        view = page.locator("#explorer-plan")
        for axis, value in (("zero_stage", "3"),):
            page.select_option(f"#ex-{axis}", value)
    else:
        if card.locator(".plan-view").count() == 0:
            card.locator("summary").click()
        view = card
    spread = spread_of_samples(STEPS)
    line = view.locator(".measured-step")
    expect(line).to_contain_text(f"Measured step {sig(spread.median_s * 1000)} ms")
    expect(line).to_contain_text(f"n={len(STEPS)}")
    assert "No step-time figures" not in view.inner_text()
    expect(view.locator("table.pvm")).to_contain_text(sig(spread.median_s * 1000))
    page.close()


def test_tiny_memory_reads_in_mib(browser, tmp_path) -> None:
    """Issue 26 item 2: 10 MiB workers (the CPU demo) read in MiB, never 'Peak 0.0 of 0.0 GiB'."""
    from report_studies import add, full_evaluation, new_study, plan, scenario

    study = new_study(scenario())
    add(study, full_evaluation(plan(zero_stage=1), tps=1000.0, headroom=0.0007, loss=0.01, hbm=0.01))
    info = pareto_info(study)
    path = tmp_path / "tiny.html"
    path.write_text(render_html(info), encoding="utf-8")
    loaded = load(browser, path)
    view = loaded.page.locator("#explorer-plan")
    assert view.locator(".mem-hbm").inner_text() == "10.2"  # 0.01 GiB = 10.24 MiB
    assert view.locator(".mem-peak").inner_text() == sig(0.0093 * 1024)
    assert "MiB" in view.locator("table.mini").first.inner_text()
    # the Pareto plots by the same rule: headroom in MiB, the checkpoint loss as a percentage
    page = loaded.page
    head = page.evaluate("() => { const el = document.getElementById('plot-headroom'); "
                         "return [el._fullLayout.xaxis.title.text, el.data[2].x[0]]; }")
    assert head[0] == "memory headroom (MiB)" and head[1] == pytest.approx(0.0007 * 1024), head
    risk = page.evaluate("() => { const el = document.getElementById('plot-risk'); "
                         "return [el._fullLayout.xaxis.title.text, el.data[2].x[0]]; }")
    assert risk[0] == "checkpoint goodput loss (%)" and risk[1] == pytest.approx(1.0), risk
    loaded.page.close()


def test_explorer_pins_two_plans_side_by_side(browser, info, tmp_path) -> None:
    """Issue 26 item 5: pin a plan, move the explorer to another, and both show in one view with which is
    faster; unpin returns to one plan."""
    path = tmp_path / "pin.html"
    path.write_text(render_html(info), encoding="utf-8")
    loaded = load(browser, path)
    page = loaded.page
    start = info.plans[info.front[0]]
    target = next(p for p in info.plans if p.plan == start.plan.model_copy(update={"zero_stage": 3}))
    page.click("#ex-pin")
    page.select_option("#ex-zero_stage", "3")
    views = page.locator("#explorer-plan .plan-view")
    expect(views).to_have_count(2)
    assert start.label in views.nth(0).locator(".plan-label").first.inner_text()
    assert target.label in views.nth(1).locator(".plan-label").first.inner_text()
    fast, slow = sorted((start, target), key=lambda p: -p.value("tokens_per_s"))
    gap = fast.value("tokens_per_s") / slow.value("tokens_per_s") - 1
    expect(page.locator("#explorer-plan .pin-line")).to_contain_text(
        f"{fast.label} is {sig(100 * gap)}% faster than {slow.label}")
    page.click("#ex-unpin")
    expect(views).to_have_count(1)
    assert [m for m in loaded.console if m[0] in ("error", "pageerror")] == []
    page.close()


def test_real_runs_fit_a_1280px_page_and_legends_count_what_the_page_counts(browser, tmp_path) -> None:
    """Issue 34 item 7: the Real-runs table was wider than a 1280 px page; the parity legend counted 21 points
    where the page said 24 runs (OOM and failed runs have no step to plot), and the Pareto legend left out the
    plans without figures."""
    from report_studies import add, full_evaluation, new_study, plan, scenario
    from test_real_runs import measured

    study = new_study(scenario())
    longs = [plan(dp=1, tp=2, pp=4, zero_stage=1, sequence_parallel=True, pp_schedule="interleaved",
                  virtual_stages=2, activation_checkpointing=ac) for ac in ("selective", "full", "none")]
    for k, p in enumerate(longs):
        pred = full_evaluation(p, tps=1_000_000 + k, headroom=20.0, loss=0.01)
        add(study, pred)
        status = ("ok", "oom", "failed")[k]
        reason = "" if status == "ok" else ("peak 81.2 GiB over 79.6 GiB HBM on rank 7 of stage 3 " * 2).strip()
        add(study, measured(p, pred, status=status, reason=reason))
    add(study, full_evaluation(plan(zero_stage=2), tps=500_000, headroom=10.0, loss=0.02))  # feasible, dominated
    add(study, full_evaluation(plan(zero_stage=0), tps=2_000_000, headroom=-5.0, loss=0.01, status="oom"))
    info = pareto_info(study)
    path = tmp_path / "runs.html"
    path.write_text(render_html(info), encoding="utf-8")
    page = load(browser, path).page
    page.set_viewport_size({"width": 1280, "height": 900})
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280
    table_w = page.evaluate("document.getElementById('runs-table').getBoundingClientRect().width")
    wrap_w = page.evaluate("document.getElementById('runs-table').parentElement.clientWidth")
    assert table_w <= wrap_w + 0.5, (table_w, wrap_w)
    page.wait_for_selector("#parity-plot[data-drawn='1'] .legend", state="attached", timeout=10_000)
    legend = page.evaluate("document.querySelector('#parity-plot .legend').textContent")
    assert "(1 of 3 runs)" in legend, legend
    assert "3 real runs of 3 plans" in page.inner_text("body")
    page.wait_for_selector("#plot-risk .legend", state="attached", timeout=10_000)
    pareto = page.evaluate("document.querySelector('#plot-risk .legend').textContent")
    unplotted = sum(1 for p in info.plans if p.values is None)
    assert unplotted and f"{unplotted} more without figures, not drawn" in pareto, pareto
    page.close()
