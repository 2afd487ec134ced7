"""What the training harness can run, decided without torch: `unsupported(scenario, plan)`.

    reason = unsupported(scenario, plan)   # None, or one line "plan.cp (2): ... ; use cp=1"

The harness's own checks (stratagem.launch.harness.model.check_supported, parallelize.check_applicable,
pipeline.check_microbatches, parallelize.build_optimizer) raise StratagemError with these same lines, so a search
that skips a plan for `unsupported`'s reason skips exactly the plans the harness would stop on. This module
imports neither torch nor ray: the multi-fidelity loop and the exporters call it on the analytic path.

Hardware-dependent checks (fp8) need the device the run will use: `device_type` "cpu" or "cuda"; by default
the scenario's (cluster.gpu.kind "cpu" -> cpu, else cuda). On cuda, fp8 still needs sm89+ and torchao, which
only the harness itself can see.
"""

from __future__ import annotations

from stratagem.spaces.exclusions import PlanExclusion
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan
from stratagem.spaces.rules import plan_facts
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record
from stratagem.spaces.training import TrainingSpec

__all__ = ["DEFAULT_LR", "HARNESS_OPTIMIZERS", "model_refusal", "plan_refusals", "microbatch_refusal", "optimizer_refusal",
           "refusals", "token_split_refusal", "unsupported"]

DEFAULT_LR = 1e-3
"""The harness's learning rate for real runs (tests use stratagem.launch.harness.verify.VERIFY_LR)."""

HARNESS_OPTIMIZERS = ("adamw", "sgd", "adafactor")
"""training.optimizer values the harness builds (torch.optim.AdamW, SGD(momentum=0.9), Adafactor)."""


def model_refusal(spec: ModelSpec) -> str | None:
    """Why the harness cannot build this model (one line naming the field), or None."""
    if spec.moe is not None and spec.moe.capacity_factor is not None:
        return (f"model.moe.capacity_factor ({spec.moe.capacity_factor}): the harness's MoE is dropless; "
                "remove capacity_factor for a real run")
    if spec.mlp != "swiglu" or spec.norm != "rmsnorm":
        return (f"model.mlp/norm ({spec.mlp}/{spec.norm}): the harness builds Llama-style models only "
                "(mlp: swiglu, norm: rmsnorm)")
    if spec.bias != "none" or spec.position_embedding != "rope":
        return (f"model.bias/position_embedding ({spec.bias}/{spec.position_embedding}): the harness builds "
                "Llama-style models only (bias: none, position_embedding: rope)")
    unbuilt = {"mla": spec.mla is not None, "qk_norm": spec.qk_norm, "attention_window": spec.attention_window,
               "attention_sinks": spec.attention_sinks, "encoder_params": spec.encoder_params}
    for name, value in unbuilt.items():
        if value:
            return (f"model.{name} ({value if not hasattr(value, 'model_dump') else 'set'}): the harness builds "
                    f"plain GQA attention over the whole sequence, without {name}; remove it for a real run")
    if spec.mtp_layers:
        return (f"model.mtp_layers ({spec.mtp_layers}): the harness builds no multi-token-prediction module; "
                "set 0 for a real run")
    return None


def optimizer_refusal(optimizer: str) -> str | None:
    """Why the harness cannot build this optimizer, or None."""
    if optimizer not in HARNESS_OPTIMIZERS:
        return (f"training.optimizer ({optimizer}): the harness runs {', '.join(HARNESS_OPTIMIZERS)}; "
                "adamw8bit needs bitsandbytes, which it does not use")
    return None


def plan_refusals(plan: Plan, spec: ModelSpec, device_type: str) -> list[str]:
    """Every plan field value the harness does not apply to this model on `device_type` ("cpu"/"cuda")."""
    out: list[str] = []
    # schedule combinations the torch stack's record marks as refused by the harness (spaces/stacks.py
    # ScheduleExclusion): the same data the search space reads, so the space never proposes them
    ex = stack_record("torch").schedule_exclusion(plan.pp_schedule, plan.cp, plan.virtual_stages, "harness",
                                                  plan.activation_checkpointing)
    if plan.pp > 1 and ex is not None:
        field, value = {"cp>1": ("plan.cp", plan.cp),
                        "op_recompute": ("plan.activation_checkpointing", plan.activation_checkpointing)
                        }.get(ex.when, ("plan.pp_schedule", plan.pp_schedule))
        out.append(f"{field} ({value}): {ex.reason}")
    torch_rec = stack_record("torch")
    unrun = [m for m in plan.recompute_modules if m not in torch_rec.recompute_modules]
    if unrun:  # the harness is the torch stack: what its record cannot recompute it would silently run otherwise
        out.append(f"plan.recompute_modules ({'+'.join(unrun)}): the harness recomputes as the torch stack does "
                   f"({torch_rec.cite('recompute_modules')}); use recompute_modules= (stratagem's selective)")
    if plan.cp > 1 and plan.dp_replicate > 1:
        out.append(f"plan.cp ({plan.cp}): the harness reduces over dp x cp flattened, not HSDP's (replicate, shard x "
                   "cp) mesh; use dp_replicate=1 with cp > 1")
    # combinations the torch stack's record marks as refused by the harness (spaces/exclusions.py PlanExclusion:
    # ZeRO-1 with the MoE experts on the expert mesh, etp other than 1 or tp; the micro-batch count's in
    # microbatch_refusal): the same data the search space reads. The "export" ones the harness runs as planned.
    for rule in torch_rec.plan_exclusions:  # (microbatches unknown here: 0, the 1f1b rule is skipped)
        if rule.refused_by != "harness" or rule.name == "1f1b_microbatches":
            continue
        if rule.applies(plan_facts(plan, spec.moe is not None, 0)):
            out.append(f"{_named(rule, plan)}: {rule.reason}")
    if plan.optimizer_offload != "none" and (plan.zero_stage < 2 or plan.dp == 1):
        out.append(f"plan.optimizer_offload (cpu): the harness offloads with FSDP2's CPUOffloadPolicy, which needs "
                   f"zero_stage 2 or 3 and dp > 1 (got zero_stage={plan.zero_stage}, dp={plan.dp}); use zero_stage=3 "
                   "or optimizer_offload=none")
    if plan.precision == "fp8" and device_type != "cuda":
        out.append(f"plan.precision (fp8): needs a GPU with FP8 tensor cores (sm89+); this run is on "
                   f"{device_type}: use bf16")
    return out


def _named(ex: PlanExclusion, plan: Plan) -> str:
    """'plan.field (value)' for a PlanExclusion's refusal line: ZeRO-1's names the degree that puts the experts
    on the expert mesh (ep, else tp)."""
    field = "plan.tp" if ex.name == "zero1_moe_expert_mesh" and plan.ep == 1 else ex.field
    return f"{field} ({getattr(plan, field.removeprefix('plan.'))})"


def microbatch_refusal(plan: Plan, microbatches: int) -> str | None:
    """torch's schedules need 1F1B: m >= pp; interleaved / zero-bubble: m a multiple of max(1, m // pp)."""
    if plan.pp == 1:
        return None
    fix = "lower micro_batch_size or dp (micro-batches per step = global_batch_size / (dp * micro_batch_size))"
    for rule in stack_record("torch").plan_exclusions:  # spaces/stacks.py: 1f1b with fewer micro-batches than pp
        if rule.name == "1f1b_microbatches" and rule.applies(plan_facts(plan, False, microbatches)):
            return f"{_named(rule, plan)}: {rule.reason} (here {microbatches} for pp={plan.pp})"
    rounds = max(1, microbatches // plan.pp)
    if plan.pp_schedule in ("interleaved", "zero_bubble") and microbatches % rounds:
        return (f"plan.micro_batch_size ({plan.micro_batch_size}): the {plan.pp_schedule} schedule "
                f"needs micro-batches per step ({microbatches}) to be a multiple of "
                f"{rounds} = max(1, m // pp); {fix}")
    return None


def refusals(scenario: Scenario, plan: Plan, device_type: str | None = None) -> list[str]:
    """Every reason the harness would stop on this scenario and plan (empty: it runs it)."""
    device = device_type or ("cpu" if scenario.cluster.gpu.kind == "cpu" else "cuda")
    out = [r for r in (model_refusal(scenario.model), optimizer_refusal(scenario.training.optimizer)) if r]
    out += plan_refusals(plan, scenario.model, device)
    micro = microbatch_refusal(plan, _microbatches(plan, scenario.training))
    if micro:
        out.append(micro)
    split = token_split_refusal(plan, scenario.model, scenario.training.seq_len)
    if split:
        out.append(split)
    return out


def token_split_refusal(plan: Plan, spec: ModelSpec, seq_len: int) -> str | None:
    """MoE under TP with etp = 1: each TP rank routes 1/tp of a micro-batch's tokens (of its s/cp under context
    parallelism), which must divide evenly (torchtitan ReordererSequenceParallel raises on an uneven split too)."""
    tokens = plan.micro_batch_size * seq_len // plan.cp
    if spec.moe is not None and plan.tp > 1 and plan.etp == 1 and tokens % plan.tp:
        return (f"plan.micro_batch_size ({plan.micro_batch_size}): with etp=1 each TP rank routes 1/tp of a "
                f"micro-batch's tokens (torchtitan ReordererSequenceParallel), so tp ({plan.tp}) must divide "
                f"micro_batch_size * seq_len / cp ({tokens}); change micro_batch_size or use etp=tp")
    return None


def _microbatches(plan: Plan, training: TrainingSpec) -> int:
    return micro_batches(plan, training.global_batch_size)


def unsupported(scenario: Scenario, plan: Plan, device_type: str | None = None) -> str | None:
    """The one-line reason the training harness cannot run `plan` on `scenario`, or None when it can.

    For the multi-fidelity loop: skip such a plan instead of spending a real run on it. Imports no torch.
    """
    found = refusals(scenario, plan, device_type)
    return found[0] if found else None
