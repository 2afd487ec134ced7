"""The per-layout choice lists of the search space (spaces/layouts.py builds the layouts): for one layout, its
pipelining list (micro-batch, schedule, virtual stages, split, recompute pair: `_pipe`, `_splits`), its sharding
list (`_zero`), and the filter the stack's exclusions apply to all three (`_runnable`, spaces/exclusions.py).
Splits are kept in canonical form (spaces/canonical.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from stratagem.spaces.canonical import canonical_split
from stratagem.spaces.exclusions import PlanFacts
from stratagem.spaces.factors import divisors
from stratagem.spaces.pipeline_split import chunk_layers, rank_layers, split_problem
from stratagem.spaces.plan import PIPELINE_SPLITS, SCHEDULES, Plan, Recompute
from stratagem.spaces.search_config import IntRange, SearchConfig, axis_values

if TYPE_CHECKING:
    from stratagem.spaces.scenario import Scenario

__all__ = ["Layout", "LayoutLists", "imbalance", "OFFLOAD", "MAX_UNEVEN_SPLITS", "DEFAULT_MAX_VIRTUAL"]

MAX_UNEVEN_SPLITS = 4  # default first/last stage layer pairs per (pp, virtual_stages): the best balanced ones
DEFAULT_MAX_VIRTUAL = 8  # interleaved: 2..8 model chunks per rank (Megatron's usual range)
OFFLOAD = ("none", "cpu")


@dataclass(frozen=True)
class Layout:
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
        """(tp, pp, cp, ep, etp): the degrees that name the layout (dp follows from them)."""
        return self.tp, self.pp, self.cp, self.ep, self.etp


def imbalance(layers: int, chunks: int) -> float:
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


class LayoutLists:
    """The lists of one layout in a scenario under a search section; records the stack's exclusions that removed
    choices (`left_out`)."""

    def __init__(self, scenario: Scenario, config: SearchConfig) -> None:
        self.scenario = scenario
        self.config = config
        self._left_out: dict[str, str] = {}  # the stack's exclusions that removed choices: name -> reason
        # the recompute axis: (activation_checkpointing, module set) pairs, module sets only with selective
        self.recompute_pairs: tuple[tuple[Recompute, str], ...] = ()

    @property
    def left_out(self) -> dict[str, str]:
        """The stack's exclusions that removed choices: name -> reason."""
        return self._left_out

    def _splits(self, pp: int, v: int) -> list[tuple[int, int, int]]:
        """(pp_split code, first_stage_layers, last_stage_layers) for one (pp, virtual_stages): the splits the
        stack has (stacks.py pp_splits, uneven_stages) that spaces/pipeline_split.py can build, narrowed by the
        search section; by default only those within max_stage_imbalance."""
        cfg, rec, layers = self.config, self.scenario.training.record, self.scenario.model.num_layers
        if pp == 1:
            return [(0, 0, 0)]
        modes = [x for x in axis_values(cfg.pp_split, PIPELINE_SPLITS, PIPELINE_SPLITS, "pp_split")
                 if x in rec.pp_splits]
        out = [(PIPELINE_SPLITS.index(x), 0, 0) for x in modes
               if split_problem(layers, pp, v, 0, 0, x) is None]
        if rec.uneven_stages and "layers" in modes:
            if cfg.first_stage_layers is None and cfg.last_stage_layers is None:
                out += [(0, f, la) for f, la in _balanced_uneven(layers, pp, v)]
            else:
                universe = list(range(0, layers + 1))
                firsts = axis_values(cfg.first_stage_layers, universe, [0], "first_stage_layers")
                lasts = axis_values(cfg.last_stage_layers, universe, [0], "last_stage_layers")
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
        mbs = [b for b in axis_values(cfg.micro_batch_size, div, div, "micro_batch_size") if per_replica % b == 0]
        # embedding_loss adds two units to split: up to (L + 2) / pp chunks per rank
        v_universe = [v for v in range(2, (layers + 2) // max(pp, 1) + 1)]
        v_default = [v for v in v_universe if v <= DEFAULT_MAX_VIRTUAL and
                     imbalance(layers, pp * v) <= cfg.max_stage_imbalance]
        if isinstance(cfg.virtual_stages, IntRange):
            v_universe = [v for v in v_universe if imbalance(layers, pp * v) <= cfg.max_stage_imbalance]
        vs = [v for v in axis_values(cfg.virtual_stages, v_universe, v_default, "virtual_stages") if v >= 2]
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

    def _runnable(self, lay: Layout) -> Layout | None:
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
        return Layout(lay.tp, lay.pp, lay.cp, lay.dp, lay.ep, lay.etp, kept_zero, kept_sp, kept_pipe)

    def _zero(self, dp: int, cp: int, zeros: list[int], offloads: list[int]) -> tuple[tuple[int, int, int], ...]:
        """(zero_stage, dp_replicate, offload) triples for one layout."""
        reps = [r for r in axis_values(self.config.dp_replicate, divisors(dp), [1], "dp_replicate")
                if dp % r == 0 and (r == 1 or self.scenario.training.record.hsdp)]
        out: list[tuple[int, int, int]] = []
        for z in zeros:
            if z == 0:
                out.append((0, 1, 0))
                continue
            out.extend((z, r, o) for r in reps if dp * cp // r > 1 for o in offloads)
        return tuple(out)
