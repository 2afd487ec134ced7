"""Collective communication: alpha-beta cost of ring collectives on a two-level topology (NVLink in a node,
network across nodes), vectorised over plans.

Sources:
  [NCCL-T] nccl-tests PERFORMANCE.md: for all-gather / reduce-scatter over n ranks each rank moves (n-1)/n of
           the total size S, all-reduce 2(n-1)/n S; bus bandwidth busbw = S/t x (n-1)/n (x2 for all-reduce).
  [Ring]   Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
           sec. 3: ring all-gather t = (n-1) alpha + (n-1)/n S beta; all-reduce = reduce-scatter + all-gather.
  [Hockney] Hockney 1994: point-to-point t = alpha + S beta.
  [NCCL-tune] nccl src/graph/tuning.cc ncclTopoTuneModel: NCCL predicts each algorithm's time (latency + bytes /
           bus bandwidth) and runs the fastest (enqueue.cc topoGetAlgoInfo). All-reduce: Ring (2(n-1) steps);
           Tree (latency 2 ((n/nodes - 1) intraLat + log2(nodes) interLat), the ring's bandwidth); NVLS on one node
           (NVSwitch in-switch reduction, latency intraLat, bus bandwidth 2 x nvlsEfficiency x NVLink: "AllReduce
           pipelines two operations"); NVLS-tree across nodes (latency intraLat + 2 log2(nodes) interLat, bus
           bandwidth min(2 x nvlsEfficiency x NVLink, network, twice the network on 2 nodes)).
  [DeepEP-bw] deepseek-ai/DeepEP README (commit 567632d, normal kernels after Tencent's #130): H800 with one CX7
           400 Gb/s NIC (~50 GB/s) per GPU, DeepSeek-V3 routing, internode dispatch / combine "bottleneck bandwidth"
           EP16 43 / 43, EP32 58 / 57, EP64 51 / 50 GB/s (RDMA); the bytes are tests/test_internode.py's: tokens x
           distinct destination nodes (the own node included) x hidden bytes.

Topology. Every stack places ranks with tensor parallel innermost, then context, data (experts inside it),
pipeline outermost (Megatron parallel_state, torchtitan's device mesh, nanotron ParallelContext). A group
of n ranks whose neighbours are `stride` ranks apart has k = min(n, max(1, G / stride)) members per node of
G GPUs. Inside one node (k = n) a ring runs on NVLink; across nodes NCCL runs one ring per channel and each
node boundary of a channel takes its own NIC, so the ring's bandwidth is min(NVLink, k x NIC) [NCCL-T; this
reproduces the playbook's measured busbw trend, tests/evaluators/test_comm.py].

Measured tables. With Calibration.rate_tables (`stratagem calibrate`), all-gather, reduce-scatter, all-reduce and
all-to-all take the measured bus bandwidth's time, size x f(n) / busbw [NCCL-T], where a curve covers the group's
placement (evaluators.rate_tables); the formulas above elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.rate_tables import RateTables, collective_time_s
from stratagem.spaces.hardware import NVLS_EFFICIENCY, ClusterSpec

__all__ = [
    "Link",
    "group_link",
    "all_gather_s",
    "reduce_scatter_s",
    "all_reduce_s",
    "p2p_s",
    "all_to_all_s",
    "bus_bandwidth_gbps",
    "DEEPEP_INTERNODE_GBPS",
    "deepep_rdma_bandwidth",
]

Array = NDArray[np.float64]
GB = 1e9


@dataclass(frozen=True)
class Link:
    """The link a group's ring runs on, per plan: size n, bandwidth (bytes/s) and latency per ring step (s)."""

    n: Array
    """Ranks in the group."""
    bandwidth: Array
    """Achieved ring bandwidth per rank, bytes/s."""
    alpha: Array
    """Latency per ring step, s: link latency + NCCL's per-step software cost."""
    intra_bandwidth: Array
    """NVLink bandwidth per rank (bytes/s), for the intra-node share of all-to-all."""
    inter_bandwidth: Array
    """Network bandwidth per rank (bytes/s), for the inter-node share of all-to-all."""
    per_node: Array
    """Group members per node (k)."""
    nvls: Array
    """NCCL's NVLS efficiency of the GPU's NVSwitch (spaces.hardware.NVLS_EFFICIENCY; 0: no NVLS)."""
    tables: RateTables | None = None
    """Measured bus bandwidths (Calibration.rate_tables): a collective they cover takes its measured time."""
    inside: NDArray[np.bool_] | bool = True
    """Whether the group lies inside one node (which measured curves apply)."""


def group_link(cluster: ClusterSpec, cal: Calibration, n: Array | float, stride: Array | float) -> Link:
    """The ring link of groups of `n` ranks spaced `stride` ranks apart (see the module docstring)."""
    n_arr = np.asarray(n, dtype=np.float64)
    g = float(cluster.gpus_per_node)
    k = np.minimum(n_arr, np.maximum(1.0, g / np.asarray(stride, dtype=np.float64)))
    inside = (k >= n_arr) | (cluster.num_nodes == 1)
    intra = cluster.intra_node_gbps * GB * cal.link_efficiency
    inter = cluster.inter_node_gbps * GB * cal.link_efficiency
    step = cal.collective_step_us * 1e-6
    bandwidth = np.where(inside, intra, np.minimum(intra, k * inter))
    alpha = np.where(inside, cluster.intra_node_latency_us * 1e-6, cluster.inter_node_latency_us * 1e-6) + step
    full = np.ones_like(n_arr)
    return Link(n=n_arr, bandwidth=bandwidth, alpha=alpha, intra_bandwidth=intra * full,
                inter_bandwidth=np.where(inside, intra, inter) * full, per_node=k,
                nvls=NVLS_EFFICIENCY.get(cluster.gpu.name, 0.0) * full, tables=cal.rate_tables, inside=inside)


def all_gather_s(link: Link, size: Array | float) -> Array:
    """Ring all-gather of a `size`-byte result: (n-1) alpha + (n-1)/n size / B [Ring sec. 3]; 0 when n = 1."""
    n = link.n
    ring = np.where(n > 1, (n - 1) * link.alpha + (n - 1) / n * size / link.bandwidth, 0.0)
    return collective_time_s(link.tables, "all_gather", n, link.inside, size, ring)


def reduce_scatter_s(link: Link, size: Array | float) -> Array:
    """Ring reduce-scatter of a `size`-byte input: same cost as all-gather [Ring sec. 3]."""
    return collective_time_s(link.tables, "reduce_scatter", link.n, link.inside, size, all_gather_s(link, size))


def all_reduce_s(link: Link, size: Array | float) -> Array:
    """All-reduce of `size` bytes as NCCL runs it: the fastest of its algorithms [NCCL-tune], each priced as
    latency + 2(n-1)/n size / bus bandwidth (nccl-tests' bus bandwidth convention [NCCL-T]).

    ring       reduce-scatter + all-gather: 2(n-1) alpha, the ring's bandwidth B [Ring sec. 3];
    NVLS       one node of an NVLS GPU: one alpha, 2 x nvls x B (the switch reduces; reduce and broadcast
               pipelined);
    NVLS-tree  several nodes of an NVLS GPU: (1 + 2 log2 nodes) alpha, min(2 x nvls x NVLink, k NICs, doubled on
               2 nodes);
    tree       several nodes otherwise: 2 (k - 1 + log2 nodes) alpha, the ring's bandwidth."""
    n, k = link.n, link.per_node
    nodes = np.maximum(1.0, n / k)
    bus = 2.0 * (n - 1) / np.maximum(n, 1.0) * size
    ring = 2.0 * all_gather_s(link, size)
    nvls_bw = 2.0 * link.nvls * link.intra_bandwidth
    one_node = link.alpha + bus / np.maximum(nvls_bw, 1e-30)
    network = k * link.inter_bandwidth * np.where(nodes <= 2.0, 2.0, 1.0)
    nvls_tree = (1.0 + 2.0 * np.log2(nodes)) * link.alpha + bus / np.maximum(np.minimum(nvls_bw, network), 1e-30)
    tree = 2.0 * (k - 1.0 + np.log2(nodes)) * link.alpha + bus / link.bandwidth
    other = np.where(nodes > 1.0, np.where(link.nvls > 0, nvls_tree, tree), np.where(link.nvls > 0, one_node, ring))
    best = np.where(n > 1, np.minimum(ring, other), 0.0)
    return collective_time_s(link.tables, "all_reduce", n, link.inside, size, best)


def p2p_s(link: Link, size: Array | float, active: NDArray[np.bool_] | bool = True) -> Array:
    """One point-to-point send: alpha + size / B [Hockney]; 0 where not `active`."""
    return np.where(active, link.alpha + size / link.bandwidth, 0.0)


def all_to_all_s(link: Link, size: Array | float) -> Array:
    """All-to-all where each rank holds `size` bytes: (n-1) alpha + the share for peers in the node over
    NVLink + the share for other nodes over the rank's own NIC (pairwise exchange)."""
    n, k = link.n, link.per_node
    local = (k - 1) / n * size / link.intra_bandwidth
    remote = (n - k) / n * size / link.inter_bandwidth
    pairwise = np.where(n > 1, (n - 1) * link.alpha + local + remote, 0.0)
    return collective_time_s(link.tables, "all_to_all", n, link.inside, size, pairwise)


def bus_bandwidth_gbps(
    cluster: ClusterSpec, cal: Calibration, collective: str, n: int, size_bytes: float,
) -> float:
    """Predicted nccl-tests bus bandwidth (GB/s) of `collective` over the first `n` GPUs of `cluster` [NCCL-T]."""
    link = group_link(cluster, cal, float(n), 1.0)
    if collective == "all_reduce":
        t = float(all_reduce_s(link, size_bytes))
        return size_bytes / t * 2 * (n - 1) / n / GB
    if collective in ("all_gather", "reduce_scatter"):
        t = float(all_gather_s(link, size_bytes))
        return size_bytes / t * (n - 1) / n / GB
    raise ValueError(f"unknown collective {collective!r}")


# DeepEP's published internode rate per EP size, dispatch and combine averaged, GB/s on 50 GB/s NICs [DeepEP-bw].
DEEPEP_INTERNODE_GBPS: dict[int, float] = {16: 43.0, 32: 57.5, 64: 50.5}
DEEPEP_LINE_GBPS = 50.0  # the CX7 400 Gb/s NIC those figures were measured on


def deepep_rdma_bandwidth(cluster: ClusterSpec, ep: Array) -> Array:
    """Bytes/s of DeepEP's internode dispatch or combine per GPU in its own convention (tokens x distinct nodes, its
    own included, x hidden bytes per second) [DeepEP-bw]: the published rate at the EP size (interpolated in log2
    ep, the nearest beyond the table) as a fraction of the line rate it was measured at, times this cluster's NIC."""
    sizes = np.log2(np.array(sorted(DEEPEP_INTERNODE_GBPS), dtype=np.float64))
    rates = np.array([DEEPEP_INTERNODE_GBPS[k] for k in sorted(DEEPEP_INTERNODE_GBPS)]) / DEEPEP_LINE_GBPS
    share = np.interp(np.log2(np.maximum(np.asarray(ep, dtype=np.float64), 1.0)), sizes, rates)
    out: Array = share * cluster.inter_node_gbps * GB
    return out
