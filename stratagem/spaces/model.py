"""Model architecture: `ModelSpec`, its parameter count, presets and Hugging Face config import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratagem.errors import StratagemError

__all__ = ["MoESpec", "ModelSpec", "MODEL_PRESETS", "model_preset"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class MoESpec(BaseModel):
    """Mixture-of-experts MLP replacing the dense MLP in every layer."""

    model_config = _FROZEN

    num_experts: int = Field(ge=1)
    """Experts per MoE layer."""
    top_k: int = Field(ge=1)
    """Experts each token is routed to."""
    expert_ffn_hidden_size: int = Field(ge=1)
    """Inner size of one expert's MLP."""


class ModelSpec(BaseModel):
    """A decoder-only transformer, as far as memory and FLOPs care."""

    model_config = _FROZEN

    name: str = "custom"
    """Display name (free text; escaped wherever it is rendered)."""
    num_layers: int = Field(ge=1)
    """Transformer blocks."""
    hidden_size: int = Field(ge=1)
    """Residual stream width h."""
    num_attention_heads: int = Field(ge=1)
    """Query heads a."""
    num_kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads (GQA); defaults to num_attention_heads (MHA)."""
    head_dim: int | None = Field(default=None, ge=1)
    """Per-head width; defaults to hidden_size / num_attention_heads."""
    ffn_hidden_size: int = Field(ge=1)
    """Dense MLP inner size f."""
    vocab_size: int = Field(ge=1)
    """Vocabulary size V."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP kind: swiglu (3 matrices, Llama) or gelu (2 matrices, GPT)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation: rmsnorm (weight only) or layernorm (weight and bias)."""
    tied_embeddings: bool = False
    """Whether the output projection shares the input embedding matrix."""
    bias: Literal["none", "qkv", "all"] = "none"
    """Linear biases: none (Llama), qkv (Qwen2) or all (GPT-2/3, NeoX)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """Rotary (no parameters) or a learned absolute table of max_position_embeddings rows."""
    max_position_embeddings: int = Field(default=2048, ge=1)
    """Rows of the learned position table (ignored for rope)."""
    moe: MoESpec | None = None
    """Mixture-of-experts MLP, or None for a dense model."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise StratagemError(
                f"model.hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads}); set model.head_dim explicitly"
            )
        if self.kv_heads > self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise StratagemError(
                f"model.num_kv_heads ({self.kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.moe is not None and self.moe.top_k > self.moe.num_experts:
            raise StratagemError(
                f"model.moe.top_k ({self.moe.top_k}) exceeds num_experts ({self.moe.num_experts})"
            )
        return self

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of all query heads: a * d."""
        return self.num_attention_heads * self.dim_head

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads: a_kv * d."""
        return self.kv_heads * self.dim_head

    def attention_params(self) -> int:
        """Q, K, V, O projections (+ biases) of one layer: h*(q + 2kv) + q*h."""
        h = self.hidden_size
        n = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.bias in ("qkv", "all"):
            n += self.q_size + 2 * self.kv_size
        if self.bias == "all":
            n += h
        return n

    def _mlp_params(self, ffn: int) -> int:
        h = self.hidden_size
        mats = 3 if self.mlp == "swiglu" else 2
        n = mats * h * ffn
        if self.bias == "all":
            n += (mats - 1) * ffn + h
        return n

    def dense_mlp_params(self) -> int:
        """One dense MLP: 3hf (SwiGLU) or 2hf (GELU), + biases."""
        return self._mlp_params(self.ffn_hidden_size)

    def expert_params(self) -> int:
        """One expert's MLP (0 for a dense model)."""
        return 0 if self.moe is None else self._mlp_params(self.moe.expert_ffn_hidden_size)

    def norm_params(self) -> int:
        """One normalisation layer: h (RMSNorm) or 2h (LayerNorm)."""
        return self.hidden_size * (1 if self.norm == "rmsnorm" else 2)

    def layer_dense_params(self) -> int:
        """Parameters of one layer that are not experts: attention, two norms, router or dense MLP."""
        n = self.attention_params() + 2 * self.norm_params()
        if self.moe is None:
            return n + self.dense_mlp_params()
        return n + self.hidden_size * self.moe.num_experts  # router h x E

    def layer_expert_params(self) -> int:
        """Parameters of all experts of one layer (0 for a dense model)."""
        return 0 if self.moe is None else self.moe.num_experts * self.expert_params()

    def embedding_params(self) -> int:
        """Token embedding V*h (+ learned positions)."""
        n = self.vocab_size * self.hidden_size
        if self.position_embedding == "learned":
            n += self.max_position_embeddings * self.hidden_size
        return n

    def head_params(self) -> int:
        """Final norm + output projection (V*h unless tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def num_params(self) -> int:
        """Total parameters: L * layer + embeddings + final norm + untied output projection."""
        per_layer = self.layer_dense_params() + self.layer_expert_params()
        return self.num_layers * per_layer + self.embedding_params() + self.head_params()

    def num_active_params(self) -> int:
        """Parameters a token passes through (top_k experts instead of all); equals num_params when dense."""
        if self.moe is None:
            return self.num_params()
        inactive = (self.moe.num_experts - self.moe.top_k) * self.expert_params()
        return self.num_params() - self.num_layers * inactive

    # ---- import ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read a local Hugging Face `config.json` (Llama, Mistral, Qwen2, Mixtral, GPT-2, GPT-NeoX)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg: dict[str, Any] = json.loads(p.read_text())
        except FileNotFoundError:
            raise StratagemError(f"model.hf_config ({p}): file not found; give the path of a config.json") from None
        except json.JSONDecodeError as e:
            raise StratagemError(f"model.hf_config ({p}): not valid JSON ({e.msg} at line {e.lineno})") from None
        return _from_hf_dict(cfg, name=str(cfg.get("_name_or_path") or p.parent.name or "hf-model"))


def _from_hf_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    kind = str(cfg.get("model_type", ""))
    try:
        if kind in ("llama", "mistral", "qwen2", "mixtral"):
            moe = None
            if kind == "mixtral":
                moe = MoESpec(
                    num_experts=cfg["num_local_experts"],
                    top_k=cfg["num_experts_per_tok"],
                    expert_ffn_hidden_size=cfg["intermediate_size"],
                )
            return ModelSpec(
                name=name,
                num_layers=cfg["num_hidden_layers"],
                hidden_size=cfg["hidden_size"],
                num_attention_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                head_dim=cfg.get("head_dim"),
                ffn_hidden_size=cfg["intermediate_size"],
                vocab_size=cfg["vocab_size"],
                mlp="swiglu",
                norm="rmsnorm",
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bias="qkv" if kind == "qwen2" else "none",
                moe=moe,
            )
        if kind == "gpt2":
            h = cfg["n_embd"]
            return ModelSpec(
                name=name,
                num_layers=cfg["n_layer"],
                hidden_size=h,
                num_attention_heads=cfg["n_head"],
                ffn_hidden_size=cfg.get("n_inner") or 4 * h,
                vocab_size=cfg["vocab_size"],
                mlp="gelu",
                norm="layernorm",
                tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                bias="all",
                position_embedding="learned",
                max_position_embeddings=cfg.get("n_positions", 1024),
            )
        if kind == "gpt_neox":
            return ModelSpec(
                name=name,
                num_layers=cfg["num_hidden_layers"],
                hidden_size=cfg["hidden_size"],
                num_attention_heads=cfg["num_attention_heads"],
                ffn_hidden_size=cfg["intermediate_size"],
                vocab_size=cfg["vocab_size"],
                mlp="gelu",
                norm="layernorm",
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bias="all",
            )
    except KeyError as e:
        raise StratagemError(f"model.hf_config: {kind} config lacks key {e.args[0]!r}") from None
    raise StratagemError(
        f"model.hf_config: model_type {kind!r} is not supported; "
        "supported: llama, mistral, qwen2, mixtral, gpt2, gpt_neox"
    )


def _llama(name: str, layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int, **kw: Any) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=ffn, vocab_size=vocab, **kw,
    )


# Published dimensions: Llama 3 (Dubey et al. 2024, Table 3), Mistral 7B (Jiang et al. 2023, Table 1),
# Mixtral (Jiang et al. 2024, sec. 2), GPT-3 175B (Brown et al. 2020, Table 2.1).
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
        _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000),
        _llama(
            "mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000,
            moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=14336),
        ),
        ModelSpec(
            name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96,
            ffn_hidden_size=4 * 12288, vocab_size=50257, mlp="gelu", norm="layernorm",
            tied_embeddings=True, bias="all", position_embedding="learned", max_position_embeddings=2048,
        ),
        # Small models for tests and CPU runs.
        _llama("tiny", 2, 64, 4, 2, 128, 256),
        _llama("tiny-4l", 4, 128, 8, 4, 256, 512),
        _llama("tiny-moe", 2, 64, 4, 2, 128, 256, moe=MoESpec(num_experts=4, top_k=2, expert_ffn_hidden_size=64)),
    ]
}


def model_preset(name: str) -> ModelSpec:
    """The preset called `name`, or an error listing the presets."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise StratagemError(
            f"model ({name!r}) is not a preset; use one of {', '.join(MODEL_PRESETS)} or give the fields"
        ) from None
