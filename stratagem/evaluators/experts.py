"""Expert layouts in memory and time: the expert grid ep x etp x edp, token dispatch, per-expert GEMM size, and
the load the busiest expert rank carries. Vectorised over `PlanColumns`.

Sources:
  [MCore-fold] Megatron-Core megatron/core/parallel_state.py initialize_model_parallel: the expert grid
          etp x ep x edp (order "tp-ep-dp-pp": etp innermost, then ep) re-partitions the tp x cp x dp ranks of a
          pipeline stage, edp = tp*dp*cp / (ep*etp) (MoE parallel folding, Liu et al. 2025, arXiv 2504.14960 sec. 3).
  [MCore-a2a] megatron/core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher: each rank sends its
          tokens' top_k copies to the ranks holding their experts (all-to-all over ep), the etp ranks of an expert
          then all-gather them (gather_from_sequence_parallel_region over the expert-TP group) and reduce-scatter
          the outputs; combine reverses both; backward repeats the exchanges on gradients.
  [BiB]   Raab & Steger 1998, "Balls into Bins - A Simple and Tight Analysis", Theorem 1: m balls thrown uniformly
          into n bins, m >> n log n, give a fullest bin of m/n + sqrt(2 (m/n) ln n) (1 + o(1)): the load of the
          busiest rank when a balanced router sends m token copies to n expert ranks.
  [Switch] Fedus et al. 2021, sec. 2.2: capacity = capacity_factor x tokens x top_k / experts; tokens beyond it
          are dropped, so no expert processes more.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.comm import Link, all_gather_s, all_to_all_s, group_link
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario

__all__ = [
    "expert_data_parallel",
    "ep_link",
    "expert_dp_link",
    "moe_tokens_per_rank",
    "load_imbalance",
    "expert_gemm_size",
    "routed_time_factor",
    "dispatch_s",
    "moe_layer_fraction",
    "routed_matmul_per_layer",
]

Array = NDArray[np.float64]


def expert_data_parallel(pc: PlanColumns) -> Array:
    """edp = tp*dp*cp / (ep*etp) [MCore-fold]."""
    return pc.tp * pc.dp * pc.cp / (pc.ep * pc.etp)


def ep_link(scn: Scenario, cal: Calibration, pc: PlanColumns) -> Link:
    """The link of an EP group: ep ranks spaced etp apart (etp innermost in the expert grid [MCore-fold]); inside
    a node whenever ep*etp fits in it."""
    return group_link(scn.cluster, cal, pc.ep, pc.etp)


def expert_dp_link(scn: Scenario, cal: Calibration, pc: PlanColumns) -> Link:
    """The link of the expert data-parallel group: edp ranks spaced ep*etp apart."""
    return group_link(scn.cluster, cal, expert_data_parallel(pc), pc.ep * pc.etp)


def moe_tokens_per_rank(scn: Scenario, pc: PlanColumns) -> Array:
    """Tokens one rank routes per micro-batch: the micro-batch's s/cp tokens, split over tp (sequence-parallel
    input of the MoE layer; Megatron requires sequence parallelism for MoE with tp > 1)."""
    return pc.micro_batch_size * scn.training.seq_len / (pc.cp * pc.tp)


def load_imbalance(scn: Scenario, pc: PlanColumns) -> Array:
    """Busiest expert rank's token copies over the mean (>= 1) [BiB]: one EP group holds
    m = ep x tokens x top_k copies over n = ep ranks, fullest = mean (1 + sqrt(2 ln n / mean)); capped by the
    capacity factor when tokens beyond capacity are dropped [Switch]. 1 for dense models or ep = 1."""
    moe = scn.model.moe
    if moe is None:
        return np.ones(len(pc))
    mean = moe_tokens_per_rank(scn, pc) * moe.top_k  # copies per rank under a perfectly balanced router
    n = pc.ep
    factor = 1.0 + np.sqrt(2.0 * np.log(np.maximum(n, 1.0)) / np.maximum(mean, 1.0))
    if moe.capacity_factor is not None:
        factor = np.minimum(factor, max(1.0, moe.capacity_factor))
    return np.where(n > 1, factor, 1.0)


def expert_gemm_size(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """Efficiency factor of one expert's GEMMs, as the dense small-GEMM term: F / (F + half_efficiency), F the
    forward FLOPs of one expert on its tokens: 2 x tokens per expert x mats x h x f / etp, where an expert
    receives ep x tokens x top_k / E copies of its EP group, all-gathered over etp [MCore-a2a]."""
    m = scn.model
    moe = m.moe
    if moe is None:
        return np.ones(len(pc))
    per_expert = pc.ep * pc.etp * moe_tokens_per_rank(scn, pc) * moe.top_k / moe.num_experts
    mats = 3.0 if m.mlp == "swiglu" else 2.0
    flops = 2.0 * per_expert * mats * m.hidden_size * moe.expert_ffn_hidden_size / pc.etp
    return flops / (flops + cal.half_efficiency_gflop * 1e9)


def moe_layer_fraction(scn: Scenario) -> float:
    """Share of layers with experts."""
    m = scn.model
    return m.num_moe_layers() / m.num_layers if m.moe is not None else 0.0


def routed_matmul_per_layer(scn: Scenario) -> float:
    """Routed-expert weights one token multiplies through, averaged over layers: MoE share x top_k x one
    expert's matmul weights (SwiGLU 3 h f, GELU 2 h f)."""
    m = scn.model
    if m.moe is None:
        return 0.0
    mats = 3.0 if m.mlp == "swiglu" else 2.0
    return moe_layer_fraction(scn) * m.moe.top_k * mats * m.hidden_size * m.moe.expert_ffn_hidden_size


def routed_time_factor(scn: Scenario, pc: PlanColumns, cal: Calibration, dense_size: Array) -> Array:
    """Multiplier on the routed-expert matmul time when it is timed at the layer's dense rate (which includes
    `dense_size`, the layer's own small-GEMM factor): load imbalance x dense_size / expert GEMM size. The total
    routed FLOPs per rank do not depend on ep/etp (tokens x top_k x expert weights / tp, balanced)."""
    return load_imbalance(scn, pc) * dense_size / np.maximum(expert_gemm_size(scn, pc, cal), 1e-12)


def dispatch_s(scn: Scenario, pc: PlanColumns, cal: Calibration, token_bytes: Array) -> Array:
    """Seconds of one MoE layer's token exchanges per micro-batch, forward + backward [MCore-a2a]: dispatch and
    combine all-to-alls over ep (4 in all) of the rank's top_k token copies (x the busiest rank's imbalance),
    and with etp > 1 the all-gather / reduce-scatter of the dispatched tokens over etp (4 in all).
    `token_bytes`: bytes of one token's hidden state in the compute dtype."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    copies = moe_tokens_per_rank(scn, pc) * moe.top_k * load_imbalance(scn, pc)
    a2a = 4.0 * all_to_all_s(ep_link(scn, cal, pc), copies * token_bytes)
    etp_link = group_link(scn.cluster, cal, pc.etp, 1.0)
    gather = 4.0 * all_gather_s(etp_link, pc.etp * copies * token_bytes)
    return a2a + gather
