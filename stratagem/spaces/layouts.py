"""The search space's construction: from a scenario and its search section, the layouts (tp, pp, cp, dp, ep, etp:
how the world is cut) each with its joint lists of per-plan choices -- sharding (zero_stage, dp_replicate,
optimizer_offload), sequence_parallel, and pipelining with recomputation -- that spaces/space.py SearchSpace
counts, decodes and suggests. Every list holds only what the stack runs and its exporter expresses
(spaces/stacks.py, spaces/exclusions.py), in canonical form (spaces/canonical.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stratagem.errors import StratagemError
from stratagem.spaces.canonical import sharding_stage
from stratagem.spaces.expert_grid import expert_grid_problem
from stratagem.spaces.factors import divisors
from stratagem.spaces.layout_lists import OFFLOAD, Layout, LayoutLists, imbalance
from stratagem.spaces.plan import (
    PRECISIONS,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    Plan,
    Precision,
    Recompute,
)
from stratagem.spaces.recompute import modules_problem
from stratagem.spaces.search_config import IntRange, SearchConfig, axis_values

if TYPE_CHECKING:
    from stratagem.spaces.scenario import Scenario

__all__ = ["LayoutBuilder", "module_sets", "MIN_CP_SHARD_TOKENS"]

# Default heuristics (bypassed by axes the scenario lists explicitly).
MIN_CP_SHARD_TOKENS = 1024  # cp: each rank keeps >= 1k tokens, or ring attention's KV exchange is exposed


@dataclass(frozen=True)
class _Degrees:
    """The degree axes' values before they are combined into layouts."""

    tps: list[int]
    pps: list[int]
    cps: list[int]
    dps: set[int]
    eps: list[int]
    etps: list[int]


@dataclass(frozen=True)
class _PerPlan:
    """The per-plan axes' values (codes) every layout draws from."""

    zeros: list[int]
    offloads: list[int]
    sps: list[int]
    schedules: list[int]


class LayoutBuilder(LayoutLists):
    """Resolves the search section's axes in a scenario and builds the layouts (`build`, each layout's lists
    from LayoutLists); on the way it records the listed axis values no valid plan has (`notes`) and the stack's
    exclusions that removed choices (`left_out`)."""

    def __init__(self, scenario: Scenario, config: SearchConfig) -> None:
        super().__init__(scenario, config)
        self.notes: list[str] = []  # listed axis values that occur in no valid plan here (ignored)
        cl = scenario.cluster
        if config.memory_margin_gib >= cl.gpu.hbm_gib:
            raise StratagemError(f"search.memory_margin_gib ({config.memory_margin_gib}): must be below the GPU's "
                                 f"{cl.gpu.hbm_gib} GiB of HBM")
        self.precisions: tuple[Precision, ...] = ()
        self.recomputes: tuple[Recompute, ...] = ()
        self.module_sets: tuple[str, ...] = ("",)

    def build(self) -> tuple[Layout, ...]:
        """Every layout with at least one valid plan, in enumeration order (tp, pp, cp, ep, etp)."""
        degrees = self._degrees()
        per_plan = self._per_plan()
        layouts = self._layouts(degrees, per_plan)
        self._check_found(degrees, layouts)
        return tuple(layouts)

    # ---- the degree axes -----------------------------------------------------------------------------
    def _degrees(self) -> _Degrees:
        cfg, world = self.config, self.scenario.cluster.num_gpus
        world_div = divisors(world)
        tps = self._tps(world_div)
        pps = self._pps(world_div)
        cps = self._cps(world_div)
        dps = set(axis_values(cfg.dp, world_div, world_div, "dp"))
        eps, etps = self._expert_degrees(world_div)
        return _Degrees(tps, pps, cps, dps, eps, etps)

    def _tps(self, world_div: list[int]) -> list[int]:
        cfg, m, cl = self.config, self.scenario.model, self.scenario.cluster
        world = cl.num_gpus
        tp_ffns = m.tp_split_ffn_sizes()  # routed experts split by etp instead (expert_grid)

        def tp_ok(t: int) -> bool:
            in_node = cfg.cross_node_tp == "allow" or cl.gpus_per_node % t == 0
            return world % t == 0 and not (m.num_attention_heads % t or m.kv_heads % t or any(f % t for f in tp_ffns)) and in_node

        tps = [t for t in axis_values(cfg.tp, world_div, world_div, "tp") if tp_ok(t)]
        node_hint = ("" if cfg.cross_node_tp == "allow" else
                     f" (a TP group stays inside a node of {cl.gpus_per_node} GPUs unless search.cross_node_tp: allow)")
        self.check_listed("tp", cfg.tp, [t for t in world_div if tp_ok(t)], node_hint)
        return tps

    def _pps(self, world_div: list[int]) -> list[int]:
        cfg, rec = self.config, self.scenario.training.record
        world, layers = self.scenario.cluster.num_gpus, self.scenario.model.num_layers

        def balanced(p: int) -> bool:
            return imbalance(layers, p) <= cfg.max_stage_imbalance

        # with pp_split embedding_loss the embedding and the loss fill a stage each: up to L + 2 stages
        max_pp = layers + (2 if "embedding_loss" in rec.pp_splits else 0)
        pp_universe = [p for p in world_div if p <= max_pp]
        pp_default = [p for p in pp_universe if balanced(p)]
        pps = axis_values(cfg.pp, pp_default if isinstance(cfg.pp, IntRange) else pp_universe, pp_default, "pp")
        pps = [p for p in pps if world % p == 0 and p <= max_pp]
        self.check_listed("pp", cfg.pp, pp_universe)
        return pps

    def _cps(self, world_div: list[int]) -> list[int]:
        cfg, tr = self.config, self.scenario.training
        cp_universe = [c for c in world_div if c == 1 or tr.seq_len % (2 * c) == 0]
        cp_default = [c for c in cp_universe if c == 1 or tr.seq_len // c >= MIN_CP_SHARD_TOKENS]
        cps = [c for c in axis_values(cfg.cp, cp_universe, cp_default, "cp")
               if c in cp_universe and (c == 1 or tr.record.context_parallel)]
        self.check_listed("cp", cfg.cp, cp_universe)
        return cps

    def _expert_degrees(self, world_div: list[int]) -> tuple[list[int], list[int]]:
        cfg, m, cl, rec = self.config, self.scenario.model, self.scenario.cluster, self.scenario.training.record
        if m.moe is None:
            eps_all = [e for e in axis_values(cfg.ep, [1], [1], "ep")]
            if eps_all != [1]:
                raise StratagemError(f"search.ep ({cfg.ep}): {m.name} is dense; expert parallelism needs an "
                                     "MoE model, leave ep out")
        else:
            e_div = divisors(m.moe.num_experts)
            eps_all = [e for e in axis_values(cfg.ep, e_div, e_div, "ep")
                       if m.moe.num_experts % e == 0 and (e == 1 or rec.expert_parallel)]
        etp_universe = [x for x in world_div if m.moe is not None and m.moe.expert_ffn_hidden_size % x == 0]
        etp_default = [x for x in etp_universe if cl.gpus_per_node % x == 0 and (x == 1 or rec.expert_tensor_parallel)]
        etps = [x for x in axis_values(cfg.etp, etp_universe or [1], etp_default or [1], "etp")
                if x == 1 or (m.moe is not None and rec.expert_tensor_parallel)]
        if m.moe is None and etps != [1]:
            raise StratagemError(f"search.etp ({cfg.etp}): {m.name} is dense; expert tensor parallelism needs an "
                                 "MoE model, leave etp out")
        return eps_all, etps

    # ---- the per-plan axes ---------------------------------------------------------------------------
    def _per_plan(self) -> _PerPlan:
        cfg, rec = self.config, self.scenario.training.record
        zeros = [z for z in axis_values(cfg.zero_stage, [0, 1, 2, 3], [0, 1, 2, 3], "zero_stage")
                 if z in rec.zero_stages]
        self.check_listed("zero_stage", cfg.zero_stage, zeros)
        offloads = [1 if o == "cpu" else 0 for o in axis_values(cfg.optimizer_offload, OFFLOAD, ["none"],
                                                                "optimizer_offload")]
        sps = [int(s) for s in axis_values(cfg.sequence_parallel, [False, True], [False, True], "sequence_parallel")
               if not s or rec.sequence_parallel]
        offloads = [o for o in offloads if o == 0 or rec.optimizer_offload]
        self._precision_and_recompute()
        schedules = [SCHEDULES.index(s) for s in axis_values(cfg.pp_schedule, SCHEDULES, SCHEDULES, "pp_schedule")
                     if s in rec.schedules]
        # the recompute axis: (activation_checkpointing, module set) pairs, module sets only with selective
        self.module_sets = module_sets(cfg.recompute_modules, self.scenario)
        self.recompute_pairs = tuple(
            (r, sets) for r in self.recomputes for sets in (self.module_sets if r == "selective" else ("",)))
        return _PerPlan(zeros, offloads, sps, schedules)

    def _precision_and_recompute(self) -> None:
        cfg, cl, tr = self.config, self.scenario.cluster, self.scenario.training
        rec = tr.record
        fp8 = cl.gpu.peak_tflops_fp8 is not None
        # precision is the user's choice (fp8 changes numerics): the axis defaults to training.precision
        prec_default = [tr.precision if (fp8 or tr.precision != "fp8") else "bf16"]
        precisions = axis_values(cfg.precision, PRECISIONS, prec_default, "precision")
        if "fp8" in precisions and not fp8:
            raise StratagemError(f"search.precision (fp8): {cl.gpu.name} has no FP8 tensor cores; use bf16")
        if "fp8" in precisions and not rec.fp8_recipes:
            raise StratagemError(f"search.precision (fp8): {rec.name} has no fp8 training recipe "
                                 f"({rec.cite('fp8_recipes')}); use bf16")
        # "op" (op-level selective recompute) is in the default axis where the stack has it: the harness runs it
        # (stratagem/launch/harness/parallelize.py op_sac_context) and memory.py/timing.py model it (op_layer_elements).
        recomputes = axis_values(cfg.activation_checkpointing, RECOMPUTES,
                                 [r for r in RECOMPUTES if r in rec.recompute_modes],
                                 "activation_checkpointing")
        unrun = [r for r in recomputes if r not in rec.recompute_modes]
        if unrun:
            raise StratagemError(f"search.activation_checkpointing ({', '.join(unrun)}): {rec.name} does not have it "
                                 f"({rec.cite('recompute_modes')}); use {', '.join(rec.recompute_modes)}")
        self.precisions = tuple(precisions)
        self.recomputes = tuple(recomputes)

    # ---- the layouts ---------------------------------------------------------------------------------
    def _layouts(self, deg: _Degrees, per: _PerPlan) -> list[Layout]:
        world, gbs = self.scenario.cluster.num_gpus, self.scenario.training.global_batch_size
        layouts: list[Layout] = []
        for t in deg.tps:
            for p in deg.pps:
                for c in deg.cps:
                    if world % (t * p * c):
                        continue
                    d = world // (t * p * c)
                    if d not in deg.dps or gbs % d:
                        continue
                    layouts += self._layouts_at(t, p, c, d, deg, per)
        return layouts

    def _layouts_at(self, t: int, p: int, c: int, d: int, deg: _Degrees, per: _PerPlan) -> list[Layout]:
        """The layouts of one (tp, pp, cp, dp): one per (ep, etp) the expert grid allows, each with its lists."""
        m, rec = self.scenario.model, self.scenario.training.record
        # schedules the stack cannot honour with this cp (stacks.py schedule_exclusions; one chunk:
        # the non-interleaved ones)
        honoured = [x for x in per.schedules if SCHEDULES[x] == "interleaved"
                    or rec.schedule_exclusion(SCHEDULES[x], c, 1) is None]
        for x in (x for x in per.schedules if x not in honoured and p > 1):
            ex = rec.schedule_exclusion(SCHEDULES[x], c, 1)
            self._left_out.setdefault(f"{SCHEDULES[x]} with {ex.when}" if ex else SCHEDULES[x],
                                      ex.reason if ex else "")
        pipe = self._pipe(p, self.scenario.training.global_batch_size // d, honoured, c)
        sp = tuple(per.sps) if t > 1 else (0,)
        if t > 1 and m.moe is not None and rec.moe_tp_requires_sp:  # stacks.py: MoE + TP needs SP
            sp = tuple(x for x in sp if x)
        if not pipe or not sp:
            return []
        zs = per.zeros if p == 1 else [z for z in per.zeros if z <= rec.max_zero_with_pp]
        # one job, one stage: zero 3 with pp runs as 2 where the stack keeps params gathered with pp
        zs = list(dict.fromkeys(sharding_stage(rec, p, z) for z in zs))
        zero = self._zero(d, c, zs, per.offloads)
        if not zero:
            return []
        out: list[Layout] = []
        for e in deg.eps:
            for et in deg.etps:  # the expert grid folds over tp x dp x cp (spaces/expert_grid.py)
                if expert_grid_problem(m, t, d, c, e, et, rec.expert_grid) is None:
                    lay = self._runnable(Layout(t, p, c, d, e, et, zero, sp, pipe))
                    if lay is not None:
                        out.append(lay)
        return out

    def _check_found(self, deg: _Degrees, layouts: list[Layout]) -> None:
        """No layout: an error naming the axes; listed degree, micro-batch and replica values no layout has: notes
        (or an error when none of a list is left)."""
        cfg = self.config
        if not layouts:
            raise StratagemError(
                f"search: no valid plan for {self.scenario.name} under this search section (tp {deg.tps}, "
                f"pp {deg.pps}, cp {deg.cps}); widen the axes, or set cross_node_tp: allow{self.left_out_text()}")
        for name, spec in (("tp", cfg.tp), ("pp", cfg.pp), ("cp", cfg.cp), ("dp", cfg.dp), ("ep", cfg.ep),
                           ("etp", cfg.etp)):
            self.check_listed(name, spec, sorted({getattr(lay, name) for lay in layouts}))
        self.check_listed("micro_batch_size", cfg.micro_batch_size,
                          sorted({q[0] for lay in layouts for q in lay.pipe}))
        self.check_listed("dp_replicate", cfg.dp_replicate, sorted({z[1] for lay in layouts for z in lay.zero}))

    def left_out_text(self) -> str:
        """For an error: the stack's exclusions that left choices out (spaces/exclusions.py), each with its fix."""
        if not self._left_out:
            return ""
        rec = self.scenario.training.record.name
        fixes = (f"{k} ({v[v.rfind('; use ') + 2:] if '; use ' in v else v})" for k, v in self._left_out.items())
        return f"; the {rec} stack leaves out (spaces/exclusions.py) " + ", ".join(fixes)

    def check_listed(self, name: str, spec: Any, possible: Sequence[Any], hint: str = "") -> None:
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
            raise StratagemError(text + self.left_out_text())
        if text not in self.notes:
            self.notes.append(text)


def module_sets(sets: list[str] | None, scenario: Scenario) -> tuple[str, ...]:
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
