"""Measure a tabular benchmark: every plan of a small scenario's search space run once for real.

    python bench/measure_table.py --scenario bench/data/cpu-table.yaml --out bench/data/cpu-table.json
        [--steps 4] [--warmup 1] [--limit N] [--plans "dp=4,zero=3;tp=4"]

Plans come from the scenario's own search space (`SearchSpace(scenario).enumerate()`); each runs through the
harness (`stratagem.launch.runners.tabulate.measure_plans`: local gloo launches on CPU, or NCCL on a GPU node) with the
scenario's per-device memory as the harness's memory cap on CPU workers, so plans that exceed it end "oom" as
they would on a device. The table keeps, per plan, the status, tokens/s per GPU and the peak tracked memory of
the worst rank, with provenance (versions, machine, CPU count, load average before and after, date, wall time).
`bench/search_regret.py --table FILE` replays it. The figure (plans, ok/oom/failed, minutes) is printed last.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratagem.evaluators.table import OutcomeTable, TableOutcome  # noqa: E402
from stratagem.launch.runners.tabulate import measure_plans  # noqa: E402
from stratagem.spaces import SearchSpace, format_plan, load_scenario, parse_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", type=Path, default=ROOT / "bench" / "data" / "cpu-table.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "cpu-table.json")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per plan")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per plan (memory is tracked in the last)")
    ap.add_argument("--limit", type=int, default=None, help="measure only the first N plans (a trial run)")
    ap.add_argument("--plans", default=None, help="';'-separated plans instead of the whole space")
    ap.add_argument("--chunk", type=int, default=6, help="plans per local launch (and per resumable save)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    scenario = load_scenario(args.scenario)
    raw = __import__("yaml").safe_load(args.scenario.read_text())
    if args.plans:
        plans = [parse_plan(t) for t in args.plans.split(";") if t.strip()]
    else:
        cols = SearchSpace(scenario).enumerate()
        plans = [cols.plan(i) for i in range(len(cols))]
    plans = plans[: args.limit] if args.limit else plans
    cap = scenario.cluster.gpu.hbm_gib if scenario.cluster.gpu.kind == "cpu" else None
    t0, load0 = time.time(), os.getloadavg()
    # Outcomes are appended to OUT.partial.jsonl as each chunk finishes, so an interrupted measurement resumes
    # where it stopped (rerun the same command); the table is written when every plan has its outcome.
    partial = args.out.with_suffix(".partial.jsonl")
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            if line.strip():
                o = json.loads(line)
                done[o["plan"]] = o
    spent = sum(float(o.get("wall_s", 0.0)) for o in done.values())
    todo = [p for p in plans if format_plan(p) not in done]
    for world in sorted({p.world_size for p in todo}):
        group = [p for p in todo if p.world_size == world]
        for i in range(0, len(group), args.chunk):
            c0 = time.time()
            part = measure_plans(scenario, group[i:i + args.chunk], args.steps, args.warmup, cap, chunk=args.chunk)
            wall = (time.time() - c0) / max(1, len(part))
            with partial.open("a") as f:
                for o in part:
                    done[o["plan"]] = {**o, "wall_s": wall}
                    f.write(json.dumps(done[o["plan"]]) + "\n")
            print(f"world {world}: {len(done)}/{len(plans)} plans measured ({time.time() - t0:.0f} s)", file=sys.stderr)
    outcomes = [done[format_plan(p)] for p in plans]
    seconds = spent + time.time() - t0
    first_ok = next((o for o in outcomes if o["status"] == "ok"), {})
    table = OutcomeTable(
        name=f"cpu table ({args.scenario.name})",
        scenario=raw,
        runs=[TableOutcome(plan=o["plan"], status=o["status"], tokens_per_s_per_gpu=o.get("tokens_per_s_per_gpu"),
                           peak_gib=o.get("peak_gib"), reason=o.get("reason", "")) for o in outcomes],
        meta={
            "source": "measured here by bench/measure_table.py (stratagem harness, real training steps)",
            "scenario_file": str(args.scenario.relative_to(ROOT) if args.scenario.is_relative_to(ROOT)
                                 else args.scenario),
            "steps": args.steps, "warmup": args.warmup, "memory_cap_gib": cap,
            "versions": first_ok.get("versions"), "device": first_ok.get("device"),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "load_average_before": load0, "load_average_after": os.getloadavg(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "wall_s": round(seconds, 1),
            "step_times_s": {o["plan"]: o["step_times_s"] for o in outcomes if "step_times_s" in o},
        },
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.model_dump(mode="json"), indent=1) + "\n")
    tmp.replace(args.out)
    partial.unlink(missing_ok=True)
    counts = {s: sum(o["status"] == s for o in outcomes) for s in ("ok", "oom", "failed")}
    print(f"wrote {args.out}")
    print(f"config: {args.scenario}, steps {args.steps}, warmup {args.warmup}, cap {cap} GiB; torch "
          f"{torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, load {load0[0]:.1f}")
    print(f"FIGURE measured table: {len(outcomes)} plans ({counts['ok']} ok, {counts['oom']} oom, "
          f"{counts['failed']} failed) in {seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
