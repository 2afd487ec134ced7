"""Rotary scaling in every export (issue 26 item 6; launch/export/rope.py): Llama 3.1's "llama3" scaling and
DeepSeek-V3's and gpt-oss's YaRN written where the engine takes them, named where it does not, and a mismatch with
what an engine fixes itself noted, never silent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from test_export_parsers import CASES, megatron_namespace

from stratagem.launch.export import export_plan
from stratagem.launch.export import model_fields as mf
from stratagem.launch.export.rope import (
    TORCHTITAN_LLAMA3_SCALING,
    TORCHTITAN_LLAMA4_SCALING,
    megatron_rope_args,
    torchtitan_rope_comment,
)

LLAMA31 = "llama405b-emb-loss-vpp8"
DEEPSEEK = "deepseek-v3-mla-moe"
LLAMA3_8B = "llama8b-5d"
GPT_OSS = "gpt-oss-window-ep16"  # gpt-oss-120b
SCOUT = "scout-chunked-ep8"  # llama4-scout-17b-16e
tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")


def test_published_scalings() -> None:
    """The values of each checkpoint's config.json "rope_scaling" (model_fields.ROPE_SCALING's comments)."""
    llama = mf.model_constants(CASES[LLAMA31][0].model).rope_scaling
    assert llama == mf.RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
    assert llama.words() == ("rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, "
                             "original_max_position_embeddings 8192)")
    deepseek = mf.model_constants(CASES[DEEPSEEK][0].model).rope_scaling
    assert (deepseek.kind, deepseek.factor, deepseek.original_max_position_embeddings, deepseek.beta_fast,
            deepseek.beta_slow, deepseek.mscale, deepseek.mscale_all_dim) == ("yarn", 40, 4096, 32, 1, 1, 1)
    assert mf.model_constants(CASES[LLAMA3_8B][0].model).rope_scaling is None  # Meta-Llama-3-8B: "rope_scaling": null
    # openai/gpt-oss-120b and -20b config.json: {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
    # "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}
    gpt_oss = CASES[GPT_OSS][0].model
    for name in ("gpt-oss-120b", "gpt-oss-20b"):
        rs = mf.model_constants(gpt_oss.model_copy(update={"name": name})).rope_scaling
        assert rs == mf.RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False), name
        assert rs.words() == ("rope_scaling yarn (factor 32, beta_fast 32, beta_slow 1, "
                              "original_max_position_embeddings 4096, truncate false)")
    assert deepseek.truncate is None and "truncate" not in deepseek.words()  # not in DeepSeek-V3's config.json
    # meta-llama/Llama-4-Scout-17B-16E config.json text_config: {"factor": 16.0, "high_freq_factor": 1.0,
    # "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    scout = mf.model_constants(CASES[SCOUT][0].model).rope_scaling
    assert scout == mf.RopeScaling("llama3", 16.0, 8192, low_freq_factor=1.0, high_freq_factor=1.0)
    assert scout.words() == ("rope_scaling llama3 (factor 16, low_freq_factor 1, high_freq_factor 1, "
                             "original_max_position_embeddings 8192)")
    assert scout == TORCHTITAN_LLAMA4_SCALING  # torchtitan v0.2.2 llama4 RoPEScalingArgs() defaults


def test_megatron_writes_the_scaling_it_takes() -> None:
    ns = megatron_namespace(export_plan(*CASES[LLAMA31], "megatron"))
    assert ns.use_rope_scaling and ns.rope_scaling_factor == 8.0 and ns.position_embedding_type == "rope"
    assert ns.rotary_base == 500000
    ns = megatron_namespace(export_plan(*CASES[DEEPSEEK], "megatron"))
    assert (ns.rope_type, ns.rotary_scaling_factor, ns.mscale, ns.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert not ns.use_rope_scaling
    assert ns.yarn_correction_range_round_to_int  # MLA's YaRN rounds, as DeepSeek-V3's config.json has it
    ns = megatron_namespace(export_plan(*CASES[LLAMA3_8B], "megatron"))
    assert not ns.use_rope_scaling and ns.rope_type is None and ns.rotary_scaling_factor is None
    assert ns.position_embedding_type == "rope"
    for case in (LLAMA31, DEEPSEEK, GPT_OSS):  # Megatron takes every field of these checkpoints': nothing to note
        assert not [n for n in export_plan(*CASES[case], "megatron").approximated if n.field == "model.rope_scaling"]


def test_megatron_writes_gpt_oss_yarn() -> None:
    """gpt-oss's YaRN (attention that is not MLA) as Megatron-LM core_v0.19.0's GPT model takes it: the options
    argument_utils._apply_yarn_config_from_args copies into config.yarn_*, read by GPTModel's YarnRotaryEmbedding;
    "truncate": false as --no-yarn-correction-range-round-to-int."""
    bundle = export_plan(*CASES[GPT_OSS], "megatron")
    ns = megatron_namespace(bundle)
    assert (ns.position_embedding_type, ns.rotary_base, ns.rope_type, ns.use_rope_scaling) == (
        "yarn", 150000, None, False)
    assert (ns.rotary_scaling_factor, ns.yarn_original_max_position_embeddings, ns.yarn_beta_fast,
            ns.yarn_beta_slow) == (32.0, 4096, 32.0, 1.0)
    assert ns.yarn_correction_range_round_to_int is False
    # no mscale in config.json: transformers' attention factor 0.1 ln(32) + 1, Megatron's for mscale 1 / all-dim 0
    assert (ns.mscale, ns.mscale_all_dim) == (1.0, 0.0)


def test_a_scaling_megatron_cannot_take_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama3 scaling whose high_freq_factor Megatron fixes otherwise (Llama 4 Scout's kind) is written with a
    note; YaRN on attention that is not MLA is noted, not written, with multi-token prediction (validate_args
    refuses --position-embedding-type yarn with --mtp-num-layers); "truncate": false on MLA is noted (its
    YarnRotaryEmbedding always rounds)."""
    scn = CASES[LLAMA3_8B][0]
    monkeypatch.setitem(mf.ROPE_SCALING, scn.model.name, mf.RopeScaling("llama3", 16.0, 8192, 1.0, 1.0))
    notes: list = []
    assert megatron_rope_args(scn.model, notes) == ("rope", ["--use-rope-scaling", "--rope-scaling-factor", "16"])
    assert [n.field for n in notes] == ["model.rope_scaling"] and "fixes low_freq_factor" in notes[0].why
    monkeypatch.setitem(mf.ROPE_SCALING, scn.model.name, mf.RopeScaling("yarn", 32.0, 4096, beta_fast=32.0))
    notes = []
    kind, args = megatron_rope_args(scn.model, notes)
    assert kind == "yarn" and "--no-yarn-correction-range-round-to-int" not in args and not notes
    assert megatron_rope_args(scn.model.model_copy(update={"mtp_layers": 1}), notes) == ("rope", [])
    assert [n.field for n in notes] == ["model.rope_scaling"] and "--mtp-num-layers" in notes[0].why
    deepseek = CASES[DEEPSEEK][0].model
    monkeypatch.setitem(mf.ROPE_SCALING, deepseek.name, mf.RopeScaling("yarn", 40.0, 4096, beta_fast=32.0,
                                                                       beta_slow=1.0, truncate=False))
    notes = []
    assert megatron_rope_args(deepseek, notes)[1][:2] == ["--rope-type", "yarn"]
    assert [n.field for n in notes] == ["model.rope_scaling"] and "always rounds" in notes[0].why


def test_torchtitan_says_what_its_llama3_model_applies() -> None:
    text = export_plan(*CASES[LLAMA31], "torchtitan").files["torchtitan.toml"]
    assert "as torchtitan's llama3 model applies it" in text
    text = export_plan(*CASES[LLAMA3_8B], "torchtitan").files["torchtitan.toml"]
    assert f"llama3-8b has no rope scaling, but torchtitan's llama3 model always applies " \
           f"{TORCHTITAN_LLAMA3_SCALING.words()}" in text and "factor 1 (no scaling)" in text
    assert "rope scaling not known for" in torchtitan_rope_comment(CASES[LLAMA3_8B][0].model.model_copy(
        update={"name": "my-model"}))


def test_deepspeed_and_torchrun_name_it() -> None:
    bundle = export_plan(*CASES[LLAMA31], "deepspeed")
    notes = json.loads(bundle.files["ds_config.json"])["_stratagem"]["unexpressed"]
    assert any(n.startswith("model: ") and "rope_scaling llama3 (factor 8" in n for n in notes), notes
    assert "rope_scaling llama3 (factor 8" in bundle.files["README.md"]
    run = export_plan(*CASES[LLAMA31], "torchrun")
    assert [n.field for n in run.approximated] == ["model.rope_scaling"]
    assert "the harness's rotary embedding has none" in run.files["run.sh"]


def test_gpt_oss_exports_carry_its_yarn() -> None:
    """Every target names or carries gpt-oss's YaRN (openai/gpt-oss-120b config.json), none runs plain rotary
    silently: torchtitan's comment (its llama3 model has no YaRN), DeepSpeed's notes, the harness's note, and
    Automodel's model built from the checkpoint's own config.json (its gpt_oss model reads rope_scaling)."""
    words = mf.ROPE_SCALING["gpt-oss-120b"].words()
    text = export_plan(*CASES[GPT_OSS], "torchtitan").files["torchtitan.toml"]
    tomllib.loads(text)
    assert f"gpt-oss-120b has {words}, but torchtitan's llama3 model always applies" in text
    _named_by_deepspeed_harness_and_automodel(GPT_OSS, words, "openai/gpt-oss-120b config.json",
                                              "openai/gpt-oss-120b")


def _named_by_deepspeed_harness_and_automodel(case: str, words: str, source: str, checkpoint: str) -> None:
    """DeepSpeed's notes and README and the harness's note name the scaling `words` (read from `source`);
    Automodel builds the model from the checkpoint's own config.json."""
    bundle = export_plan(*CASES[case], "deepspeed")
    notes = json.loads(bundle.files["ds_config.json"])["_stratagem"]["unexpressed"]
    assert any(n.startswith("model: ") and words in n for n in notes), notes
    assert words in bundle.files["README.md"]
    run = export_plan(*CASES[case], "torchrun")
    name = CASES[case][0].model.name
    assert [n.why for n in run.approximated if n.field == "model.rope_scaling"] == [
        f"{name} has {words} ({source}); the harness's rotary embedding has none: the same step cost, other numerics"]
    doc = yaml.safe_load(export_plan(*CASES[case], "automodel").files["automodel.yaml"])
    assert doc["model"]["config"] == {"_target_": "transformers.AutoConfig.from_pretrained",
                                      "pretrained_model_name_or_path": checkpoint}


@pytest.mark.skipif(importlib.util.find_spec("nemo_automodel") is None,
                    reason="nemo_automodel is not installed (make test installs nemo-automodel==0.7.0 --no-deps)")
def test_automodel_gpt_oss_reads_the_yarn_of_its_config() -> None:
    """NeMo Automodel's gpt_oss model builds its rotary embedding from the config's rope_scaling (read, not
    imported: it needs transformers and CUDA): the export has nothing to write."""
    spec = importlib.util.find_spec("nemo_automodel")
    assert spec is not None and spec.submodule_search_locations
    src = (Path(next(iter(spec.submodule_search_locations))) / "components/models/gpt_oss/model.py").read_text()
    for key in ("original_max_position_embeddings", "factor", "beta_slow", "beta_fast"):
        assert f'rope_scaling.get("{key}"' in src, key


def test_scout_exports_carry_its_scaling() -> None:
    """Llama 4 Scout's llama3 scaling (factor 16, high_freq_factor 1; meta-llama/Llama-4-Scout-17B-16E config.json
    text_config) in every target: Megatron-LM core_v0.19.0 takes the factor (--rope-scaling-factor 16) and fixes
    high_freq_factor at 4, noted with the bands that differ; torchtitan's llama3 model applies factor 8, named in
    its comment; DeepSpeed and the harness name it; Automodel builds from the checkpoint's own config.json."""
    words = mf.ROPE_SCALING["llama4-scout-17b-16e"].words()
    bundle = export_plan(*CASES[SCOUT], "megatron")
    ns = megatron_namespace(bundle)
    assert (ns.position_embedding_type, ns.use_rope_scaling, ns.rope_scaling_factor, ns.rotary_base) == (
        "rope", True, 16.0, 500000)
    assert ns.rope_type is None and ns.rotary_scaling_factor is None
    assert [n.why for n in bundle.approximated if n.field == "model.rope_scaling"] == [
        f"{words}: Megatron fixes low_freq_factor, high_freq_factor and original_max_position_embeddings at 1, 4, "
        "8192 (RotaryEmbedding._apply_scaling): high_freq_factor 4 instead of 1; it keeps the frequencies of "
        "wavelength under 2048 tokens and divides those over 8192 by 16 (between: interpolated), the checkpoint "
        "keeps those under 8192 and divides those over 8192"]
    assert "model.rope_scaling: " + words in bundle.files["megatron.sh"]
    # the rotary peculiarity the Megatron export already models: chunked attention, noted (not the NoPE layers)
    assert [n.field for n in bundle.unexpressed if n.field == "model.attention_window"] == ["model.attention_window"]
    text = export_plan(*CASES[SCOUT], "torchtitan").files["torchtitan.toml"]
    tomllib.loads(text)
    assert (f"llama4-scout-17b-16e has {words}, but torchtitan's llama3 model always applies "
            f"{TORCHTITAN_LLAMA3_SCALING.words()}") in text
    assert "to match (the defaults of torchtitan's llama4 RoPEScalingArgs" in text
    _named_by_deepspeed_harness_and_automodel(SCOUT, words, "meta-llama/Llama-4-Scout-17B-16E config.json "
                                              "(text_config)", "meta-llama/Llama-4-Scout-17B-16E")
