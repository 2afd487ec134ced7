"""Validity rules for a plan in a scenario, as data: each rule names the values and the fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stratagem.errors import StratagemError
from stratagem.spaces.factors import divisors
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = ["Rule", "RULES", "violations", "check_plan", "divisors"]


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
    ffn = s.model.moe.expert_ffn_hidden_size if s.model.moe else s.model.ffn_hidden_size
    if ffn % p.tp:
        return f"tp ({p.tp}) must divide the MLP inner size ({ffn}); valid: {_valid(divisors(ffn)[:12])}"
    return None


def _pp_layers(s: Scenario, p: Plan) -> str | None:
    layers = s.model.num_layers
    if p.pp * p.virtual_stages > layers:
        return (f"pp*virtual_stages ({p.pp}*{p.virtual_stages}) exceeds num_layers ({layers}); "
                "every model chunk needs at least one layer")
    return None


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
    if p.ep == 1:
        return None
    if s.model.moe is None:
        return f"ep ({p.ep}) needs an MoE model; {s.model.name} is dense: set ep=1"
    e = s.model.moe.num_experts
    if e % p.ep or (p.dp * p.cp) % p.ep:
        ok = [d for d in divisors(e) if (p.dp * p.cp) % d == 0]
        return f"ep ({p.ep}) must divide num_experts ({e}) and dp*cp ({p.dp * p.cp}); valid: {_valid(ok)}"
    return None


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
        m = p.grad_accumulation(s.training.global_batch_size)
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
)


def violations(scenario: Scenario, plan: Plan, rules: tuple[Rule, ...] = RULES) -> list[str]:
    """Messages of every rule the plan breaks (empty when valid)."""
    return [msg for r in rules if (msg := r.check(scenario, plan)) is not None]


def check_plan(scenario: Scenario, plan: Plan) -> None:
    """Raise StratagemError with the first broken rule."""
    broken = violations(scenario, plan)
    if broken:
        raise StratagemError(f"plan: {broken[0]}")
