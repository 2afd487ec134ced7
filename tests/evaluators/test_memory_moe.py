"""What an MoE layer keeps for backward, as each engine's code keeps it: Megatron weights the experts inside
their activation and keeps no expert output for the combine; the harness (and torchtitan) weight the experts'
outputs after the experts, which keeps them (memory_activations [MLM-P], [TT-C])."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stratagem.evaluators.experts import load_imbalance
from stratagem.evaluators.memory_activations import layer_elements, saved_tensors
from stratagem.launch.harness.moe import MoE
from stratagem.spaces import ClusterSpec, Plan, Scenario, gpu_preset
from stratagem.spaces.columns import PlanColumns


def _scn(stack: str) -> Scenario:
    return Scenario(model="tiny-moe", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), gpus_per_node=8),
                    training={"global_batch_size": 64, "stack": stack})


def _names(stack: str) -> dict[str, float]:
    pc = PlanColumns.from_plans([Plan(dp=8)])
    return {x.name: float((x.elements + np.zeros(1))[0]) for x in saved_tensors(_scn(stack), pc, 8.0, 2.0)}


def test_megatron_moe_layer_keeps_the_engine_tensors_only() -> None:
    """tiny-moe (h 64, 4 heads of 16, 2 kv heads, 4 experts of f 64, top 2), s 8, b 2, tp 1, Megatron, no
    recompute, T = s b = 16 tokens. The engine's saved tensors (core_v0.19.0): the attention half as in a dense
    layer (norm1 in, QKV in, norm2 in, MLP norm out: 4 T h; q 64 + k 32 + v 32; attention output 64), the router's
    fp32 logits and probs (2 x 2 T E bf16 widths), TEGroupedMLP's fc1 input (k T h), WeightedSwiGLUFunction's input
    (2 k T f) and probs (k T fp32: 2 k T), fc2's input (k T f); unpermute and the combine keep no tokens."""
    scn = _scn("megatron")
    pc = PlanColumns.from_plans([Plan(dp=8)])
    t, h, f, k, e = 16.0, 64.0, 64.0, 2.0, 4.0  # T = s b tokens
    copies = k * t * float(load_imbalance(scn, pc)[0])
    attention = 4 * t * h + t * (64 + 32 + 32) + t * 64  # norm1, qkv_input, norm2, mlp_input; q k v; attn_out
    engine = attention + 2 * 2 * t * e + copies * (h + 2 * f + 2 + f)
    none = float(layer_elements(scn, pc, 8.0, 2.0)[0][0])
    assert none == engine
    names = _names("megatron")
    assert "dispatch_output" not in names and names["expert_probs"] == 2 * copies


def test_the_harness_keeps_the_expert_outputs_it_weights() -> None:
    """The torch record's MoE layer is the harness's: run it on the CPU and list what autograd saves. The
    experts' outputs [k T, h] (the product `routed * weights`) are saved whole, as the record counts them
    (dispatch_output, k T h elements); Megatron's record leaves them out."""
    torch.manual_seed(0)
    scn = _scn("torch")
    layer = MoE(scn.model)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    shapes: list[tuple[int, ...]] = []

    def pack(x: torch.Tensor) -> Any:
        shapes.append(tuple(x.shape))
        return x

    x = torch.randn(2, 8, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        layer(x).sum().backward()
    k, tokens, h = scn.model.moe.top_k, 16, 64  # type: ignore[union-attr]
    assert (k * tokens, h) in shapes
    torch_names, megatron_names = _names("torch"), _names("megatron")
    assert torch_names["dispatch_output"] == torch_names["dispatch_input"]
    assert torch_names["dispatch_output"] >= k * tokens * h
    assert "dispatch_output" not in megatron_names


def test_mtp_module_weighs_on_the_last_stage_only() -> None:
    """DeepSeek-V3's multi-token-prediction module on Megatron (bf16, pp 16, ep 8): the last stage holds its
    layer (non-routed / tp, routed / ep), its norms and eh_proj, and a copy of the embedding (gpt_model.py builds
    it when mtp_process), 2 bytes each; the first stage is unchanged; the step is slower (the last rank runs one
    more layer and the head once more)."""
    from stratagem.evaluators import evaluate_many
    from stratagem.evaluators.calibration import DEFAULT_CALIBRATION
    from stratagem.evaluators.memory import rank_memory_columns

    with_mtp = Scenario(model="deepseek-v3", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=32,
                                                                 gpus_per_node=8),
                        training={"global_batch_size": 1024, "stack": "megatron"})
    m = with_mtp.model
    bare = with_mtp.model_copy(update={"model": m.model_copy(update={"mtp_layers": 0})})
    plan = Plan(dp=16, pp=16, ep=8, zero_stage=1)
    pc = PlanColumns.from_plans([plan])

    def weights(scn: Scenario, stage: str) -> float:
        return float(rank_memory_columns(scn, pc, DEFAULT_CALIBRATION, stage)["weights"][0])  # type: ignore[arg-type]

    dense, routed = m.mtp_module_params()
    assert weights(with_mtp, "first") == weights(bare, "first")
    assert weights(with_mtp, "last") - weights(bare, "last") == 2.0 * (dense + routed / 8 + m.vocab_size * m.hidden_size)
    slow, fast = evaluate_many(with_mtp, [plan]), evaluate_many(bare, [plan])
    assert slow.step_s[0] > fast.step_s[0]
