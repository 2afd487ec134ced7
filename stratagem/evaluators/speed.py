"""What scales compute: the kernel path (a training setting with each stack's default), the sustained clock under a
power cap, fp8's GEMM speed-up, and the eager fp8 casts' HBM cost. Each is an explicit term `explain` prints.

Sources:
  [torchao-f8] pytorch/ao torchao/float8: float8_scaling_utils.py hp_tensor_to_float8_dynamic -> float8_utils.py
        tensor_to_amax (torch.max(torch.abs(x))) and float8_tensor.py _ToFloat8ConstrFunc (x.to(float32) * scale,
        then float8_utils.to_fp8_saturated: clamp, .to(float8)); float8_linear.py matmul_with_hp_or_float8_args
        casts the input and the weight forward, the output gradient, and again the input / weight in the layouts
        the weight- and input-gradient GEMMs take. torchtitan docs/float8.md: "--compile.enable: required - fuses
        float8 scaling/casting kernels".
  [fp8-gemm] An fp8 GEMM runs the same tiles through tensor cores of twice the bf16 rate (H100 / H200 / B200
        datasheets: fp8 dense = 2 x bf16 dense); what it cannot speed up is the fixed part of a GEMM (launch, fill,
        last wave), which the calibration's half_efficiency_gflop describes at bf16: at r times the rate the same
        fixed time is worth r x half_efficiency_gflop of fp8 work. Scales: tensorwise one fp32 per tensor, rowwise
        one per row (both negligible bytes); blockwise 1 x 128 / 128 x 128 (TE Float8BlockScaling, DeepSeek-V3
        report sec. 3.3.1): one fp32 per 128 elements written by the cast; mxfp8 one E8M0 byte per 32 elements (OCP
        MX spec v1.0) - all applied inside the GEMM's main loop or epilogue, so the scale cost is the cast's extra
        bytes.
  [fp8-experts] Which GEMMs an fp8 plan runs in fp8: Megatron's routed experts are TE GroupedLinear modules, run in
        fp8 under fp8_autocast like every TE linear (megatron/core/transformer/moe/experts.py TEGroupedMLP;
        transformer_engine/pytorch/module/grouped_linear.py); torchtitan v0.2.2 converts nn.Linear modules only
        (quantize.linear.float8) and its routed experts (GroupedExperts, torch._grouped_mm) stay bf16 unless
        quantize.grouped_mm.float8.fqns names them (torchtitan/components/quantization/float8.py
        Float8GroupedMMConverter, "prototype"), which stratagem's torchtitan export does not set.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.spaces.hardware import ClusterSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import KernelPath, StackRecord, stack_record

Array = NDArray[np.float64]

__all__ = [
    "FP8_SCALE_BYTES",
    "EAGER_CAST_BYTES",
    "FUSED_CAST_BYTES",
    "SpeedTerm",
    "clock_factor",
    "fp8_linear_speedup",
    "fp8_gemm_size",
    "fp8_cast_bytes",
    "fp8_routed_experts",
    "fp8_casts_fused",
    "kernel_efficiency",
    "path_efficiency",
    "compute_factors",
    "speed_terms",
]


# Bytes of scale per fp8 element the cast writes, per recipe [fp8-gemm].
FP8_SCALE_BYTES: dict[str, float] = {"tensorwise": 0.0, "rowwise": 0.0, "blockwise": 4.0 / 128.0,
                                     "mxfp8": 1.0 / 32.0}

# HBM bytes per element of one dynamic fp8 cast of a bf16 tensor [torchao-f8]. Eager, each op materialises:
# abs (read 2, write 2) + max (read 2) = 6; .to(float32) (read 2, write 4) + * scale (read 4, write 4) + clamp
# (read 4, write 4) + .to(float8) (read 4, write 1) = 27; 33 in all. Fused (compiled / TE): amax read (2) + one
# read-cast-write (2 + 1) = 5; the recipe's scales add FP8_SCALE_BYTES.
EAGER_CAST_BYTES = 33.0
FUSED_CAST_BYTES = 5.0


class SpeedTerm(NamedTuple):
    """One factor that scales compute (or a TP traffic split), with where it comes from."""

    name: str
    value: float
    source: str


def clock_factor(cluster: ClusterSpec) -> float:
    """Sustained clock under a power cap, relative to the datasheet clock: (cap / TDP)^(1/3), at most 1.

    CMOS dynamic power P = a C V^2 f with the supply voltage scaled with the clock under DVFS (V ~ f), so P ~ f^3
    (Weste & Harris, CMOS VLSI Design, 4th ed., sec. 5.1); 1 when no cap is set or the TDP is not known.
    """
    tdp = cluster.gpu.tdp_w
    if tdp is None or cluster.power_cap_w <= 0:
        return 1.0
    return float(min(1.0, (cluster.power_cap_w / tdp) ** (1.0 / 3.0)))


def fp8_casts_fused(scn: Scenario) -> bool:
    """Whether fp8's scaling casts are fused into neighbouring kernels: Transformer Engine always, torchao only
    under torch.compile [torchao-f8]."""
    return scn.training.kernel_path in ("compiled", "fused")


def fp8_linear_speedup(scn: Scenario) -> float:
    """fp8 / bf16 rate of the GEMMs an fp8 plan converts, large GEMMs: the GPU's datasheet fp8 / bf16 dense peak
    ratio [fp8-gemm]; 1 where the GPU has no fp8. Smaller GEMMs gain less (fp8_gemm_size); the casts are their own
    cost (fp8_cast_bytes)."""
    gpu = scn.cluster.gpu
    if gpu.peak_tflops_fp8 is None:
        return 1.0
    return float(gpu.peak_tflops_fp8 / gpu.peak_tflops_bf16)


def fp8_gemm_size(scn: Scenario, cal: Calibration, gflop: Array) -> Array:
    """The small-GEMM efficiency factor of fp8 GEMMs of `gflop` forward GFLOP per layer and micro-batch:
    F / (F + r x half_efficiency_gflop), r = fp8_linear_speedup [fp8-gemm] (bf16's is F / (F + half))."""
    out: Array = gflop / (gflop + fp8_linear_speedup(scn) * cal.half_efficiency_gflop)
    return out


def fp8_cast_bytes(scn: Scenario) -> float:
    """HBM bytes per element of one fp8 cast: fused (EAGER_CAST_BYTES eager torchao) plus the recipe's scales
    (FP8_SCALE_BYTES) [torchao-f8, fp8-gemm]."""
    base = FUSED_CAST_BYTES if fp8_casts_fused(scn) else EAGER_CAST_BYTES
    return base + FP8_SCALE_BYTES[scn.training.fp8_recipe_used]


def fp8_routed_experts(scn: Scenario) -> bool:
    """Whether the stack's fp8 plans run the routed experts in fp8 (StackRecord.fp8_routed_experts) [fp8-experts]."""
    return scn.training.record.fp8_routed_experts


def path_efficiency(rec: StackRecord, path: KernelPath) -> float:
    """Speed of a kernel path of a stack relative to Transformer Engine's fused kernels (1.0): eager = the stack's
    eager efficiency (StackRecord.kernel_efficiency), compiled = that x the stack's compile gain, fused = 1."""
    if path == "fused":
        return 1.0
    return rec.kernel_efficiency * (rec.compile_gain if path == "compiled" else 1.0)


def kernel_efficiency(scn: Scenario, cal: Calibration | None = None) -> float:
    """Factor of the scenario's kernel path on the calibration's efficiencies: relative to the fused reference for
    the published constants; relative to the path a calibration measured (Calibration.kernel_path, on the torch
    stack the calibration runs: launch/runners/calibrate.py node_scenario) when it records one: x1 on that path."""
    tr = scn.training
    own = path_efficiency(tr.record, tr.kernel_path)
    if cal is None or cal.kernel_path is None:
        return own
    return own / path_efficiency(stack_record("torch"), cal.kernel_path)


def compute_factors(scn: Scenario, cal: Calibration | None = None) -> dict[str, float]:
    """The factors that multiply every compute rate (matmul and attention): the kernel path (relative to what the
    calibration measured) and the sustained clock under the cluster's power cap."""
    return {"kernels": kernel_efficiency(scn, cal), "clock": clock_factor(scn.cluster)}


def speed_terms(scn: Scenario, precision: str = "bf16", cal: Calibration | None = None) -> list[SpeedTerm]:
    """Every factor that scales compute for this scenario (and fp8's terms for fp8 plans), with its source, for
    `explain`."""
    tr, cl = scn.training, scn.cluster
    rec = tr.record
    f = compute_factors(scn, cal)
    cap = f"{cl.power_cap_w:g} W cap" if cl.power_cap_w > 0 else "no cap"
    default = "" if tr.kernels is not None else " (stack default)"
    paths = {"eager": f"eager ops, {rec.name} efficiency {rec.kernel_efficiency:g} ({rec.cite('kernel_efficiency')})",
             "compiled": f"torch.compile: eager {rec.kernel_efficiency:g} x compile {rec.compile_gain:g} "
                         f"({rec.cite('compile_gain')})",
             "fused": "Transformer Engine fused kernels: the reference (1.0)"}
    measured = ""
    if cal is not None and cal.kernel_path is not None:
        measured = (f"; efficiencies measured on this node on the {cal.kernel_path} path (stratagem calibrate): "
                    f"x{f['kernels']:.3g} relative to it")
    terms = [
        SpeedTerm("kernels", f["kernels"], f"training.kernels = {tr.kernel_path}{default}: {paths[tr.kernel_path]}; "
                                           f"{rec.name} runs {', '.join(rec.kernel_paths)}{measured}"),
        SpeedTerm("clock", f["clock"], f"{cl.gpu.name} TDP {cl.gpu.tdp_w or 'n/a'} W, {cap}: (cap/TDP)^(1/3)"),
    ]
    if precision == "fp8":
        experts = "" if scn.model.moe is None else (
            "; routed experts in fp8" if fp8_routed_experts(scn) else
            "; routed experts stay bf16 (torchtitan converts them only with quantize.grouped_mm.float8.fqns)")
        terms.append(SpeedTerm("fp8_linears", fp8_linear_speedup(scn),
                               f"recipe {tr.fp8_recipe_used}: datasheet fp8/bf16 on large GEMMs, less on small ones "
                               f"(the fixed part of a GEMM does not speed up){experts}"))
        fused = fp8_casts_fused(scn)
        terms.append(SpeedTerm("fp8_casts", fp8_cast_bytes(scn),
                               "bytes/element per cast (scales included), " + (
                                   "fused into neighbouring kernels" if fused else
                                   "eager torchao casts, each op over HBM (torchtitan float8 needs compile to fuse "
                                   "them)")))
    terms.append(SpeedTerm("tp_overlap", 1.0 if tr.tp_overlap else 0.0,
                           f"TP collectives {'pipelined with their GEMMs in tp chunks' if tr.tp_overlap else 'exposed'}"
                           f" ({rec.cite('tp_comm_overlap_default')})"))
    return terms
