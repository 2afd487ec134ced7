"""Collective communication: alpha-beta cost of ring collectives on a two-level topology (NVLink in a node,
network across nodes), vectorised over plans.

Sources:
  [NCCL-T] nccl-tests PERFORMANCE.md: for all-gather / reduce-scatter over n ranks each rank moves (n-1)/n of
           the total size S, all-reduce 2(n-1)/n S; bus bandwidth busbw = S/t x (n-1)/n (x2 for all-reduce).
  [Ring]   Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations in MPICH",
           sec. 3: ring all-gather t = (n-1) alpha + (n-1)/n S beta; all-reduce = reduce-scatter + all-gather.
  [Hockney] Hockney 1994: point-to-point t = alpha + S beta.

Topology. Every stack places ranks with tensor parallel innermost, then context, data (experts inside it),
pipeline outermost (Megatron parallel_state, torchtitan's device mesh, nanotron ParallelContext). A group
of n ranks whose neighbours are `stride` ranks apart has k = min(n, max(1, G / stride)) members per node of
G GPUs. Inside one node (k = n) a ring runs on NVLink; across nodes NCCL runs one ring per channel and each
node boundary of a channel takes its own NIC, so the ring's bandwidth is min(NVLink, k x NIC) [NCCL-T; this
reproduces the playbook's measured busbw trend, tests/evaluators/test_comm.py].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.spaces.hardware import ClusterSpec

__all__ = [
    "Link",
    "group_link",
    "all_gather_s",
    "reduce_scatter_s",
    "all_reduce_s",
    "p2p_s",
    "all_to_all_s",
    "bus_bandwidth_gbps",
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
                inter_bandwidth=np.where(inside, intra, inter) * full, per_node=k)


def all_gather_s(link: Link, size: Array | float) -> Array:
    """Ring all-gather of a `size`-byte result: (n-1) alpha + (n-1)/n size / B [Ring sec. 3]; 0 when n = 1."""
    n = link.n
    return np.where(n > 1, (n - 1) * link.alpha + (n - 1) / n * size / link.bandwidth, 0.0)


def reduce_scatter_s(link: Link, size: Array | float) -> Array:
    """Ring reduce-scatter of a `size`-byte input: same cost as all-gather [Ring sec. 3]."""
    return all_gather_s(link, size)


def all_reduce_s(link: Link, size: Array | float) -> Array:
    """Ring all-reduce = reduce-scatter + all-gather: 2(n-1) alpha + 2(n-1)/n size / B [Ring sec. 3]."""
    return 2.0 * all_gather_s(link, size)


def p2p_s(link: Link, size: Array | float, active: NDArray[np.bool_] | bool = True) -> Array:
    """One point-to-point send: alpha + size / B [Hockney]; 0 where not `active`."""
    return np.where(active, link.alpha + size / link.bandwidth, 0.0)


def all_to_all_s(link: Link, size: Array | float) -> Array:
    """All-to-all where each rank holds `size` bytes: (n-1) alpha + the share for peers in the node over
    NVLink + the share for other nodes over the rank's own NIC (pairwise exchange)."""
    n, k = link.n, link.per_node
    local = (k - 1) / n * size / link.intra_bandwidth
    remote = (n - k) / n * size / link.inter_bandwidth
    return np.where(n > 1, (n - 1) * link.alpha + local + remote, 0.0)


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
