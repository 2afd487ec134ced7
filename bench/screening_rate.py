"""Screening rate of the vectorised analytic evaluator: plans per second on one core.

Builds every plan of a product space for Llama-3-70B on 64 H100 (dp x tp x pp x cp = 64, ZeRO 0-3, micro-batch,
precision, recomputation, schedule, sequence parallelism), tiles it to --plans rows and times
`evaluate_many` (memory, step time, checkpoint risk, zones) over it. Pins numpy to one thread. The figure is
printed last.

    .venv/bin/python bench/screening_rate.py [--plans 1000000] [--repeat 3]
"""

from __future__ import annotations

import os

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import argparse  # noqa: E402
import itertools  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stratagem.evaluators import evaluate_many  # noqa: E402
from stratagem.spaces import Scenario, TrainingSpec, cluster_preset, model_preset  # noqa: E402
from stratagem.spaces.columns import PlanColumns  # noqa: E402


def product_space(world: int) -> PlanColumns:
    """Every (dp, tp, pp, cp) with dp*tp*pp*cp = world x zero x mbs x precision x recompute x schedule x sp."""
    rows = []
    degrees = [1, 2, 4, 8, 16, 32, 64]
    for tp, pp, cp in itertools.product(degrees[:4], degrees[:5], degrees[:3]):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for zero, mbs, prec, ac, sched, sp in itertools.product(
            range(4), (1, 2, 4), (1, 2), (0, 1, 2), (1, 2, 3) if pp > 1 else (1,), (0, 1) if tp > 1 else (0,)
        ):
            virtual = 2 if sched == 2 else 1
            rows.append((dp, tp, pp, cp, 1, 1, zero, sp, mbs, prec, ac, sched, virtual, 0))
    a = np.array(rows, dtype=np.float64).T
    names = ["dp", "tp", "pp", "cp", "ep", "dp_replicate", "zero_stage", "sequence_parallel", "micro_batch_size",
             "precision", "activation_checkpointing", "pp_schedule", "virtual_stages", "optimizer_offload"]
    return PlanColumns(**dict(zip(names, a, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 64),
                   training=TrainingSpec(seq_len=8192, global_batch_size=512))
    base = product_space(scn.cluster.num_gpus)
    reps = -(-args.plans // len(base))
    cols = base.take(np.tile(np.arange(len(base)), reps)[: args.plans])
    evaluate_many(scn, cols.take(slice(0, 1000)))  # warm up
    best = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = evaluate_many(scn, cols)
        best = min(best, time.perf_counter() - t0)
    n = len(cols)
    print(f"scenario: {scn.name}, seq 8192, global batch 512; {len(base):,} distinct plans tiled to {n:,}")
    print(f"columns per plan: {len(out)}; best of {args.repeat}: {best:.2f} s")
    print(f"python {platform.python_version()}, numpy {np.__version__}, {platform.processor() or platform.machine()}, "
          "1 thread")
    print(f"screening rate: {n / best:,.0f} plans/s on one core")


if __name__ == "__main__":
    main()
