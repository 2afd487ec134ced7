"""Validity rules for a plan in a scenario, as data: each rule names the values and the fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stratagem.errors import StratagemError
from stratagem.spaces.exclusions import PlanExclusion, PlanFacts
from stratagem.spaces.expert_grid import expert_grid_problem, grid_layout_problem
from stratagem.spaces.factors import divisors
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.pipeline_split import split_problem
from stratagem.spaces.plan import RECOMPUTES, SCHEDULES, Plan
from stratagem.spaces.recompute import modules_problem
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import StackRecord, stack_record

if TYPE_CHECKING:
    from stratagem.spaces.columns import PlanColumns

__all__ = ["Rule", "RULES", "violations", "check_plan", "capability_violations",
           "recompute_modules_problem", "plan_facts", "column_facts", "exclusion_problem"]


def _valid(values: list[int]) -> str:
    return ", ".join(map(str, values))


def _world(s: Scenario, p: Plan) -> str | None:
    n = s.cluster.num_gpus
    if p.world_size != n:
        return (f"dp*tp*pp*cp ({p.dp}*{p.tp}*{p.pp}*{p.cp} = {p.world_size}) must equal the cluster's "
                f"{n} GPUs; e.g. dp={max(1, n // (p.tp * p.pp * p.cp))}")
    return None


def _tp_heads(s: Scenario, p: Plan) -> str | None:
    m = s.model
    if m.num_attention_heads % p.tp or m.kv_heads % p.tp:
        ok = [d for d in divisors(m.num_attention_heads) if m.kv_heads % d == 0]
        return (f"tp ({p.tp}) must divide num_attention_heads ({m.num_attention_heads}) and num_kv_heads "
                f"({m.kv_heads}); valid: {_valid(ok)}")
    return None


def _tp_ffn(s: Scenario, p: Plan) -> str | None:
    # routed experts are split by etp (expert_grid); tp splits the dense and shared-expert MLPs
    for ffn in s.model.tp_split_ffn_sizes():
        if ffn % p.tp:
            return f"tp ({p.tp}) must divide the MLP inner size ({ffn}); valid: {_valid(divisors(ffn)[:12])}"
    return None


def _pp_layers(s: Scenario, p: Plan) -> str | None:
    # spaces/pipeline_split.py: even, embedding+loss counted as layers, or explicit first/last stage counts
    return split_problem(s.model.num_layers, p.pp, p.virtual_stages, p.first_stage_layers, p.last_stage_layers,
                         p.pp_split)


def _batch(s: Scenario, p: Plan) -> str | None:
    gbs = s.training.global_batch_size
    if gbs % (p.dp * p.micro_batch_size):
        if gbs % p.dp:  # no micro-batch size helps: the batch must be a multiple of dp
            hint = f"dp ({p.dp}) does not divide it: use global_batch_size={gbs + p.dp - gbs % p.dp} or another dp"
        else:
            hint = f"valid micro_batch_size: {_valid(divisors(gbs // p.dp))}"
        return (f"dp*micro_batch_size ({p.dp}*{p.micro_batch_size}) must divide global_batch_size "
                f"({gbs}); {hint}")
    return None


def _cp_seq(s: Scenario, p: Plan) -> str | None:
    if s.training.seq_len % (2 * p.cp) and p.cp > 1:
        return f"cp ({p.cp}): 2*cp must divide seq_len ({s.training.seq_len}) for load-balanced ring attention"
    return None


def _ep(s: Scenario, p: Plan) -> str | None:
    # spaces/expert_grid.py: the expert grid ep x etp x edp folds over tp x dp x cp (Megatron parallel folding)
    grid = expert_grid_problem(s.model, p.tp, p.dp, p.cp, p.ep, p.etp)  # the stack's own limits: _stack
    rec = stack_record(s.training.stack)
    if grid is None and s.model.moe is not None and p.tp > 1 and not p.sequence_parallel and rec.moe_tp_requires_sp:
        return (f"{rec.name}: MoE with tp ({p.tp}) > 1 needs sequence_parallel ({rec.cite('moe_tp_requires_sp')}); "
                "set sequence_parallel=true")
    return grid


def _replicate(s: Scenario, p: Plan) -> str | None:
    if p.dp % p.dp_replicate:
        return f"dp_replicate ({p.dp_replicate}) must divide dp ({p.dp}); valid: {_valid(divisors(p.dp))}"
    return None


def _sp(s: Scenario, p: Plan) -> str | None:
    if p.sequence_parallel and p.tp == 1:
        return "sequence_parallel needs tp > 1: set sequence_parallel=false or tp >= 2"
    return None


def _virtual(s: Scenario, p: Plan) -> str | None:
    if p.pp_schedule == "interleaved":
        if p.pp == 1 or p.virtual_stages < 2:
            return (f"pp_schedule interleaved needs pp > 1 and virtual_stages >= 2 "
                    f"(got pp={p.pp}, virtual_stages={p.virtual_stages})")
        m = micro_batches(p, s.training.global_batch_size)
        if m % p.pp:
            return (f"pp_schedule interleaved needs micro-batches per step ({m}) divisible by pp ({p.pp}); "
                    "change micro_batch_size or dp")
    elif p.virtual_stages > 1:
        return f"virtual_stages ({p.virtual_stages}) needs pp_schedule=interleaved"
    return None


def _fp8(s: Scenario, p: Plan) -> str | None:
    if p.precision == "fp8" and s.cluster.gpu.peak_tflops_fp8 is None:
        return f"precision fp8 needs FP8 tensor cores; {s.cluster.gpu.name} has none: use bf16"
    return None


def _offload(s: Scenario, p: Plan) -> str | None:
    if p.optimizer_offload == "cpu" and p.zero_stage == 0:
        return "optimizer_offload=cpu needs zero_stage >= 1 (ZeRO-Offload partitions the optimizer)"
    return None


def capability_violations(rec: StackRecord, p: Plan) -> list[str]:
    """What `p` needs that stack `rec` lacks: one message per missing capability, naming the engine code that
    enforces it and the fix (empty when the stack can run the plan)."""
    out: list[str] = []

    def missing(field: str, what: str, fix: str) -> None:
        out.append(f"{rec.name}: {what} is not supported ({rec.cite(field)}); {fix}")

    if p.zero_stage not in rec.zero_stages:
        missing("zero_stages", f"ZeRO stage {p.zero_stage}", f"use zero_stage in {_valid(list(rec.zero_stages))}")
    elif p.pp > 1 and p.zero_stage > rec.max_zero_with_pp:
        missing("max_zero_with_pp", f"ZeRO stage {p.zero_stage} with pipeline parallelism",
                f"use zero_stage <= {rec.max_zero_with_pp} or pp=1")
    if p.pp > 1 and p.pp_schedule not in rec.schedules:
        missing("schedules", f"pp_schedule {p.pp_schedule}", f"use pp_schedule in {', '.join(rec.schedules)}")
    ex = (rec.schedule_exclusion(p.pp_schedule, p.cp, p.virtual_stages, "harness", p.activation_checkpointing)
          if p.pp > 1 else None)
    # stacks.py schedule_exclusions the harness refuses (the same data it refuses from); an "export" one is a plan
    # the harness runs as planned, which the space leaves out and the exporter converts when given explicitly
    if ex is not None:
        out.append(f"{rec.name}: pp_schedule {p.pp_schedule} with {ex.when} is not supported ({ex.source}): "
                   f"{ex.reason}")
    if p.sequence_parallel and not rec.sequence_parallel:
        missing("sequence_parallel", "sequence_parallel", "set sequence_parallel=false")
    if p.cp > 1 and not rec.context_parallel:
        missing("context_parallel", f"context parallelism (cp={p.cp})", "set cp=1")
    if p.ep > 1 and not rec.expert_parallel:
        missing("expert_parallel", f"expert parallelism (ep={p.ep})", "set ep=1")
    if p.etp > 1 and not rec.expert_tensor_parallel:
        missing("expert_tensor_parallel", f"expert tensor parallelism (etp={p.etp})", "set etp=1")
    grid = grid_layout_problem(p.tp, p.dp, p.cp, p.ep, p.etp, rec.expert_grid)  # spaces/expert_grid.py
    if grid:
        out.append(f"{rec.name}: this expert layout is not supported ({rec.cite('expert_grid')}): {grid}")
    if p.optimizer_offload == "cpu" and not rec.optimizer_offload:
        missing("optimizer_offload", "optimizer_offload=cpu", "set optimizer_offload=none")
    if p.dp_replicate > 1 and not rec.hsdp:
        missing("hsdp", f"hybrid sharding (dp_replicate={p.dp_replicate})", "set dp_replicate=1")
    if p.pp > 1 and p.pp_split not in rec.pp_splits:
        missing("pp_splits", f"pp_split {p.pp_split}", f"use pp_split in {', '.join(rec.pp_splits)}")
    if (p.first_stage_layers or p.last_stage_layers) and not rec.uneven_stages:
        missing("uneven_stages", "explicit first/last stage layer counts",
                "set first_stage_layers=0 and last_stage_layers=0")
    if p.precision == "fp8" and not rec.fp8_recipes:
        missing("fp8_recipes", "fp8 training", "use precision=bf16")
    if p.activation_checkpointing not in rec.recompute_modes:
        missing("recompute_modes", f"activation_checkpointing {p.activation_checkpointing}",
                f"use one of {', '.join(rec.recompute_modes)}")
    unrun = [m for m in p.recompute_modules if m not in rec.recompute_modules]
    if unrun:
        missing("recompute_modules", f"recompute_modules {'+'.join(unrun)}",
                f"use {'+'.join(rec.recompute_modules)}" if rec.recompute_modules else "set recompute_modules=")
    return out


def recompute_modules_problem(s: Scenario, p: Plan) -> str | None:
    """recompute_modules as Megatron validates them (spaces/recompute.py modules_problem)."""
    return modules_problem(s.model, p)
    if p.activation_checkpointing != "selective":
        return (f"recompute_modules ({'+'.join(p.recompute_modules)}) needs activation_checkpointing=selective "
                f"(got {p.activation_checkpointing}); set it, or recompute_modules=")
    m = s.model
    need = {"mla_up_proj": m.mla is not None, "moe_act": m.moe is not None, "moe": m.moe is not None,
            "shared_experts": m.moe is not None and m.moe.shared_experts > 0}
    wrong = [x for x in p.recompute_modules if not need.get(x, True)]
    if wrong:
        return (f"recompute_modules ({'+'.join(wrong)}): model {m.name} has no such module (mla_up_proj needs "
                "MLA; moe_act/moe need experts; shared_experts needs shared experts); drop them")
    return None


def plan_facts(p: Plan, moe: bool, microbatches: int, seq_len: int = 0) -> PlanFacts:
    """What a stack's PlanExclusions look at, for one plan (microbatches: per step per pipeline; seq_len 0: unknown,
    the seq_len rule does not apply)."""
    return PlanFacts(moe=moe, tp=p.tp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp, pp=p.pp, zero_stage=p.zero_stage,
                     dp_replicate=p.dp_replicate, offload=p.optimizer_offload == "cpu",
                     sequence_parallel=p.sequence_parallel, one_f_one_b=p.pp_schedule == "1f1b",
                     selective=p.activation_checkpointing == "selective", microbatches=microbatches, seq_len=seq_len)


def column_facts(pc: PlanColumns, moe: bool, global_batch_size: int, seq_len: int = 0) -> PlanFacts:
    """The same for columns of plans (vectorised: every PlanExclusion.applies works elementwise)."""
    return PlanFacts(moe=moe, tp=pc.tp, dp=pc.dp, cp=pc.cp, ep=pc.ep, etp=pc.etp, pp=pc.pp, zero_stage=pc.zero_stage,
                     dp_replicate=pc.dp_replicate, offload=pc.optimizer_offload == 1,
                     sequence_parallel=pc.sequence_parallel != 0, one_f_one_b=pc.pp_schedule == SCHEDULES.index("1f1b"),
                     selective=pc.activation_checkpointing == RECOMPUTES.index("selective"),
                     microbatches=np.floor(micro_batches(pc, global_batch_size)), seq_len=seq_len)


def exclusion_problem(s: Scenario, p: Plan) -> str | None:
    """The stack's PlanExclusions its real runs refuse (spaces/exclusions.py, refused_by harness): a combination its
    engine cannot run, with the engine code. The "export" ones are no validity rule: the harness runs them as planned
    and evaluate/explain judge them; the space leaves them out and the exporter converts them, with a note."""
    rec = stack_record(s.training.stack)
    facts = plan_facts(p, s.model.moe is not None, micro_batches(p, s.training.global_batch_size),
                       s.training.seq_len)
    ex: PlanExclusion | None = rec.plan_exclusion(facts, "harness")
    if ex is None:
        return None
    return f"{rec.name}: {ex.describe(facts)} is not supported ({ex.source}): {ex.reason}"


def _stack(s: Scenario, p: Plan) -> str | None:
    broken = capability_violations(stack_record(s.training.stack), p)
    return broken[0] if broken else None


@dataclass(frozen=True)
class Rule:
    """One validity rule: a name and a check returning None or the message with the fix."""

    name: str
    check: Callable[[Scenario, Plan], str | None]


RULES: tuple[Rule, ...] = (
    Rule("world_size", _world),
    Rule("tp_divides_heads", _tp_heads),
    Rule("tp_divides_ffn", _tp_ffn),
    Rule("pp_divides_layers", _pp_layers),
    Rule("batch_divisible", _batch),
    Rule("cp_divides_seq", _cp_seq),
    Rule("ep_valid", _ep),
    Rule("dp_replicate_divides_dp", _replicate),
    Rule("sp_needs_tp", _sp),
    Rule("virtual_stages", _virtual),
    Rule("fp8_hardware", _fp8),
    Rule("offload_needs_zero", _offload),
    Rule("stack_can_run", _stack),
    Rule("stack_combinations", exclusion_problem),
    Rule("recompute_modules", recompute_modules_problem),
)


def violations(scenario: Scenario, plan: Plan, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Messages of every rule the plan breaks (empty when valid)."""
    return [msg for r in rules if (msg := r.check(scenario, plan)) is not None]


def check_plan(scenario: Scenario, plan: Plan) -> None:
    """Raise StratagemError with the first broken rule."""
    broken = violations(scenario, plan)
    if broken:
        raise StratagemError(f"plan: {broken[0]}")
