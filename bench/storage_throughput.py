"""Storage throughput against workers: trials/s that N search processes store at once, N = 1, 2, 4, 8.

Each worker is a separate process running the product's own path, `SearchSession.screen()` (before the start
line, in memory) then `open()` + `store()` (timed): the analytic store of examples/llama3-70b-64xh100.yaml with
search.stored_sample = --trials, so each worker writes about that many finished trials. Layout `studies`
(default): worker i has its own study in the one database (several searches sharing a database: what one
storage-wide lock serialises); `one-study`: all workers store the same study (each plan is stored once).

    nice -n -10 python bench/storage_throughput.py --postgres postgresql+psycopg://postgres@127.0.0.1:PORT/postgres

A scratch PostgreSQL (as root; the server's defaults, fsync on):
    D=$(mktemp -d); chown postgres $D; runuser -u postgres -- /usr/lib/postgresql/*/bin/initdb -D $D/data \
        --auth=trust -U postgres; runuser -u postgres -- /usr/lib/postgresql/*/bin/pg_ctl -D $D/data \
        -o "-p 55432 -k $D -c listen_addresses=127.0.0.1" -l $D/log -w start

Throughput = trials the round stored / (last worker's end - first worker's start). Lock wait = seconds a worker
spent waiting to take storage locks during its store (search/locks.py lock_waits): the mechanism that keeps
throughput from growing with workers when one lock guards more than one writer's data. Every round gets a new
SQLite file / new study names. The load average is printed with each round (a shared machine's load moves the
figures); the last line is the figure with config and versions.

Measured 2026-12-06, 2 shared CPUs, PostgreSQL 15 (fsync on), --trials 60, layout studies, before (b8417e2: one
storage-wide lock held through a whole store) and after (26aaba5: per-study locks, store in slices) taking turns
per worker count (/tmp script: for n in 1 2 4 8, before then after):
  postgresql trials/s   before 4.3, 4.7, 11.1, 22.1   after 5.6, 6.1, 18.1, 23.9   (1, 2, 4, 8 workers)
  lock wait per worker  before 0.04, 7.35, 10.74, 11.49 s   after 0.06, 0.32, 0.34, 0.76 s
  sqlite trials/s       before 8.1, 9.3, 13.3, 33.9   after 8.4, 11.4, 36.5, 44.3
  load average per round 7.3, 7.8-9.9, 6.3-7.8, 5.0-5.3 (others' work; it fell during the 8-worker rounds, which
  lifts both 8-worker figures: compare within a worker count, and the waits, not across rows).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
import yaml

SCENARIO = Path(__file__).resolve().parents[1] / "examples" / "llama3-70b-64xh100.yaml"


def _worker(scenario_path: str, url: str, study: str, ready: Any, start: Any, out: Any) -> None:
    """One search process: screen, wait for the start, then open the storage and store (timed)."""
    from stratagem.search.locks import lock_waits
    from stratagem.search.session import SearchSession
    from stratagem.spaces import load_scenario

    session = SearchSession(load_scenario(scenario_path), url, study, listener=lambda e: None)
    session.screen()
    ready.release()
    start.wait()
    before = lock_waits()
    t0 = time.time()
    result = session.store()
    t1 = time.time()
    after = lock_waits()
    out.put({"stored": result.stored, "t0": t0, "t1": t1, "wait_s": after.seconds - before.seconds,
             "longest_s": after.longest, "locks": after.taken - before.taken})


def run_round(scenario_path: Path, url: str, workers: int, layout: str) -> dict[str, Any]:
    """N worker processes storing at once; their figures."""
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    tag = uuid.uuid4().hex[:8]
    names = [f"tp-{tag}" if layout == "one-study" else f"tp-{tag}-w{i}" for i in range(workers)]
    procs = [ctx.Process(target=_worker, args=(str(scenario_path), url, n, ready, start, out)) for n in names]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    load = os.getloadavg()[0]
    start.set()
    got = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a worker exited {p.exitcode}")
    wall = max(g["t1"] for g in got) - min(g["t0"] for g in got)
    stored = sum(g["stored"] for g in got)
    return {"workers": workers, "stored": stored, "wall": wall, "rate": stored / wall,
            "wait_mean": statistics.mean(g["wait_s"] for g in got), "wait_max": max(g["wait_s"] for g in got),
            "locks": sum(g["locks"] for g in got), "load": (load + os.getloadavg()[0]) / 2}


def _server(url: str) -> str:
    """The PostgreSQL server's version and durability settings, in words."""
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.connect() as c:
            show = {k: c.execute(sqlalchemy.text(f"SHOW {k}")).scalar()
                    for k in ("server_version", "fsync", "synchronous_commit")}
    finally:
        engine.dispose()
    return f"PostgreSQL {show['server_version']} (fsync {show['fsync']}, synchronous_commit {show['synchronous_commit']})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", help="a PostgreSQL URL (its database gets new studies each round)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--trials", type=int, default=120, help="search.stored_sample: trials each worker stores")
    ap.add_argument("--layout", choices=["studies", "one-study"], default="studies")
    ap.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="stratagem-throughput-"))
    data = yaml.safe_load(SCENARIO.read_text())
    data["search"] = {**(data.get("search") or {}), "stored_sample": args.trials}
    scenario_path = tmp / SCENARIO.name
    scenario_path.write_text(yaml.safe_dump(data))
    backends: dict[str, Any] = {}
    if args.postgres:
        backends["postgresql"] = lambda n: args.postgres
    if not args.no_sqlite:
        backends["sqlite"] = lambda n: f"sqlite:///{tmp / f'w{n}-{uuid.uuid4().hex[:6]}.db'}"
    results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in backends}
    for n in args.workers:  # the backends take turns per worker count (the machine's load drifts)
        for kind, url_of in backends.items():
            r = run_round(scenario_path, url_of(n), n, args.layout)
            results[kind].append(r)
            print(f"{kind:10s} workers {n}: {r['stored']:5d} trials in {r['wall']:6.2f} s = {r['rate']:6.1f} "
                  f"trials/s; lock wait per worker mean {r['wait_mean']:6.2f} s, max {r['wait_max']:6.2f} s "
                  f"({r['locks']} locks taken); load {r['load']:.2f}", flush=True)
    from stratagem import __version__

    server = f"; {_server(args.postgres)}" if args.postgres else ""
    config = (f"layout {args.layout}, {args.trials} stored_sample/worker, {SCENARIO.name}, {os.cpu_count()} CPUs"
              f"{server}; stratagem {__version__}, optuna {optuna.__version__}, sqlalchemy {sqlalchemy.__version__}, "
              f"python {platform.python_version()}")
    print(f"config: {config}")
    figure = "; ".join(
        f"{kind} " + ", ".join(f"{r['workers']}w {r['rate']:.1f}/s (wait {r['wait_mean']:.2f} s, load {r['load']:.1f})"
                               for r in rs) for kind, rs in results.items())
    print(f"storage throughput, trials/s (lock wait per worker, load avg): {figure}")


if __name__ == "__main__":
    main()
