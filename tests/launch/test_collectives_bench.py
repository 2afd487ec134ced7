"""A real gloo measurement of a tiny rate table on this machine (launch/harness/collectives_bench.py): nccl-tests'
conventions, and the comm terms read what it measured."""

from __future__ import annotations

import numpy as np
import pytest

from stratagem.evaluators import Calibration
from stratagem.evaluators.comm import all_gather_s, all_reduce_s, all_to_all_s, group_link, reduce_scatter_s
from stratagem.evaluators.rate_tables import COLLECTIVES, bus_factor, collective_busbw_gbps
from stratagem.launch.harness.collectives_bench import group_sizes, measure_rate_tables, tables_from_samples
from stratagem.spaces import ClusterSpec, gpu_preset

SIZES = (4096, 65536)
SHAPES = ((1, 32, 32, 32), (1, 128, 128, 128), (2, 32, 64, 64))


def test_group_sizes() -> None:
    assert [group_sizes(w) for w in (1, 2, 3, 4, 8)] == [(), (2,), (2, 3), (2, 4), (2, 4, 8)]


def test_samples_to_tables_by_hand() -> None:
    # 1 MB all-reduce over 4 ranks in 1 ms: algbw 1 GB/s, busbw x 2 x 3/4 [nccl-tests PERFORMANCE.md]
    t = 1e-3
    busbw = 1e6 / t * float(bus_factor("all_reduce", 4)) / 1e9
    tables = tables_from_samples({"collectives": {("all_reduce", 4, 1_000_000): busbw},
                                  "gemms": {(1, 100, 100, 100): 2e-3}}, "intra_node", 1.0, "fp32", "by hand")
    assert tables.collectives[0].busbw_gbps == (1.5,)
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
