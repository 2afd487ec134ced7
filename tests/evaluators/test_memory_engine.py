"""The torch engine's memory mechanisms (stratagem/evaluators/memory_engine.py) in the analytic model, each against
the bytes the engine's code implies for Llama 3 8B (what `stratagem trace` counts at full size)."""

from __future__ import annotations

import pytest

from stratagem.evaluators.calibration import DEFAULT_CALIBRATION
from stratagem.evaluators.memory import rank_memory_columns
from stratagem.evaluators.memory_engine import lpt_worst_bin
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset, violations
from stratagem.spaces.columns import PlanColumns

M = model_preset("llama3-8b")
P = M.num_params()
VH = M.vocab_size * M.hidden_size
NORMS = (2 * M.num_layers + 1) * M.hidden_size


def _scn(gpus: int, seq: int = 4096, gbs: int = 64) -> Scenario:
    return Scenario(model=M, cluster=cluster_preset("h100-sxm-80g", gpus),
                    training={"seq_len": seq, "global_batch_size": gbs, "stack": "torch"})


def _cols(scn: Scenario, plan: Plan, stage: str = "first") -> dict[str, float]:
    assert not violations(scn, plan), violations(scn, plan)
    cols = rank_memory_columns(scn, PlanColumns.from_plans([plan]), DEFAULT_CALIBRATION, stage)  # type: ignore[arg-type]
    return {k: float(v[0]) for k, v in cols.items()}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_autocast_copies_every_linear_weight_but_not_the_embedding(recompute: str) -> None:
    # one micro-batch in flight: at the end of its forward autocast's cache holds a bf16 copy of every linear weight
    # (recomputed or not); the embedding is looked up in fp32 and the norms are not cast
    plan = Plan(dp=8, zero_stage=0, precision="bf16", activation_checkpointing=recompute)
    assert _cols(_scn(8), plan)["weights"] == pytest.approx(4 * P + 2 * (P - VH - NORMS), rel=1e-9)


@pytest.mark.parametrize("recompute,in_flight_copies", [("none", 4), ("selective", None), ("full", 1)])
def test_autocast_copies_per_in_flight_micro_batch(recompute: str, in_flight_copies: int | None) -> None:
    # pp 4, 1F1B: stage 0 holds 4 micro-batches; each keeps the casts its backward saved (checkpointed regions: none;
    # selective: all but w2), the one finishing its forward all of them
    plan = Plan(pp=4, precision="bf16", activation_checkpointing=recompute)
    cols = _cols(_scn(4), plan)
    layer = M.dense_layer_params() - 2 * M.hidden_size  # the linear weights of one layer
    stage = 8 * layer
    opt_params = cols["optimizer"] / 8  # AdamW: 8 B per parameter of the stage (embedding included)
    if in_flight_copies is None:
        w2 = M.hidden_size * M.ffn_hidden_size
        copies = 3 * 8 * (layer - w2) + stage
    else:
        copies = in_flight_copies * stage
    assert cols["weights"] == pytest.approx(4 * opt_params + 2 * copies, rel=1e-9)


def test_zero1_fullest_rank_holds_whole_parameters() -> None:
    # dp 64: the embedding alone (525M) is over 1/64 of the model (125M): its rank holds its AdamW states only
    plan = Plan(dp=64, zero_stage=1, precision="bf16")
    assert _cols(_scn(64), plan)["optimizer"] == pytest.approx(8 * VH, rel=1e-9)
    assert lpt_worst_bin(((5.0, 1), (3.0, 4)), 2) == 9.0  # 5 | 3 3 -> 5 3 | 3 3 -> 5 3 | 3 3 3


def test_ddp_accumulation_holds_grads_beside_the_buckets() -> None:
    one = _cols(_scn(8, gbs=8), Plan(dp=8, zero_stage=0, precision="bf16"))  # 1 micro-batch
    many = _cols(_scn(8, gbs=64), Plan(dp=8, zero_stage=0, precision="bf16"))  # 8 micro-batches, no_sync
    assert one["gradients"] == pytest.approx(4 * P, rel=1e-9)
    assert many["gradients"] == pytest.approx(8 * P, rel=1e-9)


def test_fsdp2_cpu_offload_keeps_shards_on_the_host() -> None:
    plan = Plan(dp=8, zero_stage=3, precision="bf16", optimizer_offload="cpu")
    cols = _cols(_scn(8), plan)
    assert cols["weights"] == 0.0 and cols["gradients"] == 0.0 and cols["optimizer"] == 0.0


def test_pipeline_keeps_a_receive_buffer_per_micro_batch() -> None:
    seq = 4096
    plan = Plan(pp=4, precision="bf16", activation_checkpointing="full")
    few, many = (_cols(_scn(4, seq, gbs), plan) for gbs in (8, 16))  # m = 8, 16; 4 in flight either way
    sbh_fp32 = seq * M.hidden_size * 4  # autocast: the residual stream crosses stages in fp32
    assert many["activations"] - few["activations"] == pytest.approx(8 * sbh_fp32, rel=1e-9)  # gradient buffers


def test_pipelined_fsdp_accumulates_unsharded_gradients() -> None:
    plan = Plan(dp=2, pp=2, zero_stage=2, precision="bf16")
    first = _cols(_scn(4), plan)
    stage_params = first["optimizer"] / 8 * 2  # AdamW 8 B per parameter, sharded over dp = 2
    assert first["gradients"] == pytest.approx(4 * stage_params, rel=1e-9)  # fp32 (reduce dtype), unsharded


def test_autocast_saves_fp32_residuals_and_one_cast_per_linear() -> None:
    seq = 4096
    sbh = seq * M.hidden_size
    autocast = _cols(_scn(2, seq, 2), Plan(dp=2, zero_stage=1, precision="bf16"))
    fsdp = _cols(_scn(2, seq, 2), Plan(dp=2, zero_stage=3, precision="bf16"))
    # per layer: two fp32 norm inputs (+2 B each) and three more bf16 casts (wk, wv, w3); the final norm in fp32
    extra = M.num_layers * (2 * 2 * sbh + 3 * 2 * sbh) + 2 * sbh
    assert autocast["activations"] - fsdp["activations"] == pytest.approx(extra, rel=1e-9)


def test_gradients_made_in_backward_overlap_the_freed_micro_batch() -> None:
    # 1F1B stage 0 with m = pp runs no forward after its first backward (as GPipe): the unsharded gradients FSDP2
    # accumulates appear while one micro-batch's activations are freed; with m = 2 pp a forward follows
    plan = Plan(dp=2, pp=2, zero_stage=2, precision="bf16")
    filled, steady = (_cols(_scn(4, gbs=gbs), plan) for gbs in (4, 8))  # m = 2 = pp, m = 4
    assert filled["gradients"] < steady["gradients"]
    last_filled, last_steady = (_cols(_scn(4, gbs=gbs), plan, "last") for gbs in (4, 8))
    assert last_filled["gradients"] == last_steady["gradients"]  # the last stage runs F B F B


def test_interleaved_warmup_covering_every_forward_holds_the_last_chunks_gradients_first() -> None:
    # pp 4, v 2: rank 0's warmup of (v - 1) p + 2 (p - 1) = 10 forwards covers all v m = 8 when m = 4, not when m = 8
    plan = Plan(dp=2, pp=4, zero_stage=0, precision="bf16", pp_schedule="interleaved", virtual_stages=2)
    filled, steady = (_cols(_scn(8, gbs=gbs), plan) for gbs in (8, 16))
    buckets = filled["optimizer"] / 2  # DDP buckets: fp32 (4 B) per parameter; AdamW states 8 B
    assert buckets < filled["gradients"] < steady["gradients"] == pytest.approx(2 * buckets, rel=1e-9)
