"""Model architecture: `ModelSpec`, its parameter count, attention cost, and presets.

Attention variants: multi-head / grouped-query attention (Llama), Multi-head Latent Attention (DeepSeek-V2/V3:
queries and keys/values pass through low-rank latents), per-head q/k norms (Qwen3), local attention on some
layers (gpt-oss sliding window, Llama 4 chunked attention) and attention sinks (gpt-oss). MoE variants: routed
experts with top-k, shared experts, first-k dense layers, MoE every n-th layer, router bias. Hugging Face
`config.json` import lives in `stratagem.spaces.hf_config`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stratagem.errors import StratagemError
from stratagem.spaces import bounds as B

__all__ = ["MoESpec", "MLASpec", "ModelSpec", "MODEL_PRESETS", "model_preset"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class MoESpec(BaseModel):
    """Mixture-of-experts MLP replacing the dense MLP in the MoE layers."""

    model_config = _FROZEN

    num_experts: int = Field(ge=1, le=B.MAX_EXPERTS)
    """Routed experts per MoE layer."""
    top_k: int = Field(ge=1, le=B.MAX_EXPERTS)
    """Routed experts each token is sent to."""
    expert_ffn_hidden_size: int = Field(ge=1, le=B.MAX_FFN)
    """Inner size of one routed expert's MLP."""
    shared_experts: int = Field(default=0, ge=0, le=B.MAX_EXPERTS)
    """Experts every token passes through besides the routed ones (DeepSeek n_shared_experts, Llama 4's
    shared expert); they are dense weights: split by tp, not by ep."""
    shared_expert_ffn_hidden_size: int | None = Field(default=None, ge=1, le=B.MAX_FFN)
    """Inner size of one shared expert; defaults to expert_ffn_hidden_size."""
    first_dense_layers: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Leading layers with a dense MLP of ffn_hidden_size instead of experts (DeepSeek first_k_dense_replace)."""
    moe_layer_step: int = Field(default=1, ge=1, le=B.MAX_LAYERS)
    """After the dense layers, every n-th layer is an MoE layer (Llama 4 interleave_moe_layer_step); others dense."""
    router_bias: bool = False
    """Whether the router has a bias of one value per expert (gpt-oss; DeepSeek-V3's e_score_correction_bias)."""
    capacity_factor: float | None = Field(default=None, gt=0, le=B.MAX_EXPERTS)
    """Tokens an expert may take, as a multiple of its even share (Switch/GShard); None: dropless."""
    route_groups: int | None = Field(default=None, ge=1, le=B.MAX_EXPERTS)
    """Group-limited routing (DeepSeek-V3 n_group): the experts fall into this many equal groups."""
    route_groups_per_token: int | None = Field(default=None, ge=1, le=B.MAX_EXPERTS)
    """Groups one token may route into (DeepSeek-V3 topk_group = 4: with one group per node, a token reaches at
    most 4 nodes, DeepSeek-V3 report sec. 3.2.2); None: no limit."""

    @property
    def shared_ffn(self) -> int:
        """Inner size of one shared expert."""
        return self.shared_expert_ffn_hidden_size or self.expert_ffn_hidden_size


class MLASpec(BaseModel):
    """Multi-head Latent Attention (DeepSeek-V2 sec. 2.1): q = W_uq norm(W_dq x) (or W_q x without a q latent),
    [k_nope, v] = W_ukv norm(c_kv) with c_kv, k_rope = W_dkv x; k_rope is shared by all heads."""

    model_config = _FROZEN

    q_lora_rank: int | None = Field(default=None, ge=1, le=B.MAX_FFN)
    """Rank of the query latent (None: a full query projection, as DeepSeek-V2-Lite)."""
    kv_lora_rank: int = Field(ge=1, le=B.MAX_FFN)
    """Rank of the compressed key/value latent c_kv."""
    qk_nope_head_dim: int = Field(ge=1, le=B.MAX_HEAD_DIM)
    """Per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = Field(ge=0, le=B.MAX_HEAD_DIM)
    """Per-head query/key width with rotary embedding (the key part is shared across heads)."""
    v_head_dim: int = Field(ge=1, le=B.MAX_HEAD_DIM)
    """Per-head value width."""


class ModelSpec(BaseModel):
    """A decoder-only transformer, as far as memory and FLOPs care."""

    model_config = _FROZEN

    name: str = "custom"
    """Display name (free text; escaped wherever it is rendered)."""
    num_layers: int = Field(ge=1, le=B.MAX_LAYERS)
    """Transformer blocks."""
    hidden_size: int = Field(ge=1, le=B.MAX_HIDDEN)
    """Residual stream width h."""
    num_attention_heads: int = Field(ge=1, le=B.MAX_HEADS)
    """Query heads a."""
    num_kv_heads: int | None = Field(default=None, ge=1, le=B.MAX_HEADS)
    """Key/value heads (GQA); defaults to num_attention_heads (MHA)."""
    head_dim: int | None = Field(default=None, ge=1, le=B.MAX_HEAD_DIM)
    """Per-head width; defaults to hidden_size / num_attention_heads."""
    ffn_hidden_size: int = Field(ge=1, le=B.MAX_FFN)
    """Dense MLP inner size f (the dense layers of an MoE model)."""
    vocab_size: int = Field(ge=1, le=B.MAX_VOCAB)
    """Vocabulary size V."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """MLP kind: swiglu (3 matrices, Llama) or gelu (2 matrices, GPT)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation: rmsnorm (weight only) or layernorm (weight and bias)."""
    tied_embeddings: bool = False
    """Whether the output projection shares the input embedding matrix."""
    bias: Literal["none", "qkv", "all"] = "none"
    """Linear biases: none (Llama), qkv (Qwen2) or all (GPT-2/3, NeoX, gpt-oss)."""
    position_embedding: Literal["rope", "learned"] = "rope"
    """Rotary (no parameters) or a learned absolute table of max_position_embeddings rows."""
    max_position_embeddings: int = Field(default=2048, ge=1, le=B.MAX_POSITIONS)
    """Rows of the learned position table (ignored for rope)."""
    moe: MoESpec | None = None
    """Mixture-of-experts MLP, or None for a dense model."""
    mla: MLASpec | None = None
    """Multi-head Latent Attention instead of grouped-query attention (DeepSeek-V2/V3)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys, head_dim weights each (Qwen3)."""
    attention_window: int | None = Field(default=None, ge=1, le=B.MAX_POSITIONS)
    """Tokens a local-attention layer sees (gpt-oss sliding_window, Llama 4 attention_chunk_size); None: all."""
    window_kind: Literal["sliding", "chunked"] = "sliding"
    """sliding: each token sees the previous attention_window tokens; chunked: the sequence is cut into chunks of
    attention_window tokens attending only within themselves (Llama 4)."""
    global_attention_every: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """With a window: every n-th layer (the last of each group of n) attends to the whole sequence (gpt-oss 2,
    Llama 4 4); 0: every layer is local."""
    attention_sinks: bool = False
    """Learned per-head sink logits in the softmax (gpt-oss): one parameter per head and layer."""
    encoder_params: int = Field(default=0, ge=0, le=B.MAX_PARAMS)
    """Parameters outside the decoder trained with it (Llama 4's vision encoder and projector); held with the
    embedding on the first pipeline stage; no work per text token."""
    mtp_layers: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Multi-token-prediction modules after the last layer (DeepSeek-V3 config num_nextn_predict_layers, Megatron
    --mtp-num-layers), each predicting one token further: a transformer layer like the model's last, three norms
    and a [2h -> h] projection, sharing the main model's embedding and output head (which it runs once more);
    held and run by the last pipeline stage (megatron/core/transformer/multi_token_prediction.py
    MultiTokenPredictionLayer, mtp_on_this_rank)."""

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.head_dim is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise StratagemError(
                f"model.hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                f"({self.num_attention_heads}); set model.head_dim explicitly"
            )
        if self.kv_heads > self.num_attention_heads or self.num_attention_heads % self.kv_heads:
            raise StratagemError(
                f"model.num_kv_heads ({self.kv_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.mla is not None and self.kv_heads != self.num_attention_heads:
            raise StratagemError(
                f"model.num_kv_heads ({self.kv_heads}): Multi-head Latent Attention expands keys and values for "
                f"every head; set num_kv_heads to num_attention_heads ({self.num_attention_heads}) or leave it out"
            )
        if self.moe is not None and self.moe.top_k > self.moe.num_experts:
            raise StratagemError(
                f"model.moe.top_k ({self.moe.top_k}) exceeds num_experts ({self.moe.num_experts})"
            )
        if self.moe is not None and self.moe.first_dense_layers >= self.num_layers:
            raise StratagemError(
                f"model.moe.first_dense_layers ({self.moe.first_dense_layers}) leaves no MoE layer of "
                f"{self.num_layers}; use at most {self.num_layers - 1}"
            )
        return self

    # ---- attention sizes -----------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """Key/value heads (every head under MLA)."""
        return self.num_kv_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        """Query/key width per head (MLA: nope + rope)."""
        if self.mla is not None:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def v_head_dim(self) -> int:
        """Value width per head (= dim_head except under MLA)."""
        return self.mla.v_head_dim if self.mla is not None else self.dim_head

    @property
    def q_size(self) -> int:
        """Width of all query heads: a * d."""
        return self.num_attention_heads * self.dim_head

    @property
    def kv_size(self) -> int:
        """Width of all key heads: a_kv * d."""
        return self.kv_heads * self.dim_head

    @property
    def v_size(self) -> int:
        """Width of all value heads (also the attention output): a_kv * d_v."""
        return self.kv_heads * self.v_head_dim

    @property
    def out_size(self) -> int:
        """Width of the attention output entering the output projection: a * d_v."""
        return self.num_attention_heads * self.v_head_dim

    def attention_matmul_params(self) -> int:
        """Weights of one layer's attention projections (no biases or norms). GQA: h(q + 2kv) + a d_v h.
        MLA [DeepSeek-V2 sec. 2.1.2, modeling_deepseek.py DeepseekV3Attention]: h r_q + r_q a (d_nope + d_rope)
        (or h a (d_nope + d_rope) without a q latent) + h (r_kv + d_rope) + r_kv a (d_nope + d_v) + a d_v h."""
        h, a = self.hidden_size, self.num_attention_heads
        out = self.out_size * h
        if self.mla is None:
            return h * (self.q_size + self.kv_size + self.v_size) + out
        m = self.mla
        q = h * self.q_size if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * self.q_size
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + out

    def attention_params(self) -> int:
        """One layer's attention: projections + biases + latent norms (MLA) + q/k norms + sinks."""
        h = self.hidden_size
        n = self.attention_matmul_params()
        if self.bias in ("qkv", "all"):
            n += self.q_size + self.kv_size + self.v_size
        if self.bias == "all":
            n += h
        if self.mla is not None:
            n += self.mla.kv_lora_rank + (self.mla.q_lora_rank or 0)  # RMSNorm of each latent
        if self.qk_norm:
            n += 2 * self.dim_head
        if self.attention_sinks:
            n += self.num_attention_heads
        return n

    def attention_saved_per_token(self) -> tuple[int, int]:
        """Elements per token one layer's attention saves for backward: (split over tp, replicated over tp).
        Split: q, k, v and the attention output (input of the output projection). MLA also keeps its latents
        (inputs of the up projections), computed by replicated down projections."""
        split = self.q_size + self.kv_size + self.v_size + self.out_size
        if self.mla is None:
            return split, 0
        m = self.mla
        return split, (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim

    def kv_per_token(self) -> int:
        """Key + value elements per token (what context parallelism exchanges): kv + v widths."""
        return self.kv_size + self.v_size

    def windowed_layers(self) -> int:
        """Layers with local attention (attention_window set, minus every global_attention_every-th layer)."""
        if self.attention_window is None:
            return 0
        g = self.global_attention_every
        return self.num_layers - (self.num_layers // g if g else 0)

    def attention_context(self, seq_len: int, causal: bool = True) -> float:
        """Keys one query attends to, averaged over tokens and layers. Global causal: s/2 (non-causal, the
        PaLM MFU convention: s); sliding window W < s causal: W - W(W-1)/(2s) (the first W tokens see fewer),
        non-causal W; chunked C < s: C/2 causal (each chunk is a causal block), C non-causal."""
        s = float(seq_len)
        full = s / 2 if causal else s
        w = self.attention_window
        if w is None or w >= seq_len:
            return full
        if self.window_kind == "sliding":
            local = (w - w * (w - 1) / (2 * s)) if causal else float(w)
        else:
            local = w / 2 if causal else float(w)
        frac = self.windowed_layers() / self.num_layers
        return frac * local + (1 - frac) * full

    def attention_flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of one layer's score and value matmuls per token, averaged over layers:
        2 x context x a (d_qk + d_v) [FlashAttention-2 sec. 4.1 counts 4 s^2 d per head, halved when causal]."""
        a = self.num_attention_heads
        return 2.0 * self.attention_context(seq_len, causal) * a * (self.dim_head + self.v_head_dim)

    # ---- MLP and layers ------------------------------------------------------------------------------
    def _mlp_params(self, ffn: int) -> int:
        h = self.hidden_size
        mats = 3 if self.mlp == "swiglu" else 2
        n = mats * h * ffn
        if self.bias == "all":
            n += (mats - 1) * ffn + h
        return n

    def _mlp_matmul(self, ffn: int) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.hidden_size * ffn

    def dense_mlp_params(self) -> int:
        """One dense MLP: 3hf (SwiGLU) or 2hf (GELU), + biases."""
        return self._mlp_params(self.ffn_hidden_size)

    def expert_params(self) -> int:
        """One routed expert's MLP (0 for a dense model)."""
        return 0 if self.moe is None else self._mlp_params(self.moe.expert_ffn_hidden_size)

    def norm_params(self) -> int:
        """One normalisation layer: h (RMSNorm) or 2h (LayerNorm)."""
        return self.hidden_size * (1 if self.norm == "rmsnorm" else 2)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i (0-based) has experts: after first_dense_layers, every moe_layer_step-th layer."""
        moe = self.moe
        if moe is None or i < moe.first_dense_layers:
            return False
        return (i - moe.first_dense_layers + 1) % moe.moe_layer_step == 0

    def num_moe_layers(self) -> int:
        """Layers with experts."""
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def moe_layer_dense_params(self) -> int:
        """Non-routed parameters of one MoE layer: attention, two norms, router (+ bias), shared experts."""
        moe = self.moe
        n = self.attention_params() + 2 * self.norm_params()
        if moe is None:
            return n + self.dense_mlp_params()
        n += self.hidden_size * moe.num_experts + (moe.num_experts if moe.router_bias else 0)
        return n + moe.shared_experts * self._mlp_params(moe.shared_ffn)

    def dense_layer_params(self) -> int:
        """One layer with a dense MLP: attention, two norms, MLP of ffn_hidden_size."""
        return self.attention_params() + 2 * self.norm_params() + self.dense_mlp_params()

    def layer_params(self, i: int) -> tuple[int, int]:
        """(non-routed, routed-expert) parameters of layer i."""
        moe = self.moe
        if moe is not None and self.is_moe_layer(i):
            return self.moe_layer_dense_params(), moe.num_experts * self.expert_params()
        return self.dense_layer_params(), 0

    def layer_dense_params(self) -> float:
        """Non-routed parameters per layer, averaged over layers (attention, norms, dense MLP or router and
        shared experts)."""
        n = self.num_moe_layers()
        dense = (self.num_layers - n) * self.dense_layer_params()
        return (n * self.moe_layer_dense_params() + dense) / self.num_layers

    def layer_expert_params(self) -> float:
        """Routed-expert parameters per layer, averaged over layers (0 for a dense model)."""
        if self.moe is None:
            return 0.0
        return self.num_moe_layers() * self.moe.num_experts * self.expert_params() / self.num_layers

    def largest_layer_params(self) -> int:
        """Parameters of the largest layer (an MoE layer with all its experts, if any)."""
        return max(sum(self.layer_params(i)) for i in range(self.num_layers))

    def layer_matmul_params(self, i: int) -> int:
        """Weights one token multiplies through in layer i: attention projections + the dense MLP, or the
        router, the shared experts and top_k routed experts. Norms and biases do no matmul work."""
        n = self.attention_matmul_params()
        moe = self.moe
        if moe is None or not self.is_moe_layer(i):
            return n + self._mlp_matmul(self.ffn_hidden_size)
        experts = moe.top_k * self._mlp_matmul(moe.expert_ffn_hidden_size)
        shared = moe.shared_experts * self._mlp_matmul(moe.shared_ffn)
        return n + self.hidden_size * moe.num_experts + experts + shared

    def mean_matmul_params_per_layer(self) -> float:
        """`layer_matmul_params` averaged over layers."""
        return sum(self.layer_matmul_params(i) for i in range(self.num_layers)) / self.num_layers

    def tp_split_ffn_sizes(self) -> tuple[int, ...]:
        """MLP inner sizes tensor parallelism splits: the dense MLP where some layer has one, the shared experts
        (routed experts are split by the expert tensor-parallel degree etp instead)."""
        sizes: list[int] = []
        if self.moe is None or self.num_moe_layers() < self.num_layers:
            sizes.append(self.ffn_hidden_size)
        if self.moe is not None and self.moe.shared_experts:
            sizes.append(self.moe.shared_ffn)
        return tuple(sizes)

    def embedding_params(self) -> int:
        """Token embedding V*h (+ learned positions) + encoder_params (held with the embedding)."""
        n = self.vocab_size * self.hidden_size + self.encoder_params
        if self.position_embedding == "learned":
            n += self.max_position_embeddings * self.hidden_size
        return n

    def head_params(self) -> int:
        """Final norm + output projection (V*h unless tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def mtp_module_params(self) -> tuple[int, int]:
        """(non-routed, routed-expert) parameters of one multi-token-prediction module: its transformer layer (like
        the last layer), enorm + hnorm + its final norm, and eh_proj [2h -> h] without bias (Megatron
        multi_token_prediction.py MultiTokenPredictionLayer; DeepSeek-V3 report sec. 2.2). The embedding and
        output head are the main model's."""
        dense, routed = self.layer_params(self.num_layers - 1)
        return dense + 3 * self.norm_params() + 2 * self.hidden_size * self.hidden_size, routed

    def mtp_params(self) -> int:
        """Parameters of all the multi-token-prediction modules (0 without them)."""
        return self.mtp_layers * sum(self.mtp_module_params())

    def num_params(self) -> int:
        """Total parameters trained: every layer + embeddings (+ encoder) + final norm + untied output projection +
        the multi-token-prediction modules (which published totals leave out: DeepSeek-V3's 671B)."""
        layers = sum(sum(self.layer_params(i)) for i in range(self.num_layers))
        return layers + self.embedding_params() + self.head_params() + self.mtp_params()

    def num_active_params(self, input_embedding: bool = True) -> int:
        """Parameters a token passes through: top_k of the routed experts instead of all (the MTP modules' too);
        equals num_params when dense. `input_embedding=False` leaves out the embedding table (and encoder), as
        OpenAI counts gpt-oss's active parameters (model card, Table 1). encoder_params are never active for a
        text token."""
        n = self.num_params() - self.encoder_params
        if self.moe is not None:
            mtp_moe = self.mtp_layers if self.is_moe_layer(self.num_layers - 1) else 0
            n -= (self.num_moe_layers() + mtp_moe) * (self.moe.num_experts - self.moe.top_k) * self.expert_params()
        return n if input_embedding else n - (self.embedding_params() - self.encoder_params)


def _llama(name: str, layers: int, h: int, heads: int, kv: int, ffn: int, vocab: int, **kw: Any) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=h, num_attention_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=ffn, vocab_size=vocab, **kw,
    )


# Llama 4's vision encoder + adapter + projector (config.json vision_config of Llama-4-Scout-17B-16E: 34 layers of
# 1408 with MLP 5632, 336 px images in 14 px patches, pixel shuffle 0.5, projector 4096 -> 5120), as
# `hf_config.llama4_vision_params` counts it from the config.
_SCOUT_VISION = 871_932_416

# Published dimensions: Llama 3 (Dubey et al. 2024, Table 3), Mistral 7B (Jiang et al. 2023, Table 1),
# Mixtral (Jiang et al. 2024, sec. 2), GPT-3 175B (Brown et al. 2020, Table 2.1); the MoE presets below are the
# config.json of each released checkpoint on the Hugging Face hub: deepseek-ai/DeepSeek-V3,
# Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, mistralai/Mixtral-8x22B-v0.1, meta-llama/Llama-4-Scout-17B-16E,
# openai/gpt-oss-120b, openai/gpt-oss-20b, moonshotai/Kimi-K2-Base (DeepSeek-V3's num_nextn_predict_layers = 1: one
# multi-token-prediction module, outside its published 671B; Kimi K2's architecture is DeepSeek-V3's with 64 heads,
# 384 experts, one dense layer and ungrouped routing, num_nextn_predict_layers = 0).
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
        _llama(
            "mixtral-8x22b", 56, 6144, 48, 8, 16384, 32000,
            moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=16384),
        ),
        ModelSpec(
            name="deepseek-v3", num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
            vocab_size=129280,
            mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
            moe=MoESpec(num_experts=256, top_k=8, expert_ffn_hidden_size=2048, shared_experts=1,
                        first_dense_layers=3, router_bias=True, route_groups=8, route_groups_per_token=4),
            mtp_layers=1,
        ),
        ModelSpec(
            name="kimi-k2", num_layers=61, hidden_size=7168, num_attention_heads=64, ffn_hidden_size=18432,
            vocab_size=163840,
            mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
            moe=MoESpec(num_experts=384, top_k=8, expert_ffn_hidden_size=2048, shared_experts=1,
                        first_dense_layers=1, router_bias=True),
        ),
        _llama(
            "qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, head_dim=128, qk_norm=True,
            moe=MoESpec(num_experts=128, top_k=8, expert_ffn_hidden_size=768),
        ),
        _llama(
            "qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, head_dim=128, qk_norm=True,
            moe=MoESpec(num_experts=128, top_k=8, expert_ffn_hidden_size=1536),
        ),
        _llama(
            "llama4-scout-17b-16e", 48, 5120, 40, 8, 16384, 202048, head_dim=128,
            attention_window=8192, window_kind="chunked", global_attention_every=4, encoder_params=_SCOUT_VISION,
            moe=MoESpec(num_experts=16, top_k=1, expert_ffn_hidden_size=8192, shared_experts=1),
        ),
        _llama(
            "gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, head_dim=64, bias="all", attention_window=128,
            global_attention_every=2, attention_sinks=True,
            moe=MoESpec(num_experts=128, top_k=4, expert_ffn_hidden_size=2880, router_bias=True),
        ),
        _llama(
            "gpt-oss-20b", 24, 2880, 64, 8, 2880, 201088, head_dim=64, bias="all", attention_window=128,
            global_attention_every=2, attention_sinks=True,
            moe=MoESpec(num_experts=32, top_k=4, expert_ffn_hidden_size=2880, router_bias=True),
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
