"""Out-of-sample calibrations for the regret benchmark: the analytic model's fitted constants refitted per fold.

The shipped constants (stratagem.evaluators.calibration.DEFAULT_CALIBRATION) were fitted on every published run in
bench/reference/, the sweep the benchmark scores included (bench/reference/README.md): a replay with them is
in sample. Here the same two fits the project ships are rerun with the held-out fold's sweep groups left out:
  time constants   bench/throughput_accuracy.py `fit` (Nelder-Mead over TIME_FIELDS, |log error| capped at log 2,
                   each source weighted equally) on the sweep's other groups + torchtitan + Megatron-LM;
  memory constants bench/memory_accuracy.py `fit` (IRLS on the peak, mean absolute relative error) on the
                   playbook runs of the other groups + torchtitan.
The communication constants (link_efficiency, collective_step_us) are fitted on nccl-tests bus bandwidths, not
on any training run, and are kept. A fold is every (model, nodes) group of one model size (`model`) or of one
node band (`nodes`): no group of the held-out fold is in its fit. Every fit starts from NEUTRAL_START (never
from the shipped constants, which saw every fold); the same procedure on all groups (`all`) is fitted too, so
the in-sample and out-of-sample columns differ only by what the fit saw.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import memory_accuracy as mem  # noqa: E402
import throughput_accuracy as tput  # noqa: E402

from stratagem.evaluators.calibration import DEFAULT_CALIBRATION, Calibration  # noqa: E402

__all__ = ["FOLDINGS", "NEUTRAL_START", "FIT_ITERATIONS", "fold_of", "folds", "fit_calibration", "fit_folds",
           "load_folds", "DEFAULT_FOLDS_FILE"]

DEFAULT_FOLDS_FILE = BENCH / "data" / "regret-folds.json"
FIT_ITERATIONS = 400
"""Nelder-Mead iterations of the time fit (bench/throughput_accuracy.py --iters default)."""
NEUTRAL_START: dict[str, float] = {
    "matmul_efficiency": 0.5, "attention_efficiency": 0.5, "half_efficiency_gflop": 1.0, "layer_floor_ms": 1.0,
    "overlap": 0.5, "step_overhead_s": 0.1,
}
"""Where every time fit starts: round values, none taken from a fit (half the peak, 1 GFLOP, 1 ms, half overlap,
0.1 s), so no fold's start has seen its held-out groups."""
NODE_BANDS: tuple[tuple[int, ...], ...] = ((1, 2, 4), (8, 16), (32, 64))
"""The `nodes` folding: one node band per fold (the sweep's 1-64 nodes in three bands)."""


def _model_key(model: str) -> str:
    return model


def _node_key(nodes: int) -> str:
    band = next((b for b in NODE_BANDS if nodes in b), (nodes,))
    return "nodes " + "/".join(str(n) for n in band)


FOLDINGS: dict[str, Callable[[str, int], str]] = {
    "model": lambda model, nodes: f"model {_model_key(model)}",
    "nodes": lambda model, nodes: _node_key(nodes),
}
"""Folding name -> the fold of a sweep group (model, nodes)."""


def fold_of(folding: str, model: str, nodes: int) -> str:
    """The fold holding sweep group (model, nodes) under `folding`."""
    return FOLDINGS[folding](model, nodes)


def folds(folding: str, sweep: Path) -> list[str]:
    """Every fold of the sweep under `folding`, in sweep order."""
    runs = json.loads(sweep.read_text())["runs"]
    seen: dict[str, None] = {}
    for r in sorted(runs, key=lambda r: (float(r["model"].rstrip("B")), r["nodes"])):
        seen.setdefault(fold_of(folding, r["model"], int(r["nodes"])), None)
    return list(seen)


def _point_group(label: str) -> tuple[str, int]:
    """(model, nodes) of a throughput_accuracy sweep label 'sweep 8B 16n dp..'."""
    _, model, nodes, *_ = label.split()
    return model, int(nodes.rstrip("n"))


def _case_group(label: str) -> tuple[str, int]:
    """(model, nodes) of a memory_accuracy playbook label '8B n16 dp..'."""
    model, nodes, *_ = label.split()
    return model, int(nodes.lstrip("n"))


_POINTS: list[Any] = []


def _predict_chunk(task: tuple[list[int], Calibration, float]) -> list[float]:
    idx, cal, poll = task
    pred, _ = _SERIAL_PREDICT([_POINTS[i] for i in idx], cal, poll)
    return [float(x) for x in pred]


_SERIAL_PREDICT = tput.predict


def _time_fit(points: list[Any], start: Calibration, iterations: int, workers: int) -> Calibration:
    """bench/throughput_accuracy.py `fit`, its predictions computed by `workers` processes, each on whole
    (source, scenario) groups: the same numbers, the loss evaluated in parallel."""
    if workers <= 1:
        return tput.fit(points, start, iterations)
    from multiprocessing import get_context

    groups: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(points):
        groups.setdefault((p.source, p.scenario.model_dump_json()), []).append(i)
    chunks: list[list[int]] = [[] for _ in range(workers)]
    for j, idx in enumerate(sorted(groups.values(), key=len, reverse=True)):
        min(chunks, key=len).extend(idx) if j >= workers else chunks[j].extend(idx)
    _POINTS[:] = points

    def parallel(pts: list[Any], cal: Calibration, sweep_poll_s: float = tput.SWEEP_P2P_POLL_S
                 ) -> tuple[np.ndarray, list[dict[str, float]]]:
        if pts is not points:
            return _SERIAL_PREDICT(pts, cal, sweep_poll_s)
        pred = np.zeros(len(points))
        for idx, got in zip(chunks, pool.map(_predict_chunk, [(c, cal, sweep_poll_s) for c in chunks]),
                            strict=True):
            pred[idx] = got
        return pred, [{} for _ in points]

    with get_context("fork").Pool(workers) as pool:
        tput.predict = parallel
        try:
            return tput.fit(points, start, iterations)
        finally:
            tput.predict = _SERIAL_PREDICT


def fit_calibration(folding: str, held_out: str | None, ref: Path, iterations: int = FIT_ITERATIONS,
                    workers: int = 1) -> tuple[Calibration, dict[str, Any]]:
    """The time and memory constants fitted without the sweep groups of fold `held_out` (None: all groups), from
    NEUTRAL_START; with what the fit saw and its loss."""
    t0 = time.perf_counter()
    points = [p for p in tput.sweep_points(ref) + tput.published_points(ref)
              if p.source != "sweep" or fold_of(folding, *_point_group(p.label)) != held_out]
    start = DEFAULT_CALIBRATION.model_copy(update=NEUTRAL_START)
    timed = _time_fit(points, start, iterations, workers)
    cases = [c for c in mem.playbook_cases(ref / "playbook_sweep_calibration.json")
             + mem.torchtitan_cases(ref / "published_cases_calibration.json")
             if c.source != "playbook" or fold_of(folding, *_case_group(c.label)) != held_out]
    memory = mem.fit(cases)
    fields = {k: float(getattr(timed, k)) for k in tput.TIME_FIELDS}
    fields.update({k: float(getattr(memory, k)) for k in ("fragmentation", "context_gib", "logits_bytes")})
    cal = DEFAULT_CALIBRATION.model_copy(update=fields)
    pred, _ = tput.predict(points, cal)
    meas = np.array([p.measured for p in points])
    info = {
        "held_out": held_out, "time_points": len(points),
        "sweep_points": sum(p.source == "sweep" for p in points), "memory_cases": len(cases),
        "time_median_ape": float(np.median(np.abs(pred / meas - 1))),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return cal, {"fields": fields, **info}


def fit_folds(foldings: Sequence[str], sweep: Path, ref: Path, path: Path = DEFAULT_FOLDS_FILE,
              iterations: int = FIT_ITERATIONS, workers: int = 4) -> dict[str, Any]:
    """Fit `all` and every fold of every folding, write them to `path` with provenance, return the document."""
    doc: dict[str, Any] = {
        "procedure": __doc__.strip().splitlines()[0], "neutral_start": NEUTRAL_START, "iterations": iterations,
        "reference": str(ref.relative_to(ROOT)) if ref.is_relative_to(ROOT) else str(ref),
        "python": platform.python_version(), "numpy": np.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "foldings": {},
    }
    _, doc["all"] = fit_calibration("model", None, ref, iterations, workers)
    print(f"folds: fitted all groups in {doc['all']['seconds']} s", file=sys.stderr)
    for folding in foldings:
        doc["foldings"][folding] = {}
        for fold in folds(folding, sweep):
            _, info = fit_calibration(folding, fold, ref, iterations, workers)
            doc["foldings"][folding][fold] = info
            print(f"folds: fitted without {fold} in {info['seconds']} s", file=sys.stderr)
            path.write_text(json.dumps(doc, indent=1) + "\n")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def load_folds(path: Path = DEFAULT_FOLDS_FILE) -> dict[str, Any]:
    """The fitted folds document (fit_folds), or a one-line error naming the file and how to make it."""
    if not path.exists():
        raise SystemExit(f"folds ({path}): not found; fit them with `python bench/search_regret.py --refit-folds`")
    return json.loads(path.read_text())


def calibration_for(doc: dict[str, Any], folding: str, fold: str) -> Calibration:
    """The calibration fitted without `fold` ('all': on every group)."""
    entry = doc["all"] if fold == "all" else doc.get("foldings", {}).get(folding, {}).get(fold)
    if entry is None:
        raise SystemExit(f"folds: '{fold}' of folding '{folding}' is not fitted in the folds file; fit it with "
                         "`python bench/search_regret.py --refit-folds`")
    return DEFAULT_CALIBRATION.model_copy(update=entry["fields"])
