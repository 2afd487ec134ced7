"""Step-time formulas against their sources, and the structure of the step."""

import numpy as np
import pytest

from stratagem.evaluators import Calibration, evaluate, evaluate_many
from stratagem.evaluators.comm import all_reduce_s, group_link
from stratagem.evaluators.speed import fp8_linear_speedup
from stratagem.evaluators.step_parts import TIME_KEYS
from stratagem.evaluators.step_terms import pipeline_poll_s
from stratagem.evaluators.timing import (
    bubble_fraction,
    megatron_flops_per_token,
    model_flops_per_token,
    rank_params,
    time_columns,
)
from stratagem.spaces import ModelSpec, Plan, Scenario, cluster_preset, model_preset
from stratagem.spaces.columns import PlanColumns

PARTS = ("compute_s", "recompute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "overhead_s")


def gpt(layers: int, hidden: int, heads: int, vocab: int = 131072) -> ModelSpec:
    return ModelSpec(name="gpt", num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     ffn_hidden_size=4 * hidden, vocab_size=vocab, mlp="gelu", norm="layernorm", bias="all")


def cols(scn: Scenario, *plans: Plan, cal: Calibration | None = None) -> dict[str, np.ndarray]:
    return evaluate_many(scn, PlanColumns.from_plans(list(plans)), cal)


@pytest.mark.parametrize("layers,hidden,heads", [(24, 2048, 16), (96, 12288, 96), (112, 18432, 144)])
def test_model_flops_equal_megatron_formula_for_gpt(layers: int, hidden: int, heads: int) -> None:
    # [Narayanan] 72 B s L h^2 (1 + s/6h + V/12hL) per iteration == [PaLM] 6N + 12 L s h for a 4h GELU GPT.
    m = gpt(layers, hidden, heads)
    assert model_flops_per_token(m, 4096) == pytest.approx(megatron_flops_per_token(layers, hidden, 4096, 131072))


def test_llama3_8b_mfu_matches_torchtitan_statement() -> None:
    # torchtitan (llama3_h100_202412): 1D FSDP Llama-3.1-8B without float8 reaches 33-39% MFU of 989 TFLOP/s;
    # its bf16 runs measured 5605-6667 tokens/s/GPU at seq 8192.
    flops = model_flops_per_token(model_preset("llama3-8b"), 8192)
    assert flops == pytest.approx(57.9e9, rel=0.01)
    for tps in (5605, 5762, 6514, 6667):
        assert 0.32 <= tps * flops / 989.5e12 <= 0.395


def test_bubble_fractions() -> None:
    p, m, v = np.array([1.0, 4, 4, 4, 8]), np.array([8.0, 8, 8, 8, 32]), np.array([1.0, 1, 2, 1, 1])
    sched = np.array([1.0, 1, 2, 3, 0])  # 1f1b, 1f1b, interleaved, zero_bubble, gpipe
    # [Narayanan sec. 2.2] (p-1)/m and (p-1)/(v m); [ZB] ZB-H1 about a third of 1F1B.
    assert list(bubble_fraction(p, m, sched, v)) == pytest.approx([0, 3 / 8, 3 / 16, 1 / 8, 7 / 32])


def test_step_is_the_sum_of_its_parts(llama8b: Scenario) -> None:
    plans = [Plan(dp=8, zero_stage=z, micro_batch_size=b, activation_checkpointing=ac)
             for z in (0, 1, 3) for b in (1, 2) for ac in ("none", "full")]
    c = cols(llama8b, *plans)
    assert np.allclose(sum(getattr(c, k) for k in PARTS), c.step_s, rtol=1e-12)
    assert np.allclose(c.tokens_per_s, 64 * 8192 / c.step_s)
    assert np.allclose(c.tokens_per_s_per_gpu * 8, c.tokens_per_s)


def test_tensor_parallel_comm_is_four_all_reduces_per_layer_per_micro_batch() -> None:
    scn = Scenario(model=model_preset("llama3-70b"), cluster=cluster_preset("h100-sxm-80g", 64),
                   training={"seq_len": 4096, "global_batch_size": 64, "stack": "torch"})
    plan = Plan(dp=8, tp=8, zero_stage=1, micro_batch_size=1)
    cal = Calibration()
    c = cols(scn, plan, cal=cal)
    link = group_link(scn.cluster, cal, 8.0, 1.0)
    per_ar = float(all_reduce_s(link, 4096 * 8192 * 2.0))  # b s h bf16 activation
    micro = 64 / 8
    assert c.tp_comm_s[0] == pytest.approx(micro * 80 * 4 * per_ar)
    # The same traffic over a group that spans nodes (tp 16 on 8-GPU nodes) costs more.
    c16 = cols(scn, Plan(dp=4, tp=16 // 2, pp=2, zero_stage=1), Plan(dp=4, tp=16, zero_stage=1))
    assert c16.tp_comm_s[1] > 2 * c16.tp_comm_s[0]


def test_zero3_moves_one_and_a_half_times_ddp_bytes() -> None:
    # [ZeRO sec. 7]: DDP all-reduce 2 Psi, ZeRO-1/2 reduce-scatter + all-gather 2 Psi, ZeRO-3 3 Psi (same dtype).
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 1024, "global_batch_size": 8})
    cal = Calibration(collective_step_us=0.0)
    big = scn.model_copy(update={"cluster": scn.cluster.model_copy(update={"intra_node_latency_us": 0.0})})
    c = cols(big, *[Plan(dp=8, zero_stage=z, precision="fp32") for z in (0, 1, 3)], cal=cal)
    traffic = c.dp_comm_s + c.dp_hidden_s  # before overlap
    # DDP's all-reduce runs as NCCL runs it (NVLS on an H100 node, comm.all_reduce_s): cheaper than its 2 Psi of
    # ring traffic; ZeRO-3 moves 1.5x ZeRO-1's reduce-scatter + all-gather
    grads = float(rank_params(big, PlanColumns.from_plans([Plan(dp=8)]))[0][0]) * 4.0
    link = group_link(big.cluster, cal, 8.0, 1.0)
    assert traffic[0] == pytest.approx(float(all_reduce_s(link, grads)))
    assert traffic[0] < traffic[1]
    assert traffic[2] == pytest.approx(1.5 * traffic[1])


def test_fsdp_traffic_repeats_per_micro_batch_and_overlaps(llama8b: Scenario) -> None:
    c = cols(llama8b, Plan(dp=8, zero_stage=3, micro_batch_size=1), Plan(dp=8, zero_stage=3, micro_batch_size=2),
             Plan(dp=8, zero_stage=1, micro_batch_size=1))
    # 8 vs 4 micro-batches: ZeRO-3 gathers and scatters once per micro-batch; ZeRO-1 once per step.
    traffic = c.dp_comm_s + c.dp_hidden_s  # before overlap
    assert traffic[0] == pytest.approx(2 * traffic[1])
    assert traffic[2] < traffic[1]
    assert c.exposed_comm_s == pytest.approx(c.tp_comm_s + c.ep_comm_s + c.pp_comm_s + c.cp_comm_s + c.dp_comm_s)
    assert np.all(c.dp_comm_s >= 0) and np.all(c.dp_hidden_s >= 0)
    none = cols(llama8b, Plan(dp=8, zero_stage=3), cal=Calibration(overlap=0.0))
    assert none.dp_hidden_s[0] == pytest.approx(0.0, abs=1e-15)
    assert none.exposed_comm_s[0] == pytest.approx(none.dp_comm_s[0])


def test_compute_terms(llama8b: Scenario) -> None:
    base = Plan(dp=8, micro_batch_size=1)
    c = cols(llama8b, base, base.model_copy(update={"activation_checkpointing": "full"}),
             base.model_copy(update={"precision": "fp8"}), base.model_copy(update={"activation_checkpointing":
                                                                                   "selective"}))
    # Full recompute repeats the forward: about a third of forward + backward (less the LM head).
    assert 0.25 < c.recompute_s[1] / c.compute_s[1] < 0.34
    # Selective recompute is elementwise work only (memory-bound), a small fraction.
    assert 0 < c.recompute_s[3] < 0.03 * c.compute_s[3]
    # torchao's fp8 casts unfused (torch stack, compile off by default): each cast op goes over HBM (33 B/element
    # eager against 5 fused, evaluators.speed): eager fp8 does not tie bf16 (issue 22 item 2), it is slower here.
    assert c.compute_s[2] > c.compute_s[0] * 1.02
    # Compiled: fp8 speeds up the linear layers only, not attention: faster, but by less than the linear speedup.
    compiled = llama8b.model_copy(update={"training": llama8b.training.model_copy(update={"compile": True})})
    cc = cols(compiled, base, base.model_copy(update={"precision": "fp8"}))
    speedup = cc.compute_s[0] / cc.compute_s[1]
    assert 1.0 < speedup < fp8_linear_speedup(compiled) == 2.0  # the H100's fp8 / bf16 datasheet peak


def test_small_per_gpu_matmuls_run_less_efficiently() -> None:
    scn = Scenario(model=model_preset("llama3-8b"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 2048, "global_batch_size": 64})
    # Both ranks do the same FLOPs per step: dp8 runs one 8-sequence micro-batch whole; tp8 runs eight of them
    # with every matmul split 8 ways, which runs less efficiently.
    cal = Calibration(half_efficiency_gflop=100.0)
    c = cols(scn, Plan(dp=8, micro_batch_size=8), Plan(dp=1, tp=8, micro_batch_size=8), cal=cal)
    # efficiency = ceiling x F / (F + F_half): F = 2 x 16384 tokens x 218M weights (/ 8 with tp)
    f_dp, f_tp = 2 * 16384 * 218.1e6, 2 * 16384 * 218.1e6 / 8
    expected = (f_dp / (f_dp + 100e9)) / (f_tp / (f_tp + 100e9))
    assert c.compute_s[1] / c.compute_s[0] == pytest.approx(expected, rel=0.01)
    big = cols(scn, Plan(dp=8, micro_batch_size=8), Plan(dp=8, micro_batch_size=1), cal=cal)
    assert big.compute_s[1] > big.compute_s[0]  # one sequence per micro-batch: smaller matmuls


def test_pipeline_bubble_and_p2p(llama8b: Scenario) -> None:
    p1 = Plan(dp=2, pp=4, micro_batch_size=1)
    pi = p1.model_copy(update={"pp_schedule": "interleaved", "virtual_stages": 2})
    c = cols(llama8b, p1, pi)
    micro = 64 / 2
    slot = (c.compute_s + c.recompute_s + c.tp_comm_s + c.cp_comm_s) / micro
    assert c.bubble_s[0] == pytest.approx(3 * slot[0], rel=0.02)
    assert c.bubble_s[1] < c.bubble_s[0] * 0.6
    assert np.all(c.pp_comm_s > 0)
    # sends on the critical path of torch's action lists (evaluators.schedules): 1F1B's lock-step
    # 2 (p - 2) + 2 (p - 1) m / p = 4 + 48, interleaved 2 (p v - 1) = 14, whatever m
    assert c.pp_comm_s[1] / c.pp_comm_s[0] == pytest.approx(14 / 52)


def test_pipeline_p2p_polling_follows_nanotron_bench_branch(llama8b: Scenario) -> None:
    # [NT-P2P]: 2 metadata messages per send/receive; end stages 4 per micro-batch, middle stages 8; each costs one
    # quantum + the latest of t ranks' phases (t / (t + 1) quantum).
    pp = np.array([1.0, 2.0, 4.0, 4.0])
    tp = np.array([1.0, 1.0, 1.0, 8.0])
    got = pipeline_poll_s(pp, tp, np.ones(4), 0.1)
    assert got == pytest.approx([0.0, 4 * 0.1 * 1.5, 8 * 0.1 * 1.5, 8 * 0.1 * (1 + 8 / 9)])
    assert np.all(pipeline_poll_s(pp, tp, np.ones(4), 0.0) == 0.0)
    # Default calibration: no polling; with 0.1 s every micro-batch of a pipeline rank pays it, bubbles included.
    plan = Plan(dp=2, pp=4, micro_batch_size=1)
    base = cols(llama8b, plan)
    polled = cols(llama8b, plan, cal=Calibration(p2p_poll_s=0.1))
    micro = 64 / 2
    assert polled.pp_comm_s[0] - base.pp_comm_s[0] == pytest.approx(micro * 8 * 0.1 * 1.5)
    assert polled.step_s[0] > base.step_s[0] + micro * 1.2


def test_launch_floor_binds_on_tiny_per_gpu_work() -> None:
    scn = Scenario(model=model_preset("tiny-4l"), cluster=cluster_preset("h100-sxm-80g", 8),
                   training={"seq_len": 128, "global_batch_size": 8})
    cal = Calibration(layer_floor_ms=2.0, step_overhead_s=0.0)
    c = cols(scn, Plan(dp=8), cal=cal)
    # 4 layers x 1 micro-batch x 2 ms: the GPU waits on the host.
    assert c.step_s[0] == pytest.approx(4 * 2e-3, rel=0.1)
    assert c.overhead_s[0] > 0.5 * c.step_s[0]


def test_cpu_gpu_kind_runs() -> None:
    scn = Scenario(model=model_preset("tiny"), cluster={"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 4},
                   training={"seq_len": 64, "global_batch_size": 8})
    ev = evaluate(scn, Plan(dp=2, tp=2, zero_stage=3, micro_batch_size=2))
    assert ev.time is not None and ev.throughput is not None and ev.zones is not None
    assert np.isfinite(ev.time.step_s) and ev.time.step_s > 0 and ev.throughput.tokens_per_s > 0


def test_time_columns_keys(llama8b: Scenario) -> None:
    tc = time_columns(llama8b, PlanColumns.from_plans([Plan(dp=8)]), Calibration())
    for k in TIME_KEYS:
        assert k in tc and tc[k].shape == (1,)
