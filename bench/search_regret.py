"""How many real runs does a search need to find the best plan? Tabular benchmarks, out of sample, with OOMs,
noise and the baselines people use.

    python bench/search_regret.py [--sweep FILE] [--table FILE ...] [--budget K] [--repeats R] [--methods ...]
                                  [--folding model|nodes] [--refit-folds] [--json [PATH]] [--plot PNG]
    python bench/search_regret.py --readme       # rewrite README's generated block from bench/data/regret.json

Every candidate's measured outcome is known (a table of measured runs), so a method's cost to find the best plan
is exact and cheap to replay, as NAS-Bench-101 (Ying et al. 2019) and HPOBench (Eggensperger et al. 2021)
compare search methods. Suites (default: the sweep and every measured table in bench/data):
  sweep   each (model, nodes) group of a sweep in the format of bench/reference/playbook_sweep_calibration.json:
          its scenario from the file's `meta`, the group's plans as candidates (runs whose recorded global batch
          contradicts dp x mbs x gas, or that the validity rules refuse, are left out and counted). The shipped
          constants were fitted on it, so it is replayed twice: in sample (shipped constants) and out of sample
          (constants refitted per fold without the instance's fold: regret/folds.py, cached in
          bench/data/regret-folds.json; --refit-folds refits them).
  table   a table measured here (bench/data/*table*.json by bench/measure_table.py): OOM runs included, each
          plan run several times; a method's run draws one sample (regret/instances.py). Its calibration (the
          cpu device's defaults) was fitted on other runs, never on the table. The history table
          (cpu-table.json) was measured when the torch space still held ZeRO-1 and selective recompute: its
          plans stay as the harness ran them, and the loop's space holds them (regret/space.py).
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
import subprocess
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
from regret.replay import METHODS, cpu_by_method, run_tasks, suite_tasks, summarise_suite  # noqa: E402
from regret.report import plot, rewrite_readme, text_table  # noqa: E402

from stratagem.errors import StratagemError  # noqa: E402
from stratagem.evaluators.table import EPSILON_RULE, load_table  # noqa: E402
from stratagem.spaces.space import SearchSpace  # noqa: E402

DATA = ROOT / "bench" / "data"
DEFAULT_SWEEP = ROOT / "bench" / "reference" / "playbook_sweep_calibration.json"
DEFAULT_TABLE = DATA / "cpu-table.json"
"""The history table: measured when the torch space still held ZeRO-1 and selective recompute."""
TABLE_GLOB = "*table*.json"
"""The measured tables in bench/data (bench/measure_table.py writes them; none of the other files matches)."""
DEFAULT_JSON = DATA / "regret.json"
DEFAULT_PLOT = DATA / "regret.png"
README = ROOT / "README.md"
TRACED = ("not replayed: no table has a traced figure per plan. The sweep's runs are nanotron's on H100, "
          "which a trace of this project's harness does not describe; the CPU tables record measured samples "
          "only (bench/measure_table.py traces nothing), so `--trace` on or off would replay the same runs.")


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=None, help="playbook-format sweep (default: the reference one)")
    ap.add_argument("--table", type=Path, action="append", default=[], help="a measured table (repeatable)")
    ap.add_argument("--budget", type=int, default=10, help="runs each method may spend per instance")
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


Suite = tuple[str, list[Instance], dict[str, Any] | None, dict[str, Any]]
"""(name, instances, folds document or None, suite header)."""


def default_tables() -> list[Path]:
    """Every measured table in bench/data (TABLE_GLOB), the history table first."""
    found = sorted(DATA.glob(TABLE_GLOB))
    return sorted(found, key=lambda p: p != DEFAULT_TABLE)


def _outside(instance: Instance) -> int:
    """How many of the instance's plans today's search space of its scenario leaves out (regret/space.py)."""
    space = SearchSpace(instance.table.load_scenario())
    out = 0
    for plan in instance.table.plans():
        try:
            space.params(plan)
        except StratagemError:
            out += 1
    return out


def table_suite(path: Path) -> Suite:
    """A measured table as a suite of one instance (out of sample: the device's default calibration)."""
    table = load_table(path)
    inst = table_instance(table)
    outside = _outside(inst)
    note = (f"; {outside} of its plans lie outside today's search space of its scenario, the replay's space holds "
            "them (bench/regret/space.py)" if outside else "")
    head = _suite_meta(f"{path.name} (measured here, {table.name})", [inst],
                       "the cpu device's default constants, fitted on other runs, never on this table" + note)
    return path.stem, [inst], None, head


def sweep_suite(sweep: Path, folds: Path, folding: str, refit: bool = False) -> Suite:
    """Every (model, nodes) group of a playbook-format sweep, in and out of sample (module docstring)."""
    instances, dropped = sweep_instances(sweep)
    if refit:
        fit_folds(list(FOLDINGS), sweep, sweep.parent, folds)
    head = _suite_meta(
        "published sweep (Ultra-Scale Playbook, nanotron on H100)", instances,
        f"in sample (shipped): the shipped constants, fitted on all of it; in sample (refit): the folds' fit "
        f"from their neutral start on every group; out of sample: the same fit without the instance's "
        f"{folding} fold (bench/regret/folds.py)")
    return "sweep", instances, load_folds(folds), {**head, "dropped": dropped}


def _suites(args: argparse.Namespace) -> list[Suite]:
    """The suites the arguments name: the sweep and every table by default; only those given otherwise."""
    out: list[Suite] = []
    if args.sweep is not None or not args.table:
        out.append(sweep_suite(args.sweep or DEFAULT_SWEEP, args.folds, args.folding, args.refit_folds))
    out += [table_suite(p) for p in (args.table or default_tables())]
    return out


def _commit() -> str:
    """The checkout's commit (what code produced the figures), with '+' when files differ from it; '' outside git."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+" if dirty else "")


def replay(suites: list[Suite], methods: list[str], budget: int, repeats: int, jobs: int, folding: str = "model",
           command: str = "") -> dict[str, Any]:
    """Every method on every suite's instances (one pool over all replays); the results document."""
    planned = [suite_tasks(inst, methods, budget, repeats, folds, folding) for _, inst, folds, _ in suites]
    every = [t for _, tasks in planned for t in tasks]
    results = run_tasks(every, jobs)  # one pool over every suite's replays
    out: dict[str, Any] = {}
    start = 0
    config = {"budget": budget, "repeats": repeats, "folding": folding, "commit": _commit(),
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "python": platform.python_version(),
              "optuna": optuna.__version__, "numpy": np.__version__}
    for (name, inst, folds, head), (columns, tasks) in zip(suites, planned, strict=True):
        mine = results[start:start + len(tasks)]
        start += len(tasks)
        cpu = {m: round(v, 1) for m, v in cpu_by_method(tasks, mine).items()}
        out[name] = {**head, "command": command, "config": {**config, "cpu_s_by_method": cpu},
                     **summarise_suite(inst, methods, columns, tasks, mine, folds, folding)}
    return {"suites": out, "traced": TRACED}


def _run(args: argparse.Namespace, methods: list[str]) -> dict[str, Any]:
    return replay(_suites(args), methods, args.budget, args.repeats, args.jobs, args.folding,
                  "python bench/search_regret.py " + " ".join(sys.argv[1:]))


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
    for name, suite in doc["suites"].items():  # where the time goes (also in each suite's config)
        cpu = suite["config"]["cpu_s_by_method"]
        print(f"{name}: CPU s by method: " + ", ".join(f"{m} {v:g}" for m, v in cpu.items()), file=sys.stderr)
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
