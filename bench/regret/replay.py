"""Replay every method on every instance: seeds, calibrations (in sample / out of sample), figures.

Seeds: run r of method m on instance i draws from numpy's SeedSequence([r, crc32 of m's name, i]): each method
has its own stream (TPE and NSGA-II no longer share a seeded start), the same for every calibration and whatever
other methods are replayed.
A method whose order depends on nothing random (all but random, tpe and nsga2) is replayed once on a table of
single measurements, `repeats` times on a table whose plans have several samples (its draws differ).
Calibrations: only MODEL_METHODS (the loop with either policy, no_recalibration, analytic_order and
rule_memory_filter) use the analytic model, so only they are replayed per calibration on the sweep: in sample
with the shipped constants; in sample refitted (the folds' procedure and start on every group: the column that
differs from out of sample only by what the fit saw); out of sample with the constants refitted without the
instance's fold (folds.py); the other methods' figures are the same in every column. The sweep's software polls
pipeline metadata every 0.1 s (bench/throughput_accuracy.py SWEEP_P2P_POLL_S, read from nanotron's code, not
fitted): both calibrations carry it, as their fits did.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from regret import methods, procedures
from regret.folds import calibration_for, fold_of
from regret.instances import Instance, Runner, Truth
from regret.scoring import score, summarise, wins_losses
from stratagem.evaluators.calibration import Calibration, default_calibration
from stratagem.search.run_order import DEFAULT_RUN_ORDER

__all__ = ["METHODS", "MODEL_METHODS", "PREVIOUS_ORDER", "RANDOMISED", "Task", "suite_tasks", "run_tasks",
           "summarise_suite", "cpu_by_method"]

PREVIOUS_ORDER = "ranked"
"""The previous shipped run-order policy (RUN_ORDERS key), replayed as its own method while another is the
default."""
METHODS = ("stratagem", *((PREVIOUS_ORDER,) if DEFAULT_RUN_ORDER != PREVIOUS_ORDER else ()), "no_recalibration",
           "analytic_order", "rule", "rule_memory_filter", "decision_tree", "ds_autotuner", "nemo_autoconfigurator",
           "random", "tpe", "nsga2")
MODEL_METHODS = ("stratagem", PREVIOUS_ORDER, "no_recalibration", "analytic_order", "rule_memory_filter")
"""Methods that use the analytic model (replayed per calibration)."""
RANDOMISED = ("random", "tpe", "nsga2")
"""Methods whose order depends on their seed even on a table of single measurements."""


def _generator(method: str, repeat: int, instance: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([repeat, zlib.crc32(method.encode()), instance]))


def run_method(method: str, truth: Truth, budget: int, rng: np.random.Generator,
               calibration: Calibration) -> Runner:
    """One replay of `method` on `truth` (its runs, in order, in a Runner)."""
    runner = Runner(truth, rng)
    seed = int(rng.integers(2**31 - 1))
    table: dict[str, Callable[[], Any]] = {
        "stratagem": lambda: [runner.record(k, v) for k, v in methods.loop(truth, budget, seed, rng, calibration)],
        PREVIOUS_ORDER: lambda: [runner.record(k, v) for k, v in
                                 methods.loop(truth, budget, seed, rng, calibration, order=PREVIOUS_ORDER)],
        "no_recalibration": lambda: [runner.record(k, v) for k, v in
                                     methods.loop(truth, budget, seed, rng, calibration, recalibrate=False)],
        "analytic_order": lambda: methods.run_static(truth, methods.analytic_order(truth, calibration), runner,
                                                     budget),
        "rule": lambda: methods.run_static(truth, methods.rule_order(truth), runner, budget),
        "rule_memory_filter": lambda: methods.run_static(truth, methods.rule_memory_filter(truth, calibration),
                                                         runner, budget),
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


Task = tuple[int, Instance, str, int, str, int, Calibration]
"""(instance index, instance, method, seed repeat, column, budget, calibration): one replay."""


def _replay(task: Task) -> dict[str, Any]:
    """One replay: its scores."""
    i, inst, m, r, column, budget, cal = task
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t0 = time.process_time()
    truth = Truth(inst)
    return {**score(truth, run_method(m, truth, budget, _generator(m, r, i), cal), budget),
            "cpu_s": time.process_time() - t0}


def suite_tasks(instances: list[Instance], methods_: list[str], budget: int, repeats: int,
                folds_doc: dict[str, Any] | None, folding: str) -> tuple[list[str], list[Task]]:
    """The columns of a suite (in and out of sample when `folds_doc` is given, a sweep; else one column with
    the device's default calibration, fitted elsewhere: out of sample for a measured table) and its replays:
    every seed of every method on every instance, a model-free method in the last column only."""
    columns = ["in_sample", "in_sample_refit", "out_of_sample"] if folds_doc is not None else ["out_of_sample"]
    tasks: list[Task] = []
    for i, inst in enumerate(instances):
        gpu = inst.table.load_scenario().cluster.gpu.name
        if folds_doc is not None:
            fold = fold_of(folding, inst.model, inst.nodes)
            cals = {"in_sample": _sweep_calibration(default_calibration(gpu)),
                    "in_sample_refit": _sweep_calibration(calibration_for(folds_doc, folding, "all")),
                    "out_of_sample": _sweep_calibration(calibration_for(folds_doc, folding, fold))}
        else:
            cals = {"out_of_sample": default_calibration(gpu)}
        noisy = any(len(o.samples) > 1 for o in inst.table.runs)
        for m in methods_:
            reps = repeats if (m in RANDOMISED or noisy) else 1
            for c in columns if m in MODEL_METHODS else columns[-1:]:
                tasks += [(i, inst, m, r, c, budget, cals[c]) for r in range(reps)]
    return columns, tasks


def run_tasks(tasks: list[Task], jobs: int) -> list[dict[str, Any]]:
    """Every replay, `jobs` at a time (processes), the longest first; results in task order."""
    if jobs <= 1:
        return [_replay(t) for t in tasks]
    from multiprocessing import get_context

    # the loop's replays on noisy tables cost the most: start them first so no process waits on them at the end
    order = sorted(range(len(tasks)), key=lambda j: (tasks[j][2] not in MODEL_METHODS,
                                                     -len(tasks[j][1].table.runs[0].samples)))
    with get_context("fork").Pool(jobs) as pool:
        done = pool.map(_replay, [tasks[j] for j in order], chunksize=1)
    out: list[dict[str, Any]] = [{} for _ in tasks]
    for j, result in zip(order, done, strict=True):
        out[j] = result
    return out


def cpu_by_method(tasks: list[Task], results: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds the replays of each method took (process time of the worker running each replay)."""
    out: dict[str, float] = {}
    for (_, _, m, _, _, _, _), s in zip(tasks, results, strict=True):
        out[m] = out.get(m, 0.0) + s.get("cpu_s", 0.0)
    return out


def summarise_suite(instances: list[Instance], methods_: list[str], columns: list[str], tasks: list[Task],
                    results: list[dict[str, Any]], folds_doc: dict[str, Any] | None,
                    folding: str) -> dict[str, Any]:
    """{"columns": {column: {method: summary}}, "sign_tests": {column: {baseline: stratagem's wins and losses
    against it per budget (scoring.wins_losses)}}, "per_instance": [...]}; a model-free method's runs stand in
    every column."""
    got: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for (i, _, m, _, c, _, _), s in zip(tasks, results, strict=True):
        got.setdefault((i, m, c), []).append(s)
    merged: dict[str, dict[str, list[dict[str, Any]]]] = {c: {m: [] for m in methods_} for c in columns}
    per: dict[str, dict[str, list[list[dict[str, Any]]]]] = {c: {m: [] for m in methods_} for c in columns}
    rows = []
    for i, inst in enumerate(instances):
        row: dict[str, Any] = {"instance": inst.name, "candidates": len(inst.table.runs)}
        if folds_doc is not None:
            row["fold"] = fold_of(folding, inst.model, inst.nodes)
        for m in methods_:
            for c in columns:
                scores = got.get((i, m, c)) or got[(i, m, columns[-1])]
                merged[c][m] += scores
                per[c][m].append(scores)
                row[f"{m}:{c}"] = float(np.median([s["runs_to_best"] for s in scores]))
        rows.append(row)
    signs = {c: {m: wins_losses(per[c]["stratagem"], per[c][m]) for m in methods_ if m != "stratagem"}
             for c in columns} if "stratagem" in methods_ else {}
    return {"columns": {c: {m: summarise(merged[c][m]) for m in methods_} for c in columns},
            "sign_tests": signs, "per_instance": rows}
