"""Per-trial storage cost: SQLite file vs PostgreSQL (and a journal file), for the two ways stratagem writes.

  analytic: `study.add_trial(evaluation_trial(...))`, one finished trial per screened plan (search/runner.py);
  measured: claim (RUNNING trial) + finish (attributes, state, values) per real run (search/claims.py).

    python bench/storage_per_trial.py --postgres postgresql+psycopg://postgres@127.0.0.1:5432/bench [--n 200]

The PostgreSQL URL is optional (without it only the file storages are timed). Prints ms per trial, last line
the figure with config and versions.
"""

from __future__ import annotations

import argparse
import platform
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
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-bench-"))
    urls = {"sqlite": f"sqlite:///{tmp / 'b.db'}", "journal": f"journal:{tmp / 'b.log'}"}
    if args.postgres:
        urls["postgresql"] = args.postgres
    got = {}
    for kind, url in urls.items():
        got[kind] = time_storage(url, args.n)
        print(f"{kind:10s} analytic {got[kind][0]:7.1f} ms/trial   measured (claim+finish) {got[kind][1]:7.1f} "
              "ms/trial")
    ratio = ""
    if "postgresql" in got:
        ratio = (f"; postgresql/sqlite: analytic {got['postgresql'][0] / got['sqlite'][0]:.2f}x, measured "
                 f"{got['postgresql'][1] / got['sqlite'][1]:.2f}x")
    print(f"storage per trial, n={args.n}, tiny-cpu plans{ratio} (optuna {optuna.__version__}, sqlalchemy "
          f"{sqlalchemy.__version__}, python {platform.python_version()})")


if __name__ == "__main__":
    main()
