"""How many real runs does a search need to find the best plan? Tabular benchmarks, out of sample, with OOMs,
noise and the baselines people use.

    python bench/search_regret.py [--sweep FILE] [--table FILE ...] [--budget K] [--repeats R] [--methods ...]
                                  [--folding model|nodes] [--refit-folds] [--json [PATH]] [--plot PNG]
    python bench/search_regret.py --readme       # rewrite README's generated block from bench/data/regret.json

Every candidate's measured outcome is known (a table of measured runs), so a method's cost to find the best plan
is exact and cheap to replay, as NAS-Bench-101 (Ying et al. 2019) and HPOBench (Eggensperger et al. 2021)
compare search methods. Suites (default: both):
  sweep   each (model, nodes) group of a sweep in the format of bench/reference/playbook_sweep_calibration.json:
          its scenario from the file's `meta`, the group's plans as candidates (runs whose recorded global batch
          contradicts dp x mbs x gas, or that the validity rules refuse, are left out and counted). The shipped
          constants were fitted on it, so it is replayed twice: in sample (shipped constants) and out of sample
          (constants refitted per fold without the instance's fold: regret/folds.py, cached in
          bench/data/regret-folds.json; --refit-folds refits them).
  table   a table measured here (bench/data/cpu-table.json by bench/measure_table.py): OOM runs included, each
          plan run several times; a method's run draws one sample (regret/instances.py). Its calibration (the
          cpu device's defaults) was fitted on other runs, never on the table.
Methods: regret/methods.py (the shipped loop, its analytic order, the rule, the decision tree, random, TPE,
NSGA-II) and regret/procedures.py (DeepSpeed's autotuner, NeMo's AutoConfigurator); figures: regret/scoring.py.
`--json` writes the document (default bench/data/regret.json, `-` for stdout), replacing the suites it replays
and keeping the others (each suite records its command and configuration); the README's section "How many real
runs the search needs" is generated from that committed file (`--readme`; tests/bench checks they agree).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import optuna  # noqa: E402
from regret.folds import DEFAULT_FOLDS_FILE, FOLDINGS, fit_folds, load_folds  # noqa: E402
from regret.instances import Instance, Truth, sweep_instances, table_instance  # noqa: E402
from regret.replay import METHODS, run_tasks, suite_tasks, summarise_suite  # noqa: E402
from regret.report import plot, rewrite_readme, text_table  # noqa: E402

from stratagem.errors import StratagemError  # noqa: E402
from stratagem.evaluators.table import EPSILON_RULE, load_table  # noqa: E402

DEFAULT_SWEEP = ROOT / "bench" / "reference" / "playbook_sweep_calibration.json"
DEFAULT_TABLE = ROOT / "bench" / "data" / "cpu-table.json"
DEFAULT_JSON = ROOT / "bench" / "data" / "regret.json"
DEFAULT_PLOT = ROOT / "bench" / "data" / "regret.png"
README = ROOT / "README.md"
TRACED = ("not replayed: neither table has a traced figure per plan. The sweep's runs are nanotron's on H100, "
          "which a trace of this project's harness does not describe; the CPU table records measured samples "
          "only (bench/measure_table.py traces nothing), so `--trace` on or off would replay the same runs.")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=None, help="playbook-format sweep (default: the reference one)")
    ap.add_argument("--table", type=Path, action="append", default=[], help="a measured table (repeatable)")
    ap.add_argument("--budget", type=int, default=20, help="runs each method may spend per instance (>= 10)")
    ap.add_argument("--repeats", type=int, default=3, help="seeds per randomised method or noisy table")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--folding", choices=sorted(FOLDINGS), default="model",
                    help="out-of-sample folds of the sweep: by model size or by node band")
    ap.add_argument("--folds", type=Path, default=DEFAULT_FOLDS_FILE, help="fitted folds file")
    ap.add_argument("--refit-folds", action="store_true", help="refit the folds' constants first (minutes)")
    ap.add_argument("--jobs", type=int, default=1, help="replays at a time (processes)")
    ap.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="regret-vs-runs plot (PNG)")
    ap.add_argument("--json", nargs="?", const=str(DEFAULT_JSON), default=None, metavar="PATH",
                    help="write the results document (default bench/data/regret.json; '-' for stdout)")
    ap.add_argument("--readme", action="store_true",
                    help="rewrite README's generated block from bench/data/regret.json (no replay) and exit")
    return ap.parse_args(argv)


def _suite_meta(title: str, instances: list[Instance], calibration_text: str) -> dict[str, Any]:
    truths = [Truth(i) for i in instances]
    eps = max((t.epsilon for t in truths), default=0.0)
    failed = sum(sum(t.failed_median(k) for k in t.keys) for t in truths)
    plans = sum(len(t.keys) for t in truths)
    return {"title": title, "instances": len(instances), "candidates": plans,
            "failed_share": failed / plans if plans else 0.0,
            "epsilon": eps, "epsilon_text": (f"{eps:.1%} ({EPSILON_RULE.split(';')[0]})" if eps > 0
                                             else "0 (one measurement per plan: the best plan itself)"),
            "calibration_text": calibration_text}


def _suites(args: argparse.Namespace) -> list[tuple[str, list[Instance], dict[str, Any] | None, dict[str, Any]]]:
    """(name, instances, folds document or None, suite header) per suite."""
    out: list[tuple[str, list[Instance], dict[str, Any] | None, dict[str, Any]]] = []
    if args.sweep is not None or not args.table:
        sweep = args.sweep or DEFAULT_SWEEP
        instances, dropped = sweep_instances(sweep)
        if args.refit_folds:
            fit_folds(list(FOLDINGS), sweep, sweep.parent, args.folds)
        head = _suite_meta(
            "published sweep (Ultra-Scale Playbook, nanotron on H100)", instances,
            f"in sample (shipped): the shipped constants, fitted on all of it; in sample (refit): the folds' fit "
            f"from their neutral start on every group; out of sample: the same fit without the instance's "
            f"{args.folding} fold (bench/regret/folds.py)")
        out.append(("sweep", instances, load_folds(args.folds), {**head, "dropped": dropped}))
    for path in args.table or [DEFAULT_TABLE]:
        table = load_table(path)
        head = _suite_meta(f"{path.name} (measured here, {table.name})", [table_instance(table)],
                           "the cpu device's default constants, fitted on other runs, never on this table")
        out.append((path.stem, [table_instance(table)], None, head))
    return out


def _run(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    budget = max(args.budget, 10)
    suites = _suites(args)
    planned = [suite_tasks(inst, methods, budget, args.repeats, folds, args.folding) for _, inst, folds, _ in suites]
    every = [t for _, tasks in planned for t in tasks]
    results = run_tasks(every, args.jobs)  # one pool over every suite's replays
    out: dict[str, Any] = {}
    start = 0
    config = {"budget": budget, "repeats": args.repeats, "folding": args.folding,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "python": platform.python_version(),
              "optuna": optuna.__version__, "numpy": np.__version__}
    command = "python bench/search_regret.py " + " ".join(sys.argv[1:])
    for (name, inst, folds, head), (columns, tasks) in zip(suites, planned, strict=True):
        mine = results[start:start + len(tasks)]
        start += len(tasks)
        out[name] = {**head, "command": command, "config": config,
                     **summarise_suite(inst, methods, columns, tasks, mine, folds, args.folding)}
    return {"suites": out, "traced": TRACED}


def _write(doc: dict[str, Any], path: Path) -> None:
    """Write the document; suites already in the file that this run did not replay are kept (each suite records
    the command and configuration that produced it)."""
    if path.exists():
        old = json.loads(path.read_text())
        doc = {**doc, "suites": {**old.get("suites", {}), **doc["suites"]}}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.readme:
        changed = rewrite_readme(README, json.loads(DEFAULT_JSON.read_text()))
        print(f"README.md: generated block {'rewritten' if changed else 'already up to date'}", file=sys.stderr)
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or args.budget < 1 or args.repeats < 1 or args.jobs < 1:
        print(f"error: --methods {','.join(bad)} unknown (valid: {', '.join(METHODS)}), or --budget/--repeats/--jobs < 1",
              file=sys.stderr)
        return 2
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.perf_counter()
    try:
        doc = _run(args, methods)
    except StratagemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for suite in doc["suites"].values():
        suite["config"]["seconds"] = round(time.perf_counter() - t0)
    print("\n".join(text_table(doc)))
    if args.json == "-":
        print(json.dumps(doc, indent=1))
    elif args.json:
        _write(doc, Path(args.json))
        doc = json.loads(Path(args.json).read_text())
        print(f"json: wrote {args.json}", file=sys.stderr)
    plot(doc, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
