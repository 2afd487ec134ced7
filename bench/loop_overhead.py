"""The real-run loop's own cost per run, apart from the run: the calibration refit after a batch
(search/calibrate.py refit_step, then search/multiplier_refit.py refit_multipliers, on --runs measured runs of a
measured table, as search/measure.py calls them) plus
the run order's choice of the next plan among every plan of a large space (examples/mixtral-8x7b-64xh200.yaml:
257,820 valid plans, the default; the run order screens them with the calibration in force and ranks them), for
each run order of search.run_order.RUN_ORDERS ("ranked": before, "expected_improvement": after), as the loop keeps
it: one run order for the session, asked batch after batch, the figure that of a batch after a refit of the
constants was adopted (a session's first batch, a new run order, is printed beside it). Each figure is
the best of --repeat; numpy pinned to one thread (the loop's process shares the host with the runs), so the
process's CPU time is its wall time on an idle core: both are printed (on a loaded host the wall time counts the
waits for a core; compare CPU times across loads). Target: under 2 s per run. The figure is printed last.

    .venv/bin/python bench/loop_overhead.py [--scenario examples/mixtral-8x7b-64xh200.yaml] [--runs 8]
        [--batch 1] [--repeat 3] [--table bench/data/cpu-table.json]
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import optuna  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from stratagem.evaluators import Evaluation  # noqa: E402
from stratagem.evaluators.calibration import default_calibration  # noqa: E402
from stratagem.evaluators.priors import prior_for  # noqa: E402
from stratagem.evaluators.table import TableEvaluator, load_table  # noqa: E402
from stratagem.search.calibrate import MEMORY_FIELDS, TIME_FIELDS, refit_step  # noqa: E402
from stratagem.search.multiplier_refit import refit_multipliers  # noqa: E402
from stratagem.search.records import DIRECTIONS  # noqa: E402
from stratagem.search.run_order import RUN_ORDERS, RunState  # noqa: E402
from stratagem.spaces import Scenario, load_scenario  # noqa: E402
from stratagem.spaces.space import SearchSpace  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Took:
    """The shortest wall and CPU (process) seconds of several calls."""

    wall: float
    cpu: float

    def __add__(self, other: Took) -> Took:
        return Took(self.wall + other.wall, self.cpu + other.cpu)

    def __str__(self) -> str:
        return f"{self.wall:.3f} s wall ({self.cpu:.3f} s CPU)"


def best_of(repeat: int, fn: Callable[[], object]) -> Took:
    """The shortest wall time and the shortest CPU time of `repeat` calls of fn."""
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return Took(wall, cpu)


def measured_runs(table_path: Path, n: int) -> tuple[Scenario, list[Evaluation]]:
    """The table's scenario and n of its median runs, as a loop's study holds them after n runs: the first n - 1
    plans that ran (ok) and the table's first OOM (a censored peak)."""
    table = load_table(table_path)
    scn = table.load_scenario()
    ev = TableEvaluator(table)
    runs = [ev.evaluate(scn, p) for p in table.plans()]
    ok = [r for r in runs if r.status == "ok"][: n - 1]
    return scn, ok + [r for r in runs if r.status == "oom"][:1]


def multiplier_refits(state: RunState, n: int) -> list[RunState]:
    """n states whose calibrations differ from state's by their step-time multipliers only (each term x1.1^i,
    the device's prior covariance): what an adopted multipliers refit leaves in force."""
    prior = prior_for(state.scenario.cluster.gpu.name).time()
    return [dataclasses.replace(state, calibration=state.calibration.model_copy(update={
        "time_multipliers": prior.model_copy(update={"mean": (math.log(1.1) * (i + 1),) * len(prior.names)})}))
        for i in range(n)]


def constants_refits(state: RunState, n: int) -> list[RunState]:
    """n states whose calibrations differ from state's in the constants a refit fits (search/calibrate.py
    TIME_FIELDS and MEMORY_FIELDS, attention efficiency with matmul's; the time ones x0.9^(i+1), the memory ones
    x1.1^(i+1)): what an adopted refit of the constants leaves in force, batch after batch."""
    out = []
    for i in range(n):
        t, m = 0.9 ** (i + 1), 1.1 ** (i + 1)
        cal = state.calibration
        out.append(dataclasses.replace(state, calibration=cal.model_copy(update={
            **{f: getattr(cal, f) * t for f in (*TIME_FIELDS, "attention_efficiency")},
            **{f: getattr(cal, f) * m for f in MEMORY_FIELDS}})))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "examples" / "mixtral-8x7b-64xh200.yaml"))
    ap.add_argument("--table", default=str(ROOT / "bench" / "data" / "cpu-table.json"))
    ap.add_argument("--runs", type=int, default=8, help="measured runs the refit fits on")
    ap.add_argument("--batch", type=int, default=1, help="plans asked of the run order per batch")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    table_scn, runs = measured_runs(Path(args.table), args.runs)
    base = default_calibration(table_scn.cluster.gpu.name)
    # as search/measure.py Measurement._refit: the constants, then the per-term multipliers at the constants in force
    constants = refit_step(table_scn, runs, base, base).calibration
    refit_parts = (best_of(args.repeat, lambda: refit_step(table_scn, runs, base, base)),
                   best_of(args.repeat, lambda: refit_multipliers(table_scn, runs, base, constants)))
    refit_s = refit_parts[0] + refit_parts[1]

    scn = load_scenario(args.scenario)
    space = SearchSpace(scn)
    cal = default_calibration(scn.cluster.gpu.name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=list(DIRECTIONS))  # in memory: nothing measured yet
    state = RunState(scenario=scn, space=space, study=study, calibration=cal, excluded=frozenset(),
                     measured_runs=0, runs_left=args.batch, unsupported=lambda s, p: None)
    start_s: dict[str, Took] = {}  # a session's first batch: a new run order, every plan predicted
    rank_s: dict[str, Took] = {}  # new constants in force (a refit adopted): every plan re-predicted under them
    kept_s: dict[str, Took] = {}  # the same calibration as the batch before (a refit refused)
    terms_s: dict[str, Took] = {}  # the same constants, new multipliers (a multipliers refit adopted)
    first: dict[str, str] = {}
    for name, make in RUN_ORDERS.items():
        start_s[name] = best_of(args.repeat, lambda m=make: m(candidates=None).next_batch(state, args.batch))
        order = make(candidates=None)  # the loop's: one run order for the session, batch after batch
        first[name] = order.next_batch(state, args.batch)[0][0].short()
        kept_s[name] = best_of(args.repeat, lambda o=order: o.next_batch(state, args.batch))
        taught = iter(multiplier_refits(state, args.repeat))
        terms_s[name] = best_of(args.repeat, lambda o=order, t=taught: o.next_batch(next(t), args.batch))
        refitted = iter(constants_refits(state, args.repeat))
        rank_s[name] = best_of(args.repeat, lambda o=order, r=refitted: o.next_batch(next(r), args.batch))

    print(f"refit: search/calibrate.py refit_step + search/multiplier_refit.py refit_multipliers on {len(runs)} measured runs of {Path(args.table).name} "
          f"({sum(r.status == 'ok' for r in runs)} ok, {sum(r.status == 'oom' for r in runs)} OOM); best of {args.repeat}: "
          f"{refit_s} ({refit_parts[0]} + {refit_parts[1]})")
    print(f"ranking: {scn.name}, {space.count():,} valid plans, {args.batch} plan(s) a batch, screened with the "
          "calibration in force each batch (as the loop does)")
    for name in RUN_ORDERS:
        print(f"  {name}: {rank_s[name]} after an adopted refit of the constants, {terms_s[name]} of "
              f"the multipliers only, {kept_s[name]} with the calibration unchanged, {start_s[name]} for a "
              f"session's first batch (first pick {first[name]})")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min); python {platform.python_version()}, numpy {np.__version__}, optuna {optuna.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), numpy on 1 thread")
    figures = ", ".join(f"{name} {(refit_s + rank_s[name]).wall / args.batch:.2f} s wall "
                        f"({(refit_s + rank_s[name]).cpu / args.batch:.2f} s CPU)" for name in RUN_ORDERS)
    print(f"loop overhead per run (refit + ranking after an adopted refit, target < 2 s): {figures}")


if __name__ == "__main__":
    main()
