"""How many real runs does a search need to find the best plan? Tabular benchmarks, baselines, regret curves.

    python bench/search_regret.py [--sweep FILE] [--table FILE ...] [--budget K] [--repeats R] [--json]
                                  [--plot regret.png] [--methods stratagem,random,...]

Every candidate's true outcome is known (a table of measured runs), so a method's cost to find the best plan is
exact and cheap to replay, as NAS-Bench-101 (Ying et al. 2019) and HPOBench (Eggensperger et al. 2021) compare
search methods. Instances:
  --sweep   each (model, nodes) group of a sweep in the format of bench/reference/playbook_sweep_calibration.json
            (default that file): its scenario from the file's `meta`, the group's plans as candidates, their
            measured tokens/s/GPU and peak memory as the truth. Runs whose recorded global batch contradicts
            dp x mbs x gas are left out, as are plans the validity rules refuse (counted).
  --table   a table measured here (bench/data/*.json, written by bench/measure_table.py), OOM runs included.
Methods (each spends "runs": one table lookup = one real run):
  stratagem         the real-run loop as shipped (search.session.SearchSession.measure with the shipped
                    run-order policy search.run_order.RankedOrder), restricted to the candidates, one run per
                    batch, refitting after each run (a refit kept only when it predicts held-out runs better);
  no_recalibration  the same loop and policy with recalibrate=False (the default constants throughout);
  analytic_order    the candidates in predicted order (fitting plans by predicted tokens/s, then the rest);
  random            a seeded random order;
  tpe, nsga2        Optuna's TPESampler / NSGAIISampler as black boxes over the candidates' axes (no analytic
                    model): each suggestion is projected onto the nearest untried candidate; objective measured
                    tokens/s/GPU (nsga2: and memory headroom); a run that fails scores 0;
  ds_autotuner      DeepSpeed's autotuner procedure (deepspeed/autotuning/README.md, "Autotuning Workflow and
                    Scope" and "Configuring Train Micro-Batch Size"): it tunes ZeRO stage and micro-batch for the
                    user's fixed model-parallel layout, so it is run per layout, layouts in increasing
                    model-parallel size (data parallel first). Per layout: ZeRO stages in the order 0,1,2,3, a
                    stage skipped when DeepSpeed's own model-state estimate (2+2+12 bytes/param, ZeRO-divided)
                    exceeds the device; within a stage the smallest micro-batch, then a binary search for the
                    largest runnable one, then up to num_tuning_micro_batch_sizes=3 micro-batches between them
                    (the fastest kept); the next stage only while the stage's best beats the previous stage's.
Figures per method: runs until the measured best is found (median and p90 over instances; not found within the
budget counts as budget + 1), the fraction of instances where it is found within 10 runs, regret after 1, 3, 5,
10 runs (1 - best found so far / true best, mean over instances and repeats), and the runs spent on plans that
failed (OOM or crash) before the best was found. The figure is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optuna

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratagem.errors import StratagemError  # noqa: E402
from stratagem.evaluators import evaluate_many  # noqa: E402
from stratagem.evaluators.table import OutcomeTable, TableEvaluator, TableOutcome, load_table  # noqa: E402
from stratagem.spaces import Plan, format_plan, violations  # noqa: E402
from stratagem.spaces.columns import PlanColumns  # noqa: E402

METHODS = ("stratagem", "no_recalibration", "analytic_order", "random", "tpe", "nsga2", "ds_autotuner")
AT = (1, 3, 5, 10)
DEFAULT_SWEEP = ROOT / "bench" / "reference" / "playbook_sweep_calibration.json"


# ---- instances ---------------------------------------------------------------------------------------------------
def sweep_tables(path: Path) -> tuple[list[OutcomeTable], dict[str, int]]:
    """One OutcomeTable per (model, nodes) group of a playbook-format sweep; counts of runs left out."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    dropped = {"contradictory_batch": 0, "duplicate": 0, "invalid": 0}
    for r in data["runs"]:
        if r["dp"] * r["mbs"] * r["gas"] != r["gbs"]:
            dropped["contradictory_batch"] += 1
            continue
        groups[(r["model"], int(r["nodes"]))].append(r)
    tables = []
    for (model, nodes), runs in sorted(groups.items(), key=lambda kv: (float(kv[0][0].rstrip("B")), kv[0][1])):
        m = meta["models"][model]
        scenario = {
            "model": {"name": f"nanotron-{model}", **{k: m[k] for k in (
                "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "tied_embeddings")}},
            "cluster": {"gpu": "h100-sxm-80g", "num_nodes": nodes, "gpus_per_node": 8},
            # meta["training"]: seq 4096, bf16, AdamW, no recompute, SP when tp > 1, 1F1B; gbs = dp*mbs*gas (256).
            "training": {"seq_len": 4096, "global_batch_size": runs[0]["gbs"], "optimizer": "adamw",
                         "stack": "nanotron"},
            "search": {"precision": "bf16", "activation_checkpointing": "none", "pp_schedule": "1f1b",
                       "cross_node_tp": "allow"},
        }
        table = OutcomeTable(name=f"{model} x {nodes} nodes", scenario=scenario, runs=[],
                             meta={"source": meta.get("source", str(path))})
        scn = table.load_scenario()
        outcomes: dict[str, TableOutcome] = {}
        for r in runs:
            plan = Plan(dp=r["dp"], tp=r["tp"], pp=r["pp"], zero_stage=r["zero"], micro_batch_size=r["mbs"],
                        sequence_parallel=r["tp"] > 1)
            if violations(scn, plan):
                dropped["invalid"] += 1
                continue
            key = format_plan(plan)
            if key in outcomes:  # the same plan measured twice: a tabular benchmark keeps one outcome, the first
                dropped["duplicate"] += 1
                continue
            outcomes[key] = TableOutcome(plan=key, status="ok", tokens_per_s_per_gpu=float(r["tok_s_gpu"]),
                                         peak_gib=float(r["mem_gb"]))
        if len(outcomes) >= 2:
            tables.append(table.model_copy(update={"runs": list(outcomes.values())}))
    return tables, dropped


class Truth:
    """The measured value of each candidate: tokens/s/GPU, 0 for a run that failed (OOM, crash)."""

    def __init__(self, table: OutcomeTable) -> None:
        self.table = table
        self.scenario = table.load_scenario()
        self.plans = table.plans()
        self.keys = [format_plan(p) for p in self.plans]
        self.outcomes = table.outcomes()
        self.value = {k: (o.tokens_per_s_per_gpu or 0.0) if o.status == "ok" else 0.0
                      for k, o in self.outcomes.items()}
        self.best = max(self.value.values())

    def failed(self, key: str) -> bool:
        """Whether the run of this plan failed (OOM or crash)."""
        return self.outcomes[key].status != "ok"


# ---- methods: each returns the plan keys in the order it spends runs ----------------------------------------------
class _Enough(Exception):
    """Raised from the loop's per-batch callback once more runs cannot change any figure."""


def order_stratagem(truth: Truth, budget: int, seed: int, recalibrate: bool = True) -> list[str]:
    """The shipped loop and run-order policy against the table: a SearchSession (journal storage in a temp dir)
    measuring with RankedOrder restricted to the candidates, one run per batch, exactly as `search --real-runs`
    drives them. The replay stops once the best plan has been run and at least max(AT) runs are spent: later
    runs change none of the figures (runs to the best, regret at 1..10)."""
    from stratagem.search.events import BatchDone, Event
    from stratagem.search.run_order import RankedOrder
    from stratagem.search.session import SearchSession

    scn = truth.scenario
    if seed and scn.search is not None:  # the loop is seeded by the scenario's search.seed
        scn = scn.model_copy(update={"search": scn.search.model_copy(update={"seed": seed})})
    evaluator = TableEvaluator(truth.table, slots=scn.cluster.num_gpus)

    def enough(event: Event) -> None:
        if not isinstance(event, BatchDone):
            return
        found = any(truth.value[k] >= truth.best * (1 - 1e-9) for k in evaluator.runs)
        if found and len(evaluator.runs) >= max(AT):
            raise _Enough

    with tempfile.TemporaryDirectory() as tmp:
        session = SearchSession(scn, f"journal:{tmp}/study.log", "regret", listener=enough)
        try:
            session.screen()
            session.store()
            session.measure(min(budget, len(truth.plans)), evaluator,
                            RankedOrder(candidates=PlanColumns.from_plans(truth.plans)), recalibrate=recalibrate)
        except _Enough:
            pass
    return list(evaluator.runs)


def order_analytic(truth: Truth) -> list[str]:
    """Predicted order with the default calibration: plans predicted to fit by tokens/s, then the others."""
    cols = evaluate_many(truth.scenario, truth.plans)
    fits = np.asarray(cols.fits) > 0
    tokens = np.asarray(cols.tokens_per_s)
    order = np.lexsort((-tokens, ~fits))
    return [truth.keys[i] for i in order]


def order_random(truth: Truth, seed: int) -> list[str]:
    """A seeded random permutation of the candidates."""
    rng = np.random.default_rng(seed)
    return [truth.keys[i] for i in rng.permutation(len(truth.keys))]


_AXES = ("dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate", "zero_stage", "sequence_parallel", "micro_batch_size",
         "precision", "activation_checkpointing", "recompute_layers", "pp_schedule", "virtual_stages",
         "optimizer_offload")


def order_blackbox(truth: Truth, budget: int, seed: int, kind: str) -> list[str]:
    """Optuna's TPE or NSGA-II as a black box: categorical axes (the values the candidates take), each suggestion
    projected onto the nearest untried candidate (axis-index distance), told the measured value."""
    dumps = [p.model_dump() for p in truth.plans]
    axes = [a for a in _AXES if len({str(d[a]) for d in dumps}) > 1]
    choices = {a: sorted({d[a] for d in dumps}, key=lambda v: (isinstance(v, str), v)) for a in axes}
    index = np.array([[choices[a].index(d[a]) for a in axes] for d in dumps], dtype=float)
    scale = np.array([max(1, len(choices[a]) - 1) for a in axes], dtype=float)
    dists = {a: optuna.distributions.CategoricalDistribution(choices[a]) for a in axes}
    if kind == "tpe":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=seed)
        study = optuna.create_study(direction="maximize", sampler=sampler)
    else:
        sampler = optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
        study = optuna.create_study(directions=["maximize", "maximize"], sampler=sampler)
    hbm = truth.scenario.cluster.gpu.hbm_gib
    tried: set[int] = set()
    order: list[str] = []
    while len(order) < min(budget, len(truth.keys)):
        trial = study.ask(dists)
        want = np.array([choices[a].index(trial.params[a]) for a in axes], dtype=float)
        d = np.abs(index - want) / scale
        dist = d.sum(axis=1) if len(axes) else np.zeros(len(truth.keys))
        dist[list(tried)] = np.inf
        i = int(np.argmin(dist))
        tried.add(i)
        key = truth.keys[i]
        order.append(key)
        out = truth.outcomes[key]
        value = truth.value[key]
        values: Any = value if kind == "tpe" else [value, (hbm - out.peak_gib) if out.peak_gib is not None else -hbm]
        params = {a: dumps[i][a] for a in axes}
        if params == trial.params:
            study.tell(trial, values)
        else:  # told what actually ran: the projected candidate
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, values=(
                [values] if kind == "tpe" else values)))
    return order


def order_ds_autotuner(truth: Truth) -> list[str]:
    """DeepSpeed's autotuner procedure per model-parallel layout (see the module docstring)."""
    scn = truth.scenario
    params = scn.model.num_params()
    hbm_bytes = scn.cluster.gpu.hbm_gib * 2**30
    by_layout: dict[tuple[int, int, int], dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    for p, k in zip(truth.plans, truth.keys, strict=True):
        by_layout[(p.tp * p.pp, p.tp, p.pp)][p.zero_stage][p.micro_batch_size] = k
    order: list[str] = []

    def run(key: str) -> float:
        if key not in order:
            order.append(key)
        return truth.value[key]

    for (mp, _tp, _pp), stages in sorted(by_layout.items()):
        dp = scn.cluster.num_gpus // mp
        previous_best = -math.inf
        for stage in sorted(stages):
            # DeepSpeed autotuner's memory estimate of model states per GPU (fp16 params+grads, 12 B Adam states),
            # divided by ZeRO stage (Rajbhandari et al. 2019, sec. 5) and by the model-parallel size.
            per_param = {0: 16.0, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[stage]
            if params / mp * per_param > hbm_bytes:
                continue
            mbs_keys = stages[stage]
            sizes = sorted(mbs_keys)
            if run(mbs_keys[sizes[0]]) <= 0:
                continue  # the smallest micro-batch does not run: the stage is not runnable
            lo, hi = 0, len(sizes) - 1  # binary search for the largest runnable micro-batch
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if run(mbs_keys[sizes[mid]]) > 0:
                    lo = mid
                else:
                    hi = mid - 1
            runnable = sizes[: lo + 1]
            pick = sorted({runnable[round(j * (len(runnable) - 1) / 2)] for j in range(3)}, reverse=True)
            best = max(run(mbs_keys[s]) for s in pick)
            best = max(best, max(truth.value[mbs_keys[s]] for s in runnable if mbs_keys[s] in order))
            if best <= previous_best:
                break
            previous_best = best
    rest = [k for k in truth.keys if k not in order]  # the autotuner stops; a user would then try the rest
    return order + rest


# ---- figures -------------------------------------------------------------------------------------------------------
def score(truth: Truth, order: Sequence[str], budget: int) -> dict[str, Any]:
    """Runs to the best, regret after k runs, failed runs before the best, for one method's run order."""
    best = truth.best
    found = next((i + 1 for i, k in enumerate(order[:budget]) if truth.value[k] >= best * (1 - 1e-9)), budget + 1)
    regret = {}
    for k in AT:
        seen = [truth.value[key] for key in order[:k]]
        regret[str(k)] = 1.0 - (max(seen) if seen else 0.0) / best
    spent = order[: min(found, budget)]
    return {"runs_to_best": found, "regret_at": regret, "oom_runs": sum(truth.failed(k) for k in spent)}


def summarise(scores: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every (instance, repeat): median/p90 runs to best, fraction found within 10, mean regret at
    1/3/5/10, total failed runs."""
    rtb = np.array([s["runs_to_best"] for s in scores], dtype=float)
    return {
        "runs_to_best_median": float(np.median(rtb)),
        "runs_to_best_p90": float(np.percentile(rtb, 90)),
        "found_within_10": float(np.mean(rtb <= 10)),
        "regret_at": {str(k): float(np.mean([s["regret_at"][str(k)] for s in scores])) for k in AT},
        "oom_runs": int(sum(s["oom_runs"] for s in scores)),
    }


def run_method(name: str, truth: Truth, budget: int, seed: int) -> list[str]:
    """The run order of method `name` on one instance."""
    table: dict[str, Callable[[], list[str]]] = {
        "stratagem": lambda: order_stratagem(truth, budget, seed),
        "no_recalibration": lambda: order_stratagem(truth, budget, seed, recalibrate=False),
        "analytic_order": lambda: order_analytic(truth),
        "random": lambda: order_random(truth, seed),
        "tpe": lambda: order_blackbox(truth, budget, seed, "tpe"),
        "nsga2": lambda: order_blackbox(truth, budget, seed, "nsga2"),
        "ds_autotuner": lambda: order_ds_autotuner(truth),
    }
    return table[name]()


# Methods whose run order does not depend on the seed: one repeat (the loop restricted to candidates makes no
# sampler proposals, so its order is a function of the table and the model alone).
DETERMINISTIC = {"analytic_order", "ds_autotuner", "stratagem", "no_recalibration"}


def plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Mean regret vs runs spent, one line per method, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=110)
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=name,
                linewidth=2.5 if name == "stratagem" else 1.2)
    ax.set(title=title, xlabel="real runs spent", ylabel="mean regret (1 - best found / true best)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"plot: wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=None, help="playbook-format sweep (default: the reference one)")
    ap.add_argument("--table", type=Path, action="append", default=[], help="a measured table (repeatable)")
    ap.add_argument("--budget", type=int, default=20, help="runs each method may spend per instance")
    ap.add_argument("--repeats", type=int, default=3, help="seeded repeats of the randomised methods")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "regret.png", help="regret-vs-runs plot")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or args.budget < 1 or args.repeats < 1:
        print(f"error: --methods {bad} unknown (valid: {', '.join(METHODS)}), or --budget/--repeats < 1",
              file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.perf_counter()
    try:
        tables: list[OutcomeTable] = []
        dropped: dict[str, int] = {}
        if args.sweep is not None or not args.table:
            tables, dropped = sweep_tables(args.sweep or DEFAULT_SWEEP)
        tables += [load_table(p) for p in args.table]
    except StratagemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = max(args.budget, max(AT))
    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    curves: dict[str, np.ndarray] = {m: np.zeros(budget) for m in methods}
    counts: dict[str, int] = {m: 0 for m in methods}
    per_instance: list[dict[str, Any]] = []
    for table in tables:
        truth = Truth(table)
        row: dict[str, Any] = {"instance": table.name, "candidates": len(truth.keys)}
        for m in methods:
            reps = 1 if m in DETERMINISTIC else args.repeats
            found = []
            for r in range(reps):
                order = run_method(m, truth, budget, seed=r)
                s = score(truth, order, budget)
                per_method[m].append(s)
                found.append(s["runs_to_best"])
                values = [truth.value[k] for k in order[:budget]]
                best_so_far = np.maximum.accumulate(np.array(values + [values[-1]] * (budget - len(values))))
                curves[m] += 1.0 - best_so_far / truth.best
                counts[m] += 1
            row[m] = float(np.median(found))
        per_instance.append(row)
    summary = {m: summarise(per_method[m]) for m in methods}
    out = {"methods": summary, "instances": len(tables)}
    plot({m: (curves[m] / max(1, counts[m])).tolist() for m in methods}, args.plot,
         f"Regret vs real runs ({len(tables)} instances)")
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"instances: {len(tables)} ({sum(len(t.runs) for t in tables)} candidate plans); left out of the sweep: "
          f"{dropped}")
    print("runs to the best, per instance (median over repeats):")
    print("  " + f"{'instance':18s}{'n':>4s}" + "".join(f"{m[:12]:>13s}" for m in methods))
    for row in per_instance:
        print("  " + f"{row['instance']:18s}{row['candidates']:4d}" + "".join(f"{row[m]:13.0f}" for m in methods))
    print()
    print(f"  {'method':18s}{'rtb med':>8s}{'rtb p90':>8s}{'<=10':>6s}" + "".join(f"{'R@' + str(k):>7s}" for k in AT)
          + f"{'failed':>7s}")
    for m in methods:
        s = summary[m]
        print(f"  {m:18s}{s['runs_to_best_median']:8.1f}{s['runs_to_best_p90']:8.1f}{s['found_within_10']:6.0%}"
              + "".join(f"{s['regret_at'][str(k)]:7.3f}" for k in AT) + f"{s['oom_runs']:7d}")
    print(f"\nconfig: budget {budget}, repeats {args.repeats}; python {platform.python_version()}, optuna "
          f"{optuna.__version__}, numpy {np.__version__}; {seconds:.0f} s")
    s = summary.get("stratagem")
    if s:
        print(f"FIGURE search regret: stratagem finds the measured best in {s['runs_to_best_median']:.0f} runs "
              f"(median; p90 {s['runs_to_best_p90']:.0f}), within 10 runs in {s['found_within_10']:.0%} of "
              f"{len(tables)} instances (target: median <= 3, >= 90%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
