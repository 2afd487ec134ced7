"""Per-trial storage cost: SQLite file vs PostgreSQL (and a journal file), for the two ways stratagem writes.

  analytic: `study.add_trial(evaluation_trial(...))`, one finished trial per screened plan (search/runner.py);
  measured: claim (RUNNING trial) + finish (attributes, state, values) per real run (search/claims.py).

    nice -n -10 python bench/storage_per_trial.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/bench \
        [--n 200] [--rounds 3]

The PostgreSQL URL is optional (without it only the file storages are timed). The storages take turns, round
after round (a shared machine's load drifts: timing one storage after the other would bias the ratio). Prints ms
per trial per round, the median and best (least disturbed) round, last line their ratios with config and
versions.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import optuna
import sqlalchemy

from stratagem.evaluators import evaluate
from stratagem.search.claims import claim, finish
from stratagem.search.storage import open_storage, parse_storage
from stratagem.search.study import evaluation_trial, open_study, provenance
from stratagem.spaces import SearchSpace, load_scenario

SCENARIO = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def time_storage(url: str, n: int) -> tuple[float, float]:
    """(analytic ms/trial, measured ms/trial) on a new study in `url`."""
    scn = load_scenario(SCENARIO)
    space = SearchSpace(scn)
    spec = parse_storage(url)
    backend = open_storage(spec)
    study = open_study(backend, spec, f"bench-{time.time_ns()}", scn, space)
    plans = [space.enumerate().plan(i) for i in range(min(n, space.count()))]
    evs = [evaluate(scn, p) for p in plans]
    usable = scn.cluster.gpu.hbm_gib - space.config.memory_margin_gib
    prov = provenance(scn, space)
    frozen = [evaluation_trial(space, ev, usable, "front", prov) for ev in evs]
    t0 = time.perf_counter()
    for f in frozen:
        study.add_trial(f)
    analytic = (time.perf_counter() - t0) / len(frozen) * 1e3
    measured_ev = [ev.model_copy(update={"fidelity": "measured"}) for ev in evs]
    t0 = time.perf_counter()
    for ev in measured_ev:
        c = claim(backend, study, space, ev.plan, "front")
        finish(backend, c, evaluation_trial(space, ev, usable, "front", prov))
    measured = (time.perf_counter() - t0) / len(measured_ev) * 1e3
    return analytic, measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", help="a PostgreSQL URL (an empty database)")
    ap.add_argument("--n", type=int, default=200, help="trials per storage and mode")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the storages take turns in each")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-bench-"))
    urls = {"sqlite": f"sqlite:///{tmp / 'b.db'}", "journal": f"journal:{tmp / 'b.log'}"}
    if args.postgres:
        urls["postgresql"] = args.postgres
    rounds: dict[str, list[tuple[float, float]]] = {kind: [] for kind in urls}
    for r in range(args.rounds):
        for kind, url in urls.items():
            rounds[kind].append(time_storage(url, args.n))
            a, m = rounds[kind][-1]
            print(f"round {r + 1} {kind:10s} analytic {a:7.1f} ms/trial   measured (claim+finish) {m:7.1f} ms/trial",
                  flush=True)
    got = {kind: (statistics.median(a for a, _ in v), statistics.median(m for _, m in v)) for kind, v in rounds.items()}
    best = {kind: (min(a for a, _ in v), min(m for _, m in v)) for kind, v in rounds.items()}  # least disturbed
    for label, figures in (("median", got), ("best", best)):
        for kind, (a, m) in figures.items():
            print(f"{label:10s} {kind:10s} analytic {a:7.1f} ms/trial   measured (claim+finish) {m:7.1f} ms/trial")
    ratio = ""
    if "postgresql" in got:
        ratio = "; postgresql/sqlite " + ", ".join(
            f"{label}: analytic {f['postgresql'][0] / f['sqlite'][0]:.2f}x, measured "
            f"{f['postgresql'][1] / f['sqlite'][1]:.2f}x" for label, f in (("median", got), ("best", best)))
    print(f"storage per trial, n={args.n}, {args.rounds} rounds, tiny-cpu plans{ratio} (optuna {optuna.__version__}, sqlalchemy "
          f"{sqlalchemy.__version__}, python {platform.python_version()})")


if __name__ == "__main__":
    main()
