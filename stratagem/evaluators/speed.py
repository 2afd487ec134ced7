"""What scales compute: the kernel path (a training setting with each stack's default), the sustained clock under a
power cap, fp8's GEMM speed-up, and the eager fp8 casts' HBM cost. Each is an explicit term `explain` prints.

Sources:
  [torchao-f8] pytorch/ao torchao/float8: float8_scaling_utils.py hp_tensor_to_float8_dynamic -> float8_utils.py
        tensor_to_amax (torch.max(torch.abs(x))) and float8_tensor.py _ToFloat8ConstrFunc (x.to(float32) * scale,
        then float8_utils.to_fp8_saturated: clamp, .to(float8)); float8_linear.py matmul_with_hp_or_float8_args
        casts the input and the weight forward, the output gradient, and again the input / weight in the layouts
        the weight- and input-gradient GEMMs take. torchtitan docs/float8.md: "--compile.enable: required - fuses
        float8 scaling/casting kernels".
"""

from __future__ import annotations

from typing import NamedTuple

from stratagem.evaluators.calibration import Calibration
from stratagem.spaces.hardware import ClusterSpec
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import KernelPath, StackRecord, stack_record

__all__ = [
    "FP8_LINEAR_SPEEDUP",
    "EAGER_CAST_BYTES",
    "FUSED_CAST_BYTES",
    "SpeedTerm",
    "clock_factor",
    "fp8_linear_speedup",
    "fp8_casts_fused",
    "kernel_efficiency",
    "path_efficiency",
    "compute_factors",
    "speed_terms",
]

# Linear-layer GEMM speed-up of fp8 over bf16 per recipe, casts fused (torch.compile for torchao, Transformer
# Engine's own kernels), derived from end-to-end ratios on Llama-3-8B, 8 x H100, seq 8192, compiled (the linears
# are ~0.6 of that step in this model):
#   tensorwise  torchtitan commit 7a04053 log: 5,760 -> 7,186 tok/s (1.25x e2e) -> 1.5x on the linears;
#               bench/reference tt-8b-8gpu-FSDP+compile -> +float8: 6,667 -> 8,532 (1.28x e2e) agrees.
#   rowwise     same log: 5,760 -> 6,424 (1.12x e2e) -> 1.2x on the linears (per-row scales, slower GEMM).
#   blockwise   DeepSeek-V3-style 1x128 / 128x128 scales (Transformer Engine Float8BlockScaling): between rowwise
#               and tensorwise, 1.3x.
#   mxfp8       torchao MXFP8 on B200 (torchao README, Sept 2025: 1.28x e2e) -> 1.5x on the linears.
# Every value stays below the datasheet fp8/bf16 ratio (2.0 on Hopper/Blackwell), which bounds it again at use.
FP8_LINEAR_SPEEDUP: dict[str, float] = {"tensorwise": 1.5, "rowwise": 1.2, "blockwise": 1.3, "mxfp8": 1.5}

# HBM bytes per element of one dynamic fp8 cast of a bf16 tensor [torchao-f8]. Eager, each op materialises:
# abs (read 2, write 2) + max (read 2) = 6; .to(float32) (read 2, write 4) + * scale (read 4, write 4) + clamp
# (read 4, write 4) + .to(float8) (read 4, write 1) = 27; 33 in all. Fused (compiled / TE): amax read (2) + one
# read-cast-write (2 + 1) = 5, already inside FP8_LINEAR_SPEEDUP's end-to-end derivation.
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
    """fp8 / bf16 speed of the linear-layer GEMMs for the scenario's recipe (FP8_LINEAR_SPEEDUP), bounded by the
    GPU's datasheet fp8 / bf16 ratio; 1 where the GPU has no fp8. Eager casts are a separate cost
    (timing: fp8 casts), not a smaller speed-up."""
    gpu, tr = scn.cluster.gpu, scn.training
    if gpu.peak_tflops_fp8 is None:
        return 1.0
    return float(min(FP8_LINEAR_SPEEDUP[tr.fp8_recipe_used], gpu.peak_tflops_fp8 / gpu.peak_tflops_bf16))


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
        terms.append(SpeedTerm("fp8_linears", fp8_linear_speedup(scn),
                               f"recipe {tr.fp8_recipe_used}, linear-layer GEMMs only (FP8_LINEAR_SPEEDUP), <= "
                               "datasheet fp8/bf16"))
        fused = fp8_casts_fused(scn)
        terms.append(SpeedTerm("fp8_casts", FUSED_CAST_BYTES if fused else EAGER_CAST_BYTES,
                               "bytes/element per cast, " + ("fused into neighbouring kernels" if fused else
                                                              "eager torchao casts, each op over HBM (torchtitan "
                                                              "float8 needs compile to fuse them)")))
    terms.append(SpeedTerm("tp_overlap", 1.0 if tr.tp_overlap else 0.0,
                           f"TP collectives {'pipelined with their GEMMs in tp chunks' if tr.tp_overlap else 'exposed'}"
                           f" ({rec.cite('tp_comm_overlap_default')})"))
    return terms
