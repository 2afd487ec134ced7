"""Measure a tabular benchmark: every plan of a small scenario's search space, each run for real several times.

    python bench/measure_table.py --scenario bench/data/cpu-table.yaml --out bench/data/cpu-table.json
        [--runs 3] [--warmup 2] [--step-budget-s S --min-steps A --max-steps B] [--limit N] [--plans "dp=4;tp=4"]

Plans come from the scenario's own search space (`SearchSpace(scenario).enumerate()`), less those the harness
refuses before any launch (the space's rules at the launched world size, `harness.support.unsupported`: listed
in the table's meta with their reason). Each plan runs `--runs` times in separate launches: run r of every plan
is measured in round r, the rounds one after the other over the whole space, each round in its own seeded
shuffled order, so a plan's runs lie minutes apart and the host's load drift lands in their spread instead of
ranking neighbours. Every run is the harness's noise-aware measurement (`stratagem.launch.runners.tabulate`:
local gloo launches on CPU, NCCL on a GPU node): warm-up, then as many timed steps as the step budget buys
(harness.budget; its defaults unless --step-budget-s/--min-steps/--max-steps), tokens/s at the median step, the
95 % interval, the peak tracked memory with the scenario's per-device memory as the harness's cap on CPU workers
(plans past it end "oom" as on a device). The table keeps per run: status, tokens/s/GPU, step spread, peak,
reason, the host's load when the run began and ended, its wall time; the meta keeps versions, machine, load per
round, timings and the step times. Outcomes go to OUT.partial.jsonl as each launch ends: rerun the same command
to resume; the table is written when every run has its outcome (bench/search_regret.py --table replays it).
The figures (plans, ok/oom/failed per round, between-run CV, epsilon, best vs runner-up, wall time, load) are
printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratagem.evaluators.table import OutcomeTable, TableOutcome, TableSample, noise_epsilon  # noqa: E402
from stratagem.launch.harness.budget import (  # noqa: E402
    DEFAULT_BUDGET_S,
    DEFAULT_MAX_STEPS,
    DEFAULT_MIN_STEPS,
    StepBudget,
)
from stratagem.launch.harness.support import unsupported  # noqa: E402
from stratagem.spaces import Plan, Scenario, SearchSpace, format_plan, load_scenario, parse_plan  # noqa: E402
from stratagem.spaces.rules import violations  # noqa: E402


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=ROOT / "bench" / "data" / "cpu-table.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "cpu-table.json")
    ap.add_argument("--runs", type=int, default=3, help="separate launches (samples) per plan")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (memory is tracked in the last)")
    ap.add_argument("--step-budget-s", type=float, default=DEFAULT_BUDGET_S, help="seconds of timed steps per run")
    ap.add_argument("--min-steps", type=int, default=DEFAULT_MIN_STEPS, help="fewest timed steps per run")
    ap.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="most timed steps per run")
    ap.add_argument("--limit", type=int, default=None, help="measure only the first N plans (a trial run)")
    ap.add_argument("--plans", default=None, help="';'-separated plans instead of the whole space")
    ap.add_argument("--chunk", type=int, default=6, help="plans per local launch (and per resumable save)")
    ap.add_argument("--seed", type=int, default=0, help="seed of each round's shuffled order")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.warmup < 1 or args.chunk < 1:
        ap.error(f"--runs ({args.runs}), --warmup ({args.warmup}) and --chunk ({args.chunk}) must be >= 1")
    return args


def table_plans(scenario: Scenario, text: str | None, limit: int | None) -> tuple[list[Plan], dict[str, str]]:
    """The plans to measure (given, or the whole space) and those the harness refuses up front, with why."""
    if text:
        plans = [parse_plan(t) for t in text.split(";") if t.strip()]
    else:
        cols = SearchSpace(scenario).enumerate()
        plans = [cols.plan(i) for i in range(len(cols))]
    refused: dict[str, str] = {}
    keep: list[Plan] = []
    for p in plans:
        broken = violations(scenario, p)
        why = broken[0] if broken else unsupported(scenario, p, "cpu")
        if why:
            refused[format_plan(p)] = why
        else:
            keep.append(p)
    return (keep[:limit] if limit else keep), refused


def _settings(args: argparse.Namespace, cap: float | None) -> dict[str, Any]:
    import yaml

    return {"scenario": yaml.safe_load(args.scenario.read_text()), "warmup": args.warmup, "cap": cap, "budget": {
        "budget_s": args.step_budget_s, "min_steps": args.min_steps, "max_steps": args.max_steps}}


def _git_state() -> str | None:
    """`COMMIT` or `COMMIT+changes` (uncommitted changes in stratagem/ or bench/) of this checkout; None
    outside git. The harness code the launches run is the code at the measurement's start."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "stratagem", "bench"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _started(partial: Path) -> dict[str, Any]:
    """When and at which commit the measurement in `partial` began (its first line), {} when not recorded."""
    if not partial.exists():
        return {}
    with partial.open() as f:
        first = json.loads(f.readline() or "{}")
    return dict(first.get("started", {}))


def _read_partial(partial: Path, settings: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """(plan, run) -> outcome from an interrupted measurement; refused when it was made with other settings."""
    done: dict[tuple[str, int], dict[str, Any]] = {}
    if not partial.exists():
        return done
    for line in partial.read_text().splitlines():
        if not line.strip():
            continue
        o = json.loads(line)
        if "settings" in o:
            if o["settings"] != settings:
                sys.exit(f"{partial}: measured with other settings (scenario, warm-up, cap or step budget); "
                         "delete it or rerun with the same options")
            continue
        done[(o["plan"], int(o["run"]))] = o
    return done


def measure(args: argparse.Namespace, scenario: Scenario, plans: list[Plan], cap: float | None,
            partial: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """Every (plan, run) outcome: round r measures run r of every plan not yet measured, in shuffled order."""
    from stratagem.launch.runners.tabulate import measure_plans

    settings = _settings(args, cap)
    done = _read_partial(partial, settings)
    if not partial.exists():
        started = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git": _git_state()}
        partial.write_text(json.dumps({"settings": settings, "started": started}) + "\n")
    budget = StepBudget(budget_s=args.step_budget_s, min_steps=args.min_steps, max_steps=args.max_steps)
    t0 = time.time()
    for run in range(args.runs):
        todo = [p for p in plans if (format_plan(p), run) not in done]
        order = np.random.default_rng([args.seed, run]).permutation(len(todo))
        todo = [todo[i] for i in order]
        for world in sorted({p.world_size for p in todo}):
            group = [p for p in todo if p.world_size == world]
            for i in range(0, len(group), args.chunk):
                load0, start = os.getloadavg(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
                part = measure_plans(scenario, group[i:i + args.chunk], 1, args.warmup, cap, chunk=args.chunk,
                                     budget=budget)
                launch = {"run": run, "launch_load": [load0, os.getloadavg()], "launch_start": start}
                with partial.open("a") as f:
                    for o in part:
                        done[(o["plan"], run)] = {**o, **launch}
                        f.write(json.dumps(done[(o["plan"], run)]) + "\n")
                print(f"run {run + 1}/{args.runs}, world {world}: {len(done)}/{len(plans) * args.runs} measured "
                      f"({time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    return done


def sample_of(o: dict[str, Any]) -> TableSample:
    """A table sample from one measured outcome (the harness's load for ok runs, else the launch's)."""
    load = o.get("host_load") or [o["launch_load"][0][0], o["launch_load"][1][0]]
    return TableSample(status=o["status"], tokens_per_s_per_gpu=o.get("tokens_per_s_per_gpu"),
                       peak_gib=o.get("peak_gib"), step_spread=o.get("step_spread"), reason=o.get("reason", ""),
                       load_before=round(load[0], 2), load_after=round(load[1], 2),
                       wall_s=round(o["wall_s"], 2) if "wall_s" in o else None)


def round_meta(done: dict[tuple[str, int], dict[str, Any]], runs: int) -> list[dict[str, Any]]:
    """Per round: ok/oom/failed counts, wall time of its runs, the host's 1/5/15-min load at its first and
    last launch."""
    out = []
    for run in range(runs):
        os_ = sorted((o for (_, r), o in done.items() if r == run), key=lambda o: o["launch_start"])
        counts = {s: sum(o["status"] == s for o in os_) for s in ("ok", "oom", "failed")}
        out.append({"run": run + 1, **counts, "runs_wall_s": round(sum(o.get("wall_s", 0.0) for o in os_), 1),
                    "first_launch": os_[0]["launch_start"] if os_ else None,
                    "load_before": os_[0]["launch_load"][0] if os_ else None,
                    "load_after": os_[-1]["launch_load"][1] if os_ else None})
    return out


def summary(table: OutcomeTable) -> list[str]:
    """The table's figures: plans, between-run CV, epsilon, best vs runner-up."""
    cvs = [statistics.stdev(x) / statistics.mean(x) for r in table.runs if len(x := r.ok_tokens()) >= 2]
    eps = table.noise_epsilon()
    ranked = sorted((r for r in table.runs if r.value > 0), key=lambda r: -r.value)
    lines = [f"plans {len(table.runs)}; median-sample status: " + ", ".join(
        f"{s} {sum(r.status == s for r in table.runs)}" for s in ("ok", "oom", "failed"))]
    if cvs:
        lines.append(f"between-run CV of tokens/s (plans with >= 2 ok runs, n={len(cvs)}): median "
                     f"{100 * statistics.median(cvs):.1f} %, p90 {100 * float(np.percentile(cvs, 90)):.1f} %")
    lines.append(f"epsilon {100 * eps:.1f} % ({(table.epsilon.rule if table.epsilon else 'derived')})")
    for name, r in zip(("best", "runner-up"), ranked[:2], strict=False):
        xs = r.ok_tokens()
        iv = r.median_sample().tokens_interval()
        within = f", median run's step interval {iv[0]:.0f}-{iv[1]:.0f}" if iv else ""
        lines.append(f"{name}: {r.plan}: median {r.value:.0f} tok/s/GPU, runs {min(xs):.0f}-{max(xs):.0f}{within}")
    if len(ranked) >= 2:
        a, b = ranked[0], ranked[1]
        apart = max(b.ok_tokens()) < min(a.ok_tokens())
        lines.append(f"best vs runner-up: +{100 * (a.value / b.value - 1):.1f} %; runs' ranges "
                     f"{'do not overlap' if apart else 'overlap'}; runner-up "
                     f"{'within' if table.within_noise(b.plan) else 'outside'} epsilon of the best; within epsilon: "
                     f"{sum(table.within_noise(r.plan) for r in ranked)} plans")
    return lines


def write_table(args: argparse.Namespace, scenario_raw: dict[str, Any], plans: list[Plan], refused: dict[str, str],
                done: dict[tuple[str, int], dict[str, Any]], cap: float | None, t0: float,
                load0: tuple[float, ...]) -> OutcomeTable:
    """The table (every plan with its runs' samples, epsilon, provenance), written atomically to --out."""
    keys = [format_plan(p) for p in plans]
    runs = [TableOutcome(plan=k, samples=[sample_of(done[(k, r)]) for r in range(args.runs)]) for k in keys]
    first_ok = next((o for o in done.values() if o["status"] == "ok"), {})
    seconds = sum(o.get("wall_s", 0.0) for o in done.values())
    table = OutcomeTable(
        name=f"cpu table ({args.scenario.name})", scenario=scenario_raw, runs=runs, epsilon=noise_epsilon(runs),
        meta={
            "source": "measured here by bench/measure_table.py (stratagem harness, real training steps)",
            "scenario_file": str(args.scenario.relative_to(ROOT) if args.scenario.is_relative_to(ROOT)
                                 else args.scenario),
            "runs_per_plan": args.runs, "warmup": args.warmup, "memory_cap_gib": cap,
            "step_budget": {"budget_s": args.step_budget_s, "min_steps": args.min_steps,
                            "max_steps": args.max_steps},
            "refused_by_harness": refused,
            "versions": first_ok.get("versions"), "device": first_ok.get("device"),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "rounds": round_meta(done, args.runs),
            "load_average_at_write": list(os.getloadavg()), "load_average_this_call": list(load0),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "runs_wall_s": round(seconds, 1),
            "measurement_wall_s": round(_span(done) or time.time() - t0, 1),
            "started": _started(args.out.with_suffix(".partial.jsonl")),
            "step_times_s": {k: [[round(t, 4) for t in done[(k, r)].get("step_times_s", [])]
                                 for r in range(args.runs)] for k in keys},
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.model_dump(mode="json", exclude_none=True), indent=1) + "\n")
    tmp.replace(args.out)
    return table


def _span(done: dict[tuple[str, int], dict[str, Any]]) -> float | None:
    """Seconds from the first launch's start to the last launch's end (its start plus its runs' wall)."""
    if not done:
        return None
    starts = [dt.datetime.fromisoformat(o["launch_start"]).timestamp() for o in done.values()]
    last = max(o["launch_start"] for o in done.values())
    tail = sum(float(o.get("wall_s", 0.0)) for o in done.values() if o["launch_start"] == last)
    return max(starts) + tail - min(starts)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    import torch
    import yaml

    torch.set_num_threads(1)
    scenario = load_scenario(args.scenario)
    raw = yaml.safe_load(args.scenario.read_text())
    plans, refused = table_plans(scenario, args.plans, args.limit)
    cap = scenario.cluster.gpu.hbm_gib if scenario.cluster.gpu.kind == "cpu" else None
    t0, load0 = time.time(), os.getloadavg()
    partial = args.out.with_suffix(".partial.jsonl")
    done = measure(args, scenario, plans, cap, partial)
    table = write_table(args, raw, plans, refused, done, cap, t0, load0)
    partial.unlink(missing_ok=True)
    print(f"wrote {args.out}")
    print(f"config: {args.scenario}, {args.runs} runs per plan, warm-up {args.warmup}, step budget "
          f"{args.step_budget_s:g} s ({args.min_steps}-{args.max_steps} steps), cap {cap} GiB; torch "
          f"{torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs; refused by the harness "
          f"before launch: {len(refused)}")
    for r in table.meta["rounds"]:
        print(f"run {r['run']}: {r['ok']} ok, {r['oom']} oom, {r['failed']} failed; runs {r['runs_wall_s']:.0f} s; "
              f"load {r['load_before'][0]:.1f} -> {r['load_after'][0]:.1f}")
    for line in summary(table):
        print(line)
    print(f"FIGURE measured table: {len(table.runs)} plans x {args.runs} runs in "
          f"{table.meta['measurement_wall_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
