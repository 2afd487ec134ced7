"""Hugging Face `config.json` -> `ModelSpec`, from a local file (no network).

Field names follow each architecture's configuration class in huggingface/transformers (models/<arch>/
configuration_<arch>.py) and, for DeepSeek-V3, the checkpoint's own configuration_deepseek.py: a key missing
from the file takes the class default where that default is what the released checkpoints use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stratagem.errors import StratagemError
from stratagem.files import read_json
from stratagem.spaces.model import MLASpec, ModelSpec, MoESpec

__all__ = ["read_hf_config", "check_hf_config", "HF_CONFIG_MAX_BYTES", "spec_from_hf_dict", "llama4_vision_params", "SUPPORTED_MODEL_TYPES"]

HF_CONFIG_MAX_BYTES = 4 << 20  # a config.json is kilobytes (Llama 4's, with its vision section, ~10 KB)
def check_hf_config(value: Any) -> Path:
    """The config.json an `hf_config` names, checked before it is parsed: a path (or a directory holding
    config.json) to a regular file of at most HF_CONFIG_MAX_BYTES of UTF-8 JSON whose top level is an object
    (stratagem.files.read_json: a FIFO, /dev/zero or a huge file is refused unread)."""
    if not isinstance(value, str | Path) or not str(value):
        raise StratagemError(f"model.hf_config ({value!r}): give the path of a config.json")
    p = Path(value)
    if p.is_dir():
        p = p / "config.json"
    data = read_json(p, "model.hf_config", HF_CONFIG_MAX_BYTES, hint="give the path of a config.json")
    if not isinstance(data, dict):
        raise StratagemError(f"model.hf_config ({p}): a JSON {type(data).__name__}, not an object; a config.json "
                             "holds one object of fields such as model_type and hidden_size")
    return p




def read_hf_config(path: str | Path) -> ModelSpec:
    """The ModelSpec of a local config.json (or a directory holding one), read bounded (stratagem.files)."""
    p = check_hf_config(path)
    cfg: dict[str, Any] = read_json(p, "model.hf_config")
    return spec_from_hf_dict(cfg, name=str(cfg.get("_name_or_path") or p.parent.name or "hf-model"))


def _every(flags: list[bool], field: str) -> int:
    """n such that exactly the layers i with (i + 1) % n == 0 are flagged (0: none flagged)."""
    marked = [i for i, f in enumerate(flags) if f]
    if not marked:
        return 0
    n = marked[0] + 1
    if marked != [i for i in range(len(flags)) if (i + 1) % n == 0]:
        raise StratagemError(f"model.hf_config: {field} has global-attention layers at {marked}, not every n-th "
                             "layer; stratagem models one global layer per group of n")
    return n


def llama4_vision_params(vc: dict[str, Any], text_hidden: int) -> int:
    """Parameters of Llama 4's vision encoder, adapter and projector [transformers models/llama4/
    modeling_llama4.py: Llama4VisionModel (class + positional embedding, patch linear without bias, pre/post
    LayerNorm, encoder layers of attention with biases + GELU MLP + 2 LayerNorms), Llama4VisionPixelShuffleMLP
    (two linears without bias), Llama4MultiModalProjector (one linear, multi_modal_projector_bias)]."""
    h, i = vc["hidden_size"], vc["intermediate_size"]
    patches = (vc["image_size"] // vc["patch_size"]) ** 2
    embed = h + (patches + 1) * h + vc.get("num_channels", 3) * vc["patch_size"] ** 2 * h + 4 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
    shuffled = int(h / vc["pixel_shuffle_ratio"] ** 2)
    adapter = shuffled * vc["projector_input_dim"] + vc["projector_input_dim"] * vc["projector_output_dim"]
    projector = vc["vision_output_dim"] * text_hidden + (text_hidden if vc.get("multi_modal_projector_bias") else 0)
    return int(embed + vc["num_hidden_layers"] * layer + adapter + projector)


def _common(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(
        name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"), vocab_size=cfg["vocab_size"], mlp="swiglu", norm="rmsnorm",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def spec_from_hf_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a parsed config.json; errors name the missing key or the unsupported model_type."""
    kind = str(cfg.get("model_type", ""))
    for section in ("text_config", "vision_config"):
        if section in cfg and not isinstance(cfg[section], dict):
            raise StratagemError(f"model.hf_config: {section} ({type(cfg[section]).__name__}) must be an object of "
                                 "fields; give the model's own config.json")
    try:
        return _build(kind, cfg, name)
    except KeyError as e:
        raise StratagemError(f"model.hf_config: {kind} config lacks key {e.args[0]!r}") from None
    except ValidationError as e:  # a field of the ModelSpec it maps to: name the config's value
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"model.hf_config: {kind} config gives {loc} ({err.get('input')!r}): "
                             f"{err['msg'].removeprefix('Value error, ')}") from None
    except ZeroDivisionError:
        raise StratagemError(f"model.hf_config: {kind} config has a size of 0 where a size divides (e.g. "
                             "patch_size, pixel_shuffle_ratio, n_head); give the model's own config.json") from None
    except (TypeError, AttributeError, IndexError) as e:
        raise StratagemError(f"model.hf_config: {kind} config has a value of the wrong type ({e}); give the "
                             "model's own config.json") from None


def _build(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a config.json whose model_type is `kind`, by its family's builder."""
    builder = _BUILDERS.get(kind)
    if builder is None:
        raise StratagemError(
            f"model.hf_config: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return builder(kind, cfg, name)


def _llama_like(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """Llama, Mistral, Qwen2/3 and their MoE forms (Mixtral, Qwen3-MoE): RMSNorm, SwiGLU, GQA; Qwen2 biases q/k/v,
    Qwen3 normalises q and k; Mistral and Mixtral attend through a sliding window when one is set."""
    moe = _llama_like_moe(kind, cfg)
    window: dict[str, Any] = {}
    if kind in ("mistral", "mixtral") and cfg.get("sliding_window"):
        window = {"attention_window": cfg["sliding_window"], "global_attention_every": 0}
    return ModelSpec(
        **_common(cfg, name), ffn_hidden_size=cfg["intermediate_size"],
        bias="qkv" if kind == "qwen2" else "none", qk_norm=kind in ("qwen3", "qwen3_moe"), moe=moe, **window,
    )


def _llama_like_moe(kind: str, cfg: dict[str, Any]) -> MoESpec | None:
    """Mixtral's experts (every layer) or Qwen3-MoE's (every decoder_sparse_step-th layer); None otherwise."""
    if kind == "mixtral":
        return MoESpec(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                       expert_ffn_hidden_size=cfg["intermediate_size"])
    if kind == "qwen3_moe":
        if cfg.get("mlp_only_layers"):
            raise StratagemError("model.hf_config: qwen3_moe mlp_only_layers is not supported; remove it")
        return MoESpec(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                       expert_ffn_hidden_size=cfg["moe_intermediate_size"],
                       moe_layer_step=cfg.get("decoder_sparse_step", 1))
    return None


def _deepseek(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V2/V3: multi-head latent attention (MLA) and, when routed experts are set, their MoE."""
    if cfg.get("moe_layer_freq", 1) != 1:
        raise StratagemError("model.hf_config: deepseek moe_layer_freq other than 1 is not supported")
    mla = MLASpec(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                  qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                  v_head_dim=cfg["v_head_dim"])
    moe = _deepseek_moe(cfg) if cfg.get("n_routed_experts") else None
    common = _common(cfg, name)
    common.update(num_kv_heads=None, head_dim=None)
    # num_nextn_predict_layers: the multi-token-prediction modules (modeling_deepseek.py; DeepSeek-V3: 1)
    return ModelSpec(**common, ffn_hidden_size=cfg["intermediate_size"], mla=mla, moe=moe,
                     mtp_layers=cfg.get("num_nextn_predict_layers") or 0)


def _deepseek_moe(cfg: dict[str, Any]) -> MoESpec:
    """DeepSeek's routed and shared experts after the first_k_dense_replace dense layers."""
    # configuration_deepseek.py: topk_method "noaux_tc" (V3) adds e_score_correction_bias to the gate
    return MoESpec(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                   expert_ffn_hidden_size=cfg["moe_intermediate_size"],
                   shared_experts=cfg.get("n_shared_experts") or 0,
                   first_dense_layers=cfg.get("first_k_dense_replace", 0),
                   router_bias=cfg.get("topk_method") == "noaux_tc",
                   # group-limited routing (modeling_deepseek.py MoEGate: n_group groups, topk_group of them)
                   route_groups=cfg.get("n_group") if (cfg.get("n_group") or 1) > 1 else None,
                   route_groups_per_token=cfg.get("topk_group") if (cfg.get("n_group") or 1) > 1 else None)


def _llama4(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """Llama 4 (its text_config; `llama4` adds the vision encoder's parameters): a shared expert beside the
    routed ones, chunked attention with a global (NoPE) layer every n-th."""
    tc = cfg["text_config"] if kind == "llama4" else cfg
    vision = llama4_vision_params(cfg["vision_config"], tc["hidden_size"]) if kind == "llama4" else 0
    layers = tc["num_hidden_layers"]
    # configuration_llama4.py: no_rope_layers[i] == 0 marks a global (NoPE) layer; default every 4th
    nope = tc.get("no_rope_layers") or [int((i + 1) % tc.get("no_rope_layer_interval", 4) != 0)
                                        for i in range(layers)]
    chunk = tc.get("attention_chunk_size")
    moe = MoESpec(num_experts=tc["num_local_experts"], top_k=tc["num_experts_per_tok"],
                  expert_ffn_hidden_size=tc["intermediate_size"], shared_experts=1,
                  moe_layer_step=tc.get("interleave_moe_layer_step", 1))
    common = _common(tc, name)
    common["tied_embeddings"] = bool(cfg.get("tie_word_embeddings", tc.get("tie_word_embeddings", False)))
    return ModelSpec(
        **common, ffn_hidden_size=tc.get("intermediate_size_mlp", tc["intermediate_size"]), moe=moe,
        attention_window=chunk, window_kind="chunked",
        global_attention_every=_every([f == 0 for f in nope], "no_rope_layers") if chunk else 0,
        encoder_params=vision,
    )


def _gpt_oss(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """gpt-oss: biased MoE with a router bias, sliding-window layers alternating with full ones, attention sinks."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(layers)]
    moe = MoESpec(num_experts=cfg["num_local_experts"],
                  top_k=cfg.get("num_experts_per_tok") or cfg["experts_per_token"],
                  expert_ffn_hidden_size=cfg["intermediate_size"], router_bias=True)
    return ModelSpec(
        **_common(cfg, name), ffn_hidden_size=cfg["intermediate_size"], bias="all", moe=moe,
        attention_window=cfg["sliding_window"], window_kind="sliding", attention_sinks=True,
        global_attention_every=_every([t == "full_attention" for t in types], "layer_types"),
    )


def _gpt2(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """GPT-2: LayerNorm, GELU MLP, biases everywhere, learned positions, tied embeddings by default."""
    h = cfg["n_embd"]
    return ModelSpec(
        name=name, num_layers=cfg["n_layer"], hidden_size=h, num_attention_heads=cfg["n_head"],
        ffn_hidden_size=cfg.get("n_inner") or 4 * h, vocab_size=cfg["vocab_size"], mlp="gelu",
        norm="layernorm", tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), bias="all",
        position_embedding="learned", max_position_embeddings=cfg.get("n_positions", 1024),
    )


def _gpt_neox(kind: str, cfg: dict[str, Any], name: str) -> ModelSpec:
    """GPT-NeoX: LayerNorm, GELU MLP, biases everywhere, rotary positions."""
    return ModelSpec(
        name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"], ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], mlp="gelu", norm="layernorm",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)), bias="all",
    )


_BUILDERS: dict[str, Callable[[str, dict[str, Any], str], ModelSpec]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"), _llama_like),
    # moonshotai/Kimi-K2 config.json: model_type kimi_k2, architectures DeepseekV3ForCausalLM
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "kimi_k2": _deepseek, "llama4": _llama4,
    "llama4_text": _llama4, "gpt_oss": _gpt_oss, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
}
"""Each supported model_type's builder."""
SUPPORTED_MODEL_TYPES = tuple(_BUILDERS)
"""The model_types read_hf_config reads (its error lists them)."""
