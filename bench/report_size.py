"""Size and render time of the report of a large study (target: a 10,000-trial study renders in a few seconds
and stays under ~10 MB).

The study is built the way `stratagem search` stores one: the scenario is screened, `select_plans` picks the
predicted front, the plans nearest the memory limit and a seeded sample of the rest (here enough for
--trials trials), each is evaluated analytically and stored with `evaluation_trial` (records.py schema), in
an in-memory Optuna storage (building 10,000 trials in SQLite takes Optuna ~70 ms each: minutes, and it is
the search's cost, not the report's; `--storage` measures loading from one anyway).

Timed: pareto_info (reading the trials, the front, advice for the leading plans), each renderer, and with
--browser the time headless Chromium takes to show the page (plots, cards and explorer built).

    python bench/report_size.py                       # 10,000 trials of llama3-70b on 64 H100
    python bench/report_size.py --trials 2000 --browser

The figures (seconds and MB) are printed last, with the configuration and versions.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import optuna
import plotly

from stratagem import __version__, evaluate, load_scenario
from stratagem.reports import (
    DEFAULT_ADVICE_LIMIT,
    pareto_info,
    read_study,
    render_csv,
    render_html,
    render_json,
    render_markdown,
)
from stratagem.search import DIRECTIONS, open_storage, parse_storage, screen, select_plans
from stratagem.search.study import evaluation_trial, provenance

ROOT = Path(__file__).resolve().parents[1]


def build_study(scenario_path: Path, n_trials: int, storage: str | None) -> tuple[optuna.Study, float]:
    scn = load_scenario(scenario_path)
    scr = screen(scn)
    chosen = select_plans(scr, max(0, n_trials - len(scr.front)), seed=0)[:n_trials]
    prov = provenance(scn, scr.space, screening=scr.mode)
    t0 = time.perf_counter()
    trials = [evaluation_trial(scr.space, evaluate(scn, scr.plan(i)), scr.usable_gib, role, prov,
                               scr.pruned_reason(i)) for i, role in chosen]
    backend = open_storage(parse_storage(storage)) if storage else None
    study = optuna.create_study(directions=list(DIRECTIONS), storage=backend, study_name="bench")
    study.set_user_attr("scenario", scn.model_dump(mode="json"))
    study.set_user_attr("scenario_hash", scn.problem_hash())
    study.set_user_attr("stratagem_version", __version__)
    study.add_trials(trials)
    return study, time.perf_counter() - t0


def browser_seconds(path: Path) -> float | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True, args=flags)
        page = ctx.new_page()
        t0 = time.perf_counter()
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='1']", timeout=300_000)
        seconds = time.perf_counter() - t0
        ctx.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", type=Path, default=ROOT / "examples" / "llama3-70b-64xh100.yaml")
    ap.add_argument("--trials", type=int, default=10_000)
    ap.add_argument("--advice-limit", type=int, default=DEFAULT_ADVICE_LIMIT)
    ap.add_argument("--storage", default=None,
                    help="build the study in this storage, e.g. journal:/tmp/b.log (default: in memory); the report "
                         "then reads it back as `stratagem report` does, and the read is part of pareto_info's time")
    ap.add_argument("--browser", action="store_true", help="also time headless Chromium showing the page")
    args = ap.parse_args()

    study, build_s = build_study(args.scenario, args.trials, args.storage)
    t0 = time.perf_counter()
    if args.storage:
        study = read_study(args.storage, "bench")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    info = pareto_info(study, advice_limit=args.advice_limit)
    info_s = time.perf_counter() - t0
    out = Path(tempfile.mkdtemp(prefix="stratagem-bench-"))
    timings: dict[str, tuple[float, int]] = {}
    for name, render in (("html", render_html), ("md", render_markdown), ("json", render_json), ("csv", render_csv)):
        t0 = time.perf_counter()
        text = render(info)
        (out / f"report.{name}").write_text(text, encoding="utf-8")
        timings[name] = (time.perf_counter() - t0, len(text.encode("utf-8")))
    from plotly.offline import get_plotlyjs

    plotly_mb = len(get_plotlyjs().encode()) / 1e6
    shown = browser_seconds(out / "report.html") if args.browser else None

    print(f"scenario: {args.scenario.name}  trials: {len(study.trials)}  plans: {len(info.plans)}  "
          f"feasible: {len(info.feasible)}  front: {len(info.front)}  advised: {args.advice_limit}")
    print(f"storage: {args.storage or 'in-memory'}  study built in {build_s:.1f} s (not part of the report)")
    print(f"stratagem {__version__}, optuna {optuna.__version__}, plotly {plotly.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}; output in {out}")
    for name, (sec, size) in timings.items():
        print(f"  render {name:4s}: {sec:6.2f} s  {size / 1e6:7.2f} MB")
    if args.browser:
        print(f"  chromium shows the page in {shown:.1f} s" if shown is not None else "  chromium not available")
    html_s, html_b = timings["html"]
    load = f"opening the storage (Optuna) {load_s:.2f} s + " if args.storage else ""
    print(f"REPORT {len(study.trials)} trials: {load}pareto_info {info_s:.2f} s + HTML {html_s:.2f} s = "
          f"{load_s + info_s + html_s:.2f} s; HTML {html_b / 1e6:.2f} MB (plotly.js {plotly_mb:.2f} MB of it)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
