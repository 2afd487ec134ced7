"""GPU and cluster specs: datasheet presets, per-preset link defaults, one-line errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stratagem.errors import StratagemError
from stratagem.spaces import GPU_PRESETS, ClusterSpec, GPUSpec, cluster_preset, gpu_preset, scenario_from_dict


@pytest.mark.parametrize("name,hbm,bf16,fp8", [
    # NVIDIA datasheets (dense): A100 312 TF bf16; H100 SXM 989.5 bf16 / 1979 fp8; H200 same silicon, 141 GB;
    # B200 2250 / 4500; AMD MI300X 1307.4 / 2614.9; L40S 362 / 733.
    ("a100-80g", 80.0, 312, None), ("h100-sxm-80g", 79.6, 989.5, 1979), ("h200", 140.4, 989.5, 1979),
    ("b200", 179.1, 2250, 4500), ("mi300x", 192.0, 1307.4, 2614.9), ("l40s", 45.0, 362, 733),
])
def test_gpu_presets(name: str, hbm: float, bf16: float, fp8: float | None) -> None:
    g = gpu_preset(name)
    assert (g.hbm_gib, g.peak_tflops_bf16, g.peak_tflops_fp8) == (hbm, bf16, fp8)
    assert g.peak_tflops("fp8") == (fp8 or bf16)  # no FP8 units: falls back to bf16


def test_every_preset_is_consistent() -> None:
    for g in GPU_PRESETS.values():
        assert g.peak_tflops_fp32 <= g.peak_tflops_tf32 <= g.peak_tflops_bf16
        assert g.peak_tflops_fp8 is None or g.peak_tflops_fp8 >= g.peak_tflops_bf16


def test_cluster_defaults_from_preset() -> None:
    c = cluster_preset("h100-sxm-80g", 64)
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus) == (8, 8, 64)
    assert (c.intra_node_gbps, c.inter_node_gbps) == (450, 50)
    assert c.price_per_gpu_hour > 0
    assert cluster_preset("a100-40g", 4).gpus_per_node == 4
    custom = ClusterSpec(gpu="h100-sxm-80g", intra_node_gbps=300, price_per_gpu_hour=1.0)  # type: ignore[arg-type]
    assert custom.intra_node_gbps == 300 and custom.inter_node_gbps == 50 and custom.price_per_gpu_hour == 1.0


def test_cluster_errors() -> None:
    with pytest.raises(StratagemError, match="12 GPUs do not fill nodes of 8"):
        cluster_preset("h100-sxm-80g", 12)
    with pytest.raises(StratagemError, match=r"cluster.gpu \('h900'\) is not a preset; use one of a100-40g"):
        gpu_preset("h900")
    custom = GPUSpec(name="mystery", hbm_gib=64, peak_tflops_fp32=10, peak_tflops_tf32=100,
                     peak_tflops_bf16=200, hbm_tbps=2)
    with pytest.raises((StratagemError, ValidationError), match="intra_node_gbps and inter_node_gbps must be set"):
        ClusterSpec(gpu=custom)
    ok = ClusterSpec(gpu=custom, intra_node_gbps=100, inter_node_gbps=25)
    assert ok.num_gpus == 8


def test_custom_gpu_in_yaml_names_the_fix() -> None:
    data = {"model": "tiny", "cluster": {"gpu": {"name": "mystery", "hbm_gib": 64, "peak_tflops_fp32": 10,
                                                 "peak_tflops_tf32": 100, "peak_tflops_bf16": 200,
                                                 "hbm_tbps": 2}}}
    with pytest.raises(StratagemError) as info:
        scenario_from_dict(data, source="s.yaml")
    assert "intra_node_gbps and inter_node_gbps must be set" in str(info.value)
    assert "\n" not in str(info.value)
