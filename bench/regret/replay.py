"""Replay every method on every instance: seeds, calibrations (in sample / out of sample), figures.

Seeds: run r of method m on instance i draws from numpy's SeedSequence([r, index of m in METHODS, i]): each
method has its own stream (TPE and NSGA-II no longer share a seeded start), the same for every calibration.
A method whose order depends on nothing random (all but random, tpe and nsga2) is replayed once on a table of
single measurements, `repeats` times on a table whose plans have several samples (its draws differ).
Calibrations: only stratagem, no_recalibration and analytic_order use the analytic model, so only they are
replayed twice on the sweep: in sample with the shipped constants, out of sample with the constants refitted
without the instance's fold (folds.py); the other methods' figures are the same in both columns. The sweep's
software polls pipeline metadata every 0.1 s (bench/throughput_accuracy.py SWEEP_P2P_POLL_S, read from
nanotron's code, not fitted): both calibrations carry it, as their fits did.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from regret import methods, procedures
from regret.folds import calibration_for, fold_of
from regret.instances import Instance, Runner, Truth
from regret.scoring import score, summarise
from stratagem.evaluators.calibration import Calibration, default_calibration

__all__ = ["METHODS", "MODEL_METHODS", "RANDOMISED", "replay_suite"]

METHODS = ("stratagem", "no_recalibration", "analytic_order", "rule", "decision_tree", "ds_autotuner",
           "nemo_autoconfigurator", "random", "tpe", "nsga2")
MODEL_METHODS = ("stratagem", "no_recalibration", "analytic_order")
"""Methods that use the analytic model (replayed per calibration)."""
RANDOMISED = ("random", "tpe", "nsga2")
"""Methods whose order depends on their seed even on a table of single measurements."""


def _generator(method: str, repeat: int, instance: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([repeat, METHODS.index(method), instance]))


def run_method(method: str, truth: Truth, budget: int, rng: np.random.Generator,
               calibration: Calibration) -> Runner:
    """One replay of `method` on `truth` (its runs, in order, in a Runner)."""
    runner = Runner(truth, rng)
    seed = int(rng.integers(2**31 - 1))
    table: dict[str, Callable[[], Any]] = {
        "stratagem": lambda: [runner.record(k, v) for k, v in methods.loop(truth, budget, seed, rng, calibration)],
        "no_recalibration": lambda: [runner.record(k, v) for k, v in
                                     methods.loop(truth, budget, seed, rng, calibration, recalibrate=False)],
        "analytic_order": lambda: methods.run_static(truth, methods.analytic_order(truth, calibration), runner,
                                                     budget),
        "rule": lambda: methods.run_static(truth, methods.rule_order(truth), runner, budget),
        "decision_tree": lambda: methods.decision_tree(truth, runner, budget),
        "ds_autotuner": lambda: procedures.ds_autotuner(truth, runner, budget),
        "nemo_autoconfigurator": lambda: procedures.nemo_autoconfigurator(truth, runner, budget),
        "random": lambda: methods.run_static(truth, methods.random_order(truth, rng), runner, budget),
        "tpe": lambda: methods.blackbox(truth, runner, budget, seed, "tpe"),
        "nsga2": lambda: methods.blackbox(truth, runner, budget, seed, "nsga2"),
    }
    table[method]()
    return runner


def _sweep_calibration(cal: Calibration) -> Calibration:
    from throughput_accuracy import SWEEP_P2P_POLL_S  # the sweep's stated software (module docstring)

    return cal.model_copy(update={"p2p_poll_s": SWEEP_P2P_POLL_S})


def _replay_instance(task: tuple[int, Instance, list[str], int, int, dict[str, Calibration] | None]
                     ) -> tuple[dict[str, Any], dict[str, dict[str, list[dict[str, Any]]]]]:
    """Every method on one instance, in every column: (per-instance row, column -> method -> scores)."""
    i, inst, methods_, budget, repeats, cals = task
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    truth = Truth(inst)
    row: dict[str, Any] = {"instance": inst.name, "candidates": len(truth.keys), "epsilon": truth.epsilon}
    assert cals is not None
    columns = list(cals)
    scores: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in methods_} for c in columns}
    for m in methods_:
        reps = repeats if (m in RANDOMISED or truth.noisy) else 1
        for column in columns if m in MODEL_METHODS else columns[-1:]:  # model-free: the same runs in every column
            found = []
            for r in range(reps):
                s = score(truth, run_method(m, truth, budget, _generator(m, r, i), cals[column]), budget)
                scores[column][m].append(s)
                found.append(s["runs_to_best"])
            row[f"{m}:{column}"] = float(np.median(found))
        for column in columns[:-1]:
            if m not in MODEL_METHODS:
                scores[column][m] = scores[columns[-1]][m]
                row[f"{m}:{column}"] = row[f"{m}:{columns[-1]}"]
    print(f"replay: {inst.name} done", file=sys.stderr, flush=True)
    return row, scores


def replay_suite(instances: list[Instance], methods_: list[str], budget: int, repeats: int,
                 folds_doc: dict[str, Any] | None, folding: str, jobs: int = 1) -> dict[str, Any]:
    """Every method on every instance of one suite; in and out of sample when `folds_doc` is given (a sweep),
    else one column with the device's default calibration (fitted elsewhere: out of sample for a measured table);
    `jobs` instances at a time (processes). Returns {"columns": {column: {method: summary}}, "per_instance": [...]}."""
    tasks = []
    for i, inst in enumerate(instances):
        gpu = inst.table.load_scenario().cluster.gpu.name
        if folds_doc is not None:
            fold = fold_of(folding, inst.model, inst.nodes)
            cals = {"in_sample": _sweep_calibration(default_calibration(gpu)),
                    "out_of_sample": _sweep_calibration(calibration_for(folds_doc, folding, fold))}
        else:
            cals = {"out_of_sample": default_calibration(gpu)}
        tasks.append((i, inst, methods_, budget, repeats, cals))
    if jobs > 1:
        from multiprocessing import get_context

        with get_context("fork").Pool(jobs) as pool:
            results = pool.map(_replay_instance, tasks, chunksize=1)
    else:
        results = [_replay_instance(t) for t in tasks]
    columns = list(tasks[0][5] or {}) if tasks else []
    rows = []
    merged: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in methods_} for c in columns}
    for (row, scores), task in zip(results, tasks, strict=True):
        inst = task[1]
        if folds_doc is not None:
            row["fold"] = fold_of(folding, inst.model, inst.nodes)
        rows.append(row)
        for c in columns:
            for m in methods_:
                merged[c][m] += scores[c][m]
    return {"columns": {c: {m: summarise(merged[c][m]) for m in methods_} for c in columns}, "per_instance": rows}
