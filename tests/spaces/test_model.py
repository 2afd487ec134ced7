import json

import pytest

from stratagem.errors import StratagemError
from stratagem.spaces import MODEL_PRESETS, ModelSpec

PUBLISHED = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "llama3-405b": 405.85e9,
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.70e9,
    "gpt3-175b": 174.6e9,
}


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_preset_counts_match_published(name: str, count: float) -> None:
    assert abs(MODEL_PRESETS[name].num_params() / count - 1) < 0.005


def test_mixtral_active_params() -> None:
    # Mixtral paper: 12.9B active parameters per token.
    assert abs(MODEL_PRESETS["mixtral-8x7b"].num_active_params() / 12.9e9 - 1) < 0.01


LLAMA_CFG = {
    "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}
MIXTRAL_CFG = {**LLAMA_CFG, "model_type": "mixtral", "vocab_size": 32000, "num_local_experts": 8,
               "num_experts_per_tok": 2}
GPT2_CFG = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257,
            "n_positions": 1024}
NEOX_CFG = {"model_type": "gpt_neox", "num_hidden_layers": 44, "hidden_size": 6144, "num_attention_heads": 64,
            "intermediate_size": 24576, "vocab_size": 50432, "tie_word_embeddings": False}
QWEN2_CFG = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
             "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
             "tie_word_embeddings": False}


@pytest.mark.parametrize("cfg,count", [
    (LLAMA_CFG, 8.03e9),        # Llama-3-8B
    (MIXTRAL_CFG, 46.70e9),     # Mixtral-8x7B
    (GPT2_CFG, 124.4e6),        # GPT-2 small (124M)
    (NEOX_CFG, 20.55e9),        # GPT-NeoX-20B (Black et al. 2022: 20,554,567,680)
    (QWEN2_CFG, 7.62e9),        # Qwen2-7B (7.62B)
])
def test_from_hf_config(tmp_path, cfg, count) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = ModelSpec.from_hf_config(path)
    assert abs(spec.num_params() / count - 1) < 0.005


def test_from_hf_config_errors(tmp_path) -> None:
    with pytest.raises(StratagemError, match="not found"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(StratagemError, match="not supported"):
        ModelSpec.from_hf_config(tmp_path)


def test_bad_heads() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=3, ffn_hidden_size=8,
                  vocab_size=10)
