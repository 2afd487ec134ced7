"""The analytic memory model checked against traced full-size steps (stratagem.launch.trace).

A seeded sample of valid plans across presets (Llama 3 8B on 8 GPUs, 70B on 64, 405B on 512; seq 8192, stack
torch: the harness's mechanisms), every Plan axis the harness applies (dp, tp, pp, zero 0-3, sequence
parallel, micro-batch, bf16/fp32, recompute none/selective/full, gpipe/1f1b/interleaved). Each plan's rank roles
are traced; per role the error of each analytic block relative to the traced peak, |analytic - traced| /
traced peak, and of the total (the analytic peak without its allocator/context overhead). Prints the median and
p90 per block and per axis value, the worst ten with their breakdown, then the figure with config and versions.

    .venv/bin/python bench/traced_vs_analytic.py --n 300 --seed 0 [--json out.json]

Each plan takes seconds to a minute of CPU (fake tensors; pipelined plans run every micro-batch).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stratagem.errors import StratagemError  # noqa: E402
from stratagem.spaces import Plan, Scenario, scenario_from_dict  # noqa: E402
from stratagem.spaces.rules import violations  # noqa: E402

PRESETS = {"llama3-8b": (1, 8), "llama3-70b": (8, 8), "llama3-405b": (64, 8)}  # (nodes, gpus per node)
GLOBAL_BATCH = 64
BLOCKS = ("weights", "gradients", "optimizer", "activations", "rest")
AXES = ("preset", "tp", "pp", "zero_stage", "sequence_parallel", "micro_batch_size", "precision",
        "activation_checkpointing", "pp_schedule")


def scenario(preset: str) -> Scenario:
    nodes, per = PRESETS[preset]
    return scenario_from_dict({
        "model": preset,
        "cluster": {"gpu": "h200" if preset != "llama3-8b" else "h100-sxm-80g", "num_nodes": nodes,
                    "gpus_per_node": per},
        "training": {"seq_len": 8192, "global_batch_size": GLOBAL_BATCH, "stack": "torch",
                     "training_tokens": 1.5e13},
    })


def sample_plans(n: int, seed: int) -> list[tuple[str, Scenario, Plan]]:
    """n distinct valid plans the harness applies, drawn uniformly per axis (seeded), presets in turn."""
    import torch

    from stratagem.launch.harness.parallelize import check_applicable
    from stratagem.launch.harness.pipeline import check_microbatches

    rng = random.Random(seed)
    scenarios = {p: scenario(p) for p in PRESETS}
    out: list[tuple[str, Scenario, Plan]] = []
    seen: set[tuple[str, str]] = set()
    tries = 0
    while len(out) < n and tries < 200 * n:
        tries += 1
        preset = list(PRESETS)[len(out) % len(PRESETS)]
        scn = scenarios[preset]
        world = scn.cluster.num_gpus
        tp, pp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8, 16])
        if world % (tp * pp):
            continue
        schedule = rng.choice(["gpipe", "1f1b", "interleaved"]) if pp > 1 else "1f1b"
        fields: dict[str, Any] = {
            "dp": world // (tp * pp), "tp": tp, "pp": pp, "zero_stage": rng.choice([0, 1, 2, 3]),
            "sequence_parallel": tp > 1 and rng.random() < 0.5, "micro_batch_size": rng.choice([1, 2]),
            "precision": rng.choice(["bf16", "bf16", "fp32"]),
            "activation_checkpointing": rng.choice(["none", "selective", "full"]),
            "pp_schedule": schedule, "virtual_stages": 2 if schedule == "interleaved" else 1,
        }
        try:
            plan = Plan(**fields)
        except ValueError:
            continue
        key = (preset, plan.short())
        if key in seen or violations(scn, plan):
            continue
        try:
            check_applicable(plan, scn.model, torch.device("cpu"))
            check_microbatches(plan, plan.grad_accumulation(GLOBAL_BATCH))
        except StratagemError:
            continue
        seen.add(key)
        out.append((preset, scn, plan))
    return out


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300, help="plans to trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every role's figures here")
    args = ap.parse_args(argv)

    import torch

    from stratagem.launch.trace.run import ANALYTIC_BLOCKS, trace_plan

    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for preset, scn, plan in sample_plans(args.n, args.seed):
        start = time.perf_counter()
        try:
            roles = trace_plan(scn, plan)
        except StratagemError as e:
            print(f"skip {preset} {plan.short()}: {e}", flush=True)
            continue
        for r in roles:
            peak = r.peak_bytes
            err = {b: abs(r.analytic[a] - r.blocks[b]) / peak for b, a in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True)}
            err["total"] = abs(r.analytic["peak"] - peak) / peak
            signed = {b: (r.analytic[a] - r.blocks[b]) / peak for b, a in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True)}
            axes = {"preset": preset, **{a: getattr(plan, a) for a in AXES[1:]}}
            rows.append({"plan": plan.short(), "role": r.role, "axes": axes, "error": err, "signed": signed,
                         "traced_gib": {b: r.blocks[b] / 2**30 for b in BLOCKS},
                         "analytic_gib": {b: r.analytic[a] / 2**30 for b, a in zip(BLOCKS, ANALYTIC_BLOCKS, strict=True)},
                         "peak_gib": peak / 2**30, "analytic_peak_gib": r.analytic["peak"] / 2**30})
        print(f"{preset:12s} {plan.short():60s} {time.perf_counter() - start:6.1f} s  total error "
              f"{max(x['error']['total'] for x in rows[-len(roles):]):.1%}", flush=True)
    if not rows:
        print("no plan traced")
        return 1
    print("\nerror per block, |analytic - traced| / traced peak (signed median: analytic - traced)")
    for b in (*BLOCKS, "total"):
        vals = [r["error"][b] for r in rows]
        signed = statistics.median(r["signed"][b] for r in rows) if b != "total" else float("nan")
        print(f"  {b:12s} median {statistics.median(vals):7.1%}  p90 {_q(vals, 0.9):7.1%}  signed median {signed:+7.1%}")
    print("\ntotal error per axis value (median, p90, roles)")
    for axis in AXES:
        groups: dict[str, list[float]] = {}
        for r in rows:
            groups.setdefault(str(r["axes"][axis]), []).append(r["error"]["total"])
        for value, vals in sorted(groups.items()):
            print(f"  {axis}={value:10s} {statistics.median(vals):7.1%} {_q(vals, 0.9):7.1%} {len(vals):4d}")
    print("\nworst ten (traced / analytic GiB per block)")
    for r in sorted(rows, key=lambda r: -r["error"]["total"])[:10]:
        parts = " ".join(f"{b[:4]} {r['traced_gib'][b]:.1f}/{r['analytic_gib'][b]:.1f}" for b in BLOCKS)
        print(f"  {r['error']['total']:6.1%} {r['axes']['preset']} {r['plan']} [{r['role']}]: {parts}; "
              f"peak {r['peak_gib']:.1f}/{r['analytic_peak_gib']:.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    totals = [r["error"]["total"] for r in rows]
    print(f"\nconfig: n={args.n} seed={args.seed} plans traced={len({(r['axes']['preset'], r['plan']) for r in rows})} "
          f"roles={len(rows)} global_batch={GLOBAL_BATCH} seq=8192 stack=torch; {time.perf_counter() - t0:.0f} s; "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print(f"FIGURE total peak error (analytic without overhead vs traced): median {statistics.median(totals):.1%}, "
          f"p90 {_q(totals, 0.9):.1%} (target 3% / 8%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
