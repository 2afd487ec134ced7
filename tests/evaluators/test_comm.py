"""The alpha-beta collective model against its formulas and the playbook's nccl-tests bus bandwidths."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from stratagem.evaluators import DEFAULT_CALIBRATION, Calibration
from stratagem.evaluators.comm import (
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    bus_bandwidth_gbps,
    group_link,
    p2p_s,
    reduce_scatter_s,
)
from stratagem.spaces import ClusterSpec, gpu_preset

REFERENCE = (Path(os.environ.get("STRATAGEM_REFERENCE") or Path(__file__).resolve().parents[2] / "bench" / "reference")
             / "published_cases_calibration.json")
H100 = gpu_preset("h100-sxm-80g")


def cluster(nodes: int) -> ClusterSpec:
    return ClusterSpec(gpu=H100, num_nodes=nodes, gpus_per_node=8)


def test_ring_formulas_by_hand() -> None:
    cal = Calibration(link_efficiency=1.0, collective_step_us=0.0)
    link = group_link(cluster(1), cal, 8.0, 1.0)
    alpha, bw = 3e-6, 450e9  # the cluster's NVLink latency and bandwidth
    size = 1e9
    # [Ring] all-gather: (n-1) alpha + (n-1)/n S / B; reduce-scatter the same; all-reduce twice that.
    assert float(all_gather_s(link, size)) == pytest.approx(7 * alpha + 7 / 8 * size / bw)
    assert float(reduce_scatter_s(link, size)) == float(all_gather_s(link, size))
    assert float(all_reduce_s(link, size)) == pytest.approx(2 * float(all_gather_s(link, size)))
    # [Hockney] point-to-point: alpha + S / B; inactive sends cost nothing.
    assert float(p2p_s(link, size)) == pytest.approx(alpha + size / bw)
    assert float(p2p_s(link, size, False)) == 0.0
    single = group_link(cluster(1), cal, 1.0, 1.0)
    assert float(all_reduce_s(single, size)) == 0.0 and float(all_to_all_s(single, size)) == 0.0


def test_topology_members_per_node_and_bandwidth() -> None:
    cal = Calibration(link_efficiency=1.0)
    cl = cluster(4)  # 32 GPUs, 8 per node, NVLink 450 GB/s, NIC 50 GB/s per GPU
    n = np.array([8.0, 16.0, 4.0, 4.0, 32.0])
    stride = np.array([1.0, 1.0, 8.0, 2.0, 1.0])
    link = group_link(cl, cal, n, stride)
    # tp8 fills a node; 16 contiguous ranks have 8 per node; stride 8 puts one per node; stride 2 -> 4 per node.
    assert list(link.per_node) == [8, 8, 1, 4, 8]
    assert link.bandwidth[0] == pytest.approx(450e9)  # inside a node: NVLink
    assert link.bandwidth[1] == pytest.approx(400e9)  # 8 NICs per node carry the ring: min(450, 8 x 50)
    assert link.bandwidth[2] == pytest.approx(50e9)  # one member per node: one NIC
    assert link.bandwidth[3] == pytest.approx(450e9)  # 4 ranks 2 apart: still inside one node
    assert link.alpha[2] > link.alpha[0]  # network hops cost more latency than NVLink
    # The same traffic is slower when the group leaves the node.
    intra = float(all_reduce_s(group_link(cl, cal, 8.0, 1.0), 1e8))
    inter = float(all_reduce_s(group_link(cl, cal, 8.0, 8.0), 1e8))
    assert inter > 5 * intra


def test_all_to_all_splits_local_and_remote_traffic() -> None:
    cal = Calibration(link_efficiency=1.0, collective_step_us=0.0)
    link = group_link(cluster(2), cal, 16.0, 1.0)
    size = 1.6e9
    expected = 15 * 15e-6 + 7 / 16 * size / 450e9 + 8 / 16 * size / 50e9
    assert float(all_to_all_s(link, size)) == pytest.approx(expected)


def _nccl_cases() -> list[dict]:
    data = json.loads(REFERENCE.read_text())
    return [c for c in data["cases"] if c["kind"] == "collective_bandwidth"]


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_busbw_trend_matches_nccl_tests(kind: str) -> None:
    """nanotron playbook, nccl-tests median busbw of 256 MB on H100 8/node over EFA, 1 to 64 nodes."""
    cases = sorted((c for c in _nccl_cases() if c["id"].split("-")[1] == kind),
                   key=lambda c: c["parallel"]["nodes"])
    assert len(cases) == 7
    measured = [c["measured"]["busbw_GBps"] for c in cases]
    predicted = [bus_bandwidth_gbps(cluster(c["parallel"]["nodes"]), DEFAULT_CALIBRATION, kind,
                                    c["parallel"]["gpus"], c["training"]["message_bytes"]) for c in cases]
    # Bus bandwidth falls as the ring grows across nodes, as measured.
    assert all(b < a for a, b in zip(predicted, predicted[1:], strict=False))
    assert predicted[-1] < predicted[0] / 10
    ratio = np.array(predicted) / np.array(measured)
    if kind == "all_reduce":
        # NCCL runs all-reduce with NVLS/tree algorithms that beat a ring; the ring model is conservative.
        assert np.all((ratio > 0.35) & (ratio < 1.2))
    else:
        assert np.all(np.abs(ratio - 1) < 0.25), ratio
