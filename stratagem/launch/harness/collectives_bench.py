"""Measure this node's collective bus bandwidths and GEMM efficiencies as tables (evaluators.rate_tables), the way
nccl-tests and cuBLAS benchmarks do, through torch.distributed (gloo on CPU, NCCL on GPUs: the same code path).

    tables = measure_rate_tables(world=2, ranks=(2,), sizes=(4096, 65536), shapes=((1, 64, 64, 64),),
                                 peak_tflops=0.05, dtype="fp32", source="...")

Collectives [NCCL-T] (nccl-tests src/common.cu BenchTime and doc/PERFORMANCE.md): for each group size n (the
first n ranks, dist.new_group) and message size S: `warmup` untimed calls, then `iters` calls timed together
after a barrier; t = elapsed / iters, the slowest rank's; algbw = S / t, busbw = algbw x f(n) (rate_tables.
bus_factor). S is the gathered output (all_gather_into_tensor), the input (reduce_scatter_tensor), the buffer
(all_reduce) and each rank's send buffer (all_to_all_single), as nccl-tests' `size` column.

GEMMs (cuBLAS benchmarks' convention): a (m x k) @ (k x n) matmul timed over `iters` calls on every rank at once
(each rank's share of the node, as in training), 2 m n k / t over the datasheet peak, the slowest rank's. A
grouped GEMM of g groups runs torch._grouped_mm where torch has it on the device, else one matmul per group
(torchtitan's experts for-loop path, torchtitan/models/moe/moe.py _run_experts_for_loop).

Placement: each group is measured where it lies. `stratagem calibrate` launches ranks on one node (launch.runners.
local): every group is `intra_node`. Under a multi-node launcher (torchrun, srun) this module's command measures
both, as nccl-tests is run inside a node and across nodes:

    torchrun --nnodes N --nproc-per-node K ... -m stratagem.launch.harness.collectives_bench --gpu h100-sxm-80g \
        --out rates.yaml          # then: stratagem calibrate scenario.yaml --rate-tables rates.yaml

`intra_node` groups are the first n ranks of the first node (n = 2, 4, ... up to its ranks); `inter_node` groups
are the first rank of each of the first m nodes (m = 2, 4, ... up to N): one rank per node, the placement the
shipped defaults' inter-node curves describe (evaluators/rate_defaults.py) and a data-parallel group across nodes
has under tensor parallelism inside them. A group over whole nodes reads the curve of its size, clamped to the
largest measured (rate_tables: flat beyond the measured group sizes). A rank's node is its launcher's node rank
(torchrun's GROUP_RANK, Slurm's SLURM_NODEID), else its host name.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stratagem.evaluators.rate_tables import (
    COLLECTIVES,
    CollectiveTable,
    GemmTable,
    Placement,
    RateTables,
    bus_factor,
)
from stratagem.spaces.hardware import Dtype

__all__ = ["Group", "bench_rank", "measure_rate_tables", "tables_from_samples", "group_sizes", "node_grid",
           "node_groups", "read_rate_tables", "rate_tables_yaml", "main"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
Group = tuple[Placement, tuple[int, ...]]
"""A measured group: its placement and its ranks (global ranks, increasing)."""


def _sync(torch: Any) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _max_over_ranks(torch: Any, dist: Any, value: float, device: Any) -> float:
    """The slowest rank's time (nccl-tests reports the time every rank saw; the collective ends with the last)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(torch: Any, dist: Any, group: Any, fn: Any, warmup: int, iters: int) -> float:
    """Seconds per call of fn() after `warmup` calls, the calls timed together after a barrier."""
    for _ in range(warmup):
        fn()
    _sync(torch)
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(torch)
    return (time.perf_counter() - t0) / iters


def _collective_call(torch: Any, dist: Any, name: str, n: int, size: int, group: Any, device: Any) -> Any:
    """A closure running collective `name` once on a message of `size` bytes (nccl-tests' size convention)."""
    elems = max(n, size // 4 // n * n)  # float32, divisible by n
    # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; older torch has the old names
    if name == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out, inp = torch.empty(elems, device=device), torch.ones(elems // n, device=device)
        return lambda: gather(out, inp, group=group)
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out, inp = torch.empty(elems // n, device=device), torch.ones(elems, device=device)
        return lambda: scatter(out, inp, group=group)
    if name == "all_reduce":
        buf = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(buf, group=group)
    out, inp = torch.empty(elems, device=device), torch.ones(elems, device=device)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _gemm_call(torch: Any, shape: tuple[int, int, int, int], dtype: Any, device: Any) -> Any:
    """A closure running one (grouped) GEMM of shape (groups, m, n, k)."""
    g, m, n, k = shape
    a = torch.randn(g * m, k, dtype=dtype, device=device)
    b = torch.randn(g, k, n, dtype=dtype, device=device)
    if g == 1:
        return lambda: torch.matmul(a, b[0])
    offs = torch.arange(m, g * m + 1, m, dtype=torch.int32, device=device)
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None and device.type == "cuda":
        return lambda: grouped(a, b, offs=offs)
    chunks = a.split(m)
    return lambda: [torch.matmul(chunks[i], b[i]) for i in range(g)]


def bench_rank(rank: int, groups: Sequence[Group], sizes: Sequence[int], shapes: Sequence[tuple[int, int, int, int]],
               dtype: str, warmup: int, iters: int, local_rank: int | None = None) -> dict[str, Any]:
    """On every rank (run_local, or a multi-node launcher): the collectives of each group at each message size, then
    the GEMMs; returns {"collectives": {(name, placement, n, size): busbw GB/s}, "gemms": {shape: seconds}}, the
    slowest rank's figures (identical on every rank). `local_rank` picks the GPU (default: `rank`, one node)."""
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank if local_rank is None else local_rank}") if on_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    coll: dict[tuple[str, str, int, int], float] = {}
    for placement, members in groups:
        n = len(members)
        # every rank calls new_group, in the same order
        group = dist.new_group(list(members)) if n < world else dist.group.WORLD
        if rank in members:
            for name in COLLECTIVES:
                for size in sizes:
                    call = _collective_call(torch, dist, name, n, size, group, device)
                    coll[(name, placement, n, size)] = _timed(torch, dist, group, call, warmup, iters)
        dist.barrier()
    keys = [(c, placement, len(members), s) for placement, members in groups for c in COLLECTIVES for s in sizes]
    slowest = {key: _max_over_ranks(torch, dist, coll.get(key, 0.0), device) for key in keys}
    busbw = {key: s / t * float(bus_factor(c, n)) / 1e9 for key, t in slowest.items() for c, _, n, s in [key]}
    gemms: dict[tuple[int, int, int, int], float] = {}
    for shape in shapes:
        call = _gemm_call(torch, shape, getattr(torch, _DTYPES[dtype]), device)
        gemms[shape] = _max_over_ranks(torch, dist, _timed(torch, dist, None, call, warmup, iters), device)
    return {"collectives": busbw, "gemms": gemms}


def tables_from_samples(samples: dict[str, Any], peak_tflops: float, dtype: str, source: str) -> RateTables:
    """RateTables from bench_rank's figures: one curve per (collective, placement, n), GEMM efficiency
    2 g m n k / t / peak per kind (dense: one group; grouped: several)."""
    curves: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for (name, placement, n, size), bw in samples["collectives"].items():
        curves.setdefault((name, placement, n), []).append((float(size), bw))
    collectives = tuple(CollectiveTable(collective=name, ranks=n, placement=placement,  # type: ignore[arg-type]
                                        sizes_bytes=tuple(s for s, _ in sorted(pts)),
                                        busbw_gbps=tuple(b for _, b in sorted(pts)))
                        for (name, placement, n), pts in sorted(curves.items()))
    gemms = []
    for kind in ("dense", "grouped"):
        pts = sorted(((2.0 * g * m * n * k, (g, m, n, k), 2.0 * g * m * n * k / t / (peak_tflops * 1e12))
                      for (g, m, n, k), t in samples["gemms"].items() if (g == 1) == (kind == "dense")))
        if pts:
            gemms.append(GemmTable(kind=kind, shapes=tuple(s for _, s, _ in pts),
                                   efficiency=tuple(e for _, _, e in pts), peak_tflops=peak_tflops, dtype=dtype))
    return RateTables(source=source, collectives=collectives, gemms=tuple(gemms))


# The grid `stratagem calibrate` measures. GPUs: nccl-tests' usual sweep (-b 64K -e 1G -f 4) and square bf16 GEMMs
# 1K-8K as cuBLAS benchmarks run them, grouped: 8 experts' GEMMs of a Mixtral-like expert (h 4096, ffn 14336 / 8
# rows per expert 512-4096); CPU ranks: sizes and shapes small enough for a few seconds on gloo.
GPU_SIZES = tuple(1 << e for e in range(16, 31, 2))
CPU_SIZES = tuple(1 << e for e in range(12, 21, 2))
GPU_SHAPES = ((1, 1024, 1024, 1024), (1, 2048, 2048, 2048), (1, 4096, 4096, 4096), (1, 8192, 8192, 8192),
              (8, 512, 1792, 4096), (8, 2048, 1792, 4096), (8, 4096, 1792, 4096))
CPU_SHAPES = ((1, 64, 64, 64), (1, 128, 128, 128), (1, 256, 256, 256), (4, 32, 128, 128), (4, 128, 128, 128))


def group_sizes(world: int) -> tuple[int, ...]:
    """Group sizes measured on `world` ranks: the powers of two from 2 below it, and `world` itself."""
    return tuple(sorted({*(1 << e for e in range(1, world.bit_length()) if (1 << e) < world), world})) \
        if world >= 2 else ()


def node_groups(nodes: Sequence[str]) -> tuple[Group, ...]:
    """The groups measured on ranks whose nodes are `nodes` (one entry per global rank, ranks of a node
    consecutive, as torchrun and srun number them): intra_node, the first n ranks of the first node for n in
    group_sizes(its ranks); inter_node, the first rank of each of the first m nodes for m in group_sizes(node
    count)."""
    order = list(dict.fromkeys(nodes))
    members = {node: [r for r, x in enumerate(nodes) if x == node] for node in order}
    per_node = {len(m) for m in members.values()}
    if len(per_node) != 1 or any(m != list(range(m[0], m[0] + len(m))) for m in members.values()):
        raise ValueError(f"every node needs the same number of consecutive ranks (got {[members[n] for n in order]})")
    k = per_node.pop()
    first = members[order[0]]
    intra: list[Group] = [("intra_node", tuple(first[:n])) for n in group_sizes(k)]
    inter: list[Group] = [("inter_node", tuple(members[node][0] for node in order[:m])) for m in group_sizes(len(order))]
    return (*intra, *inter)


def node_grid(on_gpu: bool) -> tuple[tuple[int, ...], tuple[tuple[int, int, int, int], ...], Dtype]:
    """(message sizes, GEMM shapes, dtype) `stratagem calibrate` measures on a GPU node or on CPU ranks."""
    return (GPU_SIZES, GPU_SHAPES, "bf16") if on_gpu else (CPU_SIZES, CPU_SHAPES, "fp32")


def measure_rate_tables(world: int, ranks: Sequence[int], sizes: Sequence[int],
                        shapes: Sequence[tuple[int, int, int, int]], peak_tflops: float, dtype: str, source: str,
                        warmup: int = 2, iters: int = 5, timeout_s: float = 300.0) -> RateTables:
    """Launch `world` local ranks (launch.runners.local.run_local), measure, and return the node's tables
    (intra_node curves: every rank is on this node)."""
    from stratagem.launch.runners.local import run_local

    bad = [n for n in ranks if not 2 <= n <= world]
    if bad:
        raise ValueError(f"group sizes {bad} must lie in 2..{world}")
    groups: tuple[Group, ...] = tuple(("intra_node", tuple(range(n))) for n in ranks)
    per_rank = run_local(bench_rank, world, args=(groups, tuple(sizes), tuple(shapes), dtype, warmup, iters),
                         timeout_s=timeout_s, pg_timeout_s=min(120.0, timeout_s))
    return tables_from_samples(per_rank[0], peak_tflops, dtype, source)


RATES_FORMAT = "stratagem-rate-tables/1"


def rate_tables_yaml(tables: RateTables) -> str:
    """The file `main` writes and `read_rate_tables` reads."""
    import yaml

    return yaml.safe_dump({"format": RATES_FORMAT, "rate_tables": tables.model_dump(mode="json")}, sort_keys=False)


def read_rate_tables(path: str | Path) -> RateTables:
    """A rate-tables file written by this module's command; errors are one line naming the file and the field."""
    from pydantic import ValidationError

    from stratagem.errors import StratagemError
    from stratagem.files import read_yaml

    hint = "write it with `torchrun ... -m stratagem.launch.harness.collectives_bench --out FILE`"
    data = read_yaml(path, "rate tables", hint=hint)
    if not isinstance(data, dict) or data.get("format") != RATES_FORMAT:
        raise StratagemError(f"rate tables ({path}): format is not {RATES_FORMAT}; {hint}")
    try:
        return RateTables.model_validate(data.get("rate_tables"))
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"rate tables ({path}): rate_tables.{loc}: {err['msg']}") from None


def _node_id() -> str:
    """This rank's node: the launcher's node rank (torchrun GROUP_RANK, Slurm SLURM_NODEID), else the host name."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return socket.gethostname()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m stratagem.launch.harness.collectives_bench",
                                 description="Measure collective bus bandwidths inside a node and across nodes, and "
                                             "GEMM efficiencies, on every rank a launcher (torchrun, srun) started; "
                                             "rank 0 writes the tables for `stratagem calibrate --rate-tables`.")
    ap.add_argument("--gpu", required=True, help="GPU preset of the nodes (the scenario's cluster.gpu): its "
                                                 "datasheet peak is the GEMM efficiencies' reference")
    ap.add_argument("--out", required=True, type=Path, help="rate-tables file to write (on rank 0's node)")
    ap.add_argument("--force", action="store_true", help="replace --out even if stratagem did not write it")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls per measurement")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per measurement")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run under a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; rank 0 writes
    --out. 0 on success, 2 for a user mistake (one line on rank 0; every rank exits)."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from stratagem.errors import StratagemError
    from stratagem.files import check_owned, write_owned
    from stratagem.spaces.hardware import gpu_preset

    args = _parse(argv)
    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = [""]
        if rank == 0:
            try:
                if args.warmup < 0 or args.iters < 1:
                    raise StratagemError(f"--warmup ({args.warmup}) must be >= 0 and --iters ({args.iters}) >= 1")
                gpu_preset(args.gpu)
                check_owned(args.out, args.force, "--out")
            except StratagemError as e:
                problem = [str(e)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            if rank == 0:
                print(f"error: {problem[0]}", flush=True)
            return 2
        nodes: list[str] = [""] * world
        dist.all_gather_object(nodes, _node_id())
        groups = node_groups(nodes)
        sizes, shapes, dtype = node_grid(on_gpu)
        samples = bench_rank(rank, groups, sizes, shapes, dtype, args.warmup, args.iters,
                             local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        if rank == 0:
            gpu = gpu_preset(args.gpu)
            when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            count = len(dict.fromkeys(nodes))
            source = (f"stratagem collectives bench on {count} node(s) x {world // count} {gpu.name} rank(s), "
                      f"{'nccl' if on_gpu else 'gloo'}, torch {torch.__version__}, {when}")
            tables = tables_from_samples(samples, gpu.peak_tflops(dtype), dtype, source)
            write_owned(args.out, rate_tables_yaml(tables), args.force, "--out")
            print(f"wrote {args.out}: {len(tables.collectives)} collective curves "
                  f"({sum(c.placement == 'inter_node' for c in tables.collectives)} across nodes), "
                  f"{len(tables.gemms)} GEMM table(s)", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
