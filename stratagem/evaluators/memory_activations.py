"""What one transformer layer saves for backward, tensor by tensor, and how many bytes that is per micro-batch.

One inventory serves the three questions the memory model asks of a layer: how much it saves with no
recompute, under stratagem's selective recompute or Megatron's module recompute (`Plan.recompute_modules`), and
in which dtype each tensor is kept (fp8 plans on Transformer Engine keep a linear's input quantized). Vectorised
over `PlanColumns` like stratagem.evaluators.memory.

Per layer per micro-batch, s = sequence (/ cp), b = micro-batch, h = hidden, f = MLP width, t = tp; sbh is a
[s, b, h] tensor; "/ t" is a TP shard; "/ sp" is / t with sequence parallelism (else whole):
  norm1_input   [s/sp, b, h]  residual stream into the attention norm (the layer input)
  qkv_input     [s/sp, b, h]  attention norm output, saved by the QKV linear (full s with torch DTensor SP)
  qkv           [s, b, (q + k + v)/t]  attention inputs saved by the attention kernel
  attn_out      [s, b, o/t]   attention output, the output projection's input
  attn_out_high [s, b, o/t]   fp8 on TE only: the attention kernel's own bf16 copy of its output (FA backward)
  latents       [s, b, r_q + r_kv + d_rope]  MLA latents, inputs of the up projections
  packed_qkv    [s, b, 2 kv/t]  nanotron's packed [3, b, s, a, d] copy (MHA)
  norm2_input   [s/sp, b, h]  residual stream into the MLP norm
  mlp_input     [s/sp, b, h]  MLP norm output, saved by fc1 (full s with torch DTensor SP)
  per MLP group (dense MLP, routed experts x top_k x imbalance, shared experts):
    act_input   [s, b, 2f/t] SwiGLU gate and up (GELU: fc1 output [s, b, f/t])
    act_mid     [s, b, f/t]  silu(g), kept by eager silu(g) * u for the product's backward (not when fused)
    act_output  [s, b, f/t]  the activation's output, fc2's input
  dispatch_input  [k s b h / t x etp]  tokens dispatched to the experts (grouped fc1's input)
  dispatch_output [k s b h / t x etp]  the experts' outputs, kept by the product with the gate weights after the
                  experts (StackRecord.moe_probs_applied "combine") [TT-C]; in the compute dtype (the harness's)
  expert_probs    [k s b / t x etp]    fp32 permuted probs the weighted activation keeps instead (Megatron,
                  moe_probs_applied "activation"), 2 bf16-element widths [MLM-P]
  router          [s, b, E/t] fp32 logits and probabilities (2 tensors, 2 bf16-element widths each)

Sources:
  [MLM-R] megatron/core/transformer/transformer_config.py recompute_modules: "moe_act", "layernorm",
          "mla_up_proj" discard their outputs (CheckpointWithoutOutput: the consumer's saved reference is freed
          and refilled in backward); "core_attn", "mlp", "moe", "shared_experts" checkpoint their module (only
          its input is kept, and that input is already saved by the layer).
  [TE]    transformer_engine/pytorch/module/linear.py _Linear.forward (and layernorm_linear.py,
          grouped_linear.py): under fp8 the saved input is the quantized tensor, row-wise data dropped
          (update_usage(rowwise_usage=False, columnwise_usage=True)): 1 byte per element.
  [AO]    torchao/float8/float8_linear.py matmul_with_hp_or_float8_args.forward: save_for_backward(input_hp, ...):
          torchao's fp8 linears keep the high-precision input.
  [SWI]   megatron/core/fusions/fused_bias_swiglu.py SwiGLUFunction.forward: save_for_backward(input) only
          (fp8_input_store: the input cast to float8_e4m3fn).
  [MLM-P] Megatron-Core (core_v0.19.0) weights the routed experts inside their activation: megatron/core/
          transformer/moe/experts.py TEGroupedMLP.forward bias_act_func -> weighted_bias_swiglu_impl
          (fused_bias_swiglu.py WeightedSwiGLUFunction.forward: save_for_backward(input, weights), the fc1 output
          and the permuted probs); moe/token_dispatcher.py combine_postprocess unpermutes without probs
          (moe/moe_utils.py unpermute: a scatter, indices only) and the combine saves no tokens (all_to_all;
          DeepEP: moe/fused_a2a.py FusedCombine.forward keeps ctx.handle only). No expert output is kept.
          NeMo Automodel 0.7.0 does the same (components/moe/experts.py GroupedExpertsDeepEP: the activation is
          get_expert_activation_for_deepep -> weighted_bias_swiglu_impl).
  [TT-C]  torchtitan v0.2.2 torchtitan/models/moe/moe.py MoE.forward, score_before_experts=False (its DeepSeek-V3
          and Qwen3 configs): torch.bmm(top_scores, routed_output_unsorted.float()) keeps the experts' outputs
          (in fp32 there, twice the harness's compute-dtype `routed * weights`); DeepSpeed's MOELayer einsum
          over expert_output likewise (deepspeed/moe/sharded_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.experts import load_imbalance
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import sp_divisor
from stratagem.spaces.plan import RecomputeModule
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["Saved", "saved_tensors", "layer_elements", "layer_bytes", "module_recompute_elements"]

Array = NDArray[np.float64]
FP8_BYTES = 1.0  # float8_e4m3fn / e5m2 data; the per-tensor or per-block scales are < 1 % and left out


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for backward: elements per layer per micro-batch on this rank, the Megatron
    module whose recompute frees it (None: kept by every module recompute), whether it is a linear's input
    (quantized under fp8 on Transformer Engine), and whether stratagem's selective recompute keeps it."""

    name: str
    elements: Array | float
    module: RecomputeModule | None = None
    linear_input: bool = False
    selective: bool = True
    act_input: bool = False
    """The MLP activation's input (fp8 with training.activation_func_fp8_input_store [SWI])."""


def _mlp_group(prefix: str, sbf: Array | float, glu: bool, fused: bool, module: RecomputeModule,
               act_module: RecomputeModule | None) -> list[Saved]:
    """The saved tensors of one MLP group of width f (sbf = s b f / t x copies). Selective keeps the activation's
    input only (the harness's policy: down(silu(g) * u) is recomputed)."""
    act_in = 2.0 * sbf if glu else sbf
    out = [Saved(f"{prefix}act_input", act_in, module, act_input=True)]
    if glu and not fused:  # eager silu(g) * u: silu(g) kept for the product's backward
        out.append(Saved(f"{prefix}act_mid", sbf, act_module or module, selective=False))
    out.append(Saved(f"{prefix}act_output", sbf, act_module or module, linear_input=True, selective=False))
    return out


def saved_tensors(scn: Scenario, pc: PlanColumns, s: Array | float, b: Array | float, dense_mlp: bool = False
                  ) -> list[Saved]:
    """The tensors one layer saves for backward with no recompute (module docstring's table). `dense_mlp`: a
    layer of an MoE model with a dense MLP of ffn_hidden_size (DeepSeek's first_dense_layers)."""
    m = scn.model
    rec = stack_record(scn.training.stack)
    t, sp = pc.tp, pc.sequence_parallel
    sp_div = np.where(sp > 0, t, 1.0)
    sbh = s * b * m.hidden_size
    # torch DTensor SP saves the QKV and MLP inputs all-gathered (PrepareModuleInput desired Replicate)
    linear_in = np.where(sp > 0, sbh, sbh / sp_div) if rec.sp_saves_gathered_inputs else sbh / sp_div
    _, latents = m.attention_saved_per_token()
    up: RecomputeModule | None = "mla_up_proj" if m.mla is not None else None
    fp8_store = np.asarray(pc.fp8 & (rec.fp8_activation_store == "fp8"), dtype=np.float64)
    out = [
        Saved("norm1_input", sbh / sp_div),
        Saved("qkv_input", linear_in, "layernorm", linear_input=True),
        Saved("qkv", s * b * (m.q_size + m.kv_size + m.v_size) / t, up),
        Saved("attn_out", s * b * m.out_size / t, linear_input=True),
        # under TE fp8 the projection keeps its fp8 copy and flash attention its own bf16 output [TE]
        Saved("attn_out_high", fp8_store * s * b * m.out_size / t, "core_attn"),
        Saved("latents", s * b * latents, linear_input=True),
        Saved("norm2_input", sbh / sp_div),
        Saved("mlp_input", linear_in, "layernorm", linear_input=True),
    ]
    if rec.mha_packed_qkv and m.kv_heads == m.num_attention_heads:
        out.append(Saved("packed_qkv", 2 * s * b * m.kv_size / t))
    glu = m.mlp == "swiglu"
    if m.moe is None or dense_mlp:
        return out + _mlp_group("", s * b * m.ffn_hidden_size / t, glu, rec.fused_glu, "mlp", None)
    # evaluators/experts.py: the busiest expert rank holds top_k x imbalance routed copies; the dispatched tokens
    # are all-gathered over etp; router logits and probabilities in fp32 (2 elements each)
    e = m.moe
    imb = load_imbalance(scn, pc)
    routed = e.top_k * imb * s * b * e.expert_ffn_hidden_size / t
    # the probs-weighted activation is WeightedSwiGLUFunction, which saves only its input (and the probs) [MLM-P]
    weighted = rec.fused_glu or rec.moe_probs_applied == "activation"
    out += _mlp_group("expert_", routed, glu, weighted, "moe", "moe_act")
    if e.shared_experts:
        shared = e.shared_experts * s * b * e.shared_ffn / t
        out += [Saved(x.name, x.elements, "shared_experts" if x.module == "moe" else x.module, x.linear_input,
                      x.selective, x.act_input)
                for x in _mlp_group("shared_", shared, glu, rec.fused_glu, "moe", None)]
    copies = e.top_k * imb * s * b / t * pc.etp  # routed token copies on the busiest expert rank
    out += [
        Saved("dispatch_input", copies * m.hidden_size, "moe", linear_input=True),
        Saved("router", 2 * 2 * s * b * e.num_experts / t, "moe"),
    ]
    if rec.moe_probs_applied == "activation":  # [MLM-P]: the probs, not the experts' outputs
        return out + [Saved("expert_probs", 2 * copies, "moe")]
    return out + [Saved("dispatch_output", copies * m.hidden_size, "moe")]  # [TT-C]


def _kept_by_modules(pc: PlanColumns, x: Saved) -> NDArray[np.bool_]:
    """Whether the plans' module recompute keeps `x` [MLM-R]: "moe" also frees the shared experts' tensors."""
    if x.module is None:
        return np.ones(len(pc), dtype=bool)
    gone = pc.recomputes_module(x.module)
    if x.module == "shared_experts":
        gone = gone | pc.recomputes_module("moe")
    return np.asarray(~gone)


def layer_elements(scn: Scenario, pc: PlanColumns, s: Array | float, b: Array | float, dense_mlp: bool = False
                   ) -> tuple[Array, Array, Array]:
    """Saved elements per layer per micro-batch: (no recompute, selective or module recompute, full recompute).
    Full recompute keeps only the layer input, sbh (/ t with SP) [Korthikanti et al. 2022 Table 2]."""
    saved = saved_tensors(scn, pc, s, b, dense_mlp)
    z = np.zeros(len(pc))
    none = sum((x.elements + z for x in saved), z)
    selective = sum((x.elements + z for x in saved if x.selective), z)
    modules = sum((np.where(_kept_by_modules(pc, x), x.elements, 0.0) for x in saved), z)
    full = s * b * scn.model.hidden_size / sp_divisor(pc) + z
    return none, np.where(pc.by_module, modules, selective), full


def layer_bytes(scn: Scenario, pc: PlanColumns, s: Array | float, b: Array | float, act_bytes: Array,
                dense_mlp: bool = False) -> tuple[Array, Array, Array]:
    """`layer_elements` in bytes: `act_bytes` per element (the compute dtype), a linear's input at 1 byte on
    fp8 plans of a stack whose fp8 linears keep the quantized input [TE] (torchao keeps bf16 [AO]), the MLP
    activation's input at 1 byte with training.activation_func_fp8_input_store [SWI]."""
    rec = stack_record(scn.training.stack)
    fp8_in = pc.fp8 & (rec.fp8_activation_store == "fp8")
    fp8_act = scn.training.activation_func_fp8_input_store and rec.fused_glu
    saved = saved_tensors(scn, pc, s, b, dense_mlp)
    z = np.zeros(len(pc))

    def width(x: Saved) -> Array:
        if x.act_input and fp8_act:
            return FP8_BYTES + z
        return np.where(fp8_in, FP8_BYTES, act_bytes) if x.linear_input else act_bytes + z

    none = sum((x.elements * width(x) for x in saved), z)
    selective = sum((x.elements * width(x) for x in saved if x.selective), z)
    modules = sum((np.where(_kept_by_modules(pc, x), x.elements * width(x), 0.0) for x in saved), z)
    full = s * b * scn.model.hidden_size / sp_divisor(pc) * act_bytes + z
    return none, np.where(pc.by_module, modules, selective), full


def module_recompute_elements(scn: Scenario, pc: PlanColumns, s: Array | float, b: Array | float
                              ) -> dict[str, Array]:
    """Elements per layer per micro-batch each recomputed module frees (what its recompute re-creates): for the
    recompute time term (evaluators/timing.py) and `explain`."""
    out: dict[str, Array] = {}
    z = np.zeros(len(pc))
    for x in saved_tensors(scn, pc, s, b):
        if x.module is not None:
            out[x.module] = out.get(x.module, z) + np.where(~_kept_by_modules(pc, x), x.elements, 0.0)
    return out
