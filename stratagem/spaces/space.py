"""The search space: which values each Plan axis may take in a scenario, counted, enumerated as columns, and
suggested to an Optuna trial.

A plan is a *layout* (tp, pp, cp, dp, ep: how the world is cut) plus per-layout choices (built by
spaces/layouts.py from the scenario's search section, spaces/search_config.py). Each layout keeps
three small joint lists -- sharding (zero_stage, dp_replicate, optimizer_offload), sequence_parallel and
pipelining with recomputation (micro_batch_size, pp_schedule, virtual_stages, the split, activation_checkpointing
with recompute_modules: a schedule the stack cannot run with a recompute mode is left out) -- and one global one
(precision). Plan number i is a mixed-radix number over those lists, so counting is a sum of
products and enumeration (or sampling) is a vectorised decode: no Plan object on the hot path.

Conditional axes apply only where they mean something: sequence_parallel with tp > 1, pp_schedule with
pp > 1, virtual_stages with the interleaved schedule, dp_replicate and optimizer_offload with zero_stage >= 1,
zero_stage > 0 with a sharding group dp*cp > 1 (a ZeRO/FSDP wrapper over one rank: a pointless job, not
enumerated). Elsewhere they keep the Plan default. Pipeline splits that give the same chunks, 1f1b with one
micro-batch (= gpipe) and zero 3 with pp where the stack keeps parameters gathered with pp (= zero 2) are
enumerated once, in their canonical form (spaces/canonical.py): every enumerated plan is
`canonical_plan` of itself and no two build the same job, so `count()` counts distinct jobs.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from stratagem.errors import StratagemError
from stratagem.spaces.canonical import canonical_plan
from stratagem.spaces.layout_lists import OFFLOAD, Layout
from stratagem.spaces.layouts import LayoutBuilder
from stratagem.spaces.plan import (
    PIPELINE_SPLITS,
    PRECISIONS,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    Plan,
    Precision,
    Recompute,
)
from stratagem.spaces.search_config import SearchConfig

if TYPE_CHECKING:
    import optuna

    from stratagem.spaces.columns import PlanColumns
    from stratagem.spaces.scenario import Scenario

__all__ = ["SearchSpace", "AXES"]

IntArray = NDArray[np.int64]

# Axis order of `SearchSpace.suggest` (define-by-run) and of the stored trial params.
AXES: tuple[str, ...] = (
    "tp", "pp", "cp", "dp", "ep", "etp", "zero_stage", "dp_replicate", "optimizer_offload", "sequence_parallel",
    "micro_batch_size", "pp_schedule", "virtual_stages", "pp_split", "first_stage_layers", "last_stage_layers",
    "precision", "activation_checkpointing", "recompute_modules",
)
SPACE_VERSION = "runnable-3"  # what the enumeration yields; bumped when the same search section yields other plans
# (canonical-1: one canonical plan per job, spaces/canonical.py; the Optuna choices of the split axes changed;
# runnable-1: the stack record's PlanExclusions are left out, stacks.py and exclusions.py; runnable-2: so are the
# torch record's export exclusions, what torchtitan cannot express exactly, spaces/exclusions.py; runnable-3:
# zero 3 with pp is zero 2 where the stack keeps parameters gathered with pp, canonical.py sharding_stage)

class SearchSpace:
    """Every valid plan of a scenario under its search config; see the module docstring."""

    def __init__(self, scenario: Scenario, config: SearchConfig | None = None) -> None:
        self.scenario = scenario
        self.config = cfg = config or scenario.search or SearchConfig()
        built = LayoutBuilder(scenario, cfg)  # the stack's capabilities (spaces/stacks.py): only plans it runs
        self.layouts: tuple[Layout, ...] = built.build()
        self.notes: list[str] = built.notes  # listed axis values that occur in no valid plan here (ignored)
        self._left_out: dict[str, str] = built.left_out  # the stack's exclusions that removed choices
        self.precisions: tuple[Precision, ...] = built.precisions
        self.recomputes: tuple[Recompute, ...] = built.recomputes
        # the recompute axis: (activation_checkpointing, module set) pairs, module sets only with selective
        self.module_sets: tuple[str, ...] = built.module_sets
        self.recompute_pairs: tuple[tuple[Recompute, str], ...] = built.recompute_pairs
        self._build_tables()

    def _build_tables(self) -> None:
        lays = self.layouts
        n = len(lays)
        self._lay = {k: np.array([getattr(lay, k) for lay in lays], dtype=np.int64)
                     for k in ("tp", "pp", "cp", "dp", "ep", "etp")}
        self._nz = np.array([len(lay.zero) for lay in lays], dtype=np.int64)
        self._nsp = np.array([len(lay.sp) for lay in lays], dtype=np.int64)
        self._npipe = np.array([len(lay.pipe) for lay in lays], dtype=np.int64)
        self._zero_tab = np.zeros((n, int(self._nz.max()), 3), dtype=np.int64)
        self._sp_tab = np.zeros((n, int(self._nsp.max())), dtype=np.int64)
        self._pipe_tab = np.zeros((n, int(self._npipe.max()), 7), dtype=np.int64)
        for i, lay in enumerate(lays):
            self._zero_tab[i, : len(lay.zero)] = lay.zero
            self._sp_tab[i, : len(lay.sp)] = lay.sp
            self._pipe_tab[i, : len(lay.pipe)] = lay.pipe
        self._prec_codes = np.array([PRECISIONS.index(p) for p in self.precisions], dtype=np.int64)
        self._ac_codes = np.array([RECOMPUTES.index(r) for r, _ in self.recompute_pairs], dtype=np.int64)
        self._module_codes = np.array([sum(2 ** RECOMPUTE_MODULES.index(x) for x in sets.split("+") if x)
                                       for _, sets in self.recompute_pairs], dtype=np.int64)
        per = self._nz * self._nsp * self._npipe * len(self.precisions)  # the recompute pair is in the pipe table
        self._ends = np.cumsum(per)
        self._starts = self._ends - per
        self._by_key = {lay.key: lay for lay in lays}
        self._axis_choices = self._global_choices()

    # ---- counting and enumeration --------------------------------------------------------------------
    def count(self) -> int:
        """Number of valid plans (exact, without enumerating)."""
        return int(self._ends[-1])

    def __len__(self) -> int:
        return self.count()

    def decode(self, index: NDArray[np.integer[Any]]) -> PlanColumns:
        """The plans with these numbers (0 <= i < count()), as columns; vectorised."""
        from stratagem.spaces.columns import PlanColumns

        idx = np.asarray(index, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.count()):
            raise IndexError(f"plan numbers must lie in [0, {self.count()})")
        s = np.searchsorted(self._ends, idx, side="right")
        r = idx - self._starts[s]
        n_prec = len(self.precisions)
        prec, r = r % n_prec, r // n_prec
        ipipe, r = r % self._npipe[s], r // self._npipe[s]
        isp, iz = r % self._nsp[s], r // self._nsp[s]
        zero, pipe = self._zero_tab[s, iz], self._pipe_tab[s, ipipe]
        ac = pipe[:, 6]

        def f(a: NDArray[Any]) -> NDArray[np.float64]:
            return np.asarray(a, dtype=np.float64)

        return PlanColumns(
            dp=f(self._lay["dp"][s]), tp=f(self._lay["tp"][s]), pp=f(self._lay["pp"][s]),
            cp=f(self._lay["cp"][s]), ep=f(self._lay["ep"][s]), etp=f(self._lay["etp"][s]), dp_replicate=f(zero[:, 1]),
            zero_stage=f(zero[:, 0]), sequence_parallel=f(self._sp_tab[s, isp]), micro_batch_size=f(pipe[:, 0]),
            precision=f(self._prec_codes[prec]), activation_checkpointing=f(self._ac_codes[ac]),
            pp_schedule=f(pipe[:, 1]), virtual_stages=f(pipe[:, 2]), optimizer_offload=f(zero[:, 2]),
            pp_split=f(pipe[:, 3]), first_stage_layers=f(pipe[:, 4]), last_stage_layers=f(pipe[:, 5]),
            recompute_modules=f(self._module_codes[ac]),
        )

    def enumerate(self) -> PlanColumns:
        """Every valid plan, as columns."""
        return self.decode(np.arange(self.count(), dtype=np.int64))

    def sample_numbers(self, size: int, seed: int | None = None) -> IntArray:
        """`size` distinct plan numbers drawn uniformly (all of them, sorted, when size >= count)."""
        n = self.count()
        if size >= n:
            return np.arange(n, dtype=np.int64)
        rng = np.random.default_rng(self.config.seed if seed is None else seed)
        return np.sort(rng.choice(n, size=size, replace=False)).astype(np.int64)

    def digest(self) -> str:
        """Hash of the scenario (problem), the search config and SPACE_VERSION: identifies this space (and so the
        default study name: a study made by an older enumeration is not resumed with other plans)."""
        config = self.config.model_dump(mode="json")
        if config.get("recompute_modules") is None:  # added later: unset keeps the digests of earlier studies
            config.pop("recompute_modules", None)
        blob = json.dumps([self.scenario.problem_hash(), config, SPACE_VERSION],
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- Optuna: define-by-run -----------------------------------------------------------------------
    def _global_choices(self) -> dict[str, tuple[Any, ...]]:
        """Per axis, every value it takes anywhere in the space (the trial's categorical choices)."""
        lays = self.layouts

        def ints(values: Any) -> tuple[int, ...]:
            return tuple(sorted({int(v) for v in values}))

        return {
            "tp": ints(lay.tp for lay in lays),
            "pp": ints(lay.pp for lay in lays),
            "cp": ints(lay.cp for lay in lays),
            "ep": ints(lay.ep for lay in lays),
            "etp": ints(lay.etp for lay in lays),
            "zero_stage": ints(z[0] for lay in lays for z in lay.zero),
            "dp_replicate": ints(z[1] for lay in lays for z in lay.zero if z[0] > 0) or (1,),
            "optimizer_offload": tuple(o for i, o in enumerate(OFFLOAD)
                                       if any(z[2] == i for lay in lays for z in lay.zero if z[0] > 0)) or ("none",),
            "sequence_parallel": tuple(bool(v) for v in sorted({s for lay in lays if lay.tp > 1 for s in lay.sp}))
            or (False,),
            "micro_batch_size": ints(q[0] for lay in lays for q in lay.pipe),
            "pp_schedule": tuple(SCHEDULES[c] for c in sorted({q[1] for lay in lays if lay.pp > 1 for q in lay.pipe}))
            or ("1f1b",),
            "virtual_stages": ints(q[2] for lay in lays for q in lay.pipe if q[2] > 1) or (2,),
            "pp_split": tuple(PIPELINE_SPLITS[c] for c in sorted({q[3] for lay in lays for q in lay.pipe}))
            or ("layers",),
            "first_stage_layers": ints(q[4] for lay in lays for q in lay.pipe),
            "last_stage_layers": ints(q[5] for lay in lays for q in lay.pipe),
            "precision": self.precisions,
            "activation_checkpointing": self.recomputes,
            "recompute_modules": self.module_sets,
        }

    def choices(self, name: str) -> tuple[Any, ...]:
        """The categorical choices of axis `name` in this space (identical in every trial of a study)."""
        return self._axis_choices[name]

    def allowed(self, name: str, partial: dict[str, Any]) -> list[Any] | None:
        """Values axis `name` may take given the earlier axes in `partial` (AXES order); None when the axis
        does not apply to that partial plan (it keeps the Plan default and is not suggested)."""
        if name in _DEGREE_AXES:
            return self._allowed_degree(name, partial)
        p = partial
        lay = self._by_key.get((p["tp"], p["pp"], p["cp"], p.get("ep", 1), p.get("etp", 1)))
        if lay is None:
            return []
        if name == "precision":
            return list(self.precisions)
        if name in ("zero_stage", "dp_replicate", "optimizer_offload", "sequence_parallel"):
            return _allowed_sharding(lay, name, p)
        if name in ("activation_checkpointing", "recompute_modules"):
            return self._allowed_recompute(lay, name, p)
        if name in _PIPELINING_AXES:
            return _allowed_pipelining(lay, name, p)
        raise KeyError(name)

    def _allowed_degree(self, name: str, p: dict[str, Any]) -> list[Any] | None:
        """tp, pp, cp, dp, ep, etp: the values of the layouts matching the degrees chosen before."""
        lays = self.layouts
        if name in ("ep", "etp") and self.scenario.model.moe is None:
            return None
        earlier = _DEGREE_AXES[:_DEGREE_AXES.index(name)]
        if name == "ep":  # dp is derived (one value per tp, pp, cp): ep follows tp, pp, cp
            earlier = ("tp", "pp", "cp")
        if name == "etp":
            earlier = ("tp", "pp", "cp", "ep")
        return sorted({getattr(lay, name) for lay in lays if all(getattr(lay, k) == p[k] for k in earlier)})

    def _allowed_recompute(self, lay: Layout, name: str, p: dict[str, Any]) -> list[Any] | None:
        """activation_checkpointing and recompute_modules: the recompute pairs of the matching pipe entries."""
        if name == "recompute_modules" and (p.get("activation_checkpointing") != "selective"
                                            or self.module_sets == ("",)):
            return None
        pairs = {self.recompute_pairs[q[6]] for q in _matching_pipe(lay, p)}
        if name == "activation_checkpointing":
            return [r for r in self.recomputes if any(ac == r for ac, _ in pairs)]
        return [x for x in self.module_sets if ("selective", x) in pairs]

    def project(self, name: str, value: Any, partial: dict[str, Any]) -> Any:
        """`value` if axis `name` allows it after `partial`, else the nearest allowed value (by log-ratio for
        integers, by position in the choices otherwise)."""
        ok = self.allowed(name, partial)
        if not ok or value in ok:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            order = self._axis_choices[name]
            pos = order.index(value) if value in order else 0
            return min(ok, key=lambda v: (abs(order.index(v) - pos), order.index(v)))
        shift = 1 if min(ok) <= 0 or value <= 0 else 0  # stage layer counts take 0 (= even split): log(v + 1)
        return min(ok, key=lambda v: (abs(math.log(v + shift) - math.log(max(value, 0) + shift)), v))

    def suggest(self, trial: optuna.trial.Trial) -> Plan:
        """Define-by-run: suggest each applicable axis in AXES order, its choices fixed per study; dp is
        derived (a single-valued int). With `ProjectingSampler` every suggestion is valid; with another sampler
        an invalid combination yields a Plan that breaks a rule (the caller records it as infeasible). The plan
        returned is canonical (`canonical`): a sampler's non-canonical combination names the same job."""
        values: dict[str, Any] = {}
        for name in AXES:
            ok = self.allowed(name, values)
            if ok is None:
                continue
            if name == "dp":
                world = self.scenario.cluster.num_gpus
                d = max(1, world // (values["tp"] * values["pp"] * values["cp"]))
                values["dp"] = trial.suggest_int("dp", d, d)
            else:
                values[name] = trial.suggest_categorical(name, self._axis_choices[name])
        return self.canonical(Plan(**values))

    def canonical(self, plan: Plan) -> Plan:
        """`spaces.canonical.canonical_plan` in this space's scenario: the one Plan for the job `plan` builds."""
        return canonical_plan(self.scenario, plan)

    def canonical_columns(self, plans: PlanColumns) -> PlanColumns:
        """`plans` (e.g. a user's candidates) with each row replaced by its canonical plan and rows naming a job
        already seen dropped (first kept, order kept): one row per job. Row by row: for small sets only."""
        from stratagem.spaces.columns import PlanColumns

        seen: dict[Plan, None] = {}
        for i in range(len(plans)):
            seen.setdefault(self.canonical(plans.plan(i)), None)
        return PlanColumns.from_plans(list(seen))

    def params(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
        """(params, distributions) that `suggest` records for `plan`: the applicable axes only, of its canonical
        plan (`canonical`: a plan that builds the same job as an enumerated one is stored as that one)."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        plan = self.canonical(plan)
        dump = plan.model_dump(mode="json")
        params: dict[str, Any] = {}
        dists: dict[str, Any] = {}
        for name in AXES:
            if self.allowed(name, params) is None:
                continue
            params[name] = "+".join(plan.recompute_modules) if name == "recompute_modules" else dump[name]
            if name == "dp":
                dists[name] = IntDistribution(plan.dp, plan.dp)
                continue
            choices = self._axis_choices[name]
            if params[name] not in choices:  # a study holds only plans of its space (Optuna's distributions)
                left_out = f" (the stack leaves out: {', '.join(self._left_out)})" if self._left_out else ""
                raise StratagemError(
                    f"plan.{name} ({params[name]}) of {plan.short()} is outside the scenario's search space ({name}: "
                    f"{', '.join(map(str, choices))}){left_out}; widen the search section or use a plan it holds")
            dists[name] = CategoricalDistribution(choices)
        return params, dists

    def summary(self) -> dict[str, Any]:
        """Axis values and counts, for reports and the CLI."""
        return {"plans": self.count(), "layouts": len(self.layouts), "notes": list(self.notes),
                **{k: list(v) for k, v in self._axis_choices.items()}}


_DEGREE_AXES = ("tp", "pp", "cp", "dp", "ep", "etp")
_PIPELINING_AXES = ("micro_batch_size", "pp_schedule", "virtual_stages", "pp_split", "first_stage_layers",
                    "last_stage_layers")


def _allowed_sharding(lay: Layout, name: str, p: dict[str, Any]) -> list[Any] | None:
    """zero_stage, dp_replicate, optimizer_offload and sequence_parallel in one layout (see `allowed`)."""
    if name == "zero_stage":
        return sorted({z[0] for z in lay.zero}) if lay.dp * lay.cp > 1 else None
    if name == "sequence_parallel":
        return [bool(s) for s in lay.sp] if lay.tp > 1 else None
    if p.get("zero_stage", 0) == 0:
        return None
    zs = [z for z in lay.zero if z[0] == p["zero_stage"]]
    if name == "dp_replicate":
        return sorted({z[1] for z in zs})
    return [o for i, o in enumerate(OFFLOAD) if any(z[2] == i and z[1] == p["dp_replicate"] for z in zs)]


def _allowed_pipelining(lay: Layout, name: str, p: dict[str, Any]) -> list[Any] | None:
    """micro_batch_size, pp_schedule, virtual_stages and the split axes in one layout (see `allowed`)."""
    if name == "micro_batch_size":
        return sorted({q[0] for q in lay.pipe})
    if name == "pp_schedule":
        if lay.pp == 1:
            return None
        codes = sorted({q[1] for q in lay.pipe if q[0] == p["micro_batch_size"]})
        return [SCHEDULES[c] for c in codes]
    if name == "virtual_stages":
        if p.get("pp_schedule", "1f1b") != "interleaved":
            return None
        return sorted({q[2] for q in lay.pipe if q[0] == p["micro_batch_size"] and SCHEDULES[q[1]] == "interleaved"})
    if lay.pp == 1:  # pp_split, first_stage_layers, last_stage_layers
        return None
    sched = SCHEDULES.index(p.get("pp_schedule", "1f1b"))
    qs = [q for q in lay.pipe if (q[0], q[1], q[2]) == (p["micro_batch_size"], sched, p.get("virtual_stages", 1))]
    if name == "pp_split":
        return [PIPELINE_SPLITS[c] for c in sorted({q[3] for q in qs})]
    qs = [q for q in qs if PIPELINE_SPLITS[q[3]] == p.get("pp_split", "layers")]
    if name == "last_stage_layers":
        qs = [q for q in qs if q[4] == p.get("first_stage_layers", 0)]
    values = sorted({q[4] if name == "first_stage_layers" else q[5] for q in qs})
    return None if values == [0] else values


def _matching_pipe(lay: Layout, partial: dict[str, Any]) -> list[tuple[int, ...]]:
    """The layout's pipe entries (with their recompute pair) that match the partial plan's micro-batch, schedule,
    virtual stages and split (absent fields: the Plan defaults, as a plan without pipelining has them)."""
    key = (partial["micro_batch_size"], SCHEDULES.index(partial.get("pp_schedule", "1f1b")),
           partial.get("virtual_stages", 1), PIPELINE_SPLITS.index(partial.get("pp_split", "layers")),
           partial.get("first_stage_layers", 0), partial.get("last_stage_layers", 0))
    return [q for q in lay.pipe if q[:6] == key]
