"""Rotary scaling in every export (issue 26 item 6; launch/export/rope.py): Llama 3.1's "llama3" scaling and
DeepSeek-V3's YaRN written where the engine takes them, named where it does not, and a mismatch with what an
engine fixes itself noted, never silent."""

from __future__ import annotations

import json

import pytest
from test_export_parsers import CASES, megatron_namespace

from stratagem.launch.export import export_plan
from stratagem.launch.export import model_fields as mf
from stratagem.launch.export.rope import (
    TORCHTITAN_LLAMA3_SCALING,
    megatron_rope_args,
    torchtitan_rope_comment,
)

LLAMA31 = "llama405b-emb-loss-vpp8"
DEEPSEEK = "deepseek-v3-mla-moe"
LLAMA3_8B = "llama8b-5d"


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


def test_megatron_writes_the_scaling_it_takes() -> None:
    ns = megatron_namespace(export_plan(*CASES[LLAMA31], "megatron"))
    assert ns.use_rope_scaling and ns.rope_scaling_factor == 8.0 and ns.position_embedding_type == "rope"
    assert ns.rotary_base == 500000
    ns = megatron_namespace(export_plan(*CASES[DEEPSEEK], "megatron"))
    assert (ns.rope_type, ns.rotary_scaling_factor, ns.mscale, ns.mscale_all_dim) == ("yarn", 40.0, 1.0, 1.0)
    assert not ns.use_rope_scaling
    ns = megatron_namespace(export_plan(*CASES[LLAMA3_8B], "megatron"))
    assert not ns.use_rope_scaling and ns.rope_type is None and ns.rotary_scaling_factor is None
    for case in (LLAMA31, DEEPSEEK):  # Megatron's fixed fields equal these checkpoints': nothing to note
        assert not [n for n in export_plan(*CASES[case], "megatron").approximated if n.field == "model.rope_scaling"]


def test_a_scaling_megatron_cannot_take_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama3 scaling whose high_freq_factor Megatron fixes otherwise (Llama 4 Scout's kind) is written with a
    note, and YaRN on attention that is not MLA is noted, not written."""
    scn = CASES[LLAMA3_8B][0]
    monkeypatch.setitem(mf.ROPE_SCALING, scn.model.name, mf.RopeScaling("llama3", 16.0, 8192, 1.0, 1.0))
    notes: list = []
    assert megatron_rope_args(scn.model, notes) == ("rope", ["--use-rope-scaling", "--rope-scaling-factor", "16"])
    assert [n.field for n in notes] == ["model.rope_scaling"] and "fixes low_freq_factor" in notes[0].why
    monkeypatch.setitem(mf.ROPE_SCALING, scn.model.name, mf.RopeScaling("yarn", 32.0, 4096, beta_fast=32.0))
    notes = []
    assert megatron_rope_args(scn.model, notes) == ("rope", [])
    assert "not written" in notes[0].why


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
