"""Which Megatron recompute modules a plan may list for a model (shared by spaces/rules.py and spaces/space.py)."""

from __future__ import annotations

from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan

__all__ = ["modules_problem"]


def modules_problem(model: ModelSpec, plan: Plan) -> str | None:
    """plan.recompute_modules as Megatron validates them (megatron/core/transformer/transformer_config.py
    __post_init__): only with selective granularity; mla_up_proj only with MLA; MoE modules need experts."""
    if not plan.recompute_modules:
        return None
    if plan.activation_checkpointing != "selective":
        return (f"recompute_modules ({'+'.join(plan.recompute_modules)}) needs activation_checkpointing=selective "
                f"(got {plan.activation_checkpointing}); set it, or recompute_modules=")
    m = model
    need = {"mla_up_proj": m.mla is not None, "moe_act": m.moe is not None, "moe": m.moe is not None,
            "shared_experts": m.moe is not None and m.moe.shared_experts > 0}
    wrong = [x for x in plan.recompute_modules if not need.get(x, True)]
    if wrong:
        return (f"recompute_modules ({'+'.join(wrong)}): model {m.name} has no such module (mla_up_proj needs "
                "MLA; moe_act/moe need experts; shared_experts needs shared experts); drop them")
    return None
