"""NeMo Automodel's model states as it keeps them, and its published MoE layouts fitting the GPUs they ran on.

Automodel 0.7.0 keeps the resident FSDP2 shards in bf16 (model.torch_dtype bfloat16) with bf16 gradients; with
Transformer Engine FusedAdam (docs/guides/mixed-precision-training.mdx, Pattern A: master_weights,
store_param_remainders, fp32 exp_avg / exp_avg_sq) the fp32 master is the bf16 parameter plus a 16-bit remainder
("the same ~4 bytes/param as torch AdamW's fp32 resident parameter") and the moments are fp32; with torch.optim.Adam
on those bf16 parameters (its examples/llm_benchmark configs) the moments take the parameter's dtype and no
remainder exists.
"""

from __future__ import annotations

import pytest

from stratagem.evaluators import evaluate
from stratagem.evaluators.memory import model_state_bytes, optimizer_state_bytes
from stratagem.spaces import ClusterSpec, Plan, Scenario, gpu_preset, violations
from stratagem.spaces.stacks import stack_record


def _per_param(state_dtype: str) -> dict[str, float]:
    rec = stack_record("automodel")
    adam = optimizer_state_bytes("adamw", 4096, 14336) / (2.0 if state_dtype == "bf16" else 1.0)
    out = model_state_bytes(rec.states_for(state_dtype), 1.0, 3, 1.0, adam)  # type: ignore[arg-type]
    return {k: float(v) for k, v in out.items()}


def test_te_fused_adam_keeps_a_remainder_not_an_fp32_master() -> None:
    got = _per_param("fp32")
    # bf16 parameter 2 + bf16 gradient 2 + 16-bit remainder 2 + fp32 moments 8 (fused_adam.py store_param_remainders)
    assert got == {"weights": 2.0, "gradients": 2.0, "optimizer": 10.0}
    # the guide: parameter + remainder cost what torch AdamW's fp32 resident parameter costs (4 bytes)
    assert got["weights"] + (got["optimizer"] - 8.0) == 4.0


def test_torch_adam_on_bf16_parameters_keeps_bf16_moments_and_no_remainder() -> None:
    assert _per_param("bf16") == {"weights": 2.0, "gradients": 2.0, "optimizer": 4.0}


def test_every_state_is_sharded_over_the_fsdp_group() -> None:
    rec = stack_record("automodel")
    out = model_state_bytes(rec.states_for("fp32"), 1.0, 3, 8.0, 8.0)
    assert float(sum(out.values())) == pytest.approx(14.0 / 8)


# docs/performance-summary.mdx (NeMo Automodel, DGX-H100, BF16): layouts that ran on 80 GiB H100s, with the
# benchmark configs' torch.optim.Adam (bf16 moments), full activation checkpointing and DeepEP
PUBLISHED = [
    # DeepSeek V3 671B, 256 GPUs: GBS 512, MBS 1, LBS 8, TP1 PP4 EP64 VP8, FSDP 64
    ("deepseek-v3", 32, 512, Plan(dp=64, pp=4, ep=64, zero_stage=3, micro_batch_size=1, pp_schedule="interleaved",
                                  virtual_stages=8, activation_checkpointing="full")),
    # Qwen3 MoE 30B, 8 GPUs: GBS 512, MBS 4, GA 16, EP8, FSDP 8
    ("qwen3-30b-a3b", 1, 512, Plan(dp=8, ep=8, zero_stage=3, micro_batch_size=4, activation_checkpointing="full")),
]


@pytest.mark.parametrize(("model", "nodes", "gbs", "plan"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_automodel_layouts_fit(model: str, nodes: int, gbs: int, plan: Plan) -> None:
    scn = Scenario(model=model, cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=nodes, gpus_per_node=8),
                   training={"seq_len": 4096, "global_batch_size": gbs, "stack": "automodel",
                             "optimizer_state_dtype": "bf16"})
    assert violations(scn, plan) == []
    ev = evaluate(scn, plan)
    assert ev.status == "ok", (ev.status, ev.reason)
    if plan.pp == 1:  # bf16 moments (4 bytes) beside bf16 weights (2), both sharded alike: twice the weights
        assert ev.memory is not None and ev.memory.optimizer_gib == pytest.approx(2 * ev.memory.weights_gib)


@pytest.mark.parametrize(("state_dtype", "saved_bytes"), [("fp32", 2 + 2 + 8), ("bf16", 2 + 4)])
def test_checkpoint_saves_the_states_automodel_keeps(state_dtype: str, saved_bytes: float) -> None:
    """The training checkpoint holds the bf16 parameters, the optimizer's master remainders (TE FusedAdam) and its
    moments: 12 bytes per parameter with fp32 moments, 6 with torch Adam's bf16 ones (no fp32 master anywhere)."""
    scn = Scenario(model="llama3-8b", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=1, gpus_per_node=8),
                   training={"seq_len": 4096, "global_batch_size": 64, "stack": "automodel",
                             "optimizer_state_dtype": state_dtype})
    ev = evaluate(scn, Plan(dp=8, zero_stage=3))
    assert ev.checkpoint is not None
    assert ev.checkpoint.state_gib * 2**30 == pytest.approx(scn.model.num_params() * saved_bytes)
