"""The search space: which values each Plan axis may take in a scenario, counted, enumerated as columns, and
suggested to an Optuna trial.

A plan is a *layout* (tp, pp, cp, dp, ep: how the world is cut) plus per-layout choices. Each layout keeps
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stratagem.errors import StratagemError
from stratagem.spaces.canonical import canonical_plan, canonical_split, sharding_stage
from stratagem.spaces.expert_grid import expert_grid_problem
from stratagem.spaces.factors import divisors
from stratagem.spaces.pipeline_split import chunk_layers, rank_layers, split_problem
from stratagem.spaces.plan import (
    PIPELINE_SPLITS,
    PRECISIONS,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    PipelineSplit,
    Plan,
    Precision,
    Recompute,
    Schedule,
)
from stratagem.spaces.recompute import modules_problem
from stratagem.spaces.stacks import PlanFacts

if TYPE_CHECKING:
    import optuna

    from stratagem.spaces.columns import PlanColumns
    from stratagem.spaces.scenario import Scenario

__all__ = ["IntRange", "SearchConfig", "SearchSpace", "AXES"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
IntArray = NDArray[np.int64]

# Axis order of `SearchSpace.suggest` (define-by-run) and of the stored trial params.
AXES: tuple[str, ...] = (
    "tp", "pp", "cp", "dp", "ep", "etp", "zero_stage", "dp_replicate", "optimizer_offload", "sequence_parallel",
    "micro_batch_size", "pp_schedule", "virtual_stages", "pp_split", "first_stage_layers", "last_stage_layers",
    "precision", "activation_checkpointing", "recompute_modules",
)
SPACE_VERSION = "runnable-3"  # what the enumeration yields; bumped when the same search section yields other plans
# (canonical-1: one canonical plan per job, spaces/canonical.py; the Optuna choices of the split axes changed;
# runnable-1: the stack record's PlanExclusions are left out, stacks.py, issue 24 item 6; runnable-2: so are the
# torch record's export exclusions, what torchtitan cannot express exactly, spaces/exclusions.py; runnable-3:
# zero 3 with pp is zero 2 where the stack keeps parameters gathered with pp, canonical.py sharding_stage)
MAX_UNEVEN_SPLITS = 4  # default first/last stage layer pairs per (pp, virtual_stages): the best balanced ones
# Default heuristics (bypassed by axes the scenario lists explicitly).
MIN_CP_SHARD_TOKENS = 1024  # cp: each rank keeps >= 1k tokens, or ring attention's KV exchange is exposed
DEFAULT_MAX_VIRTUAL = 8  # interleaved: 2..8 model chunks per rank (Megatron's usual range)
_OFFLOAD = ("none", "cpu")


class IntRange(BaseModel):
    """An inclusive range of an integer axis: `{min: 2, max: 16}`."""

    model_config = _FROZEN

    min: int = Field(default=0, ge=0)
    """Smallest value allowed."""
    max: int | None = Field(default=None, ge=0)
    """Largest value allowed (None = no bound)."""


IntAxis = int | list[int] | IntRange


class SearchConfig(BaseModel):
    """The scenario's `search:` section. Every axis is optional: unset, it takes defaults derived from the
    scenario; an int or value fixes it; a list narrows it to those values; `{min, max}` to a range."""

    model_config = _FROZEN

    dp: IntAxis | None = None
    """Data-parallel degree (derived: world / (tp*pp*cp)); a value or list filters the layouts."""
    tp: IntAxis | None = None
    """Tensor-parallel degree. Default: divisors of the world that divide the heads, KV heads and MLP size."""
    pp: IntAxis | None = None
    """Pipeline degree. Default: divisors of the world whose layer split is within max_stage_imbalance."""
    cp: IntAxis | None = None
    """Context-parallel degree. Default: divisors of the world with 2*cp | seq_len and >= 1024 tokens per rank."""
    ep: IntAxis | None = None
    """Expert-parallel degree (MoE). Default: divisors of num_experts with ep*etp dividing tp*dp*cp."""
    etp: IntAxis | None = None
    """Expert tensor-parallel degree (MoE, stacks with ETP). Default: divisors of the node size that divide the
    expert MLP, with ep*etp dividing tp*dp*cp (Megatron MoE parallel folding)."""
    pp_split: PipelineSplit | list[PipelineSplit] | None = None
    """Pipeline split (pp > 1): layers, or embedding_loss (embedding and loss counted as layers). Default: every
    split the stack has that divides evenly."""
    first_stage_layers: IntAxis | None = None
    """Layers on the first pipeline stage (0: even split). Default, where the stack has uneven stages: 0 and up to
    MAX_UNEVEN_SPLITS balanced first/last pairs whose ends are no heavier than the middle stages."""
    last_stage_layers: IntAxis | None = None
    """Layers on the last pipeline stage (0: even split); default as first_stage_layers."""
    dp_replicate: IntAxis | None = None
    """HSDP replicas (zero_stage >= 1). Default 1 (plain ZeRO/FSDP); give a list or range to explore HSDP."""
    zero_stage: IntAxis | None = None
    """ZeRO/FSDP stage. Default 0-3 (stages > 0 only where the sharding group dp*cp > 1)."""
    sequence_parallel: bool | list[bool] | None = None
    """Sequence parallelism (applies to tp > 1). Default: both."""
    micro_batch_size: IntAxis | None = None
    """Sequences per micro-batch. Default: every divisor of the per-replica batch global_batch_size / dp."""
    precision: Precision | list[Precision] | None = None
    """Compute precision. Default: fp32, bf16 and fp8 where the GPU has FP8 tensor cores."""
    activation_checkpointing: Recompute | list[Recompute] | None = None
    """Recomputation. Default: none, selective, full."""
    recompute_modules: list[str] | None = None
    """Module sets to try with selective recompute, each written `a+b` (Megatron --recompute-modules: core_attn,
    moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts); "" is stratagem's own selective. Default (unset):
    no module sets, only ""; stacks without module recompute (StackRecord.recompute_modules) refuse a list."""
    pp_schedule: Schedule | list[Schedule] | None = None
    """Pipeline schedule (applies to pp > 1). Default: all four."""
    virtual_stages: IntAxis | None = None
    """Model chunks per rank (applies to the interleaved schedule). Default: 2-8, within max_stage_imbalance."""
    optimizer_offload: Literal["none", "cpu"] | list[Literal["none", "cpu"]] | None = None
    """Optimizer states in host memory (applies to zero_stage >= 1). Default: none only; list cpu to try it."""
    cross_node_tp: Literal["forbid", "allow"] = "forbid"
    """forbid: a TP group stays inside one node (tp divides gpus_per_node); allow: TP may span nodes."""
    memory_margin_gib: float = Field(default=2.0, ge=0)
    """GiB kept free per GPU: plans whose predicted peak exceeds HBM minus this are pruned. Covers what the
    analytic model leaves out (CUDA context, NCCL buffers: ~1-2 GiB on H100)."""
    max_stage_imbalance: float = Field(default=1.25, ge=1.0)
    """Default pp/virtual_stages values keep the most loaded pipeline rank within this factor of the mean."""
    exhaustive_limit: int = Field(default=2_000_000, ge=1)
    """Spaces up to this many valid plans are screened exhaustively; larger ones are sampled and explored."""
    stored_sample: int = Field(default=32, ge=0)
    """Plans off the front stored as trials besides the front: half pruned ones nearest the memory limit,
    half a random sample of the rest."""
    seed: int = 0
    """Seed of every random choice (samples, samplers), so a rerun makes the same choices and resumes."""


@dataclass(frozen=True)
class _Layout:
    """One way to cut the world, with its joint lists of per-plan choices."""

    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    zero: tuple[tuple[int, int, int], ...]  # (zero_stage, dp_replicate, offload 0/1)
    sp: tuple[int, ...]  # 0/1
    # (micro_batch_size, schedule code, virtual_stages, pp_split code, first_stage_layers, last_stage_layers,
    #  index into SearchSpace.recompute_pairs)
    pipe: tuple[tuple[int, int, int, int, int, int, int], ...]

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        return self.tp, self.pp, self.cp, self.ep, self.etp


def _choices(spec: Any, universe: Sequence[Any], default: Sequence[Any], field: str) -> list[Any]:
    """Values of one axis: the default list when unset; a range filters the universe; a value/list is kept."""
    if spec is None:
        return list(default)
    if isinstance(spec, IntRange):
        hi = spec.max if spec.max is not None else math.inf
        if hi < spec.min:
            raise StratagemError(f"search.{field} ({{min: {spec.min}, max: {spec.max}}}): max is below min")
        return [v for v in universe if spec.min <= v <= hi]
    values = spec if isinstance(spec, list) else [spec]
    if not values:
        raise StratagemError(f"search.{field} ([]): give at least one value or leave the axis out")
    return list(dict.fromkeys(values))


def _imbalance(layers: int, chunks: int) -> float:
    """Layers on the most loaded rank over the mean: ceil(L / chunks) * chunks / L."""
    return math.ceil(layers / chunks) * chunks / layers


def _split_imbalance(layers: int, pp: int, v: int, split: tuple[int, int, int]) -> float:
    """Most loaded pipeline rank over the mean, counting the embedding and the loss as one layer each (what the
    embedding_loss and uneven splits are for): max rank units / ((L + 2) / pp)."""
    code, first, last = split
    ranks = list(rank_layers(chunk_layers(layers, pp, v, first, last, PIPELINE_SPLITS[code]), pp))
    ranks[0] += 1
    ranks[-1] += 1
    return max(ranks) * pp / (layers + 2)


def _balanced_uneven(layers: int, pp: int, v: int) -> list[tuple[int, int]]:
    """Up to MAX_UNEVEN_SPLITS (first, last) stage layer counts for Megatron's uneven split: middle stages of m
    layers near L / pp, the rest on the first and/or last stage, neither heavier than a middle stage; the most
    balanced first (by `_split_imbalance`)."""
    found: set[tuple[int, int]] = set()
    mean = layers / pp
    for m in range(max(1, math.floor(mean) - 1), math.ceil(mean) + 2):
        for set_first, set_last in ((True, False), (False, True), (True, True)):
            middle_stages = pp - set_first - set_last
            rest = layers - m * middle_stages
            if set_first and set_last:
                first, last = rest - rest // 2, rest // 2
            else:
                first, last = (rest, 0) if set_first else (0, rest)
            if (set_first and not 1 <= first <= m) or (set_last and not 1 <= last <= m):
                continue
            if split_problem(layers, pp, v, first, last, "layers") is None:
                found.add((first, last))
    ranked = sorted(found, key=lambda x: (_split_imbalance(layers, pp, v, (0, *x)), x))
    return ranked[:MAX_UNEVEN_SPLITS]


class SearchSpace:
    """Every valid plan of a scenario under its search config; see the module docstring."""

    def __init__(self, scenario: Scenario, config: SearchConfig | None = None) -> None:
        self.scenario = scenario
        self.config = cfg = config or scenario.search or SearchConfig()
        self.notes: list[str] = []  # listed axis values that occur in no valid plan here (ignored)
        self._left_out: dict[str, str] = {}  # the stack's exclusions that removed choices: name -> reason
        m, cl, tr = scenario.model, scenario.cluster, scenario.training
        rec = tr.record  # the stack's capabilities (spaces/stacks.py): the space holds only plans it can run
        world, layers = cl.num_gpus, m.num_layers
        if cfg.memory_margin_gib >= cl.gpu.hbm_gib:
            raise StratagemError(f"search.memory_margin_gib ({cfg.memory_margin_gib}): must be below the GPU's "
                                 f"{cl.gpu.hbm_gib} GiB of HBM")
        tp_ffns = m.tp_split_ffn_sizes()  # routed experts split by etp instead (expert_grid)
        world_div = divisors(world)

        def balanced(p: int) -> bool:
            return _imbalance(layers, p) <= cfg.max_stage_imbalance

        def tp_ok(t: int) -> bool:
            in_node = cfg.cross_node_tp == "allow" or cl.gpus_per_node % t == 0
            return world % t == 0 and not (m.num_attention_heads % t or m.kv_heads % t or any(f % t for f in tp_ffns)) and in_node

        tps = [t for t in _choices(cfg.tp, world_div, world_div, "tp") if tp_ok(t)]
        node_hint = ("" if cfg.cross_node_tp == "allow" else
                     f" (a TP group stays inside a node of {cl.gpus_per_node} GPUs unless search.cross_node_tp: allow)")
        self._check_listed("tp", cfg.tp, [t for t in world_div if tp_ok(t)], node_hint)
        # with pp_split embedding_loss the embedding and the loss fill a stage each: up to L + 2 stages
        max_pp = layers + (2 if "embedding_loss" in rec.pp_splits else 0)
        pp_universe = [p for p in world_div if p <= max_pp]
        pp_default = [p for p in pp_universe if balanced(p)]
        pps = _choices(cfg.pp, pp_default if isinstance(cfg.pp, IntRange) else pp_universe, pp_default, "pp")
        pps = [p for p in pps if world % p == 0 and p <= max_pp]
        self._check_listed("pp", cfg.pp, pp_universe)
        cp_universe = [c for c in world_div if c == 1 or tr.seq_len % (2 * c) == 0]
        cp_default = [c for c in cp_universe if c == 1 or tr.seq_len // c >= MIN_CP_SHARD_TOKENS]
        cps = [c for c in _choices(cfg.cp, cp_universe, cp_default, "cp")
               if c in cp_universe and (c == 1 or rec.context_parallel)]
        self._check_listed("cp", cfg.cp, cp_universe)
        dps = set(_choices(cfg.dp, world_div, world_div, "dp"))
        if m.moe is None:
            eps_all = [e for e in _choices(cfg.ep, [1], [1], "ep")]
            if eps_all != [1]:
                raise StratagemError(f"search.ep ({cfg.ep}): {m.name} is dense; expert parallelism needs an "
                                     "MoE model, leave ep out")
        else:
            e_div = divisors(m.moe.num_experts)
            eps_all = [e for e in _choices(cfg.ep, e_div, e_div, "ep")
                       if m.moe.num_experts % e == 0 and (e == 1 or rec.expert_parallel)]
        etp_universe = [x for x in world_div if m.moe is not None and m.moe.expert_ffn_hidden_size % x == 0]
        etp_default = [x for x in etp_universe if cl.gpus_per_node % x == 0 and (x == 1 or rec.expert_tensor_parallel)]
        etps = [x for x in _choices(cfg.etp, etp_universe or [1], etp_default or [1], "etp")
                if x == 1 or (m.moe is not None and rec.expert_tensor_parallel)]
        if m.moe is None and etps != [1]:
            raise StratagemError(f"search.etp ({cfg.etp}): {m.name} is dense; expert tensor parallelism needs an "
                                 "MoE model, leave etp out")
        zeros = [z for z in _choices(cfg.zero_stage, [0, 1, 2, 3], [0, 1, 2, 3], "zero_stage") if z in rec.zero_stages]
        self._check_listed("zero_stage", cfg.zero_stage, zeros)
        offloads = [1 if o == "cpu" else 0 for o in _choices(cfg.optimizer_offload, _OFFLOAD, ["none"],
                                                            "optimizer_offload")]
        sps = [int(s) for s in _choices(cfg.sequence_parallel, [False, True], [False, True], "sequence_parallel")
               if not s or rec.sequence_parallel]
        offloads = [o for o in offloads if o == 0 or rec.optimizer_offload]
        fp8 = cl.gpu.peak_tflops_fp8 is not None
        # precision is the user's choice (fp8 changes numerics): the axis defaults to training.precision
        prec_default = [tr.precision if (fp8 or tr.precision != "fp8") else "bf16"]
        precisions = _choices(cfg.precision, PRECISIONS, prec_default, "precision")
        if "fp8" in precisions and not fp8:
            raise StratagemError(f"search.precision (fp8): {cl.gpu.name} has no FP8 tensor cores; use bf16")
        if "fp8" in precisions and not rec.fp8_recipes:
            raise StratagemError(f"search.precision (fp8): {rec.name} has no fp8 training recipe "
                                 f"({rec.cite('fp8_recipes')}); use bf16")
        # "op" (op-level selective recompute) is in the default axis where the stack has it: the harness runs it
        # (stratagem/launch/harness/parallelize.py op_sac_context) and memory.py/timing.py model it (op_layer_elements).
        recomputes = _choices(cfg.activation_checkpointing, RECOMPUTES,
                              [r for r in RECOMPUTES if r in rec.recompute_modes],
                              "activation_checkpointing")
        unrun = [r for r in recomputes if r not in rec.recompute_modes]
        if unrun:
            raise StratagemError(f"search.activation_checkpointing ({', '.join(unrun)}): {rec.name} does not have it "
                                 f"({rec.cite('recompute_modes')}); use {', '.join(rec.recompute_modes)}")
        schedules = [SCHEDULES.index(s) for s in _choices(cfg.pp_schedule, SCHEDULES, SCHEDULES, "pp_schedule")
                     if s in rec.schedules]
        self.precisions: tuple[Precision, ...] = tuple(precisions)
        self.recomputes: tuple[Recompute, ...] = tuple(recomputes)
        # the recompute axis: (activation_checkpointing, module set) pairs, module sets only with selective
        self.module_sets: tuple[str, ...] = _module_sets(cfg.recompute_modules, self.scenario)
        self.recompute_pairs: tuple[tuple[Recompute, str], ...] = tuple(
            (r, sets) for r in self.recomputes for sets in (self.module_sets if r == "selective" else ("",)))

        gbs = tr.global_batch_size
        layouts: list[_Layout] = []
        for t in tps:
            for p in pps:
                for c in cps:
                    if world % (t * p * c):
                        continue
                    d = world // (t * p * c)
                    if d not in dps or gbs % d:
                        continue
                    # schedules the stack cannot honour with this cp (stacks.py schedule_exclusions; one chunk:
                    # the non-interleaved ones)
                    honoured = [x for x in schedules if SCHEDULES[x] == "interleaved"
                                or rec.schedule_exclusion(SCHEDULES[x], c, 1) is None]
                    for x in (x for x in schedules if x not in honoured and p > 1):
                        ex = rec.schedule_exclusion(SCHEDULES[x], c, 1)
                        self._left_out.setdefault(f"{SCHEDULES[x]} with {ex.when}" if ex else SCHEDULES[x],
                                                  ex.reason if ex else "")
                    pipe = self._pipe(p, gbs // d, honoured, c)
                    sp = tuple(sps) if t > 1 else (0,)
                    if t > 1 and m.moe is not None and rec.moe_tp_requires_sp:  # stacks.py: MoE + TP needs SP
                        sp = tuple(x for x in sp if x)
                    if not pipe or not sp:
                        continue
                    zs = zeros if p == 1 else [z for z in zeros if z <= rec.max_zero_with_pp]
                    # one job, one stage: zero 3 with pp runs as 2 where the stack keeps params gathered with pp
                    zs = list(dict.fromkeys(sharding_stage(rec, p, z) for z in zs))
                    zero = self._zero(d, c, zs, offloads)
                    if not zero:
                        continue
                    for e in eps_all:
                        for et in etps:  # the expert grid folds over tp x dp x cp (spaces/expert_grid.py)
                            if expert_grid_problem(m, t, d, c, e, et, rec.expert_grid) is None:
                                lay = self._runnable(_Layout(t, p, c, d, e, et, zero, sp, pipe))
                                if lay is not None:
                                    layouts.append(lay)
        if not layouts:
            raise StratagemError(
                f"search: no valid plan for {scenario.name} under this search section (tp {tps}, pp {pps}, "
                f"cp {cps}); widen the axes, or set cross_node_tp: allow{self._left_out_text()}")
        self.layouts: tuple[_Layout, ...] = tuple(layouts)
        for name, spec in (("tp", cfg.tp), ("pp", cfg.pp), ("cp", cfg.cp), ("dp", cfg.dp), ("ep", cfg.ep),
                           ("etp", cfg.etp)):
            self._check_listed(name, spec, sorted({getattr(lay, name) for lay in layouts}))
        self._check_listed("micro_batch_size", cfg.micro_batch_size,
                           sorted({q[0] for lay in layouts for q in lay.pipe}))
        self._check_listed("dp_replicate", cfg.dp_replicate, sorted({z[1] for lay in layouts for z in lay.zero}))
        self._build_tables()

    # ---- construction --------------------------------------------------------------------------------
    def _splits(self, pp: int, v: int) -> list[tuple[int, int, int]]:
        """(pp_split code, first_stage_layers, last_stage_layers) for one (pp, virtual_stages): the splits the
        stack has (stacks.py pp_splits, uneven_stages) that spaces/pipeline_split.py can build, narrowed by the
        search section; by default only those within max_stage_imbalance."""
        cfg, rec, layers = self.config, self.scenario.training.record, self.scenario.model.num_layers
        if pp == 1:
            return [(0, 0, 0)]
        modes = [x for x in _choices(cfg.pp_split, PIPELINE_SPLITS, PIPELINE_SPLITS, "pp_split")
                 if x in rec.pp_splits]
        out = [(PIPELINE_SPLITS.index(x), 0, 0) for x in modes
               if split_problem(layers, pp, v, 0, 0, x) is None]
        if rec.uneven_stages and "layers" in modes:
            if cfg.first_stage_layers is None and cfg.last_stage_layers is None:
                out += [(0, f, la) for f, la in _balanced_uneven(layers, pp, v)]
            else:
                universe = list(range(0, layers + 1))
                firsts = _choices(cfg.first_stage_layers, universe, [0], "first_stage_layers")
                lasts = _choices(cfg.last_stage_layers, universe, [0], "last_stage_layers")
                out += [(0, f, la) for f in firsts for la in lasts if (f or la)
                        and split_problem(layers, pp, v, f, la, "layers") is None]
        explicit = cfg.pp_split is not None or cfg.first_stage_layers is not None or cfg.last_stage_layers is not None
        if not explicit:
            out = [x for x in out if _split_imbalance(layers, pp, v, x) <= cfg.max_stage_imbalance] or out[:1]
        return list(dict.fromkeys(self._canonical_split(pp, v, x) for x in out))

    def _canonical_split(self, pp: int, v: int, split: tuple[int, int, int]) -> tuple[int, int, int]:
        """The canonical encoding (spaces/canonical.py canonical_split) of a split: splits that give the same
        chunks are one job, enumerated once."""
        plan = Plan(pp=pp, virtual_stages=v, pp_schedule="interleaved" if v > 1 else "1f1b",
                    pp_split=PIPELINE_SPLITS[split[0]], first_stage_layers=split[1], last_stage_layers=split[2])
        name, first, last = canonical_split(self.scenario, plan)
        return PIPELINE_SPLITS.index(name), first, last

    def _pipe(self, pp: int, per_replica: int, schedules: list[int], cp: int = 1
              ) -> tuple[tuple[int, int, int, int, int, int, int], ...]:
        """(micro_batch_size, schedule, virtual_stages, pp_split, first, last, recompute pair) for one pp degree,
        per-replica batch and cp: the recompute pair (index into recompute_pairs) is joined here, so a schedule
        the stack cannot run with a recompute mode (stacks.py schedule_exclusions, e.g. torch's zero_bubble with
        op recompute) is never enumerated."""
        cfg, layers = self.config, self.scenario.model.num_layers
        div = divisors(per_replica)
        mbs = [b for b in _choices(cfg.micro_batch_size, div, div, "micro_batch_size") if per_replica % b == 0]
        # embedding_loss adds two units to split: up to (L + 2) / pp chunks per rank
        v_universe = [v for v in range(2, (layers + 2) // max(pp, 1) + 1)]
        v_default = [v for v in v_universe if v <= DEFAULT_MAX_VIRTUAL and
                     _imbalance(layers, pp * v) <= cfg.max_stage_imbalance]
        if isinstance(cfg.virtual_stages, IntRange):
            v_universe = [v for v in v_universe if _imbalance(layers, pp * v) <= cfg.max_stage_imbalance]
        vs = [v for v in _choices(cfg.virtual_stages, v_universe, v_default, "virtual_stages") if v >= 2]
        splits = {v: self._splits(pp, v) for v in [1, *vs]} if pp > 1 else {1: [(0, 0, 0)]}
        out: list[tuple[int, int, int, int, int, int]] = []
        for b in mbs:
            if pp == 1:
                out.append((b, SCHEDULES.index("1f1b"), 1, 0, 0, 0))
                continue
            micro = per_replica // b
            # one micro-batch: 1f1b runs as gpipe (spaces/canonical.py), enumerated once, as gpipe where the stack has it
            merged = micro == 1 and "gpipe" in self.scenario.training.record.schedules
            gpipe = SCHEDULES.index("gpipe")
            for s in dict.fromkeys(gpipe if merged and SCHEDULES[c] == "1f1b" else c for c in schedules):
                if SCHEDULES[s] != "interleaved":
                    out.extend((b, s, 1, *x) for x in splits[1])
                elif micro % pp == 0:
                    out.extend((b, s, v, *x) for v in vs for x in splits[v])
        rec = self.scenario.training.record
        return tuple((*q, i) for q in out for i, (ac, _) in enumerate(self.recompute_pairs)
                     if pp == 1 or rec.schedule_exclusion(SCHEDULES[q[1]], cp, q[2], recompute=ac) is None)

    def _runnable(self, lay: _Layout) -> _Layout | None:
        """The layout without the choices its stack's exclusions rule out (spaces/exclusions.py: what the harness
        refuses and what the stack's exporter cannot express, one rule with both), or None when none is left. Each
        PlanExclusion reads the layout's degrees plus one choice list (`reads`: sharding, sequence_parallel or
        pipelining) and filters that list only, vectorised over its entries (tests/spaces/test_rules_exclusions.py
        checks every enumerated plan)."""
        rec, moe = self.scenario.training.record, self.scenario.model.moe is not None
        if not rec.plan_exclusions:
            return lay
        per_replica = self.scenario.training.global_batch_size // lay.dp
        base = PlanFacts(moe=moe, tp=lay.tp, dp=lay.dp, cp=lay.cp, ep=lay.ep, etp=lay.etp, pp=lay.pp, zero_stage=0,
                         dp_replicate=1, offload=False, sequence_parallel=False, one_f_one_b=False, selective=False,
                         microbatches=per_replica, seq_len=self.scenario.training.seq_len)
        zero, sp, pipe = (np.array(x, dtype=np.int64).reshape(len(x), -1) for x in (lay.zero, lay.sp, lay.pipe))
        selective = np.array([ac == "selective" for ac, _ in self.recompute_pairs])
        facts = {
            "layout": (base, 1),
            "sharding": (replace(base, zero_stage=zero[:, 0], dp_replicate=zero[:, 1], offload=zero[:, 2] == 1),
                         len(zero)),
            "sequence_parallel": (replace(base, sequence_parallel=sp[:, 0] != 0), len(sp)),
            "pipelining": (replace(base, one_f_one_b=pipe[:, 1] == SCHEDULES.index("1f1b"),
                                   microbatches=per_replica // pipe[:, 0], selective=selective[pipe[:, 6]]), len(pipe)),
        }
        keep = {}
        for reads, (f, n) in facts.items():
            mask = np.ones(n, dtype=bool)
            for ex in rec.plan_exclusions:
                if ex.reads == reads:
                    hit = np.broadcast_to(np.asarray(ex.applies(f), dtype=bool), (n,))
                    if hit[mask].any():
                        self._left_out.setdefault(ex.name, ex.reason)
                    mask &= ~hit
            keep[reads] = mask
        if not keep["layout"].all():
            return None
        kept_zero = tuple(z for z, k in zip(lay.zero, keep["sharding"], strict=True) if k)
        kept_sp = tuple(x for x, k in zip(lay.sp, keep["sequence_parallel"], strict=True) if k)
        kept_pipe = tuple(q for q, k in zip(lay.pipe, keep["pipelining"], strict=True) if k)
        if not kept_zero or not kept_sp or not kept_pipe:
            return None
        return _Layout(lay.tp, lay.pp, lay.cp, lay.dp, lay.ep, lay.etp, kept_zero, kept_sp, kept_pipe)

    def _zero(self, dp: int, cp: int, zeros: list[int], offloads: list[int]) -> tuple[tuple[int, int, int], ...]:
        """(zero_stage, dp_replicate, offload) triples for one layout."""
        reps = [r for r in _choices(self.config.dp_replicate, divisors(dp), [1], "dp_replicate")
                if dp % r == 0 and (r == 1 or self.scenario.training.record.hsdp)]
        out: list[tuple[int, int, int]] = []
        for z in zeros:
            if z == 0:
                out.append((0, 1, 0))
                continue
            out.extend((z, r, o) for r in reps if dp * cp // r > 1 for o in offloads)
        return tuple(out)

    def _left_out_text(self) -> str:
        """For an error: the stack's exclusions that left choices out (spaces/exclusions.py), each with its fix."""
        if not self._left_out:
            return ""
        rec = self.scenario.training.record.name
        fixes = (f"{k} ({v[v.rfind('; use ') + 2:] if '; use ' in v else v})" for k, v in self._left_out.items())
        return f"; the {rec} stack leaves out (spaces/exclusions.py) " + ", ".join(fixes)

    def _check_listed(self, name: str, spec: Any, possible: Sequence[Any], hint: str = "") -> None:
        """Values the scenario lists for an axis must occur in some valid plan: none of them -> an error;
        some -> a note (the same search section may serve other cluster sizes, e.g. capacity planning)."""
        if spec is None or isinstance(spec, IntRange):
            return
        listed = spec if isinstance(spec, list) else [spec]
        missing = [v for v in listed if v not in possible]
        if not missing:
            return
        text = (f"search.{name} ({', '.join(map(str, missing))}): no valid plan of {self.scenario.name} has it; "
                f"possible here: {', '.join(map(str, possible)) or 'none'}{hint}")
        if len(missing) == len(listed):
            raise StratagemError(text + self._left_out_text())
        if text not in self.notes:
            self.notes.append(text)

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
            "optimizer_offload": tuple(o for i, o in enumerate(_OFFLOAD)
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
        p = partial
        lays = self.layouts
        if name == "tp":
            return sorted({lay.tp for lay in lays})
        if name == "pp":
            return sorted({lay.pp for lay in lays if lay.tp == p["tp"]})
        if name == "cp":
            return sorted({lay.cp for lay in lays if (lay.tp, lay.pp) == (p["tp"], p["pp"])})
        if name == "dp":
            return sorted({lay.dp for lay in lays if (lay.tp, lay.pp, lay.cp) == (p["tp"], p["pp"], p["cp"])})
        if name == "ep":
            if self.scenario.model.moe is None:
                return None
            return sorted({lay.ep for lay in lays if (lay.tp, lay.pp, lay.cp) == (p["tp"], p["pp"], p["cp"])})
        if name == "etp":
            if self.scenario.model.moe is None:
                return None
            return sorted({lay.etp for lay in lays
                           if (lay.tp, lay.pp, lay.cp, lay.ep) == (p["tp"], p["pp"], p["cp"], p["ep"])})
        lay = self._by_key.get((p["tp"], p["pp"], p["cp"], p.get("ep", 1), p.get("etp", 1)))
        if lay is None:
            return []
        if name == "zero_stage":
            return sorted({z[0] for z in lay.zero}) if lay.dp * lay.cp > 1 else None
        if name in ("dp_replicate", "optimizer_offload"):
            if p.get("zero_stage", 0) == 0:
                return None
            zs = [z for z in lay.zero if z[0] == p["zero_stage"]]
            if name == "dp_replicate":
                return sorted({z[1] for z in zs})
            return [o for i, o in enumerate(_OFFLOAD) if any(z[2] == i and z[1] == p["dp_replicate"] for z in zs)]
        if name == "sequence_parallel":
            return [bool(s) for s in lay.sp] if lay.tp > 1 else None
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
        if name in ("pp_split", "first_stage_layers", "last_stage_layers"):
            if lay.pp == 1:
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
        if name == "precision":
            return list(self.precisions)
        if name == "activation_checkpointing":
            pairs = {self.recompute_pairs[q[6]] for q in _matching_pipe(lay, p)}
            return [r for r in self.recomputes if any(ac == r for ac, _ in pairs)]
        if name == "recompute_modules":
            if p.get("activation_checkpointing") != "selective" or self.module_sets == ("",):
                return None
            pairs = {self.recompute_pairs[q[6]] for q in _matching_pipe(lay, p)}
            return [x for x in self.module_sets if ("selective", x) in pairs]
        raise KeyError(name)

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
            else:
                dists[name] = CategoricalDistribution(self._axis_choices[name])
        return params, dists

    def summary(self) -> dict[str, Any]:
        """Axis values and counts, for reports and the CLI."""
        return {"plans": self.count(), "layouts": len(self.layouts), "notes": list(self.notes),
                **{k: list(v) for k, v in self._axis_choices.items()}}


def _matching_pipe(lay: _Layout, partial: dict[str, Any]) -> list[tuple[int, ...]]:
    """The layout's pipe entries (with their recompute pair) that match the partial plan's micro-batch, schedule,
    virtual stages and split (absent fields: the Plan defaults, as a plan without pipelining has them)."""
    key = (partial["micro_batch_size"], SCHEDULES.index(partial.get("pp_schedule", "1f1b")),
           partial.get("virtual_stages", 1), PIPELINE_SPLITS.index(partial.get("pp_split", "layers")),
           partial.get("first_stage_layers", 0), partial.get("last_stage_layers", 0))
    return [q for q in lay.pipe if q[:6] == key]


def _module_sets(sets: list[str] | None, scenario: Scenario) -> tuple[str, ...]:
    """search.recompute_modules as canonical `a+b` strings ("" = stratagem's selective), each checked like a plan's
    recompute_modules (spaces/rules.py): the stack must have the modules, the model must have what they recompute."""
    if sets is None:
        return ("",)
    out: list[str] = []
    rec = scenario.training.record
    for text in sets:
        try:
            plan = Plan.model_validate({"activation_checkpointing": "selective", "recompute_modules": text})
        except ValidationError:
            raise StratagemError(f"search.recompute_modules ({text!r}): use modules among "
                                 f"{', '.join(RECOMPUTE_MODULES)} joined by +, or \"\"") from None
        unrun = [m for m in plan.recompute_modules if m not in rec.recompute_modules]
        broken = modules_problem(scenario.model, plan)
        if unrun or broken:
            why = (f"{rec.name} does not recompute {'+'.join(unrun)} ({rec.cite('recompute_modules')})" if unrun
                   else str(broken))
            raise StratagemError(f"search.recompute_modules ({text!r}): {why}")
        key = "+".join(plan.recompute_modules)
        if key not in out:
            out.append(key)
    return tuple(out) or ("",)
