"""Accelerators and clusters: `GPUSpec`, `ClusterSpec` and their presets."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratagem.errors import StratagemError
from stratagem.spaces import bounds as B

__all__ = ["GPUSpec", "ClusterSpec", "GPU_PRESETS", "NVLS_EFFICIENCY", "gpu_preset", "cluster_preset"]

_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # NaN/inf: one line, not a result

Dtype = Literal["fp32", "tf32", "bf16", "fp8"]


class GPUSpec(BaseModel):
    """One accelerator: memory, dense peak throughput per dtype, memory bandwidth."""

    model_config = _FROZEN

    name: str
    """Display name."""
    hbm_gib: float = Field(gt=0, le=B.MAX_HBM_GIB)
    """Device memory usable by the framework, GiB."""
    peak_tflops_fp32: float = Field(ge=B.MIN_TFLOPS, le=B.MAX_TFLOPS)
    """Dense FP32 (non-tensor-core) peak, TFLOP/s."""
    peak_tflops_tf32: float = Field(ge=B.MIN_TFLOPS, le=B.MAX_TFLOPS)
    """Dense TF32 tensor-core peak, TFLOP/s."""
    peak_tflops_bf16: float = Field(ge=B.MIN_TFLOPS, le=B.MAX_TFLOPS)
    """Dense BF16 tensor-core peak, TFLOP/s."""
    peak_tflops_fp8: float | None = Field(default=None, ge=B.MIN_TFLOPS, le=B.MAX_TFLOPS)
    """Dense FP8 tensor-core peak, TFLOP/s; None where the hardware has no FP8."""
    hbm_tbps: float = Field(ge=B.MIN_TBPS, le=B.MAX_TBPS)
    """Memory bandwidth, TB/s."""
    kind: Literal["gpu", "cpu"] = "gpu"
    """gpu for accelerators; cpu for this machine's gloo workers (real CPU runs)."""
    tdp_w: float | None = Field(default=None, gt=0, le=B.MAX_WATTS)
    """Datasheet board power (TDP), W: the power at which the peaks above are reached; None = not stated."""

    def peak_tflops(self, dtype: Dtype) -> float:
        """Dense peak for `dtype`; fp8 falls back to bf16 where the hardware lacks it."""
        value = {
            "fp32": self.peak_tflops_fp32,
            "tf32": self.peak_tflops_tf32,
            "bf16": self.peak_tflops_bf16,
            "fp8": self.peak_tflops_fp8 or self.peak_tflops_bf16,
        }[dtype]
        return value


# Datasheet values, dense (no 2:4 sparsity). hbm_gib is the capacity nvidia-smi reports in MiB / 1024.
#   A100: NVIDIA A100 Tensor Core GPU datasheet (2021), SXM column.
#   H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column (sparse figures halved).
#   H100 96GB: the H100 SXM5 96GB HBM3 part used in Meta's Grand Teton (torchtitan benchmarks), same SM count.
#   H200: NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column.
#   B200: NVIDIA HGX B200 datasheet (2024), per GPU (sparse figures halved).
#   MI300X: AMD Instinct MI300X datasheet (2023).
#   L40S: NVIDIA L40S datasheet (2023) (sparse figures halved).
#   tdp_w: the same datasheets' max board power (A100 SXM 400 W, H100/H200 SXM 700 W, B200 1000 W, MI300X 750 W,
#   L40S 350 W).
#   cpu: this machine's cores under gloo; peaks are rough placeholders that real-run calibration replaces.
GPU_PRESETS: dict[str, GPUSpec] = {
    g.name: g
    for g in [
        GPUSpec(name="a100-40g", hbm_gib=40.0, peak_tflops_fp32=19.5, peak_tflops_tf32=156,
                peak_tflops_bf16=312, hbm_tbps=1.555, tdp_w=400),
        GPUSpec(name="a100-80g", hbm_gib=80.0, peak_tflops_fp32=19.5, peak_tflops_tf32=156,
                peak_tflops_bf16=312, hbm_tbps=2.039, tdp_w=400),
        GPUSpec(name="h100-sxm-80g", hbm_gib=79.6, peak_tflops_fp32=66.9, peak_tflops_tf32=494.5,
                peak_tflops_bf16=989.5, peak_tflops_fp8=1979, hbm_tbps=3.35, tdp_w=700),
        GPUSpec(name="h100-96g", hbm_gib=95.0, peak_tflops_fp32=66.9, peak_tflops_tf32=494.5,
                peak_tflops_bf16=989.5, peak_tflops_fp8=1979, hbm_tbps=3.35, tdp_w=700),
        GPUSpec(name="h200", hbm_gib=140.4, peak_tflops_fp32=66.9, peak_tflops_tf32=494.5,
                peak_tflops_bf16=989.5, peak_tflops_fp8=1979, hbm_tbps=4.8, tdp_w=700),
        GPUSpec(name="b200", hbm_gib=179.1, peak_tflops_fp32=75, peak_tflops_tf32=1100,
                peak_tflops_bf16=2250, peak_tflops_fp8=4500, hbm_tbps=8.0, tdp_w=1000),
        GPUSpec(name="mi300x", hbm_gib=192.0, peak_tflops_fp32=163.4, peak_tflops_tf32=653.7,
                peak_tflops_bf16=1307.4, peak_tflops_fp8=2614.9, hbm_tbps=5.3, tdp_w=750),
        GPUSpec(name="l40s", hbm_gib=45.0, peak_tflops_fp32=91.6, peak_tflops_tf32=183,
                peak_tflops_bf16=362, peak_tflops_fp8=733, hbm_tbps=0.864, tdp_w=350),
        GPUSpec(name="cpu", hbm_gib=4.0, peak_tflops_fp32=0.05, peak_tflops_tf32=0.05,
                peak_tflops_bf16=0.05, hbm_tbps=0.02, kind="cpu"),
    ]
}

# Per-GPU link defaults by preset, GB/s one direction: NVLink 3 = 300 (A100), NVLink 4 = 450 (H100/H200),
# NVLink 5 = 900 (B200), Infinity Fabric 7 x 64 = 448 (MI300X), PCIe 4 x16 = 32 (L40S);
# network: one 400 Gb/s NIC per GPU = 50 GB/s (H100/H200/B200/MI300X), 200 Gb/s = 25 GB/s (A100, L40S).
_LINKS: dict[str, tuple[float, float]] = {
    "a100-40g": (300, 25), "a100-80g": (300, 25), "h100-sxm-80g": (450, 50), "h100-96g": (450, 50),
    "h200": (450, 50), "b200": (900, 50), "mi300x": (448, 50), "l40s": (32, 25), "cpu": (5, 1),
}
# NVLink SHARP (NVLS): the NVSwitch of these parts reduces in the switch, and NCCL runs all-reduce with its NVLS
# (one node) or NVLS-tree (several nodes) algorithm at nvlsEfficiency of the NVLink bandwidth per direction, twice
# over because the all-reduce pipelines its reduce and its broadcast (nccl src/graph/tuning.cc: nvlsEfficiency
# Hopper 0.85, Blackwell 0.74; "AllReduce pipelines two operations": intraBw *= 2). Ampere's NVSwitch has no NVLS
# (efficiency 0): NCCL picks a ring or a tree there.
NVLS_EFFICIENCY: dict[str, float] = {"h100-sxm-80g": 0.85, "h100-96g": 0.85, "h200": 0.85, "b200": 0.74}
# Illustrative on-demand prices, USD per GPU-hour; set your own in the scenario.
_PRICE: dict[str, float] = {
    "a100-40g": 1.3, "a100-80g": 1.8, "h100-sxm-80g": 2.5, "h100-96g": 2.7, "h200": 3.2,
    "b200": 5.0, "mi300x": 2.5, "l40s": 1.0, "cpu": 0.0,
}
# Node MTBF: Llama 3 (Dubey et al. 2024, sec. 3.3.4) saw 419 unexpected interruptions in 54 days on 16,384
# H100s in 2,048 nodes: job MTBF = 54*24/419 = 3.09 h, so per-node MTBF = 3.09 h * 2048 = ~6,300 h.
_NODE_MTBF_H = 6300.0


def gpu_preset(name: str) -> GPUSpec:
    """The GPU preset called `name`, or an error listing the presets."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise StratagemError(
            f"cluster.gpu ({name!r}) is not a preset; use one of {', '.join(GPU_PRESETS)} or give the fields"
        ) from None


class ClusterSpec(BaseModel):
    """A homogeneous cluster: nodes of identical GPUs, one network, one checkpoint store."""

    model_config = _FROZEN

    gpu: GPUSpec
    """The accelerator (a preset name in YAML, or the fields)."""
    num_nodes: int = Field(default=1, ge=1, le=B.MAX_NODES)
    """Nodes in the job."""
    gpus_per_node: int = Field(default=8, ge=1, le=B.MAX_GPUS_PER_NODE)
    """GPUs per node (one NVLink/xGMI domain)."""
    intra_node_gbps: float = Field(default=0.0, ge=0, le=B.MAX_LINK_GBPS)
    """Per-GPU intra-node bandwidth, GB/s one direction (0 = the GPU preset's default)."""
    inter_node_gbps: float = Field(default=0.0, ge=0, le=B.MAX_LINK_GBPS)
    """Per-GPU network bandwidth, GB/s one direction (0 = the GPU preset's default)."""
    intra_node_latency_us: float = Field(default=3.0, ge=0, le=B.MAX_LATENCY_US)
    """Per-hop latency inside a node, microseconds (alpha of the alpha-beta model)."""
    inter_node_latency_us: float = Field(default=15.0, ge=0, le=B.MAX_LATENCY_US)
    """Per-hop latency across nodes, microseconds."""
    storage_write_gbps: float = Field(default=100.0, ge=B.MIN_STORAGE_GBPS, le=B.MAX_STORAGE_GBPS)
    """Aggregate checkpoint storage write bandwidth, GB/s."""
    storage_read_gbps: float = Field(default=200.0, ge=B.MIN_STORAGE_GBPS, le=B.MAX_STORAGE_GBPS)
    """Aggregate checkpoint storage read bandwidth, GB/s."""
    node_storage_gbps: float = Field(default=5.0, ge=B.MIN_STORAGE_GBPS, le=B.MAX_STORAGE_GBPS)
    """Per-node bandwidth to the checkpoint store, GB/s."""
    node_mtbf_hours: float = Field(default=_NODE_MTBF_H, ge=B.MIN_MTBF_HOURS, le=B.MAX_MTBF_HOURS)
    """Mean time between failures of one node, hours (default from Llama 3's 54-day run)."""
    power_cap_w: float = Field(default=0.0, ge=0, le=B.MAX_WATTS)
    """Power limit each GPU runs under, W (nvidia-smi -pl); 0 = the GPU's datasheet TDP. A cap below the TDP
    lowers the sustained clock and with it every compute term (evaluators.timing.clock_factor)."""
    price_per_gpu_hour: float = Field(default=0.0, ge=0, le=B.MAX_PRICE)
    """USD per GPU-hour (left out or null: the GPU preset's illustrative default; a negative price is refused)."""
    calibration: str | None = None
    """Calibration file written by `stratagem calibrate` on this hardware (relative to the scenario file);
    None = the published constants. Not part of the problem hash."""
    calibration_device_mismatch: Literal["refuse", "allow"] = "refuse"
    """A calibration fitted on another GPU preset than `gpu`: refuse (default) or allow with a warning
    (evaluators/calibration_file.py check_device). Not part of the problem hash."""

    @model_validator(mode="before")
    @classmethod
    def _resolve(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            gpu = data.get("gpu")
            preset = None
            if isinstance(gpu, str):
                data["gpu"] = gpu_preset(gpu)
            elif isinstance(gpu, dict) and "preset" in gpu:
                # {preset: NAME, field: value...}: a preset with fields changed (e.g. a tighter memory budget);
                # merged fields, so that pydantic names a bad one as cluster.gpu.<field>
                preset = gpu_preset(str(gpu["preset"]))
                data["gpu"] = {**preset.model_dump(), **{k: v for k, v in gpu.items() if k != "preset"}}
            name = data["gpu"].name if isinstance(data.get("gpu"), GPUSpec) else preset.name if preset else None
            if name in _LINKS:
                intra, inter = _LINKS[name]
                if not data.get("intra_node_gbps"):
                    data["intra_node_gbps"] = intra
                if not data.get("inter_node_gbps"):
                    data["inter_node_gbps"] = inter
            if data.get("price_per_gpu_hour") is None:
                data["price_per_gpu_hour"] = _PRICE.get(name or "", 0.0)
        return data

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        if self.intra_node_gbps <= 0 or self.inter_node_gbps <= 0:
            raise StratagemError(
                f"cluster ({self.gpu.name}): intra_node_gbps and inter_node_gbps must be set (> 0) "
                "for a GPU that is not a preset"
            )
        if self.num_gpus > B.MAX_GPUS:
            raise StratagemError(f"num_nodes x gpus_per_node ({self.num_nodes} x {self.gpus_per_node} = "
                                 f"{self.num_gpus:,} GPUs): at most {B.MAX_GPUS:,} in one job (spaces/bounds.py)")
        return self

    @property
    def num_gpus(self) -> int:
        """GPUs in the cluster (nodes x GPUs per node)."""
        return self.num_nodes * self.gpus_per_node


def cluster_preset(gpu: str, num_gpus: int, gpus_per_node: int = 8) -> ClusterSpec:
    """A cluster of `num_gpus` preset GPUs, `gpus_per_node` to a node."""
    per_node = min(gpus_per_node, num_gpus)
    if num_gpus % per_node:
        raise StratagemError(f"cluster: {num_gpus} GPUs do not fill nodes of {per_node}")
    return ClusterSpec(gpu=gpu_preset(gpu), num_nodes=num_gpus // per_node, gpus_per_node=per_node)
