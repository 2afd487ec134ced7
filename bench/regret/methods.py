"""Search methods replayed on a table: each spends runs through a `Runner` (one drawn sample per run) or, for
the shipped loop, through the table evaluator with the same kind of seeded draws.

  stratagem         the real-run loop as shipped: search.session.SearchSession.measure with the shipped run-order
                    policy (search.run_order.RUN_ORDERS[DEFAULT_RUN_ORDER]) restricted to the candidates, one run
                    per batch, refitting after each run (a refit kept only when it predicts held-out runs better);
                    its predictions start from the calibration given (the shipped one in sample, the fold's refit
                    out of sample);
  ranked            the same loop with the previous shipped policy, RUN_ORDERS["ranked"] (RankedOrder), replayed
                    only while another policy is the default;
  no_recalibration  the shipped loop and policy with recalibrate=False (the start calibration throughout);
  analytic_order    the candidates in predicted order with the start calibration (fitting plans by predicted
                    tokens/s, then the rest), no refit;
  rule_memory_filter  the rule's order (below), the plans the analytic memory model predicts fit (peak <= usable
                    memory, the screening's feasibility, start calibration) first, then the rest: the rule with the
                    loop's memory filter and nothing else of the model;
  random            a seeded random order;
  tpe, nsga2        Optuna's TPESampler / NSGAIISampler as black boxes over the candidates' axes (no analytic
                    model), each with its own seed: a suggestion is projected onto the nearest untried candidate;
                    objective the measured tokens/s/GPU (nsga2: and memory headroom); a failed run scores 0.
                    Their random start-up is half the budget (`startup`): TPESampler samples at random until
                    n_startup_trials trials have finished, NSGAIISampler's first generation of population_size
                    trials is random and each later generation is bred from the previous one (Optuna docs,
                    optuna.samplers.TPESampler `n_startup_trials`, optuna.samplers.NSGAIISampler
                    `population_size`, "must be greater than or equal to crossover.n_parents", 2 for the
                    UniformCrossover it applies to categorical parameters). Their defaults (10 and 50) would spend
                    a budget of 10 on random runs only; half leaves as many runs to the model (TPE) or to a bred
                    generation (NSGA-II) as to the start-up. A projected run is told as what ran, carrying the
                    suggested trial's generation (NSGA-II counts only completed trials of a generation);
  rule              the one-line rule: smallest tp x pp, then largest micro-batch, then lowest ZeRO stage (ties:
                    smaller tp, then least recomputation, then the table's order), a fixed order, no model;
  decision_tree     the seed's decision tree (evaluators/advice.py) as a fixed walk with no model: from the rule's
                    first plan, one group of axes at a time in the tree's order: memory (precision, then
                    micro-batch and recomputation, then ZeRO stage), then communication (tp, then pp placement),
                    then bubbles (schedule, virtual stages); each axis's values in the tree's preference order,
                    each on the plan that differs from the current one in that group only (skipped when the table
                    lacks it), stopping the axis at the first run that is not better after one that ran; the
                    current plan moves to the best measured; the walk ends after the last group.
The DeepSpeed autotuner and NeMo AutoConfigurator procedures are in procedures.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import optuna

from regret.instances import Runner, Truth
from stratagem.evaluators import Calibration, evaluate_many
from stratagem.evaluators.table import TableEvaluator
from stratagem.spaces import Plan
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.search_config import SearchConfig

__all__ = ["loop", "analytic_order", "random_order", "blackbox", "rule_order", "rule_memory_filter", "decision_tree",
           "run_static", "startup", "AXES", "axis_space"]

AXES = ("dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate", "zero_stage", "sequence_parallel", "micro_batch_size",
        "precision", "activation_checkpointing", "recompute_layers", "pp_schedule", "virtual_stages",
        "optimizer_offload")
_RECOMPUTE = {"none": 0, "selective": 1, "full": 2}
_PRECISION_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


class _Enough(Exception):
    """Raised from the loop's evaluator once more runs cannot change any figure."""


class _Replayed(TableEvaluator):
    """The table evaluator of one replay: raises _Enough right after the run that ends it (the budget's last, or
    on a table of single measurements the best plan's: later runs change no figure there), so the loop's refit
    after that run, which could only reorder runs that never happen, is not computed."""

    def __init__(self, truth: Truth, budget: int, **kwargs: Any) -> None:
        super().__init__(truth.table, **kwargs)
        self._truth = truth
        self._budget = budget

    def evaluate_batch(self, scenario: Any, plans: Sequence[Plan]) -> Any:
        """The table's runs of `plans`; then _Enough when the replay is over."""
        out = super().evaluate_batch(scenario, plans)
        if len(self.runs) >= self._budget or (not self._truth.noisy and any(map(self._truth.is_best, self.runs))):
            raise _Enough
        return out


def loop(truth: Truth, budget: int, seed: int, rng: np.random.Generator, calibration: Calibration,
         recalibrate: bool = True, order: str | None = None) -> list[tuple[str, float]]:
    """The shipped loop with run-order policy `order` (search.run_order.RUN_ORDERS; None: DEFAULT_RUN_ORDER, the
    shipped one) against the table: SearchSession with journal storage in a temp dir, the policy restricted to
    the candidates, one run per batch, the session's space holding the candidates (regret/space.py), each run one
    drawn sample. Stops right after the run that spends the budget, or (tables of single measurements) after the
    best plan's run: later runs change no figure (_Replayed). Returns (plan key, value the run showed) per run."""
    from regret.space import CandidateSpace
    from stratagem.search.run_order import DEFAULT_RUN_ORDER, RUN_ORDERS
    from stratagem.search.session import SearchSession

    scn = truth.scenario
    if scn.search is not None:  # the loop is seeded by the scenario's search.seed
        scn = scn.model_copy(update={"search": scn.search.model_copy(update={"seed": seed})})
    evaluator = _Replayed(truth, budget, calibration=calibration, slots=scn.cluster.num_gpus,
                          rng=rng if truth.noisy else None)

    with tempfile.TemporaryDirectory() as tmp:
        session = SearchSession(scn, f"journal:{tmp}/study.log", "regret", calibration=calibration,
                                listener=lambda event: None)
        session.space = CandidateSpace(scn, truth.plans)  # before anything is stored: every trial's choices
        policy = RUN_ORDERS[order or DEFAULT_RUN_ORDER](candidates=PlanColumns.from_plans(truth.plans))
        try:
            session.screen()
            session.store()
            session.measure(min(budget, len(truth.plans)), evaluator, policy, recalibrate=recalibrate)
        except _Enough:
            pass
    return [(k, truth.outcomes[k].samples[i].value) for k, i in evaluator.draws]


def run_static(truth: Truth, order: Sequence[str], runner: Runner, budget: int) -> None:
    """Run a fixed order (each plan once) until the budget is spent."""
    for key in order[:budget]:
        runner.run(key)


def analytic_order(truth: Truth, calibration: Calibration) -> list[str]:
    """Predicted order with `calibration`: plans predicted to fit by predicted tokens/s, then the others."""
    cols = evaluate_many(truth.scenario, truth.plans, calibration)
    fits = np.asarray(cols.fits) > 0
    tokens = np.asarray(cols.tokens_per_s)
    return [truth.keys[i] for i in np.lexsort((-tokens, ~fits))]


def random_order(truth: Truth, rng: np.random.Generator) -> list[str]:
    """A seeded random permutation of the candidates."""
    return [truth.keys[i] for i in rng.permutation(len(truth.keys))]


def _tie_key(p: Plan) -> tuple[Any, ...]:
    return (_RECOMPUTE.get(p.activation_checkpointing, 0), _PRECISION_BYTES.get(p.precision, 2))


def rule_order(truth: Truth) -> list[str]:
    """The one-line rule's order (module docstring); stable, so remaining ties keep the table's order."""
    idx = sorted(range(len(truth.plans)), key=lambda i: (
        truth.plans[i].tp * truth.plans[i].pp, -truth.plans[i].micro_batch_size, truth.plans[i].zero_stage,
        truth.plans[i].tp, *_tie_key(truth.plans[i])))
    return [truth.keys[i] for i in idx]


def rule_memory_filter(truth: Truth, calibration: Calibration) -> list[str]:
    """The rule's order with the plans predicted to fit (peak <= HBM - search.memory_margin_gib, `calibration`)
    first, then the others, each part in the rule's order."""
    cols = evaluate_many(truth.scenario, truth.plans, calibration)
    usable = truth.scenario.cluster.gpu.hbm_gib - (truth.scenario.search or SearchConfig()).memory_margin_gib
    fits = {k for k, peak in zip(truth.keys, np.asarray(cols.peak_gib), strict=True) if peak <= usable}
    rule = rule_order(truth)
    return [k for k in rule if k in fits] + [k for k in rule if k not in fits]


def axis_space(plans: Sequence[Plan]) -> tuple[list[str], dict[str, list[Any]], np.ndarray]:
    """The axes on which the candidates differ, each axis's values (sorted), and each plan's value indices."""
    dumps = [p.model_dump() for p in plans]
    axes = [a for a in AXES if len({str(d[a]) for d in dumps}) > 1]
    choices = {a: sorted({d[a] for d in dumps}, key=lambda v: (isinstance(v, str), v)) for a in axes}
    index = np.array([[choices[a].index(d[a]) for a in axes] for d in dumps], dtype=float).reshape(len(plans),
                                                                                                   len(axes))
    return axes, choices, index


def startup(budget: int) -> int:
    """Random start-up trials of TPE (n_startup_trials) and NSGA-II (population_size) for a budget: half of it, at
    least 2 (NSGA-II's crossover needs 2 parents; module docstring)."""
    return max(2, budget // 2)


def blackbox(truth: Truth, runner: Runner, budget: int, seed: int, kind: str) -> optuna.Study:
    """Optuna's TPE or NSGA-II as a black box (module docstring), seeded with `seed`; returns its study."""
    axes, choices, index = axis_space(truth.plans)
    dumps = [p.model_dump() for p in truth.plans]
    scale = np.array([max(1, len(choices[a]) - 1) for a in axes], dtype=float)
    dists = {a: optuna.distributions.CategoricalDistribution(choices[a]) for a in axes}
    if kind == "tpe":
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup(budget)))
    else:
        study = optuna.create_study(directions=["maximize", "maximize"], sampler=optuna.samplers.NSGAIISampler(
            seed=seed, population_size=startup(budget)))
    hbm = truth.scenario.cluster.gpu.hbm_gib
    tried: set[int] = set()
    while len(runner.order) < min(budget, len(truth.keys)):
        trial = study.ask(dists)
        want = np.array([choices[a].index(trial.params[a]) for a in axes], dtype=float)
        dist = (np.abs(index - want) / scale).sum(axis=1) if axes else np.zeros(len(truth.keys))
        dist[list(tried)] = np.inf
        i = int(np.argmin(dist))
        tried.add(i)
        key = truth.keys[i]
        value = runner.run(key)
        peak = truth.outcomes[key].peak_gib
        values: Any = value if kind == "tpe" else [value, (hbm - peak) if value > 0 and peak is not None else -hbm]
        params = {a: dumps[i][a] for a in axes}
        if params == trial.params:
            study.tell(trial, values)
        else:  # told what actually ran: the projected candidate, in the suggestion's generation (NSGA-II)
            asked = study.get_trials(deepcopy=False)[trial.number]
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                      values=[values] if kind == "tpe" else values,
                                                      system_attrs=dict(asked.system_attrs)))
    return study


# The decision tree's groups, in its order, each axis with its values in the tree's preference order.
_TREE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("memory: precision", ("precision",)),
    ("memory: micro-batch and recomputation", ("micro_batch_size", "activation_checkpointing", "recompute_layers")),
    ("memory: sharding", ("zero_stage", "optimizer_offload")),
    ("communication: tensor parallel", ("tp", "sequence_parallel")),
    ("communication: pipeline placement", ("pp",)),
    ("bubbles", ("pp_schedule", "virtual_stages")),
)


def _preference(axis: str, values: list[Any]) -> list[Any]:
    """An axis's values in the order the tree tries them: fewer bytes, larger micro-batch, less recomputation,
    lower ZeRO stage, smaller tp and pp, the schedule with the smaller bubble (listed order), no offload."""
    if axis == "precision":
        return sorted(values, key=lambda v: _PRECISION_BYTES.get(v, 2))
    if axis == "micro_batch_size":
        return sorted(values, reverse=True)
    if axis == "activation_checkpointing":
        return sorted(values, key=lambda v: _RECOMPUTE.get(v, 0))
    return sorted(values, key=lambda v: (isinstance(v, str), v))


def decision_tree(truth: Truth, runner: Runner, budget: int) -> None:
    """The seed's decision tree as a fixed walk (module docstring)."""
    axes, choices, index = axis_space(truth.plans)
    free = [a == "dp" for a in axes]  # dp follows from the layout
    current = truth.keys.index(rule_order(truth)[0])
    best_value = runner.run(truth.keys[current])
    for _, group in _TREE:
        others = np.array([not f and a not in group for a, f in zip(axes, free, strict=True)])
        for axis in (a for a in group if a in axes):
            j = axes.index(axis)
            ran_ok = best_value > 0
            for value in _preference(axis, choices[axis]):
                if len(runner.order) >= budget:
                    return
                same = (index[:, others] == index[current, others]).all(axis=1)
                match = np.flatnonzero(same & (index[:, j] == choices[axis].index(value)))
                if not len(match) or runner.ran(truth.keys[int(match[0])]):
                    continue  # the table lacks this step's plan (or it ran): the tree goes on
                cand = int(match[0])
                seen = runner.run(truth.keys[cand])
                if seen > best_value:
                    best_value, current = seen, cand
                elif ran_ok:
                    break  # not better after one that ran: this axis is settled
                ran_ok = ran_ok or seen > 0
