"""The shipped collective tables: the published per-hardware figures the comm terms already use, as tables in the
measured tables' form (evaluators.rate_tables), so a measurement can be set beside them.

The figures are spaces/hardware.py's per-GPU link bandwidths and latencies (NVLink generation and NIC per preset,
sourced there) through evaluators.comm's collectives, whose link efficiency and per-step cost were fitted on the
Ultra-Scale Playbook's nccl-tests bus bandwidths (evaluators.calibration: link_efficiency, collective_step_us).
Tables read back give the formulas' times at the sampled sizes (tests/evaluators/test_rate_tables.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.comm import all_gather_s, all_reduce_s, all_to_all_s, group_link, reduce_scatter_s
from stratagem.evaluators.rate_tables import COLLECTIVES, CollectiveTable, Placement, RateTables, bus_factor
from stratagem.spaces.hardware import ClusterSpec

__all__ = ["published_tables", "published_busbw_gbps"]

_TIME = {"all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s, "all_reduce": all_reduce_s,
         "all_to_all": all_to_all_s}


def published_busbw_gbps(cluster: ClusterSpec, cal: Calibration, collective: str, n: int, stride: float,
                         sizes: Sequence[float]) -> tuple[float, ...]:
    """nccl-tests bus bandwidth (GB/s) the formulas give `collective` over `n` ranks `stride` apart at each size:
    size x f(n) / t [NCCL-T], t from evaluators.comm with `cal` stripped of any measured tables."""
    formula = cal.model_copy(update={"rate_tables": None})
    link = group_link(cluster, formula, float(n), stride)
    size = np.asarray(sizes, dtype=np.float64)
    t = _TIME[collective](link, size)
    return tuple(float(v) for v in size * bus_factor(collective, n) / t / 1e9)


def published_tables(cluster: ClusterSpec, cal: Calibration, ranks: Sequence[int],
                     sizes: Sequence[float]) -> RateTables:
    """Every collective at each group size in `ranks` and each message size, inside a node (groups of consecutive
    ranks, up to the node's GPUs) and across nodes (one rank per node, where the cluster has that many nodes)."""
    curves = []
    placements: tuple[tuple[Placement, float], ...] = (("intra_node", 1.0), ("inter_node", float(cluster.gpus_per_node)))
    for n in ranks:
        for placement, stride in placements:
            fits = n <= cluster.gpus_per_node if placement == "intra_node" else n <= cluster.num_nodes
            if not fits or n < 2:
                continue
            for coll in COLLECTIVES:
                curves.append(CollectiveTable(collective=coll, ranks=n, placement=placement,
                                              sizes_bytes=tuple(map(float, sizes)),
                                              busbw_gbps=published_busbw_gbps(cluster, cal, coll, n, stride, sizes)))
    source = (f"published defaults: spaces/hardware.py {cluster.gpu.name} links ({cluster.intra_node_gbps:g} GB/s in "
              f"a node, {cluster.inter_node_gbps:g} GB/s network per GPU) through evaluators/comm.py")
    return RateTables(source=source, collectives=tuple(curves))
