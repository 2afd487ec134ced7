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
  [Torch-a2a] torch.distributed all_to_all_single -> ProcessGroupNCCL::alltoall_base -> NCCL ncclGroupStart; one
          ncclSend + ncclRecv per peer; ncclGroupEnd (torch/csrc/cuda/nccl.cpp all2all_single_equal_split): every
          peer's transfer is in flight at once.
  [DeepEP] deepseek-ai/DeepEP README and csrc/kernels/internode.cu dispatch: for cross-node EP, each token goes
          once over RDMA to every destination node (the GPU with the same local rank), then over NVLink to the
          experts' GPUs in that node; DeepSeek-V3 report sec. 3.2.2 (node-limited routing, <= 4 nodes a token).
  [MCore-permute] megatron/core/transformer/moe/moe_utils.py permute / unpermute (index_select of the tokens
          into expert order, scatter_add of the weighted outputs back).
  [Grouped] megatron/core/transformer/moe/experts.py TEGroupedMLP; torchtitan GroupedExperts (torch._grouped_mm).
  [TE-multi] TransformerEngine transformer_engine/common/gemm/cublaslt_gemm.cu nvte_multi_tensor_gemm: TE's grouped
          GEMM (GroupedLinear, behind TEGroupedMLP) runs one cuBLAS GEMM per local expert, round-robin over
          transformer_engine/common/util/multi_stream.cpp num_compute_streams = 4 streams (multi_stream_cublas_gemm);
          the single-kernel CUTLASS grouped GEMM only with NVTE_USE_CUTLASS_GROUPED_GEMM=1 on Hopper (off by default).
  [Switch] Fedus et al. 2021, sec. 2.2: capacity = capacity_factor x tokens x top_k / experts; tokens beyond it
          are dropped, so no expert processes more.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.comm import Link, all_gather_s, deepep_rdma_bandwidth, group_link
from stratagem.evaluators.rate_tables import EXPERT_GEMMS, gemm_size
from stratagem.evaluators.routing import expected_token_nodes
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import expert_data_parallel
from stratagem.spaces.scenario import Scenario

__all__ = [
    "ep_link",
    "expert_dp_link",
    "moe_tokens_per_rank",
    "load_imbalance",
    "expert_gemm_size",
    "routed_time_factor",
    "dispatch_s",
    "exchange_s",
    "ep_nodes",
    "token_nodes",
    "remote_nodes_per_token",
    "dispatch_bytes_per_token",
    "permute_s",
    "GEMM_TILE_ROWS",
    "grouped_gemm_concurrency",
    "moe_layer_fraction",
    "routed_matmul_per_layer",
]

Array = NDArray[np.float64]

# Rows of one grouped-GEMM tile: CUTLASS / cuBLAS Hopper grouped GEMMs (TE GroupedLinear, torch._grouped_mm) tile M
# in 128 rows; an expert's rows are padded to whole tiles.
GEMM_TILE_ROWS = 128.0


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


# Expert GEMMs one grouped-GEMM call keeps in flight at once, by the stack's kernels (StackRecord.kernels):
# Transformer Engine's GroupedLinear issues one cuBLAS GEMM per local expert over its 4 compute streams [TE-multi];
# eager PyTorch stacks with a grouped GEMM call torch._grouped_mm, one kernel over every local expert [Grouped]
# (None: all of them).
GROUPED_GEMM_STREAMS: dict[str, float | None] = {"transformer_engine": 4.0, "eager": None}


def grouped_gemm_concurrency(scn: Scenario, pc: PlanColumns) -> Array:
    """Local experts whose GEMMs run at the same time in one grouped-GEMM call: all E/ep of them in a single
    grouped kernel (torch._grouped_mm), at most 4 with Transformer Engine's per-expert cuBLAS GEMMs on 4 streams
    [TE-multi]; 1 without a grouped GEMM (one GEMM per expert, in turn)."""
    moe = scn.model.moe
    rec = scn.training.record
    if moe is None or not rec.grouped_gemm:
        return np.ones(len(pc))
    local = np.maximum(1.0, moe.num_experts / pc.ep)
    streams = GROUPED_GEMM_STREAMS.get(rec.kernels)
    return local if streams is None else np.minimum(local, streams)


def expert_gemm_size(scn: Scenario, pc: PlanColumns, cal: Calibration) -> Array:
    """Efficiency factor of the routed-expert GEMMs, as the dense small-GEMM term F / (F + half_efficiency).

    An expert receives n = ep x tokens x top_k / E copies of its EP group, all-gathered over etp [MCore-a2a].
    F is the forward FLOPs of the expert GEMMs in flight together (grouped_gemm_concurrency of them, 2 x n x mats x
    h x f / etp each): the whole group in one grouped kernel [Grouped], 4 experts at a time with Transformer
    Engine's per-expert GEMMs on 4 streams [TE-multi], one expert without a grouped GEMM. Each expert's rows fill
    whole 128-row tiles, so n / (ceil(n / 128) x 128) of the tiles' work is useful."""
    m = scn.model
    moe = m.moe
    if moe is None:
        return np.ones(len(pc))
    per_expert = pc.ep * pc.etp * moe_tokens_per_rank(scn, pc) * moe.top_k / moe.num_experts
    mats = 3.0 if m.mlp == "swiglu" else 2.0
    flops = 2.0 * per_expert * mats * m.hidden_size * moe.expert_ffn_hidden_size / pc.etp
    if not scn.training.record.grouped_gemm:
        return gemm_size(cal.rate_tables, "dense", flops, EXPERT_GEMMS, cal.matmul_efficiency,
                         cal.half_efficiency_gflop * 1e9)
    group = flops * grouped_gemm_concurrency(scn, pc)
    rows = np.maximum(per_expert, 1e-9)
    fill = rows / (np.ceil(rows / GEMM_TILE_ROWS) * GEMM_TILE_ROWS)
    half = cal.half_efficiency_gflop * 1e9
    return gemm_size(cal.rate_tables, "grouped", group, EXPERT_GEMMS, cal.matmul_efficiency, half) * fill


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


def ep_nodes(scn: Scenario, cal: Calibration, pc: PlanColumns) -> Array:
    """Nodes one EP group spans: ep / (its members per node)."""
    link = ep_link(scn, cal, pc)
    return np.maximum(1.0, link.n / link.per_node)


def token_nodes(scn: Scenario, cal: Calibration, pc: PlanColumns) -> Array:
    """Expected distinct nodes of the EP group (its own included) a token's top_k experts sit on, as the router
    picks them (evaluators.routing.expected_token_nodes: hypergeometric for a free router, the engine's
    group-limited top-k for DeepSeek-V3's node-limited routing, n_group / topk_group)."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    n_nodes = ep_nodes(scn, cal, pc)
    cache: dict[float, float] = {}
    for n in np.unique(n_nodes):
        cache[float(n)] = expected_token_nodes(moe.num_experts, moe.top_k, float(n), moe.route_groups,
                                               moe.route_groups_per_token)
    return np.array([cache[float(n)] for n in n_nodes])


def remote_nodes_per_token(scn: Scenario, cal: Calibration, pc: PlanColumns) -> Array:
    """Expected number of other nodes a token's top_k experts sit on: token_nodes x (N - 1) / N, each of the N nodes
    being the token's own with the same probability under an even router."""
    n_nodes = ep_nodes(scn, cal, pc)
    return token_nodes(scn, cal, pc) * (n_nodes - 1.0) / n_nodes


def dispatch_bytes_per_token(scn: Scenario, pc: PlanColumns) -> tuple[Array, Array]:
    """(dispatch, combine) bytes of one token copy's hidden state on the wire.

    Combine and both backward exchanges carry the compute dtype (fp32 plans 4 B, else bf16 2 B). The forward
    dispatch is fp8 where the recipe quantises before dispatching: DeepSeek-V3 (report sec. 3.3.2, "we quantize the
    activation before MoE up-projections into FP8 and then apply dispatch components") with DeepEP's fp8
    dispatch (deep_ep Buffer.dispatch takes (fp8 x, per-128 scales)): h bytes + one fp32 scale per 128 values."""
    h = float(scn.model.hidden_size)
    dense = np.where(pc.fp32, 4.0, 2.0) * h
    tr = scn.training
    fp8_dispatch = tr.dispatcher == "deepep" and tr.fp8_recipe_used == "blockwise"
    dispatch = np.where(pc.fp8 & fp8_dispatch, h * (1.0 + 4.0 / 128.0), dense)
    return dispatch, dense


def exchange_s(scn: Scenario, pc: PlanColumns, cal: Calibration, token_bytes: Array) -> Array:
    """Seconds of one dispatch (or combine) of the rank's tokens over the EP group, all peers posted at once.

    alltoall [Torch-a2a, MCore-a2a]: NCCL's all-to-all is a group of send/recv to every peer (ncclGroupStart ..
    ncclGroupEnd), so the peers proceed together: one latency, then the copies for peers in the node over NVLink
    and those for other nodes over the rank's NIC at the same time: max of the two.
    deepep [DeepEP]: internode dispatch sends each token once per destination node over RDMA (to the GPU of the
    same local index there), which forwards it over NVLink to the experts' GPUs: the RDMA side moves tokens x
    token_nodes at DeepEP's published rate in its own convention (comm.deepep_rdma_bandwidth: the own node
    counted, as its test counts it), NVLink the copies for other GPUs of each node; both run at once. Combine
    mirrors it."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    link = ep_link(scn, cal, pc)
    n, k_node = link.n, link.per_node
    tokens = moe_tokens_per_rank(scn, pc) * load_imbalance(scn, pc)
    copies = tokens * moe.top_k
    nvl_a2a = copies * (k_node - 1.0) / n * token_bytes
    nic_a2a = copies * (n - k_node) / n * token_bytes
    nic_s = nic_a2a / link.inter_bandwidth
    nvl = nvl_a2a
    if scn.training.dispatcher == "deepep":
        # DeepEP's own byte count (distinct nodes, the own one included) at its published rate [DeepEP]
        across = n > k_node
        deepep_nic = tokens * token_nodes(scn, cal, pc) * token_bytes / deepep_rdma_bandwidth(scn.cluster, n)
        nic_s = np.where(across, deepep_nic, nic_s)
        nvl = copies * (k_node - 1.0) / k_node * token_bytes
    seconds = np.maximum(nvl / link.intra_bandwidth, nic_s)
    return np.where(n > 1, link.alpha + seconds, 0.0)


def permute_s(scn: Scenario, pc: PlanColumns) -> Array:
    """HBM seconds of one MoE layer's permute + unpermute, forward + backward, per micro-batch [MCore-permute]:
    permute reads the T tokens and writes their T x top_k copies in expert order, unpermute reads the copies and
    writes the weighted sum back: 2 T h (1 + top_k) elements moved forward, the same backward."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    elem = np.where(pc.fp32, 4.0, 2.0)
    tokens = moe_tokens_per_rank(scn, pc) * load_imbalance(scn, pc)
    moved = 4.0 * tokens * scn.model.hidden_size * (1.0 + moe.top_k) * elem
    return moved / (scn.cluster.gpu.hbm_tbps * 1e12)


def dispatch_s(scn: Scenario, pc: PlanColumns, cal: Calibration, token_bytes: Array | None = None) -> Array:
    """Seconds of one MoE layer's token exchanges per micro-batch, forward + backward [MCore-a2a]: dispatch and
    combine over ep forward, their mirror images backward (exchange_s each, dispatch in its dtype), and with
    etp > 1 the all-gather / reduce-scatter of the dispatched tokens over etp (4 in all). `token_bytes`: bytes of
    one token's hidden state on the wire (default: dispatch_bytes_per_token)."""
    moe = scn.model.moe
    if moe is None:
        return np.zeros(len(pc))
    dispatch, combine = dispatch_bytes_per_token(scn, pc)
    if token_bytes is not None:
        dispatch = combine = np.asarray(token_bytes, dtype=np.float64)
    a2a = exchange_s(scn, pc, cal, dispatch) + 3.0 * exchange_s(scn, pc, cal, combine)
    copies = moe_tokens_per_rank(scn, pc) * moe.top_k * load_imbalance(scn, pc)
    etp_link = group_link(scn.cluster, cal, pc.etp, 1.0)
    gather = 4.0 * all_gather_s(etp_link, pc.etp * copies * combine)
    return a2a + gather

