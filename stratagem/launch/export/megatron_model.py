"""The megatron target's MODEL_ARGS: Megatron-LM's pretrain_gpt.py arguments for the architecture (shape,
positions, MLP, norm, biases), its MoE, its attention variants, no dropout and the vocabulary padding; what
Megatron cannot express is noted. Verified against the release pinned here (megatron.py's docstring says how):
  arguments.py                 --moe-layer-freq's list pattern, --window-size / --window-attn-skip-freq
  core/transformer/multi_latent_attention.py   the MLA options
  training/vocab_utils.py      vocabulary padding to a multiple of 128 x tp
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stratagem.launch.export.bundle import FieldNote, Layout
from stratagem.launch.export.model_fields import model_constants
from stratagem.launch.export.rope import megatron_rope_args
from stratagem.spaces.model import ModelSpec

__all__ = ["MEGATRON_VERSION", "MEGATRON_COMMIT", "Notes", "model_args"]

# The Megatron-LM release both megatron modules are verified against (megatron.py re-exports the pins).
MEGATRON_VERSION = "core_v0.19.0"
MEGATRON_COMMIT = "5be9626709af2722333bf54797c954c09edeada3"
_VOCAB_MULTIPLE = 128  # --make-vocab-size-divisible-by default


def _layer_pattern(flags: list[int]) -> str:
    """A --moe-layer-freq list pattern, run-length encoded: [0,0,0,1,1] -> "([0]*3+[1]*2)"."""
    runs: list[tuple[int, int]] = []
    for f in flags:
        if runs and runs[-1][0] == f:
            runs[-1] = (f, runs[-1][1] + 1)
        else:
            runs.append((f, 1))
    return "(" + "+".join(f"[{f}]*{n}" for f, n in runs) + ")"


@dataclass
class Notes:
    """The fields an export cannot express (un) and those it writes approximately (ap), in the order found."""

    un: list[FieldNote] = field(default_factory=list)
    """Fields left out: ExportBundle.unexpressed."""
    ap: list[FieldNote] = field(default_factory=list)
    """Fields written approximately: ExportBundle.approximated."""


def _shape_args(lay: Layout, notes: Notes) -> list[str]:
    """Model dimensions, attention heads, position embedding, MLP, norm, embedding tying and biases."""
    m, tr = lay.scenario.model, lay.scenario.training
    model = [
        "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads),
    ]
    if m.head_dim is not None and m.head_dim * m.num_attention_heads != m.hidden_size:
        model += ["--kv-channels", str(m.head_dim)]
    if m.kv_heads != m.num_attention_heads:
        model += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    model += ["--seq-length", str(tr.seq_len)]
    # rotary base and norm epsilon: Megatron's defaults (--rotary-base 10000, --norm-epsilon 1e-5) are wrong for
    # Llama 3 (500000), DeepSeek-V3 (1e-6), ...: always written (model_fields.PUBLISHED)
    consts = model_constants(m)
    if not consts.source:
        notes.ap.append(FieldNote("model.rope_theta", f"not known for {m.name}: Megatron's defaults --rotary-base "
                                  f"{consts.rope_theta} / --norm-epsilon {consts.norm_eps:g} are written, no rope "
                                  "scaling; set your checkpoint's rope_theta, norm epsilon and rope_scaling"))
    if m.position_embedding == "rope":  # rope scaling (Llama 3.1, YaRN): launch/export/rope.py
        kind, scaling = megatron_rope_args(m, notes.ap)
        model += ["--position-embedding-type", kind, "--max-position-embeddings", str(tr.seq_len),
                  "--rotary-base", str(consts.rope_theta), *scaling]
    else:
        model += ["--position-embedding-type", "learned_absolute",
                  "--max-position-embeddings", str(m.max_position_embeddings)]
    if m.mlp == "swiglu":
        model.append("--swiglu")
    model += ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm",
              "--norm-epsilon", f"{consts.norm_eps:g}"]
    if not m.tied_embeddings:
        model.append("--untie-embeddings-and-output-weights")
    if m.bias == "none":
        model.append("--disable-bias-linear")
    elif m.bias == "qkv":
        model += ["--disable-bias-linear", "--add-qkv-bias"]
    return model


def _moe_args(m: ModelSpec, notes: Notes) -> list[str]:
    """MoE experts, router top-k and scoring, shared experts, dense-layer pattern and capacity factor."""
    if m.moe is None:
        return []
    model = ["--num-experts", str(m.moe.num_experts), "--moe-router-topk", str(m.moe.top_k),
             "--moe-ffn-hidden-size", str(m.moe.expert_ffn_hidden_size),
             "--moe-grouped-gemm"]  # TransformerConfig: recompute of moe_act needs grouped GEMM
    if m.moe.shared_experts:  # Megatron's shared expert is one MLP of the summed size
        model += ["--moe-shared-expert-intermediate-size", str(m.moe.shared_experts * m.moe.shared_ffn)]
    if m.num_moe_layers() < m.num_layers:  # dense layers: arguments.py moe_freq_type's list pattern
        model += ["--moe-layer-freq", _layer_pattern([int(m.is_moe_layer(i)) for i in range(m.num_layers)])]
    if m.moe.router_bias and m.mla is not None:  # DeepSeek-V3: sigmoid scores + aux-loss-free expert bias
        model += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
    elif m.moe.router_bias:
        notes.un.append(FieldNote("model.moe.router_bias", "true: Megatron's router has no linear bias (gpt-oss); "
                                  "the router is written without it"))
    if m.moe.capacity_factor is not None:
        model += ["--moe-expert-capacity-factor", str(m.moe.capacity_factor)]
    return model


def _attention_args(m: ModelSpec, notes: Notes) -> list[str]:
    """Attention variants: multi-head latent attention, QK norm, sliding windows; sinks noted."""
    model: list[str] = []
    if m.mla is not None:  # Multi-head Latent Attention (megatron/core/transformer/multi_latent_attention.py)
        model += ["--multi-latent-attention", "--kv-lora-rank", str(m.mla.kv_lora_rank),
                  "--qk-head-dim", str(m.mla.qk_nope_head_dim), "--qk-pos-emb-head-dim", str(m.mla.qk_rope_head_dim),
                  "--v-head-dim", str(m.mla.v_head_dim)]
        if m.mla.q_lora_rank is not None:
            model += ["--q-lora-rank", str(m.mla.q_lora_rank)]
    if m.qk_norm:
        model.append("--qk-layernorm")
    if m.attention_window is not None:
        if m.window_kind == "sliding":  # arguments.py --window-size (left, right), --window-attn-skip-freq N
            model += ["--window-size", f"({m.attention_window},0)"]
            if m.global_attention_every:
                model += ["--window-attn-skip-freq", str(m.global_attention_every)]
        else:
            notes.un.append(FieldNote("model.attention_window", f"{m.attention_window} (chunked, Llama 4): Megatron-LM "
                                      f"{MEGATRON_VERSION}'s GPT model has no chunked attention; layers attend globally"))
    if m.attention_sinks:
        notes.un.append(FieldNote("model.attention_sinks", "true: learned sink logits are not written; set "
                                  "TransformerConfig.softmax_type='learnable' in a model provider"))
    return model


def _vocab_args(lay: Layout, notes: Notes) -> list[str]:
    """The vocabulary padding multiple, written, and a note when padding to 128 x tp adds rows."""
    m, p = lay.scenario.model, lay.plan
    multiple = _VOCAB_MULTIPLE * p.tp
    padded = -(-m.vocab_size // multiple) * multiple
    if padded != m.vocab_size:
        notes.ap.append(FieldNote(
            "model.vocab_size",
            f"{m.vocab_size}: Megatron pads the embedding and output to a multiple of 128 x tp = {padded} rows "
            "(--make-vocab-size-divisible-by 128): slightly more memory and compute than planned",
        ))
    return ["--make-vocab-size-divisible-by", str(_VOCAB_MULTIPLE)]  # written, not left to the default


def model_args(lay: Layout, notes: Notes) -> list[str]:
    """MODEL_ARGS: the architecture, MoE, attention variants, no dropout, vocabulary padding."""
    m = lay.scenario.model
    model = _shape_args(lay, notes) + _moe_args(m, notes) + _attention_args(m, notes)
    if m.encoder_params:
        notes.un.append(FieldNote("model.encoder_params", f"{m.encoder_params}: pretrain_gpt.py builds no vision "
                                  "encoder; the text decoder alone is written"))
    if m.mtp_layers:  # megatron/training/arguments.py --mtp-num-layers: the modules on the last stage
        model += ["--mtp-num-layers", str(m.mtp_layers)]
    # stratagem's activation model has no dropout (Megatron's default is 0.1 and saves masks)
    model += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    return model + _vocab_args(lay, notes)
