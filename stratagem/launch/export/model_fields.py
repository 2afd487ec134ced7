"""Model constants an engine needs and would otherwise default wrongly: the rotary base (rope_theta), the norm
epsilon and the rotary scaling (rope_scaling: Llama 3.1's and Llama 4 Scout's frequency scaling, DeepSeek-V3's
and gpt-oss's YaRN). The scenario's ModelSpec does not carry them (they change neither memory nor time), so the
exporters read them here, per preset, from the `config.json` of each released checkpoint on the Hugging Face hub.
A model not listed gets the engine's default written explicitly, with a note saying to set the checkpoint's
values.

Engine defaults they replace: Megatron-LM core_v0.19.0 --rotary-base 10000 (megatron/training/arguments.py) and
--norm-epsilon 1e-5 (TransformerConfig.layernorm_epsilon); torchtitan's llama3 TransformerModelArgs rope_theta
500000 and norm_eps 1e-5 (torchtitan/models/llama3/model/args.py), fixed per registered flavor.
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem.spaces.model import ModelSpec

__all__ = ["ModelConstants", "RopeScaling", "model_constants", "PUBLISHED", "ROPE_SCALING", "THROUGHPUT_WARMUP",
           "THROUGHPUT_TIMED", "throughput_steps"]


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's `rope_scaling` (Hugging Face config.json): how the rotary frequencies are rescaled."""

    kind: str
    """"llama3" (Llama 3.1: low frequencies divided by `factor`, a smooth band between) or "yarn" (YaRN, Peng et
    al. 2023, arXiv 2309.00071: NTK-by-parts interpolation with an attention temperature)."""
    factor: float
    """The context-extension factor (config.json "factor")."""
    original_max_position_embeddings: int
    """The context the model was pre-trained at before the extension."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original / low_freq_factor are scaled by 1 / factor."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original / high_freq_factor are kept."""
    beta_fast: float | None = None
    """yarn: the fast boundary of the correction range (rotations)."""
    beta_slow: float | None = None
    """yarn: the slow boundary of the correction range (rotations)."""
    mscale: float | None = None
    """yarn: the attention temperature's scale."""
    mscale_all_dim: float | None = None
    """yarn: the temperature's scale over all dimensions (DeepSeek's MLA)."""
    truncate: bool | None = None
    """yarn: config.json "truncate", whether the correction range's ends are rounded to whole dimensions (None: not
    set, rounded). Read by Hugging Face transformers (modeling_rope_utils.py _compute_yarn_parameters:
    rope_scaling.get("truncate", True)) and by Megatron-LM core_v0.19.0's GPT model (YarnRotaryEmbedding
    correction_range_round_to_int, megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py; the
    option --no-yarn-correction-range-round-to-int in megatron/training/arguments.py)."""

    def words(self) -> str:
        """`rope_scaling llama3 (factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings
        8192)`: every field the checkpoint sets, as config.json names it."""
        fields = {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                  "high_freq_factor": self.high_freq_factor, "beta_fast": self.beta_fast,
                  "beta_slow": self.beta_slow, "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim,
                  "original_max_position_embeddings": self.original_max_position_embeddings}
        words = [f"{k} {v:g}" for k, v in fields.items() if v is not None]
        if self.truncate is not None:
            words.append(f"truncate {str(self.truncate).lower()}")
        return f"rope_scaling {self.kind} (" + ", ".join(words) + ")"


@dataclass(frozen=True)
class ModelConstants:
    """The rotary base and norm epsilon of a model, and where they come from."""

    rope_theta: int | None
    """Rotary base (None: learned absolute positions, no rotary embedding)."""
    norm_eps: float
    """Epsilon of every LayerNorm/RMSNorm."""
    source: str
    """The config the values are read from; empty when they are the engine's defaults (not known)."""
    rope_scaling: RopeScaling | None = None
    """The checkpoint's rotary scaling (ROPE_SCALING); None: none (plain rotary, or not known when `source` is
    empty)."""


# preset name -> (rope_theta, rms_norm_eps / layer_norm_epsilon, the config.json they are read from)
PUBLISHED: dict[str, tuple[int | None, float, str]] = {
    "llama3-8b": (500000, 1e-5, "meta-llama/Meta-Llama-3-8B config.json"),
    "llama3-70b": (500000, 1e-5, "meta-llama/Meta-Llama-3-70B config.json"),
    "llama3-405b": (500000, 1e-5, "meta-llama/Llama-3.1-405B config.json"),
    "mistral-7b": (10000, 1e-5, "mistralai/Mistral-7B-v0.1 config.json"),
    "mixtral-8x7b": (1000000, 1e-5, "mistralai/Mixtral-8x7B-v0.1 config.json"),
    "mixtral-8x22b": (1000000, 1e-5, "mistralai/Mixtral-8x22B-v0.1 config.json"),
    "deepseek-v3": (10000, 1e-6, "deepseek-ai/DeepSeek-V3 config.json"),
    "qwen3-30b-a3b": (1000000, 1e-6, "Qwen/Qwen3-30B-A3B config.json"),
    "qwen3-235b-a22b": (1000000, 1e-6, "Qwen/Qwen3-235B-A22B config.json"),
    "llama4-scout-17b-16e": (500000, 1e-5, "meta-llama/Llama-4-Scout-17B-16E config.json (text_config)"),
    "gpt-oss-120b": (150000, 1e-5, "openai/gpt-oss-120b config.json"),
    "gpt-oss-20b": (150000, 1e-5, "openai/gpt-oss-20b config.json"),
    "gpt3-175b": (None, 1e-5, "GPT-3 (Brown et al. 2020) as GPT-2's layer_norm_epsilon; learned positions"),
    # stratagem's own harness model (launch/harness/model.py ROPE_THETA, RMSNorm eps)
    "tiny": (500000, 1e-5, "stratagem harness model (launch/harness/model.py)"),
    "tiny-4l": (500000, 1e-5, "stratagem harness model (launch/harness/model.py)"),
    "tiny-moe": (500000, 1e-5, "stratagem harness model (launch/harness/model.py)"),
}


# preset name -> rope_scaling of the same config.json as PUBLISHED (presets whose config.json has
# "rope_scaling": null are not listed: Llama 3 8B/70B (Meta-Llama-3), Mistral, Mixtral, Qwen3)
ROPE_SCALING: dict[str, RopeScaling] = {
    # meta-llama/Llama-3.1-405B config.json: {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    # "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    "llama3-405b": RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),
    # meta-llama/Llama-4-Scout-17B-16E config.json text_config: {"factor": 16.0, "high_freq_factor": 1.0,
    # "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"} (the defaults of
    # torchtitan v0.2.2's llama4 RoPEScalingArgs, torchtitan/models/llama4/model/args.py). Its NoPE layers (every
    # 4th, no_rope_layers) carry no rotary embedding at all: the scaling applies to the chunked-attention layers
    "llama4-scout-17b-16e": RopeScaling("llama3", 16.0, 8192, low_freq_factor=1.0, high_freq_factor=1.0),
    # deepseek-ai/DeepSeek-V3 config.json: {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
    # "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    "deepseek-v3": RopeScaling("yarn", 40.0, 4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    # openai/gpt-oss-120b and openai/gpt-oss-20b config.json (the same): {"beta_fast": 32.0, "beta_slow": 1.0,
    # "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false}
    "gpt-oss-120b": RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
    "gpt-oss-20b": RopeScaling("yarn", 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False),
}


def model_constants(model: ModelSpec, default_theta: int = 10000, default_eps: float = 1e-5) -> ModelConstants:
    """The model's rotary base and norm epsilon (PUBLISHED, by preset name); for a model not listed, the
    engine's defaults `default_theta` / `default_eps` with an empty source (the exporter notes it)."""
    found = PUBLISHED.get(model.name)
    if found is not None:
        theta, eps, source = found
        rope = model.position_embedding == "rope"
        return ModelConstants(theta if rope else None, eps, source, ROPE_SCALING.get(model.name) if rope else None)
    return ModelConstants(default_theta if model.position_embedding == "rope" else None, default_eps, "")


# A throughput check, not the training run: the first steps pay for compilation, allocator growth and
# communicator set-up, so THROUGHPUT_WARMUP steps are left out of the figure; THROUGHPUT_TIMED timed steps give
# a median whose 95 % order-statistic interval (evaluators/spread.py spread_of_samples) spans ranks 14-27 of
# 40 (1-based), i.e. it leaves out the slowest and fastest third of the samples.
THROUGHPUT_WARMUP = 10
THROUGHPUT_TIMED = 40


def throughput_steps() -> int:
    """Optimizer steps of an exported throughput check: warm-up plus timed steps."""
    return THROUGHPUT_WARMUP + THROUGHPUT_TIMED
