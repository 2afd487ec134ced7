"""TP overlap as the engines run it and the published torchtitan pairs (issue 24 items 2 and 4).

Published pairs: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch 1963fc8, torchtitan 9dec370,
Grand Teton H100 96 GB at the 500 W default limit):
  Table 4  Llama 3.1 70B, 256 GPUs (FSDP 32, TP 8), local batch 16, full AC, compile + Float8:
           2D 829 tok/s/GPU (71.9 GiB), 2D + AsyncTP 876 (67.6 GiB): +5.7%.
  Table 5  Llama 3.1 405B, 512 GPUs (FSDP 8, TP 8, PP 8), local batch 32, full AC, compile + Float8 + AsyncTP:
           1F1B 100 tok/s/GPU (82.5 GiB), Interleaved 1F1B 128 (72.7 GiB): +28%. torchtitan 9dec370 splits the
           local batch into pipeline_parallel_degree micro-batches when none are set
           (parallelisms/pipelining_utils.py build_pipeline_schedule): 8 micro-batches of 4, and 2 stages per rank
           for the looped schedule (generate_split_points).
"""

from __future__ import annotations

import numpy as np
import pytest

from stratagem.evaluators import DEFAULT_CALIBRATION, evaluate_many
from stratagem.evaluators.comm import all_gather_s, group_link, reduce_scatter_s
from stratagem.evaluators.memory import rank_memory_columns
from stratagem.evaluators.step_terms import step_context, tp_layer_s, tp_traffic_s
from stratagem.evaluators.timing import speed_rows
from stratagem.spaces import MODEL_PRESETS, ClusterSpec, Plan, Scenario, TrainingSpec, gpu_preset
from stratagem.spaces.columns import PlanColumns


def _scn(model: str, gpus: int, gbs: int, async_tp: bool, **kw: object) -> Scenario:
    cluster = ClusterSpec(gpu=gpu_preset("h100-96g"), num_nodes=gpus // 8, gpus_per_node=8, power_cap_w=500.0)
    training = TrainingSpec(seq_len=8192, global_batch_size=gbs, stack="torch", compile=True, precision="fp8",
                            tp_comm_overlap=async_tp, **kw)  # type: ignore[arg-type]
    return Scenario(model=MODEL_PRESETS[model], cluster=cluster, training=training)


PLAN_70B = Plan(dp=32, tp=8, zero_stage=3, micro_batch_size=16, sequence_parallel=True, precision="fp8",
                activation_checkpointing="full")


def _pp405(schedule: str) -> Plan:
    return Plan(dp=8, tp=8, pp=8, zero_stage=3, micro_batch_size=4, sequence_parallel=True, precision="fp8",
                activation_checkpointing="full", pp_schedule=schedule,  # type: ignore[arg-type]
                virtual_stages=2 if schedule == "interleaved" else 1)


def test_async_tp_pair_as_published() -> None:
    vanilla = float(evaluate_many(_scn("llama3-70b", 256, 512, False), [PLAN_70B]).tokens_per_s_per_gpu[0])
    fused = float(evaluate_many(_scn("llama3-70b", 256, 512, True), [PLAN_70B]).tokens_per_s_per_gpu[0])
    assert vanilla == pytest.approx(829, rel=0.15) and fused == pytest.approx(876, rel=0.15)
    # published +5.7%; the engine's mechanism (below) leaves the backward reduce-scatters and each fused op's
    # staging, barriers and reduction exposed: about +14%, where crediting every chunk gave +28%
    assert 1.0 < fused / vanilla < 1.0 + 3 * 0.057


def test_async_tp_leaves_the_unmatched_collectives_exposed() -> None:
    """Even with GEMMs far longer than their copies, the backward's 2 reduce-scatters (of the summed input
    gradients: no producer matmul for inductor's micro_pipeline_tp to fuse) stay NCCL, and what is hidden is
    below the whole traffic."""
    scn = _scn("llama3-70b", 256, 512, True)
    ctx = step_context(scn, PlanColumns.from_plans([PLAN_70B]), DEFAULT_CALIBRATION)
    exposed, total = tp_layer_s(ctx)
    nccl = group_link(scn.cluster, DEFAULT_CALIBRATION, np.array([8.0]), 1.0)
    assert exposed[0] >= 2 * reduce_scatter_s(nccl, ctx.activation)[0]
    assert 0.3 < 1 - exposed[0] / total[0] < 0.8


def test_fp8_gathers_move_one_byte() -> None:
    """torchtitan's float8 TP (torchao, tensorwise) casts before every all-gather: forward inputs
    (Float8ColwiseParallel / PrepareFloat8ModuleInput), backward output gradients (Float8RowwiseParallel's
    _NoopFwToFloat8BwDynamic); the reduce-scatters stay bf16."""
    fp8 = _scn("llama3-70b", 256, 512, False)
    ctx8 = step_context(fp8, PlanColumns.from_plans([PLAN_70B]), DEFAULT_CALIBRATION)
    bf16_plan = PLAN_70B.model_copy(update={"precision": "bf16"})
    ctx16 = step_context(fp8, PlanColumns.from_plans([bf16_plan]), DEFAULT_CALIBRATION)
    link = group_link(fp8.cluster, DEFAULT_CALIBRATION, np.array([8.0]), 1.0)
    saved = tp_traffic_s(ctx16, link)[0] - tp_traffic_s(ctx8, link)[0]
    # 2 forward all-gathers, again in the recomputed forward (full AC), 2 backward ones, each half the bytes
    half = all_gather_s(link, ctx16.activation)[0] - all_gather_s(link, ctx16.activation / 2)[0]
    assert saved == pytest.approx(6 * half)


def test_explain_prints_the_hidden_share_and_the_schedule_table() -> None:
    rows = {name: (value, source) for name, value, source in speed_rows(_scn("llama3-405b", 512, 256, True),
                                                                         _pp405("interleaved"))}
    value, source = rows["TP share hidden"]
    assert value.endswith("%") and "micro_pipeline_tp" in source
    idle, detail = rows["pipeline"]
    # ScheduleInterleaved1F1B with m = 8 = p: rank 0's warm-up (v - 1) p + 2 (p - 1) = 22 is capped at v m = 16
    assert idle == "idle 3.5 slots" and "interleaved, p 8, v 2, m 8" in detail
    assert "rank 0 16/0/16, rank 7 9/7/9" in detail and "30 P2P sends" in detail


def test_interleaved_pair_as_torchtitan_ran_it() -> None:
    scn = _scn("llama3-405b", 512, 256, True)
    f = evaluate_many(scn, [_pp405("1f1b"), _pp405("interleaved")])
    gain = float(f.tokens_per_s_per_gpu[1] / f.tokens_per_s_per_gpu[0])
    assert gain == pytest.approx(128 / 100, abs=0.08)  # bubble 7 of 8 slots -> 3.5 of 8
    assert float(f.tokens_per_s_per_gpu[0]) == pytest.approx(100, rel=0.15)
    # memory of the first stage (rank 0): interleaved 1F1B with m = p runs all 16 chunk forwards before its first
    # backward (same activations as 1F1B's 8 micro-batches), but its gradients appear chunk by chunk (the last
    # chunk's backwards first): below 1F1B's, as published (82.5 vs 72.7 GiB, the largest over ranks)
    first = [rank_memory_columns(scn, PlanColumns.from_plans([_pp405(s)]), DEFAULT_CALIBRATION, "first")["peak"][0]
             for s in ("1f1b", "interleaved")]
    assert first[1] < first[0]
    # and the worst rank too, now that the last stage keeps vocabulary-parallel logits under PP (torchtitan's
    # loss_parallel around pp_schedule.step): rank 0 is the worst in both
    assert f.peak_gib[1] < f.peak_gib[0] and list(f.worst_stage) == [0, 0]
