"""Two tuning procedures people use, replayed on a table (no analytic model: each uses only what it states).

ds_autotuner — DeepSpeed's autotuner in its default fast mode (deepspeed/autotuning/README.md, "Autotuning
Workflow and Scope", "Configuring Train Micro-Batch Size", "Fast Mode", "Tuning algorithms"; the steps below as
deepspeed/autotuning/autotuner.py `tune`, `tune_space`, `get_min_max_micro_batch_size` and
`get_tuning_micro_batch_size_list` carry them out). It tunes ZeRO stage and micro-batch for a configuration the
user fixes (model-parallel layout, recomputation, precision): a user runs it once per such configuration, in the
rule's order (smallest tp x pp first). Per configuration:
  1. a model-information profiling run with the least-memory setting (highest ZeRO stage, smallest micro-batch):
     the parameter count and the activation memory of micro-batch 1 (its measured peak minus DeepSpeed's estimate
     of the model states); it is not itself a tuning result (unless a later step asks for the same setting: the
     replay then reuses it instead of charging a second run); if it fails the configuration is skipped;
  2. ZeRO stages in the order 0, 1, 2, 3 (those the table has); a stage is tuned only if DeepSpeed's estimate of
     model states (2+2+16 bytes/param in 16-bit, 4+4+8 in fp32; ZeRO-1/2/3 divide the optimizer / gradients /
     parameters by the GPU count; all by the model-parallel size) plus that activation memory is under the device;
     and, as autotuner.py does, only if its estimated largest micro-batch (free memory / activation memory) is not
     below the previous stage's largest runnable one;
  3. in a stage: the smallest micro-batch (stage not runnable if it fails); the largest runnable micro-batch tried
     at 1.05x, 1x and 0.95x the estimate, else found by binary search from the smallest (stopping when a larger
     one gains under 5 %, METRIC_PERCENT_DIFF_CONST); then num_tuning_micro_batch_sizes = 3 micro-batches from
     half the largest to the largest (its stride) are run; the stage's best is kept (fast mode tunes nothing
     else; the same-accumulation refinement has nothing to run where every micro-batch has its own accumulation
     count, as in these tables);
  4. the exploration of stages stops when a stage's best is no better than the previous stage's (README step 3).
A requested micro-batch the table lacks is run as the table's nearest one (ties: the smaller); a setting already
run is not run again (the autotuner skips experiments whose results exist).

nemo_autoconfigurator — NeMo's AutoConfigurator (nemo/collections/llm/tools/auto_configurator/core/
training_config.py `generate_grid_search_configs`, `GPT3GridSearch.init_params`, `_calculate_tp_pp_mbs_grid`;
docs "Use Auto Configurator to Find the Optimal Configuration"): its heuristic grid of tp, pp, cp, ep and
micro-batch for the model size, sequence length and GPU memory (GPT3GridSearch's tables; its class defaults
where no table row applies), filtered as it filters (heads % tp, layers % pp, global batch % (mbs x data
parallel), min <= tp x pp x cp x ep <= max model parallel), run in its order (tp, then pp, cp, ep, then
micro-batch), the best kept. The model size is the nominal one the user names, not a parameter count: NeMo's
runner.py AutoConfigurator._get_model_size reads `model_size_in_b` from the model config's name (the number
before its B or M: Llama3Config8B is 8) and its base configs are per named size; a sweep group is named by its
size ("8B", whose 8.86e9 parameters would select the "<= 13B" row), so the row is that of the named size. A
model whose name carries no size (the CPU tables') falls back to its parameter count; no 80 GB row applies to
those devices anyway. NeMo's defaults fix the rest: the distributed optimizer (ZeRO-1), no
recomputation, sequence parallel with tp > 1, 16-bit precision; each config runs on the table's plan with those
(else the nearest stage, recomputation, precision); a config the table lacks cannot run and is counted.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

from regret.instances import Runner, Truth
from regret.methods import rule_order
from stratagem.spaces import Plan

__all__ = ["ds_autotuner", "nemo_autoconfigurator", "nemo_grid", "nominal_size_b"]

METRIC_PERCENT_DIFF = 0.05
"""deepspeed/autotuning/constants.py METRIC_PERCENT_DIFF_CONST: a larger micro-batch must gain 5 %."""
NUM_TUNING_MICRO_BATCH_SIZES = 3
"""deepspeed/autotuning README, autotuning configuration default."""


def _states_bytes(params: float, stage: int, gpus: int, mp: int, bytes16: bool) -> float:
    """DeepSpeed autotuner's model-state memory per GPU (autotuner.py get_instantiation_memory_required_per_gpu):
    Adam assumed; 16-bit: 2 B params, 2 B grads, 16 B optimizer; else 4, 4, 8; ZeRO stage >= 1/2/3 divides the
    optimizer/gradients/parameters by the GPU count; the sum by the model-parallel size."""
    p, g, o = (2.0, 2.0, 16.0) if bytes16 else (4.0, 4.0, 8.0)
    o = o / gpus if stage >= 1 else o
    g = g / gpus if stage >= 2 else g
    p = p / gpus if stage >= 3 else p
    return params * (p + g + o) / mp


def _nearest(sizes: list[int], want: int) -> int:
    return min(sizes, key=lambda s: (abs(s - want), s))


def _configurations(truth: Truth) -> list[tuple[tuple[Any, ...], dict[int, dict[int, str]]]]:
    """The table's plans grouped by what the autotuner does not tune (everything but ZeRO stage and micro-batch),
    in the rule's order of each group's first plan; each group: stage -> micro-batch -> plan key."""
    groups: dict[tuple[Any, ...], dict[int, dict[int, str]]] = defaultdict(lambda: defaultdict(dict))
    first: dict[tuple[Any, ...], int] = {}
    rank = {k: i for i, k in enumerate(rule_order(truth))}
    for p, k in zip(truth.plans, truth.keys, strict=True):
        d = p.model_dump()
        fixed = tuple((a, str(v)) for a, v in sorted(d.items()) if a not in ("zero_stage", "micro_batch_size", "dp"))
        groups[fixed][p.zero_stage][p.micro_batch_size] = k
        first[fixed] = min(first.get(fixed, rank[k]), rank[k])
    return [(f, groups[f]) for f in sorted(groups, key=lambda f: first[f])]


def _stage(runner: Runner, keys: dict[int, str], est_max: int, budget: int) -> tuple[float, int]:
    """Fast-mode tuning of one ZeRO stage (module docstring, step 3): (stage best, largest runnable micro-batch)."""
    sizes = sorted(keys)

    def run(mbs: int) -> float:
        key = keys[_nearest(sizes, mbs)]
        if runner.ran(key):  # run before (the profiling run's setting): its result is this experiment's
            runner.promote(key)
            return runner.observed(key)
        return runner.run(key) if len(runner.order) < budget else 0.0

    lo = sizes[0]
    base = run(lo)
    if base <= 0:
        return 0.0, 0
    values = {lo: base}
    largest = 0
    for want in (math.ceil(1.05 * est_max), est_max, int(0.95 * est_max)):
        size = _nearest(sizes, max(want, lo))
        if (v := run(size)) > 0:
            values[size], largest = v, size
            break
    if not largest:  # binary search from the smallest, stopping at a plateau
        low, high, prev = 0, sizes.index(_nearest(sizes, max(est_max, lo))), base
        while low <= high:
            mid = (low + high) // 2
            v = run(sizes[mid])
            if v > 0:
                values[sizes[mid]], low = v, mid + 1
                if (v - prev) / prev < METRIC_PERCENT_DIFF:
                    break
                prev = v
            else:
                high = mid - 1
        largest = sizes[max(0, low - 1)]
    start = max(lo, largest // 2)
    stride = max(1, (largest - start) // NUM_TUNING_MICRO_BATCH_SIZES)
    for mbs in [*range(start, largest, stride), largest]:
        if len(runner.order) >= budget:
            break
        values[_nearest(sizes, mbs)] = run(mbs)
    return max(values.values()), largest


def ds_autotuner(truth: Truth, runner: Runner, budget: int) -> None:
    """DeepSpeed's autotuner procedure, once per configuration it does not tune (module docstring)."""
    scn = truth.scenario
    params = float(scn.model.num_params())
    gpus = scn.cluster.num_gpus
    hbm = scn.cluster.gpu.hbm_gib * 2**30
    for _fixed, stages in _configurations(truth):
        if len(runner.order) >= budget:
            return
        some = next(iter(next(iter(stages.values())).values()))
        plan: Plan = truth.plans[truth.keys.index(some)]
        mp = plan.tp * plan.pp * plan.cp
        bytes16 = plan.precision != "fp32"
        top = max(stages)
        profile = stages[top][min(stages[top])]
        if runner.ran(profile):
            continue
        if runner.run(profile, candidate=False) <= 0 or runner.last_peak is None:
            continue  # "the model is not runnable": no model information
        act = max(1.0, runner.last_peak * 2**30 - _states_bytes(params, top, gpus, mp, bytes16))
        act_per_mbs = act / min(stages[top])
        prev_best, prev_max = 0.0, 0
        for stage in sorted(stages):
            if len(runner.order) >= budget:
                return
            states = _states_bytes(params, stage, gpus, mp, bytes16)
            if hbm <= states + act_per_mbs:
                continue
            est_max = int((hbm - states) // act_per_mbs)
            if est_max < prev_max:
                continue
            best, largest = _stage(runner, stages[stage], max(1, est_max), budget)
            if largest == 0:
                continue
            if best <= prev_best:
                break
            prev_best, prev_max = best, largest


# GPT3GridSearch.init_params, 80 GB GPUs, seq_length 4096 (the sweep's): (max size in B, tp, (pp lo, pp hi),
# mbs, min_mp, max_mp); other seq lengths and GPUs fall back to the class defaults (_DEFAULT_GRID).
_GRID_80G_4096: tuple[tuple[float, tuple[int, ...], tuple[int, int] | None, tuple[int, ...], int, int], ...] = (
    (1.0, (1, 2, 4), None, (1, 2, 4, 8), 1, 8),
    (4.0, (1, 2, 4), None, (1, 2, 4, 8), 1, 8),
    (8.0, (1, 2, 4), (1, 2), (1, 2, 4), 1, 8),
    (13.0, (2, 4), (1, 2), (1, 2, 4), 1, 8),
    (23.0, (4, 8), (1, 2), (1, 2), 4, 16),
    (45.0, (4, 8), (2, 4), (1, 2), 8, 32),
    (95.0, (4, 8), (1, 8), (1, 2), 8, 64),
)
_DEFAULT_GRID = ((1, 2, 4, 8), None, (1, 2, 4, 8), 1, 8)


_NAMED_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([BbMm])\b")
"""A size in a model's name: a number followed by B (billions) or M (millions), e.g. 8B, 1.5b, 126M."""


def nominal_size_b(truth: Truth) -> float:
    """The model size AutoConfigurator is given, in billions (module docstring): the sweep group's named size,
    else the size in the scenario's model name, else the parameter count."""
    for name in (truth.instance.model, truth.scenario.model.name):
        found = _NAMED_SIZE.findall(name)
        if found:
            number, unit = found[-1]
            return float(number) / (1000.0 if unit in "Mm" else 1.0)
    return truth.scenario.model.num_params() / 1e9


def nemo_grid(truth: Truth) -> list[tuple[int, int, int]]:
    """AutoConfigurator's (tp, pp, mbs) configs for this scenario, in its order (module docstring)."""
    scn = truth.scenario
    m = scn.model
    size_b = nominal_size_b(truth)
    row: tuple[Any, ...] = _DEFAULT_GRID
    if round(scn.cluster.gpu.hbm_gib * 2**30 / 1e9) == 80 or round(scn.cluster.gpu.hbm_gib) == 80:
        if scn.training.seq_len == 4096:
            row = next((r[1:] for r in _GRID_80G_4096 if size_b <= r[0]), _DEFAULT_GRID)
    tps, pp_range, mbss, min_mp, max_mp = row
    valid_pp = [x for x in range(1, m.num_layers + 1) if m.num_layers % x == 0]  # only divisors of the layers
    pps = [1] if pp_range is None else [x for x in valid_pp if pp_range[0] <= x <= pp_range[1]]
    gpus, gbs = scn.cluster.num_gpus, scn.training.global_batch_size
    layouts = [(tp, pp) for tp in tps for pp in pps
               if m.num_attention_heads % tp == 0 and m.num_layers % pp == 0 and min_mp <= tp * pp <= max_mp
               and any(gbs % (mbs * gpus / (tp * pp)) == 0 for mbs in mbss)]
    return [(tp, pp, mbs) for tp, pp in layouts for mbs in mbss if gbs % (mbs * gpus / (tp * pp)) == 0]


def _nemo_plan(truth: Truth, tp: int, pp: int, mbs: int) -> str | None:
    """The table's plan for one AutoConfigurator config with NeMo's defaults (module docstring), or None."""
    match = [(p, k) for p, k in zip(truth.plans, truth.keys, strict=True)
             if p.tp == tp and p.pp == pp and p.micro_batch_size == mbs and p.cp == 1]
    if not match:
        return None

    def distance(p: Plan) -> tuple[int, ...]:
        return (abs(p.zero_stage - 1), p.activation_checkpointing != "none", p.sequence_parallel != (tp > 1),
                p.precision == "fp32")
    return min(match, key=lambda pk: distance(pk[0]))[1]


def nemo_autoconfigurator(truth: Truth, runner: Runner, budget: int) -> int:
    """AutoConfigurator's grid run in its order; returns how many of its configs the table lacks."""
    missing = 0
    for tp, pp, mbs in nemo_grid(truth):
        key = _nemo_plan(truth, tp, pp, mbs)
        if key is None:
            missing += 1
            continue
        if len(runner.order) >= budget:
            break
        if not runner.ran(key):
            runner.run(key)
    return missing
