"""Scenario YAML loading: preset names, {preset, overrides}, {hf_config}, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stratagem.errors import StratagemError
from stratagem.spaces import MODEL_PRESETS, Plan, load_scenario, scenario_from_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def write(tmp_path: Path, text: str, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_preset_names(tmp_path: Path) -> None:
    scn = load_scenario(write(tmp_path, "model: llama3-70b\ncluster: {gpu: h100-sxm-80g, num_nodes: 8}\n"
                                        "training: {seq_len: 8192, global_batch_size: 512, stack: megatron}\n"
                                        "plan: {dp: 8, tp: 8, zero_stage: 1}\n"))
    assert scn.model == MODEL_PRESETS["llama3-70b"]
    assert scn.cluster.num_gpus == 64 and scn.cluster.gpu.name == "h100-sxm-80g"
    assert scn.cluster.intra_node_gbps == 450 and scn.cluster.inter_node_gbps == 50  # preset link defaults
    assert scn.training.stack == "megatron" and scn.training.optimizer == "adamw"  # default optimizer
    assert scn.plan == Plan(dp=8, tp=8, zero_stage=1)
    assert scn.name == "llama3-70b on 64x h100-sxm-80g"


def test_preset_with_overrides(tmp_path: Path) -> None:
    scn = load_scenario(write(tmp_path, "model: {preset: llama3-8b, num_layers: 16, name: half-8b}\n"
                                        "cluster: {gpu: a100-80g}\n"))
    base = MODEL_PRESETS["llama3-8b"]
    assert scn.model.num_layers == 16 and scn.model.name == "half-8b"
    assert scn.model.hidden_size == base.hidden_size and scn.model.vocab_size == base.vocab_size
    assert scn.plan is None and scn.training.seq_len == 4096


def test_hf_config(tmp_path: Path) -> None:
    cfg = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    scn = load_scenario(write(tmp_path, f"model: {{hf_config: {tmp_path / 'config.json'}}}\n"
                                        "cluster: {gpu: h100-sxm-80g}\n"))
    assert abs(scn.model.num_params() / 7.24e9 - 1) < 0.005  # Mistral 7B
    # A directory holding config.json works too, and overrides apply on top.
    scn = load_scenario(write(tmp_path, f"model: {{hf_config: {tmp_path}, num_layers: 2}}\n"
                                        "cluster: {gpu: h100-sxm-80g}\n", "dir.yaml"))
    assert scn.model.num_layers == 2


SCENARIO_EXAMPLES = sorted(p for p in EXAMPLES.glob("*.yaml") if not p.name.endswith("-calibration.yaml"))
"""The example scenarios (calibration files, `*-calibration.yaml`, sit beside the scenarios that name them)."""


def _same(got: object, value: object, where: str) -> None:
    """The loaded `got` holds what the file wrote as `value` (mappings field by field)."""
    if isinstance(value, dict):
        for key, sub in value.items():
            if key == "preset":  # {preset: NAME, field: value}: the fields are checked, the preset named
                assert getattr(got, "name", sub) == sub or where == "model", f"{where}.preset"
                continue
            _same(getattr(got, key), sub, f"{where}.{key}")
        return
    got = getattr(got, "name", got)  # a preset name -> the spec it names
    if isinstance(got, float) and isinstance(value, str):
        value = float(value)  # YAML 1.1 reads 1.5e13 as a string; the model coerces it
    if isinstance(value, list):
        got = list(got)  # type: ignore[call-overload]
    if isinstance(value, str) and value.endswith((".yaml", ".json")) and got != value:
        got = Path(str(got)).name  # a file named relative to the scenario is stored resolved
    assert got == value, where


@pytest.mark.parametrize("example", SCENARIO_EXAMPLES, ids=lambda p: p.name)
def test_examples_load(example: Path) -> None:
    """Every value the example file sets is the value loaded (a dropped or renamed key fails), and the loaded
    scenario survives a JSON round trip unchanged (what a study stores is what the search ran)."""
    import yaml

    raw = yaml.safe_load(example.read_text())
    scn = load_scenario(example)
    if isinstance(raw["model"], str):
        assert scn.model == MODEL_PRESETS[raw["model"]]
    else:
        _same(scn.model, raw["model"], "model")
    for section in ("cluster", "training", "plan", "search"):
        if raw.get(section) is not None:
            _same(getattr(scn, section), raw[section], section)
    assert scenario_from_dict(scn.model_dump(mode="json")) == scn


def test_problem_hash_ignores_plan() -> None:
    data = {"model": "tiny", "cluster": {"gpu": "cpu", "gpus_per_node": 2}}
    a = scenario_from_dict(data)
    b = scenario_from_dict({**data, "plan": {"dp": 2}})
    c = scenario_from_dict({**data, "training": {"seq_len": 128}})
    assert a.problem_hash() == b.problem_hash() != c.problem_hash()


BAD = [
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: 1\n", ["not valid YAML at line"]),
    ("", ["expected a mapping with model, cluster and training"]),
    ("- 1\n- 2\n", ["expected a mapping"]),
    ("model: llama3-8b\n", ["cluster", "Field required"]),
    ("model: llama3-9b\ncluster: {gpu: h100-sxm-80g}\n", ["model ('llama3-9b') is not a preset", "llama3-8b"]),
    ("model: llama3-8b\ncluster: {gpu: h900}\n", ["cluster.gpu ('h900') is not a preset", "h100-sxm-80g"]),
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: 0}\n",
     ["cluster.num_nodes (0)", "greater than or equal to 1"]),
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g}\ntraining: {seq_len: abc}\n", ["training.seq_len ('abc')"]),
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g}\ntraining: {stack: jax}\n", ["training.stack ('jax')",
                                                                                "'torch', 'megatron'"]),
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g}\nplan: {dp: 8, zero_stage: 5}\n", ["plan.zero_stage (5)"]),
    ("model: {preset: llama3-8b, num_kv_heads: 5}\ncluster: {gpu: h100-sxm-80g}\n",
     ["model.num_kv_heads (5) must divide num_attention_heads (32)"]),
    ("model: {num_layers: 2}\ncluster: {gpu: h100-sxm-80g}\n", ["model.hidden_size", "Field required"]),
    ("model: {hf_config: /nonexistent/config.json}\ncluster: {gpu: h100-sxm-80g}\n",
     ["model.hf_config (/nonexistent/config.json): file not found"]),
    ("model: llama3-8b\ncluster: {gpu: h100-sxm-80g}\nbudget: 3\n", ["budget", "no such key; valid keys: cluster, model, plan, search, training"]),
]


@pytest.mark.parametrize("text,fragments", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_scenario_is_one_line_naming_the_field(tmp_path: Path, text: str, fragments: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(StratagemError) as info:
        load_scenario(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg  # the file is named
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(StratagemError, match="file not found"):
        load_scenario(tmp_path / "nope.yaml")
    with pytest.raises(StratagemError, match="is a directory"):
        load_scenario(tmp_path)


def test_model_errors_have_no_empty_field(tmp_path: Path) -> None:
    path = write(tmp_path, "model: llama3-9b\ncluster: {gpu: h100-sxm-80g}\n")
    with pytest.raises(StratagemError) as info:
        load_scenario(path)
    assert ": :" not in str(info.value)


def test_preset_override_typo_names_model_field(tmp_path: Path) -> None:
    path = write(tmp_path, "model: {preset: llama3-8b, num_layerz: 3}\ncluster: {gpu: h100-sxm-80g}\n")
    with pytest.raises(StratagemError, match=r"model\.num_layerz"):
        load_scenario(path)


def test_hf_config_relative_to_scenario_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = write(tmp_path, "model: {hf_config: config.json}\ncluster: {gpu: cpu, gpus_per_node: 1}\n")
    monkeypatch.chdir(Path("/"))
    assert load_scenario(path).model.num_layers == 2


@pytest.mark.parametrize("case,words", [
    ("dev-zero", "not a regular file"),
    ("fifo", "not a regular file"),
    ("huge", "over the 4 MiB"),
    ("list", "a JSON list, not an object"),
    ("binary", "not a text file"),
])
def test_hf_config_is_bounded_and_named(tmp_path: Path, case: str, words: str) -> None:
    """Issue 12 item 3: special or huge files are refused unread; every message names model.hf_config."""
    import os
    import time

    target = tmp_path / "config.json"
    if case == "dev-zero":
        target = Path("/dev/zero")
    elif case == "fifo":
        os.mkfifo(target)  # opening it for reading would block forever
    elif case == "huge":
        with open(target, "wb") as f:
            f.truncate(5 << 20)  # sparse: 5 MiB
    elif case == "list":
        target.write_text("[1, 2, 3]")
    elif case == "binary":
        target.write_bytes(bytes(range(256)) * 4)
    path = write(tmp_path, f"model: {{hf_config: {target}}}\ncluster: {{gpu: h100-sxm-80g}}\n")
    t0 = time.monotonic()
    with pytest.raises(StratagemError) as e:
        load_scenario(path)
    assert time.monotonic() - t0 < 2
    msg = str(e.value)
    assert "model.hf_config" in msg and words in msg and "\n" not in msg, msg


def test_resolve_plan_fills_the_cluster_with_dp() -> None:
    """The CLI's --plan rule lives in the library (issue 11 item 1): dp fills the cluster unless given."""
    from stratagem.spaces import resolve_plan

    scn = load_scenario(EXAMPLES / "llama3-8b-8xh100.yaml")
    assert resolve_plan(scn, None) == scn.default_plan()
    assert resolve_plan(scn, "tp=2,zero=1").dp == 4
    assert resolve_plan(scn, "tp = 2 pp=2").dp == 2
    assert resolve_plan(scn, "dp=2,tp=2").dp == 2  # given: kept
    assert resolve_plan(scn, "tp=2,dp_replicate=2").dp == 4  # dp_replicate is not dp


def test_gpu_preset_with_overrides(tmp_path: Path) -> None:
    """`gpu: {preset: NAME, field: value}` (the demo's tight per-worker memory budget): the preset's fields and
    link defaults, the given ones changed; a bad one named as cluster.gpu.<field>."""
    scn = load_scenario(write(tmp_path, "model: llama3-8b\ncluster: {gpu: {preset: cpu, hbm_gib: 0.012}, "
                                        "gpus_per_node: 4}\n"))
    assert scn.cluster.gpu.hbm_gib == 0.012 and scn.cluster.gpu.kind == "cpu" and scn.cluster.gpu.name == "cpu"
    assert scn.cluster.intra_node_gbps == 5  # the cpu preset's link default still applies
    with pytest.raises(StratagemError, match=r"cluster\.gpu\.hbm_gib \(-1\)"):
        load_scenario(write(tmp_path, "model: llama3-8b\ncluster: {gpu: {preset: cpu, hbm_gib: -1}}\n", "b.yaml"))
