"""Measured rate tables: interpolation, nccl-tests' bus-bandwidth conventions, and the comm terms reading them
(unchanged bit for bit without tables)."""

import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from stratagem.evaluators import Calibration
from stratagem.evaluators.comm import all_gather_s, all_reduce_s, all_to_all_s, group_link, reduce_scatter_s
from stratagem.evaluators.rate_defaults import published_tables
from stratagem.evaluators.rate_tables import (
    LAYER_GEMMS,
    CollectiveTable,
    GemmTable,
    RateTables,
    bus_factor,
    collective_busbw_gbps,
    collective_time_s,
    gemm_efficiency,
    gemm_size,
    joined,
    tables_summary,
)
from stratagem.evaluators.speed import compute_factors
from stratagem.evaluators.step_terms import step_context
from stratagem.spaces import ClusterSpec, Plan, PlanColumns, gpu_preset, load_scenario

ROOT = Path(__file__).resolve().parents[2]

H100 = gpu_preset("h100-sxm-80g")


def curve(coll: str, n: int, placement: str = "intra_node", bws: tuple[float, ...] = (10.0, 100.0)) -> CollectiveTable:
    return CollectiveTable(collective=coll, ranks=n, placement=placement, sizes_bytes=(1e3, 1e6)[:len(bws)],
                           busbw_gbps=bws)


def test_bus_factor_is_nccl_tests() -> None:
    # nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n
    assert float(bus_factor("all_reduce", 8)) == pytest.approx(2 * 7 / 8)
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert float(bus_factor(c, 4)) == pytest.approx(3 / 4)


def test_busbw_linear_in_log_size_flat_beyond() -> None:
    t = RateTables(source="t", collectives=(curve("all_gather", 2),))
    mid = math.sqrt(1e3 * 1e6)  # halfway in log size
    bw = collective_busbw_gbps(t, "all_gather", np.array([2.0, 2.0, 2.0, 2.0]), True,
                               np.array([1e3, mid, 1e6, 1e9]))
    np.testing.assert_allclose(bw, [10.0, 55.0, 100.0, 100.0])
    assert collective_busbw_gbps(t, "all_gather", 2.0, True, 1.0) == pytest.approx(10.0)  # flat below


def test_busbw_interpolates_group_size_in_log_and_nearest_beyond() -> None:
    t = RateTables(source="t", collectives=(curve("all_reduce", 2, bws=(10.0,)), curve("all_reduce", 8, bws=(40.0,))))
    bw = collective_busbw_gbps(t, "all_reduce", np.array([2.0, 4.0, 8.0, 64.0]), True, 1e3)
    np.testing.assert_allclose(bw, [10.0, 25.0, 40.0, 40.0])  # log2 4 is halfway between log2 2 and log2 8


def test_placement_without_curve_is_nan() -> None:
    t = RateTables(source="t", collectives=(curve("all_gather", 2),))
    bw = collective_busbw_gbps(t, "all_gather", np.array([2.0, 2.0]), np.array([True, False]), 1e3)
    assert bw[0] == pytest.approx(10.0) and np.isnan(bw[1])
    assert np.isnan(collective_busbw_gbps(t, "all_to_all", 2.0, True, 1e3))


def test_gemm_efficiency_log_flops() -> None:
    g = GemmTable(kind="dense", shapes=((1, 10, 10, 10), (1, 100, 100, 100)), efficiency=(0.2, 0.8), peak_tflops=1.0)
    t = RateTables(source="t", gemms=(g,))
    mid = math.sqrt(2e3 * 2e6)
    np.testing.assert_allclose(gemm_efficiency(t, "dense", np.array([1.0, mid, 1e12])), [0.2, 0.5, 0.8])
    assert gemm_efficiency(t, "grouped", 1e6) is None
    assert gemm_efficiency(None, "dense", 1e6) is None
    assert tables_summary(t) == ["dense GEMM efficiency: measured at 2 shape(s) (bf16, vs 1 TFLOP/s)"]


def test_tables_refuse_bad_points() -> None:
    with pytest.raises(ValidationError, match="increasing"):
        CollectiveTable(collective="all_gather", ranks=2, placement="intra_node", sizes_bytes=(2.0, 1.0),
                        busbw_gbps=(1.0, 1.0))
    with pytest.raises(ValidationError, match="one value per point"):
        CollectiveTable(collective="all_gather", ranks=2, placement="intra_node", sizes_bytes=(1.0,),
                        busbw_gbps=(1.0, 2.0))
    with pytest.raises(ValidationError, match="same"):
        RateTables(source="t", collectives=(curve("all_gather", 2), curve("all_gather", 2)))


def _times(cal: Calibration, cluster: ClusterSpec, n: np.ndarray, stride: np.ndarray,
           size: np.ndarray) -> list[np.ndarray]:
    link = group_link(cluster, cal, n, stride)
    return [all_gather_s(link, size), reduce_scatter_s(link, size), all_reduce_s(link, size), all_to_all_s(link, size)]


def test_no_tables_bit_for_bit_and_measured_time_where_covered() -> None:
    cluster = ClusterSpec(gpu=H100, num_nodes=4, gpus_per_node=8)
    n = np.array([1.0, 2.0, 8.0, 16.0, 32.0])
    stride = np.array([1.0, 1.0, 1.0, 8.0, 1.0])
    size = np.array([1e6, 1e7, 1e8, 1e9, 1e9])
    base = Calibration()
    before = _times(base, cluster, n, stride, size)
    # without tables the formula's own array comes back (the same object: bit for bit)
    assert group_link(cluster, base, n, stride).tables is None
    formula = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert collective_time_s(None, "all_gather", n, True, size, formula) is formula
    curves = tuple(curve(c, r, bws=(50.0, 50.0)) for c in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
                   for r in (2, 8))
    cal = base.model_copy(update={"rate_tables": RateTables(source="t", collectives=curves)})
    after = _times(cal, cluster, n, stride, size)
    inside = np.array([True, True, True, False, False])  # 16 ranks 8 apart and 32 ranks span nodes
    for name, b, a in zip(("all_gather", "reduce_scatter", "all_reduce", "all_to_all"), before, after, strict=True):
        assert a[0] == 0.0  # one rank: nothing to move
        expect = size * bus_factor(name, n) / 50e9  # t = S x f(n) / busbw [NCCL-T]
        np.testing.assert_allclose(a[1:3], expect[1:3], rtol=1e-12)  # measured where covered (inside a node)
        np.testing.assert_array_equal(a[~inside], b[~inside])  # across nodes: no curve, the formula as it was


def test_gemm_size_without_table_is_the_formula_bit_for_bit() -> None:
    f = np.array([1e6, 3.3e9, 7.7e12])
    half = Calibration().half_efficiency_gflop * 1e9
    assert gemm_size(None, "dense", f, LAYER_GEMMS, 0.62, half).tobytes() == (f / (f + half)).tobytes()
    # a table of the other kind leaves this kind on the formula
    grouped = RateTables(source="t", gemms=(GemmTable(kind="grouped", shapes=((2, 8, 8, 8),), efficiency=(0.1,),
                                                      peak_tflops=1.0),))
    assert gemm_size(grouped, "dense", f, LAYER_GEMMS, 0.62, half).tobytes() == (f / (f + half)).tobytes()


def test_step_context_runs_gemms_at_the_measured_efficiency() -> None:
    scn = load_scenario(ROOT / "examples" / "llama3-8b-8xh100.yaml")
    pc = PlanColumns.from_plans([Plan(tp=2, dp=4, micro_batch_size=1)])
    base = Calibration()
    eff = 0.4
    table = GemmTable(kind="dense", shapes=((1, 1024, 1024, 1024),), efficiency=(eff,), peak_tflops=989.0)
    cal = base.model_copy(update={"rate_tables": RateTables(source="t", gemms=(table,))})
    plain, read = step_context(scn, pc, base), step_context(scn, pc, cal)
    f = compute_factors(scn, cal)
    peak = scn.cluster.gpu.peak_tflops("bf16") * 1e12
    np.testing.assert_allclose(read.mm_rate, peak * eff * f["kernels"] * f["clock"], rtol=1e-12)
    assert not np.allclose(plain.mm_rate, read.mm_rate)


def test_published_tables_read_back_as_the_formulas() -> None:
    # the shipped curves are hardware.py's links through comm.py: read back, the formula's time at each size
    cluster = ClusterSpec(gpu=H100, num_nodes=4, gpus_per_node=8)
    cal = Calibration()
    sizes = (1e4, 1e6, 1e8)
    shipped = published_tables(cluster, cal, (2, 4, 8), sizes)
    assert {(c.ranks, c.placement) for c in shipped.collectives} == {
        (2, "intra_node"), (4, "intra_node"), (8, "intra_node"), (2, "inter_node"), (4, "inter_node")}
    assert "hardware.py h100-sxm-80g" in shipped.source
    with_tables = cal.model_copy(update={"rate_tables": shipped})
    size = np.array(sizes)
    for n, stride in ((8.0, 1.0), (4.0, 8.0)):
        plain, read = _times(cal, cluster, n, stride, size), _times(with_tables, cluster, n, stride, size)
        for a, b in zip(plain, read, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-9)


def test_joined_keeps_the_first_tables_and_adds_what_they_lack() -> None:
    def curve(coll: str, n: int, placement: str, bw: float) -> CollectiveTable:
        return CollectiveTable(collective=coll, ranks=n, placement=placement, sizes_bytes=(1e6,), busbw_gbps=(bw,))

    gemm = GemmTable(kind="dense", shapes=((1, 64, 64, 64),), efficiency=(0.5,), peak_tflops=1.0, dtype="fp32")
    node = RateTables(source="node", collectives=(curve("all_reduce", 2, "intra_node", 10.0),), gemms=(gemm,))
    nodes = RateTables(source="nodes", collectives=(curve("all_reduce", 2, "intra_node", 99.0),
                                                    curve("all_reduce", 16, "inter_node", 40.0)),
                       gemms=(gemm.model_copy(update={"efficiency": (0.9,)}),
                              gemm.model_copy(update={"kind": "grouped"})))
    both = joined(node, nodes)
    assert both.source == "node; nodes"
    assert [(c.ranks, c.placement, c.busbw_gbps) for c in both.collectives] == [(2, "intra_node", (10.0,)),
                                                                                (16, "inter_node", (40.0,))]
    assert [(g.kind, g.efficiency) for g in both.gemms] == [("dense", (0.5,)), ("grouped", (0.5,))]
