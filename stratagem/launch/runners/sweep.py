"""Single-device plans run one after the other in this process, each set beside the analytic prediction.

    python -m stratagem.launch.runners.sweep --scenario S.yaml --out DIR [--grid] [--plans "mbs=1;mbs=2,ac=full"]
        [--gpu auto|PRESET] [--steps 5 | --step-budget-s S [--min-steps A] [--max-steps B]] [--warmup 2]

--grid runs precision {bf16, fp32} x micro-batch {1, 2, 4} x recompute {none, selective, full}. The scenario's
cluster becomes one device of --gpu (auto: the preset matching this CUDA device; cpu without one). Per plan
it writes DIR/<label>.json (the harness result, or the OOM / failure) and finally DIR/summary.json, and
prints predicted vs measured peak memory and tokens/s. A CUDA OOM is a result (status "oom"), not a crash.
Used by scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from stratagem.evaluators.analytic import evaluate
from stratagem.launch.harness.budget import DEFAULT_MAX_STEPS, DEFAULT_MIN_STEPS, StepBudget
from stratagem.launch.harness.run import run_plan
from stratagem.spaces.hardware import ClusterSpec, gpu_preset
from stratagem.spaces.plan import Plan, format_plan, parse_plan
from stratagem.spaces.scenario import Scenario, load_scenario
from stratagem.units import GIB

__all__ = ["GRID", "detect_gpu", "single_device", "run_sweep", "table", "main"]

GRID = [f"precision={p},mbs={m},ac={a}" for p, m, a in
        itertools.product(("bf16", "fp32"), (1, 2, 4), ("none", "selective", "full"))]


def detect_gpu() -> str:
    """The GPU preset for this machine's CUDA device 0, or "cpu" without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).upper()
    mem_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    for key, preset in (("H200", "h200"), ("B200", "b200"), ("L40S", "l40s"), ("MI300", "mi300x")):
        if key in name:
            return preset
    if "H100" in name:
        return "h100-96g" if mem_gib > 85 else "h100-sxm-80g"
    if "A100" in name:
        return "a100-80g" if mem_gib > 45 else "a100-40g"
    raise SystemExit(f"gpu ({torch.cuda.get_device_name(0)}): no preset matches; pass --gpu PRESET")


def single_device(scenario: Scenario, gpu: str) -> Scenario:
    """The scenario on one device of preset `gpu`."""
    cluster = ClusterSpec(gpu=gpu_preset(gpu), num_nodes=1, gpus_per_node=1)
    return scenario.model_copy(update={"cluster": cluster})


def _label(plan: Plan) -> str:
    return plan.short().replace(" ", "_")


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_one(scenario: Scenario, plan: Plan, steps: int, warmup: int, seed: int,
            budget: StepBudget | None = None) -> dict[str, Any]:
    """Prediction and measurement of one plan (`steps` timed steps, or as many as `budget` buys); status
    ok | oom | failed."""
    ev = evaluate(scenario, plan)
    entry: dict[str, Any] = {"plan": format_plan(plan), "label": plan.short(),
                             "predicted": ev.model_dump(mode="json")}
    try:
        entry["result"] = run_plan(scenario, plan, None if budget is not None else steps, warmup, seed,
                                   checkpoint=False, budget=budget)
        entry["status"] = "ok"
    except torch.cuda.OutOfMemoryError as e:
        entry.update(status="oom", reason=str(e).splitlines()[0])
    except Exception as e:  # noqa: BLE001 - one failing plan must not stop the sweep
        entry.update(status="failed", reason=f"{type(e).__name__}: {e}".splitlines()[0],
                     traceback=traceback.format_exc())
    finally:
        _free_memory()
    return entry


def run_sweep(scenario: Scenario, plans: list[Plan], out: Path, steps: int, warmup: int,
              seed: int = 0, budget: StepBudget | None = None) -> list[dict[str, Any]]:
    """Run each plan through the harness in turn and write one JSON result per plan under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for plan in plans:
        entry = run_one(scenario, plan, steps, warmup, seed, budget)
        (out / f"{_label(plan)}.json").write_text(json.dumps(entry, indent=1))
        entries.append(entry)
        print(f"{entry['status']:6} {entry['label']}", file=sys.stderr, flush=True)
    summary = [_row(e) for e in entries]
    (out / "summary.json").write_text(json.dumps({"scenario": scenario.model_dump(mode="json"),
                                                  "rows": summary}, indent=1))
    return entries


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    pred = entry["predicted"]
    mem, thr = pred.get("memory") or {}, pred.get("throughput") or {}
    row: dict[str, Any] = {"plan": entry["plan"], "label": entry["label"], "status": entry["status"],
                           "predicted_peak_gib": mem.get("peak_gib"), "predicted_status": pred.get("status"),
                           "predicted_tokens_per_s": thr.get("tokens_per_s")}
    result = entry.get("result")
    if result:
        rank = result["ranks"][0]
        row.update(measured_peak_gib=rank.get("peak_reserved_bytes", rank["peak_bytes"]) / GIB,
                   measured_allocated_gib=rank.get("peak_allocated_bytes", rank["peak_bytes"]) / GIB,
                   measured_tokens_per_s=result["tokens_per_s"], step_s=result["step_s"])
    return row


def table(entries: list[dict[str, Any]]) -> str:
    """Predicted vs measured, one line per plan (peak: reserved on CUDA, tracked live bytes on CPU)."""
    head = (f"{'plan':28} {'status':6} {'pred GiB':>9} {'meas GiB':>9} {'alloc GiB':>9} {'mem err':>8} "
            f"{'pred tok/s':>11} {'meas tok/s':>11} {'tok err':>8}")
    lines = [head, "-" * len(head)]

    def num(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, int | float) else "-"

    for e in entries:
        r = _row(e)
        mem_err = tok_err = None
        if r.get("measured_peak_gib") and r["predicted_peak_gib"]:
            mem_err = r["predicted_peak_gib"] / r["measured_peak_gib"] - 1
        if r.get("measured_tokens_per_s") and r["predicted_tokens_per_s"]:
            tok_err = r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1
        lines.append(f"{r['label'][:28]:28} {r['status']:6} {num(r['predicted_peak_gib'], '9.3f')} "
                     f"{num(r.get('measured_peak_gib'), '9.3f')} {num(r.get('measured_allocated_gib'), '9.3f')} "
                     f"{num(mem_err, '+8.1%')} {num(r['predicted_tokens_per_s'], '11.0f')} "
                     f"{num(r.get('measured_tokens_per_s'), '11.0f')} {num(tok_err, '+8.1%')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line of `python -m stratagem.launch.runners.sweep`; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m stratagem.launch.runners.sweep", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", required=True)
    p.add_argument("--out", required=True, help="directory for the JSON results")
    p.add_argument("--plans", default=None, help='";"-separated plans (default: --grid)')
    p.add_argument("--grid", action="store_true", help="precision x micro-batch x recompute (18 plans)")
    p.add_argument("--gpu", default="auto", help="GPU preset of this device (auto: detect; cpu: no GPU)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (without --step-budget-s)")
    p.add_argument("--step-budget-s", type=float, default=None,
                   help="time N steps, N = clamp(budget / warm-up step, --min-steps, --max-steps) (harness.budget)")
    p.add_argument("--min-steps", type=int, default=DEFAULT_MIN_STEPS)
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    gpu = detect_gpu() if args.gpu == "auto" else args.gpu
    scenario = single_device(load_scenario(args.scenario), gpu)
    texts = GRID if args.grid or not args.plans else [t for t in args.plans.split(";") if t.strip()]
    plans = [parse_plan(t) for t in texts]
    budget = None if args.step_budget_s is None else StepBudget(
        budget_s=args.step_budget_s, min_steps=args.min_steps, max_steps=args.max_steps)
    entries = run_sweep(scenario, plans, Path(args.out), args.steps, args.warmup, args.seed, budget)
    print(f"{scenario.model.name} ({scenario.model.num_params() / 1e9:.2f} B parameters) on one {gpu}; "
          f"seq {scenario.training.seq_len}, global batch {scenario.training.global_batch_size}")
    print(table(entries))
    return 0 if all(e["status"] in ("ok", "oom") for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
