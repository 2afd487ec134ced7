"""Rotary scaling for each target, one home: what every exporter writes for a model whose checkpoint rescales its
rotary frequencies (model_fields.ROPE_SCALING: Llama 3.1's and Llama 4 Scout's "llama3" scaling, DeepSeek-V3's and
gpt-oss's YaRN), and what it notes where the engine fixes the scaling itself.

- Megatron-LM core_v0.19.0 (megatron/training/arguments.py, argument_utils.py): llama3 scaling is
  `--use-rope-scaling --rope-scaling-factor F` (RotaryEmbedding._apply_scaling fixes low_freq_factor 1,
  high_freq_factor 4, original_max_position_embeddings 8192: Llama 4 Scout's high_freq_factor 1 is noted);
  Multi-head Latent Attention reads
  `--rope-type yarn --rotary-scaling-factor F --mscale M --mscale-all-dim A` into MLATransformerConfig, whose
  original_max_position_embeddings (4096), beta_fast (32) and beta_slow (1) have no option, and whose
  YarnRotaryEmbedding always rounds the correction range (multi_latent_attention.py passes no
  correction_range_round_to_int). YaRN for other attention (gpt-oss) is `--position-embedding-type yarn
  --rotary-scaling-factor F --yarn-original-max-position-embeddings O --yarn-beta-fast B --yarn-beta-slow b
  --mscale M --mscale-all-dim A [--no-yarn-correction-range-round-to-int]`, which
  argument_utils._apply_yarn_config_from_args copies into the config.yarn_* that GPTModel's YarnRotaryEmbedding
  reads (megatron/core/models/gpt/gpt_model.py); validate_args refuses it with --mtp-num-layers, so there it is
  noted, not written. Left out, Megatron runs plain rotary for llama3 and for gpt-oss's YaRN, and
  --rotary-scaling-factor 1.0 / --mscale-all-dim 0.0 for MLA's YaRN.
- torchtitan v0.2.2: the llama3 model always applies llama3 scaling with RoPEScalingArgs' defaults (factor 8,
  low 1, high 4, original 8192: torchtitan/models/llama3/model/args.py, model.py precompute_freqs_cis), fixed
  per registered flavor: right for Llama 3.1, wrong for a model without scaling, with YaRN or with Llama 4 Scout's
  factor 16 / high_freq_factor 1 (the llama4 model's RoPEScalingArgs defaults, torchtitan/models/llama4/model/args.py;
  the exports build the llama3 model).
- DeepSpeed and the torchrun harness build no model from a config: the README / notes name the scaling (the
  harness's model has none: other numerics, same step cost).
- NeMo Automodel builds the model from the checkpoint's own config.json (automodel.hf_model_id), rope_scaling
  included (nemo_automodel/components/models/gpt_oss/model.py reads it for gpt-oss; Llama 4 Scout's is in its
  config.json text_config): nothing is written.
"""

from __future__ import annotations

from stratagem.launch.export.bundle import FieldNote
from stratagem.launch.export.model_fields import RopeScaling, model_constants
from stratagem.spaces.model import ModelSpec

__all__ = ["megatron_rope_args", "torchtitan_rope_comment", "TORCHTITAN_LLAMA3_SCALING", "TORCHTITAN_LLAMA4_SCALING"]

_MEGATRON_LLAMA3_FIXED = (1.0, 4.0, 8192)
"""Megatron RotaryEmbedding._apply_scaling's low_freq_factor, high_freq_factor, original_max_position_embeddings."""
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_MEGATRON_MLA_FIXED = (4096, 32.0, 1.0)
"""MLATransformerConfig's original_max_position_embeddings, beta_fast, beta_slow (no command-line option)."""
TORCHTITAN_LLAMA3_SCALING = RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
"""torchtitan llama3 RoPEScalingArgs() defaults, applied by every registered llama3 flavor."""
TORCHTITAN_LLAMA4_SCALING = RopeScaling("llama3", 16.0, 8192, low_freq_factor=1.0, high_freq_factor=1.0)
"""torchtitan llama4 RoPEScalingArgs() defaults (torchtitan/models/llama4/model/args.py), set by its 17bx16e flavor
(torchtitan/models/llama4/__init__.py); the exports build the llama3 model, which does not read them."""


def _g(x: float | None, default: float) -> str:
    return f"{default if x is None else x:g}"


def megatron_rope_args(m: ModelSpec, approximated: list[FieldNote]) -> tuple[str, list[str]]:
    """(--position-embedding-type value, the scaling options) for a rotary model; a note in `approximated`
    where Megatron fixes a field the checkpoint sets otherwise."""
    rs = model_constants(m).rope_scaling
    if rs is None:
        return "rope", []
    if rs.kind == "llama3":
        given = (rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings)
        if given != _MEGATRON_LLAMA3_FIXED:
            # only the factor is an option: RotaryEmbedding calls _apply_scaling with its defaults for the rest
            m_low, m_high, m_orig = _MEGATRON_LLAMA3_FIXED
            low, high, orig = (fixed if g is None else g
                               for g, fixed in zip(given, _MEGATRON_LLAMA3_FIXED, strict=True))
            runs = ", ".join(f"{name} {fixed:g} instead of {'unset' if g is None else f'{g:g}'}"
                             for name, g, fixed in zip(_LLAMA3_FIELDS, given, _MEGATRON_LLAMA3_FIXED, strict=True)
                             if g != fixed)
            approximated.append(FieldNote(
                "model.rope_scaling",
                f"{rs.words()}: Megatron fixes low_freq_factor, high_freq_factor and original_max_position_embeddings "
                f"at {m_low:g}, {m_high:g}, {m_orig} (RotaryEmbedding._apply_scaling): {runs}; it keeps the "
                f"frequencies of wavelength under {m_orig / m_high:g} tokens and divides those over "
                f"{m_orig / m_low:g} by {rs.factor:g} (between: interpolated), the checkpoint keeps those under "
                f"{orig / high:g} and divides those over {orig / low:g}"))
        return "rope", ["--use-rope-scaling", "--rope-scaling-factor", f"{rs.factor:g}"]
    if rs.kind == "yarn" and m.mla is not None:
        if (rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow) != _MEGATRON_MLA_FIXED:
            approximated.append(FieldNote("model.rope_scaling", f"{rs.words()}: MLATransformerConfig fixes "
                                          "original_max_position_embeddings, beta_fast, beta_slow at 4096, 32, 1 "
                                          "(no option); set them in a YAML config"))
        if rs.truncate is False:
            approximated.append(FieldNote("model.rope_scaling", f"{rs.words()}: Multi-head Latent Attention's "
                                          "YarnRotaryEmbedding always rounds the correction range (truncate true; "
                                          "multi_latent_attention.py)"))
        return "rope", ["--rope-type", "yarn", "--rotary-scaling-factor", f"{rs.factor:g}", "--mscale",
                        _g(rs.mscale, 1.0), "--mscale-all-dim", _g(rs.mscale_all_dim, 0.0)]
    if rs.kind == "yarn" and not m.mtp_layers:
        # without mscale in config.json (gpt-oss), transformers' attention factor is 0.1 ln(factor) + 1: what
        # Megatron's _yarn_get_concentration_factor gives for mscale 1, mscale_all_dim 0 (its defaults, written)
        args = ["--rotary-scaling-factor", f"{rs.factor:g}",
                "--yarn-original-max-position-embeddings", str(rs.original_max_position_embeddings),
                "--yarn-beta-fast", _g(rs.beta_fast, 32.0), "--yarn-beta-slow", _g(rs.beta_slow, 1.0),
                "--mscale", _g(rs.mscale, 1.0), "--mscale-all-dim", _g(rs.mscale_all_dim, 0.0)]
        if rs.truncate is False:  # config.json "truncate": false (YarnRotaryEmbedding correction_range_round_to_int)
            args.append("--no-yarn-correction-range-round-to-int")
        return "yarn", args
    approximated.append(FieldNote("model.rope_scaling", f"{rs.words()}: not written; Megatron's validate_args "
                                  "refuses --position-embedding-type yarn with --mtp-num-layers"
                                  if rs.kind == "yarn" else f"{rs.words()}: not written (Megatron takes llama3 "
                                  "scaling and YaRN only)"))
    return "rope", []


def torchtitan_rope_comment(m: ModelSpec) -> str:
    """What torchtitan's llama3 model does to this model's rotary frequencies, for the model comment."""
    consts = model_constants(m)
    rs = consts.rope_scaling
    applied = TORCHTITAN_LLAMA3_SCALING.words()
    if not consts.source:
        return (f"rope scaling not known for {m.name}; torchtitan's llama3 model always applies {applied} "
                "(RoPEScalingArgs defaults): a flavor registered for this model must set rope_scaling_args to "
                "your checkpoint's (factor 1: none)")
    if rs == TORCHTITAN_LLAMA3_SCALING:
        return f"{rs.words()}: as torchtitan's llama3 model applies it (RoPEScalingArgs defaults)"
    has = rs.words() if rs is not None else "no rope scaling"
    llama4 = (" (the defaults of torchtitan's llama4 RoPEScalingArgs, torchtitan/models/llama4/model/args.py)"
              if rs == TORCHTITAN_LLAMA4_SCALING else "")
    return (f"{m.name} has {has}, but torchtitan's llama3 model always applies {applied} (RoPEScalingArgs "
            "defaults, torchtitan/models/llama3/model/args.py): a flavor registered for this model must set "
            "rope_scaling_args" + (" to match" + llama4 if rs is not None else " to factor 1 (no scaling)"))
