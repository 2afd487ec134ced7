"""Host work of a transformer layer: the Python-level operations its forward and backward issue, as the engine's
code issues them, each priced in host seconds; an MoE layer's forward blocks the host, so a layer takes at least its
host time (evaluators.timing's launch floor, evaluators.ep_overlap's combined steps). Vectorised over `PlanColumns`.

Sources:
  [MCore-sync] megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
          (d2h_event.synchronize(): the host waits for the token counts before the all-to-all) and
          megatron/core/transformer/moe/fused_a2a.py FusedDispatch.forward (DeepEP's dispatch: "the CPU will wait for
          GPU's signal to arrive"): every MoE layer's forward blocks the host once, so the host cannot run ahead of
          the GPU across MoE layers.
  [MB-B200] Megatron-Bridge docs/performance-summary.md, 26.02 container, DGX-B200: Qwen3-30B-A3B on 8 GPUs, EP8,
          MBS 1, GBS 512, 9,691 tok/s/GPU: 512 x 4096 / (9,691 x 8) s per step over 64 micro-batches x 48 layers =
          8.8 ms per MoE layer and micro-batch, host-bound (the same table's DGX-B300 row at MBS 8, 29,521
          tok/s/GPU, needs 2.9 ms of GPU time per 4,096 tokens); its recipe graphs the router and the dispatcher's
          preprocess (cuda_graph_scope moe_router, moe_preprocess), so its eager host work is the rest of the layer.
  [MCore-recompute] megatron/core/transformer/transformer_layer.py / moe/moe_layer.py: each module named in
          --recompute-modules runs its forward again (CheckpointWithoutOutput) before its backward: its forward
          operations are issued twice.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.experts import GROUPED_GEMM_STREAMS, moe_layer_fraction
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = [
    "HOST_OPS",
    "RECOMPUTE_HOST_OPS",
    "TE_GROUPED_MLP_HOST_S_PER_EXPERT",
    "MBRIDGE_B200_LAYER_HOST_S",
    "MOE_OP_HOST_RATIO",
    "moe_blocks",
    "dense_op_host_s",
    "moe_op_host_s",
    "moe_layer_host_s",
    "pre_dispatch_host_share",
    "expert_host_s",
    "recompute_host_s",
    "layer_host_s",
]

Array = NDArray[np.float64]

# Host operations (Python-level calls that launch kernels, a collective or a host sync) one transformer layer issues
# per micro-batch in Megatron-Core with Transformer Engine, fused router and fused permute, (forward, backward),
# counted in the engine's code; backward counts the autograd nodes the forward's ops leave.
HOST_OPS: dict[str, tuple[int, int, str]] = {
    "attention": (8, 8, "megatron/core/transformer/attention.py SelfAttention.forward: linear_qkv "
                        "(TELayerNormColumnParallelLinear), q/k layernorm, apply_rotary_pos_emb on q and k, "
                        "TEDotProductAttention, linear_proj; transformer_layer.py self_attn_bda"),
    "mlp": (4, 4, "megatron/core/transformer/mlp.py MLP.forward: linear_fc1 (pre-MLP norm fused), bias_swiglu, "
                  "linear_fc2; transformer_layer.py mlp_bda"),
    "moe_norm": (1, 1, "models/gpt/gpt_layer_specs.py: MoE layers keep pre_mlp_layernorm as its own TENorm"),
    "router": (10, 5, "moe/router.py TopKRouter.forward: cast to moe_router_dtype, gating linear, "
                      "fused topk_with_score_function, compute_routing_scores_for_aux_loss, tokens per expert, "
                      "switch_load_balancing_loss_func (3), save_to_aux_losses_tracker, MoEAuxLossAutoScaler"),
    "dispatch_alltoall": (21, 4, "moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.preprocess (9 count ops + the "
                                 "all-gather of counts over tp x ep), _maybe_dtoh_and_synchronize (4 D2H copies, "
                                 "record, synchronize), permute (fused, 2), token_dispatch (2 all-to-alls: tokens, "
                                 "probs), dispatch_postprocess sort_chunks_by_idxs"),
    "dispatch_deepep": (9, 2, "moe/token_dispatcher.py _DeepepManager: setup_metadata topk, probs to fp32, "
                              "fused_dispatch (dispatch layout + dispatch; the host waits for the counts), "
                              "fused_indices_to_multihot, tokens_per_expert.sum().item(), permute (fused, 2)"),
    "experts": (5, 3, "moe/experts.py TEGroupedMLP.forward: split + GroupedLinear fc1, weighted bias_swiglu with "
                      "the routing probs, split + GroupedLinear fc2 (each GroupedLinear one host call; its "
                      "per-expert cuBLAS launches run in C++ [TE-multi])"),
    "combine_alltoall": (3, 3, "moe/token_dispatcher.py combine_preprocess sort_chunks_by_idxs, token_combine "
                               "all-to-all, combine_postprocess unpermute (fused)"),
    "combine_deepep": (2, 2, "moe/token_dispatcher.py _DeepepManager unpermute (fused), fused_combine"),
    "moe_bda": (1, 1, "transformer_layer.py mlp_bda"),
}



# Forward operations a recomputed module issues again [MCore-recompute], and whether they are priced as the dense
# blocks' operations or the MoE block's (moe_op_host_s).
RECOMPUTE_HOST_OPS: dict[str, tuple[int, str]] = {
    "core_attn": (1, "dense"), "layernorm": (2, "dense"), "mlp": (HOST_OPS["mlp"][0], "dense"),
    "mla_up_proj": (2, "dense"), "shared_experts": (HOST_OPS["mlp"][0], "moe"), "moe_act": (1, "moe"),
    "moe": (HOST_OPS["experts"][0], "moe"),
}

# Host seconds Transformer Engine's grouped MLP spends per local expert, forward + backward: TE issue #2897
# ("Reduce CPU overhead in grouped MLP block", 2026-04): 64 experts at hidden size 128 on GB200 (host-bound) take
# ~1.2 ms forward and ~2.1 ms backward, i.e. 3.3 ms / 64 experts (per-expert GEMM setup and launch, per-expert
# quantizer and wgrad allocations; TE issue #1499: torch.split and 2 x num_gemms torch.empty calls). Measured on a
# Grace host with the fused MXFP8 path: an upper bound for x86 hosts.
TE_GROUPED_MLP_HOST_S_PER_EXPERT = (1.2e-3 + 2.1e-3) / 64.0




def _ops(*blocks: str) -> int:
    return sum(HOST_OPS[b][0] + HOST_OPS[b][1] for b in blocks)


def moe_blocks(scn: Scenario) -> tuple[str, ...]:
    """The MoE block's HOST_OPS entries for the scenario's dispatcher (attention aside)."""
    d = "deepep" if scn.training.dispatcher == "deepep" else "alltoall"
    return ("moe_norm", "router", f"dispatch_{d}", "experts", f"combine_{d}", "moe_bda")


def dense_op_host_s(cal: Calibration) -> float:
    """Host seconds of one attention or dense-MLP operation: Calibration.layer_floor_ms (a dense layer's forward +
    backward launch time, fitted on dense runs or measured by `stratagem calibrate`) over its HOST_OPS count."""
    return cal.layer_floor_ms * 1e-3 / _ops("attention", "mlp")


def _moe_op_ratio() -> float:
    """MOE_OP_HOST_RATIO from [MB-B200]: the run's layer host time, less its attention operations at the default
    calibration's dense price and its 16 local experts' TE loop, over the MoE block's eager operations (the alltoall
    dispatcher's, less the graphed router (forward + backward) and dispatcher preprocess (9 count ops and the
    all-gather of counts: forward only))."""
    dense = dense_op_host_s(Calibration())
    blocks = ("moe_norm", "router", "dispatch_alltoall", "experts", "combine_alltoall", "moe_bda")
    eager = _ops(*blocks) - _ops("router") - 10
    moe_op = (MBRIDGE_B200_LAYER_HOST_S - _ops("attention") * dense - 16 * TE_GROUPED_MLP_HOST_S_PER_EXPERT) / eager
    return moe_op / dense


# [MB-B200]: seconds of host work per MoE layer and micro-batch of that host-bound run.
MBRIDGE_B200_LAYER_HOST_S = 512 * 4096 / (9691 * 8) / (64 * 48)
# Host seconds of one MoE-block operation (router, dispatcher, grouped MLP, combine) over a dense block's: the
# published host-bound MoE run [MB-B200] priced against the default calibration (_moe_op_ratio). A calibration that
# measures this node's layer_floor_ms scales both.
MOE_OP_HOST_RATIO = _moe_op_ratio()


def moe_op_host_s(cal: Calibration) -> float:
    """Host seconds of one MoE-block operation: dense_op_host_s x MOE_OP_HOST_RATIO [MB-B200]."""
    return dense_op_host_s(cal) * MOE_OP_HOST_RATIO


def moe_layer_host_s(scn: Scenario, cal: Calibration) -> float:
    """Host seconds of one MoE layer's operations, forward + backward, local experts' loop aside: attention at the
    dense price, the MoE block (moe_blocks) at the MoE price."""
    return _ops("attention") * dense_op_host_s(cal) + _ops(*moe_blocks(scn)) * moe_op_host_s(cal)


def pre_dispatch_host_share(scn: Scenario, cal: Calibration) -> float:
    """Share of an MoE layer's host seconds (moe_layer_host_s) the host spends in a combined 1F1B step before the
    forward dispatch blocks it (evaluators.ep_overlap [MCore-host]): B's combine backward, A's attention, norm and
    router forward, B's experts backward and bias-dropout-add backward."""
    blocks = moe_blocks(scn)
    moe_pre = HOST_OPS["moe_norm"][0] + HOST_OPS["router"][0] + sum(HOST_OPS[b][1] for b in blocks[3:])
    pre = HOST_OPS["attention"][0] * dense_op_host_s(cal) + moe_pre * moe_op_host_s(cal)
    return pre / moe_layer_host_s(scn, cal)


def expert_host_s(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """Host seconds of one MoE layer's local experts per micro-batch, forward + backward, beyond HOST_OPS' one call
    per grouped GEMM: Transformer Engine loops its local experts on the host (TE_GROUPED_MLP_HOST_S_PER_EXPERT each,
    experts.py [TE-multi]); torch._grouped_mm takes them in one call (0); without a grouped GEMM each expert is its
    own MLP call (HOST_OPS["mlp"] operations at the dense price). Averaged over layers."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    local = np.maximum(1.0, moe.num_experts / pc.ep)
    rec = scn.training.record
    if not rec.grouped_gemm:
        per_expert = _ops("mlp") * dense_op_host_s(cal)
    else:
        per_expert = TE_GROUPED_MLP_HOST_S_PER_EXPERT if GROUPED_GEMM_STREAMS.get(rec.kernels) else 0.0
    out: Array = moe_layer_fraction(scn) * local * per_expert
    return out


def recompute_host_s(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """Host seconds the modules of --recompute-modules add per layer and micro-batch (RECOMPUTE_HOST_OPS
    [MCore-recompute]), averaged over layers (MoE modules on MoE layers, the dense MLP on dense ones)."""
    share = moe_layer_fraction(scn)
    price = {"dense": dense_op_host_s(cal), "moe": moe_op_host_s(cal)}
    out = np.zeros(len(pc))
    for name, (ops, kind) in RECOMPUTE_HOST_OPS.items():
        layers = share if name in ("moe", "moe_act", "shared_experts") else (1.0 - share if name == "mlp" else 1.0)
        out = out + np.where(pc.recomputes_module(name), ops * price[kind] * layers, 0.0)  # type: ignore[arg-type]
    return out


def layer_host_s(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """Host seconds to launch one layer's forward + backward per micro-batch, averaged over layers: dense layers
    Calibration.layer_floor_ms; MoE layers moe_layer_host_s (their operations at their prices); plus the local
    experts' host loop (expert_host_s) and recomputed modules (recompute_host_s). A layer takes at least this long:
    MoE layers block the host once per forward [MCore-sync], so it cannot work ahead of the GPU across them."""
    share = moe_layer_fraction(scn)
    moe = moe_layer_host_s(scn, cal) if scn.model.moe is not None else 0.0
    base = (1.0 - share) * cal.layer_floor_ms * 1e-3 + share * moe
    return base + expert_host_s(scn, pc, cal) + recompute_host_s(scn, pc, cal)
