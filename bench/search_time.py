"""Wall time of a whole `stratagem search` (process start to exit: imports, space, analytic screening, Pareto
front, storing trials in a fresh SQLite file), for

  1. llama3-405b on 1024 H100s (examples/llama3-405b-1024xh100.yaml as it is: 153,888 valid plans), and
  2. a ~1,000,000-plan space: mixtral-8x7b on 64 H200s with HSDP (every dp_replicate) and optimizer offload
     opened, recompute none/full (1,045,884 valid plans),

each run `--repeat` times (best and median reported), plus the phases measured in-process and the per-trial
storage cost (SQLite and journal). Target: under 10 s each on the 2-core machine. The figure is printed last.

    .venv/bin/python bench/search_time.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = {
    "llama3-405b-1024xh100": ("llama3-405b-1024xh100.yaml", {}),
    "mixtral-8x7b-64xh200-1M": ("mixtral-8x7b-64xh200.yaml", {
        "precision": ["fp32", "bf16", "fp8"], "dp_replicate": {"min": 1}, "optimizer_offload": ["none", "cpu"],
        "activation_checkpointing": ["none", "full"]}),
}  # each search section replaces the example's; {} keeps the example's own


def scenario_file(tmp: Path, name: str) -> Path:
    example, search = CASES[name]
    data = yaml.safe_load((ROOT / "examples" / example).read_text())
    if search:
        data["search"] = search
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def whole_command(path: Path, url: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "stratagem.cli", "search", str(path), "--storage", url, "--json"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    return time.perf_counter() - t0, json.loads(out.stdout)


def phases(path: Path, tmp: Path) -> dict[str, float]:
    """The same search in-process, phase by phase (imports already paid)."""
    from stratagem.search import SearchSession, screen
    from stratagem.search.events import Phase
    from stratagem.spaces import SearchSpace, load_scenario

    s = load_scenario(path)
    t0 = time.perf_counter()
    space = SearchSpace(s)
    t1 = time.perf_counter()
    plans = space.enumerate()
    t2 = time.perf_counter()
    from stratagem.evaluators import evaluate_many

    evaluate_many(s, plans.take(slice(0, min(len(plans), 250_000))))
    t3 = time.perf_counter()
    sc = screen(s, space=space)
    t4 = time.perf_counter()
    marks: dict[str, float] = {}

    def progress(phase: str, done: int, total: int) -> None:
        marks.setdefault(phase + "_start", time.perf_counter())
        marks[phase + "_end"] = time.perf_counter()

    session = SearchSession(s, f"sqlite:///{tmp}/phases-{path.stem}.db", "p",
                            listener=lambda e: progress(e.phase, e.done, e.total) if isinstance(e, Phase) else None)
    session.screen()
    r = session.store()
    store = marks.get("store_end", 0.0) - marks.get("store_start", 0.0)
    return {"space_build_s": t1 - t0, "enumerate_s": t2 - t1,
            "evaluate_250k_s": t3 - t2, "screen_s (enumerate+evaluate+front)": t4 - t3,
            "store_s": store, "stored_trials": r.stored, "valid": sc.counts.valid, "front": sc.counts.front}


def storage_cost(tmp: Path, n: int = 100) -> dict[str, float]:
    """ms per trial written whole (study.add_trial) to SQLite and to a journal file."""
    import optuna

    from stratagem.evaluators import evaluate
    from stratagem.search.storage import open_storage, parse_storage
    from stratagem.search.study import evaluation_trial, provenance
    from stratagem.spaces import SearchSpace, load_scenario

    s = load_scenario(ROOT / "examples" / "llama3-8b-8xh100.yaml")
    space = SearchSpace(s)
    pc = space.decode(space.sample_numbers(n, seed=0))
    prov = provenance(s, space)
    trials = [evaluation_trial(space, evaluate(s, pc.plan(i)), 77.6, "sample", prov) for i in range(n)]
    out = {}
    for url in (f"sqlite:///{tmp}/cost.db", f"journal:{tmp}/cost.log"):
        study = optuna.create_study(storage=open_storage(parse_storage(url)), study_name="c",
                                    directions=["maximize", "maximize", "minimize"])
        t0 = time.perf_counter()
        for t in trials:
            study.add_trial(t)
        out[url.split(":")[0]] = (time.perf_counter() - t0) / n * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import numpy
    import optuna

    import stratagem

    print(f"stratagem {stratagem.__version__}, optuna {optuna.__version__}, numpy {numpy.__version__}, "
          f"python {platform.python_version()}, {platform.machine()}, cpus {__import__('os').cpu_count()}")
    figures = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cost = storage_cost(tmp)
        print(f"storage cost per trial (add_trial, whole trial in one write): sqlite {cost['sqlite']:.1f} ms, "
              f"journal {cost['journal']:.1f} ms")
        for name in CASES:
            path = scenario_file(tmp, name)
            print(f"\n{name}: search section {CASES[name][1] or 'of the example'}")
            ph = phases(path, tmp)
            print("  in-process: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v:,}"
                                               for k, v in ph.items()))
            times = []
            for i in range(args.repeat):
                wall, out = whole_command(path, f"sqlite:///{tmp}/{name}-{i}.db")
                times.append(wall)
                c = out["counts"]
                print(f"  run {i + 1}: {wall:.2f} s  (valid {c['valid']:,}, screened {c['screened']:,}, pruned "
                      f"{c['pruned']:,}, front {c['front']}, trials stored {out['stored']})")
            figures[name] = (min(times), statistics.median(times), out["counts"]["valid"])
    print()
    print("whole `stratagem search` wall time, fresh SQLite storage (target < 10 s): " + "; ".join(
        f"{k} ({v[2]:,} plans) best {v[0]:.2f} s, median {v[1]:.2f} s" for k, v in figures.items()))


if __name__ == "__main__":
    main()
