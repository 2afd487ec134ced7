"""A real gloo measurement of a tiny rate table on this machine (launch/harness/collectives_bench.py): nccl-tests'
conventions, and the comm terms read what it measured; across two torchrun "nodes" on this host, the curves inside
a node and across nodes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stratagem.errors import StratagemError
from stratagem.evaluators import Calibration
from stratagem.evaluators.comm import all_gather_s, all_reduce_s, all_to_all_s, group_link, reduce_scatter_s
from stratagem.evaluators.rate_tables import COLLECTIVES, bus_factor, collective_busbw_gbps
from stratagem.launch.harness.collectives_bench import (
    group_sizes,
    measure_rate_tables,
    node_groups,
    rate_tables_yaml,
    read_rate_tables,
    tables_from_samples,
)
from stratagem.launch.runners.local import free_port
from stratagem.spaces import ClusterSpec, gpu_preset

SIZES = (4096, 65536)
SHAPES = ((1, 32, 32, 32), (1, 128, 128, 128), (2, 32, 64, 64))


def test_group_sizes() -> None:
    assert [group_sizes(w) for w in (1, 2, 3, 4, 8)] == [(), (2,), (2, 3), (2, 4), (2, 4, 8)]


def test_node_groups_inside_the_first_node_and_over_whole_nodes() -> None:
    assert node_groups(["a", "a", "b", "b"]) == (("intra_node", (0, 1)), ("inter_node", (0, 2)))
    assert node_groups(["x"] * 4) == (("intra_node", (0, 1)), ("intra_node", (0, 1, 2, 3)))
    assert node_groups(["a", "b", "c"]) == (("inter_node", (0, 1)), ("inter_node", (0, 1, 2)))
    groups = node_groups([n for n in "abcd" for _ in range(8)])
    assert groups == (("intra_node", (0, 1)), ("intra_node", (0, 1, 2, 3)), ("intra_node", tuple(range(8))),
                      ("inter_node", (0, 8)), ("inter_node", (0, 8, 16, 24)))  # one rank on each node
    for uneven in (["a", "a", "b"], ["a", "b", "a", "b"]):
        with pytest.raises(ValueError, match="same number of consecutive ranks"):
            node_groups(uneven)


def test_samples_to_tables_by_hand() -> None:
    # 1 MB all-reduce over 4 ranks in 1 ms: algbw 1 GB/s, busbw x 2 x 3/4 [nccl-tests PERFORMANCE.md]
    t = 1e-3
    busbw = 1e6 / t * float(bus_factor("all_reduce", 4)) / 1e9
    tables = tables_from_samples({"collectives": {("all_reduce", "inter_node", 4, 1_000_000): busbw},
                                  "gemms": {(1, 100, 100, 100): 2e-3}}, 1.0, "fp32", "by hand")
    assert tables.collectives[0].busbw_gbps == (1.5,) and tables.collectives[0].placement == "inter_node"
    assert tables.gemms[0].kind == "dense" and tables.gemms[0].efficiency == pytest.approx((2e6 / 2e-3 / 1e12,))


def test_real_gloo_table_is_read_by_the_comm_terms() -> None:
    tables = measure_rate_tables(2, (2,), SIZES, SHAPES, peak_tflops=0.05, dtype="fp32", source="test",
                                 warmup=1, iters=3, timeout_s=120)
    curves = {(c.collective, c.ranks, c.placement): c for c in tables.collectives}
    assert sorted(curves) == sorted((c, 2, "intra_node") for c in COLLECTIVES)
    assert all(c.sizes_bytes == tuple(map(float, SIZES)) and min(c.busbw_gbps) > 0 for c in curves.values())
    kinds = {g.kind: g for g in tables.gemms}
    assert sorted(kinds) == ["dense", "grouped"] and len(kinds["dense"].shapes) == 2
    assert all(e > 0 for g in tables.gemms for e in g.efficiency)

    cluster = ClusterSpec(gpu=gpu_preset("cpu"), num_nodes=1, gpus_per_node=2)
    base = Calibration()
    measured = base.model_copy(update={"rate_tables": tables})
    size = np.array([4096.0, 20000.0, 65536.0])
    plain, read = group_link(cluster, base, 2.0, 1.0), group_link(cluster, measured, 2.0, 1.0)
    for name, fn in (("all_gather", all_gather_s), ("reduce_scatter", reduce_scatter_s),
                     ("all_reduce", all_reduce_s), ("all_to_all", all_to_all_s)):
        bw = collective_busbw_gbps(tables, name, 2.0, True, size)
        expect = size * float(bus_factor(name, 2)) / (bw * 1e9)
        np.testing.assert_allclose(fn(read, size), expect, rtol=1e-12)
        assert not np.allclose(fn(plain, size), fn(read, size))  # the measured rate, not the formula's
        # and at the measured sizes exactly the measured busbw
        np.testing.assert_allclose(bw[[0, 2]], curves[(name, 2, "intra_node")].busbw_gbps, rtol=1e-12)


def test_a_rate_tables_file_reads_back_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    tables = tables_from_samples({"collectives": {("all_gather", "inter_node", 16, 1 << 20): 40.0,
                                                  ("all_gather", "inter_node", 16, 1 << 24): 90.0},
                                  "gemms": {}}, 1.0, "fp32", "by hand")
    path = tmp_path / "rates.yaml"
    path.write_text(rate_tables_yaml(tables))
    assert read_rate_tables(path) == tables
    path.write_text(rate_tables_yaml(tables).replace("90.0", "-90.0"))
    with pytest.raises(StratagemError, match=r"rate tables \(.*rates.yaml\): rate_tables.collectives.0: .*> 0"):
        read_rate_tables(path)
    path.write_text("format: something-else\n")
    with pytest.raises(StratagemError, match="format is not stratagem-rate-tables/1"):
        read_rate_tables(path)


@pytest.mark.integration
def test_two_torchrun_nodes_measure_inside_and_across_nodes(tmp_path: Path) -> None:
    """Two torchrun "nodes" of 2 ranks on this host (each its own TMPDIR, as on a cluster without a shared
    filesystem): one curve per collective inside a node (2 ranks) and across the 2 nodes (one rank on each), read
    back and priced by the comm terms for a group that spans nodes."""
    out = tmp_path / "rates.yaml"
    port = free_port()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    procs = []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
        env = {**os.environ, "TMPDIR": str(tmp_path / f"node{node}"), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2", "--master-addr",
             "127.0.0.1", "--master-port", str(port), "-m", "stratagem.launch.harness.collectives_bench",
             "--gpu", "cpu", "--out", str(out), "--warmup", "1", "--iters", "2"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "4 across nodes" in logs[0]
    tables = read_rate_tables(out)
    assert "2 node(s) x 2 cpu rank(s), gloo" in tables.source
    assert sorted((c.collective, c.ranks, c.placement) for c in tables.collectives) == sorted(
        [(c, 2, "intra_node") for c in COLLECTIVES] + [(c, 2, "inter_node") for c in COLLECTIVES])
    size = np.array([4096.0, 65536.0])
    across = {c.collective: c for c in tables.collectives if c.placement == "inter_node"}
    for name in COLLECTIVES:
        bw = collective_busbw_gbps(tables, name, 2.0, False, size)
        np.testing.assert_allclose(bw, [across[name].busbw_gbps[0], across[name].busbw_gbps[2]], rtol=1e-12)
