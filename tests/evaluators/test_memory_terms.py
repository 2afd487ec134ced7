"""Memory mechanisms that follow the engines' code: fp8 saved inputs (Transformer Engine vs torchao), Megatron's
module recompute, the optimizer step's transient (measured op by op on torch's own AdamW), MoE stages that mix
dense and MoE layers."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stratagem.errors import StratagemError
from stratagem.evaluators import evaluate_many
from stratagem.evaluators.memory import _moe_share
from stratagem.evaluators.memory_activations import layer_bytes, module_recompute_elements
from stratagem.evaluators.memory_copies import adamw_step_bytes, optimizer_step_bytes
from stratagem.evaluators.memory_pipeline import IN_FLIGHT
from stratagem.spaces import MODEL_PRESETS, ClusterSpec, Plan, Scenario, gpu_preset, scenario_from_dict
from stratagem.spaces.columns import PlanColumns


def _scn(model: str, stack: str, gpu: str = "h100-sxm-80g", gpus: int = 8, **training: Any) -> Scenario:
    return Scenario(model=model, cluster=ClusterSpec(gpu=gpu_preset(gpu), gpus_per_node=gpus),
                    training={"global_batch_size": 64, "stack": stack, **training})


def _bytes(scn: Scenario, plan: Plan, s: float = 8, b: float = 2) -> tuple[float, float, float]:
    pc = PlanColumns.from_plans([plan])
    act = np.where(pc.fp32, 4.0, 2.0)
    return tuple(float(x[0]) for x in layer_bytes(scn, pc, np.float64(s), np.float64(b), act))  # type: ignore[return-value]


# ---- fp8 saved inputs --------------------------------------------------------------------------------------
def test_transformer_engine_keeps_linear_inputs_in_fp8() -> None:
    """tiny (h 64, 4 heads of 16, 2 kv heads, SwiGLU f 128), s 8, b 2, tp 1, Megatron (fused SwiGLU).
    bf16, elements: norm1 in, QKV in, norm2 in, MLP in (4 sbh = 4096); q 64 + k 32 + v 32 (s b 128 = 2048); attention
    output (s b 64 = 1024); SwiGLU input 2 sbf (4096) and fc2 input sbf (2048): 13312 elements, 26624 bytes.
    fp8 (TE _Linear.forward saves the quantized input): QKV in, MLP in, O-proj in, fc2 in at 1 byte (1024 + 1024 +
    1024 + 2048 = 5120 elements: -5120 bytes), plus flash attention's own bf16 output (+2048 bytes)."""
    scn = _scn("tiny", "megatron")
    bf16 = _bytes(scn, Plan(dp=8))[0]
    fp8 = _bytes(scn, Plan(dp=8, precision="fp8"))[0]
    assert bf16 == 26624
    assert fp8 == 26624 - 5120 + 2048


def test_activation_input_stored_in_fp8() -> None:
    """Megatron --activation-func-fp8-input-store (fused_bias_swiglu.py: input.to(float8_e4m3fn)): SwiGLU's
    2 sbf input (4096 elements) at 1 byte instead of 2; refused on a stack without the fused activation."""
    plain = _bytes(_scn("tiny", "megatron"), Plan(dp=8))[0]
    stored = _bytes(_scn("tiny", "megatron", activation_func_fp8_input_store=True), Plan(dp=8))[0]
    assert plain - stored == 4096
    with pytest.raises(StratagemError, match="activation_func_fp8_input_store"):
        scenario_from_dict({"model": "tiny", "cluster": {"gpu": "h100-sxm-80g"},
                            "training": {"stack": "torch", "activation_func_fp8_input_store": True}})


def test_torchao_fp8_keeps_high_precision_inputs() -> None:
    """torchao Float8Linear saves input_hp: fp8 saves nothing on the torch stack (eager SwiGLU keeps silu(g) too:
    4 sbf)."""
    scn = _scn("tiny", "torch")
    assert _bytes(scn, Plan(dp=8, precision="fp8")) == _bytes(scn, Plan(dp=8))
    assert _bytes(scn, Plan(dp=8))[0] == 2 * (4096 + 2048 + 1024 + 4 * 2048)


# ---- module recompute --------------------------------------------------------------------------------------
def test_each_module_frees_what_megatron_discards() -> None:
    """DeepSeek-V3 layer (MLA, 256 experts top 8, 1 shared expert of 2048), s 8, b 1, tp 1, ep 8, uniform routing
    at this plan's imbalance: layernorm frees both norm outputs (2 sbh); mla_up_proj the up projections' q, k, v
    (s b a (192 + 192 + 128)); moe_act the routed experts' fc2 inputs (k x imbalance x s b f); core_attn, on bf16,
    nothing (the projection saves the same tensor)."""
    m = MODEL_PRESETS["deepseek-v3"]
    scn = _scn("deepseek-v3", "megatron")
    plan = Plan(dp=8, ep=8, activation_checkpointing="selective",
                recompute_modules="layernorm+mla_up_proj+moe_act+core_attn")
    pc = PlanColumns.from_plans([plan])
    freed = {k: float(v[0]) for k, v in module_recompute_elements(scn, pc, np.float64(8), np.float64(1)).items()}
    sbh = 8 * m.hidden_size
    assert freed["layernorm"] == 2 * sbh
    assert freed["mla_up_proj"] == 8 * 128 * (192 + 192 + 128)
    assert freed["core_attn"] == 0.0
    imbalance = freed["moe_act"] / (8 * 8 * 2048)
    assert imbalance >= 1.0
    assert freed["moe"] == 0.0 and freed["shared_experts"] == 0.0  # not in this plan's list


def test_module_recompute_between_selective_and_full() -> None:
    """moe recompute keeps less than selective and more than full; an empty list is stratagem's selective."""
    scn = _scn("deepseek-v3", "megatron")
    none, sel, full = _bytes(scn, Plan(dp=8, ep=8, activation_checkpointing="selective"))
    _, moe, _ = _bytes(scn, Plan(dp=8, ep=8, activation_checkpointing="selective", recompute_modules="moe"))
    assert full < moe < sel < none


def test_first_stage_of_deepseek_holds_dense_layers() -> None:
    """PP16: rank 0 holds layers 0-3, the first three with dense MLPs (first_k_dense_replace = 3)."""
    scn = _scn("deepseek-v3", "megatron", gpus=8)
    pc = PlanColumns.from_plans([Plan(dp=1, pp=8, ep=1)])
    share = float(_moe_share(scn, pc, last=False)[0])
    assert share == pytest.approx(5 / 8)  # 61 layers over 8 stages: 8 on rank 0, 3 of them dense


def test_deepseek_v3_layout_runs_with_its_recipe() -> None:
    """DeepSeek-V3 tech report (arXiv 2412.19437) sec. 3.2.3 and 3.3.2: PP16 x EP64 x ZeRO-1 on H800 80 GB, fp8
    caching of linear inputs and SwiGLU inputs, RMSNorm and MLA up-projection recomputed, SwiGLU output recomputed, bf16 Adam
    moments: the run exists, so the predicted peak fits the GPU; the same layout without the module recompute
    is not (the report recomputes to fit). A check, not a fit: no constant was set from it."""
    scn = Scenario(model="deepseek-v3", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=256,
                                                            gpus_per_node=8),
                   training={"seq_len": 4096, "global_batch_size": 15360, "stack": "megatron", "precision": "fp8",
                             "optimizer_state_dtype": "bf16", "activation_func_fp8_input_store": True})
    base = {"dp": 128, "pp": 16, "ep": 64, "zero_stage": 1, "precision": "fp8", "activation_checkpointing": "selective"}
    with_recipe = evaluate_many(scn, [Plan(**base, recompute_modules="layernorm+mla_up_proj+moe_act")])
    without = evaluate_many(scn, [Plan(**base)])
    assert with_recipe.peak_gib[0] < with_recipe.hbm_gib[0]  # H800 = H100 SXM's 80 GB
    assert without.peak_gib[0] > without.hbm_gib[0]


# ---- the optimizer step's transient ------------------------------------------------------------------------
class _LiveBytes(TorchDispatchMode):
    """Bytes of the tensors ops allocate while the mode is on, alive at the peak (a tensor counts until its Python
    object is collected); storages in `known` (parameters, gradients, states) are not counted."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        self.known, self.now, self.peak = known, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                n, ptr = t.untyped_storage().nbytes(), t.untyped_storage().data_ptr()
                self.known.add(ptr)
                self.now += n
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, n, ptr)
        return out

    def _free(self, n: int, ptr: int) -> None:
        self.now -= n
        self.known.discard(ptr)


@pytest.mark.parametrize("implementation", ["foreach", "for-loop", "fused"])
def test_adamw_step_transient_measured(implementation: str) -> None:
    """torch.optim.AdamW's step, op by op: foreach (_multi_tensor_adam) allocates exp_avg_sq_sqrt, as large as the
    second moments (half the Adam states); the for-loop three tensors of the largest parameter; fused
    (torch._fused_adamw_) nothing. `adamw_step_bytes` gives all three."""
    params = [torch.nn.Parameter(torch.randn(300, 200)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(70))]
    for p in params:
        p.grad = torch.randn_like(p)
    kwargs = {"fused": True} if implementation == "fused" else {"foreach": implementation == "foreach"}
    opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
    opt.step()  # states exist from here
    known = {t.untyped_storage().data_ptr() for p in params
             for t in (p, p.grad, *[v for v in opt.state[p].values() if torch.is_tensor(v)])}
    with _LiveBytes(known) as live:
        opt.step()
    n = sum(p.numel() for p in params)
    predicted = adamw_step_bytes(implementation, np.array([8.0 * n]), np.array([300.0 * 200]))[0]
    assert live.peak == predicted


@pytest.mark.parametrize("stack,gpu,implementation", [
    ("torch", "h100-sxm-80g", "fused"), ("torch", "cpu", "for-loop"), ("megatron", "h100-sxm-80g", "fused")])
def test_optimizer_step_follows_the_implementation_run(stack: str, gpu: str, implementation: str) -> None:
    """The transient of the AdamW the plan's job runs: fused on a GPU for torch (torchtitan's default
    implementation and the harness's on CUDA) and Megatron (TE / apex FusedAdam); on the CPU device the harness
    runs torch's default there, the for-loop."""
    scn = _scn("tiny", stack, gpu=gpu)
    pc = PlanColumns.from_plans([Plan(dp=8)])
    states, largest = np.array([8e9]), np.array([1e6])
    assert optimizer_step_bytes(scn, pc, states, largest)[0] == adamw_step_bytes(implementation, states, largest)[0]


# ---- pipeline schedules ------------------------------------------------------------------------------------
def _torch_peak_chunks(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Most micro-batch chunks whose forward is done and backward not, on `rank`, in torch's own action list
    (torch/distributed/pipelining/schedules.py), in units of the rank's whole stage (v chunks)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as sched

    if schedule == "interleaved":
        rounds = max(1, m // p)
        state = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, number_of_rounds=rounds,
                                microbatches_per_round=m // rounds)
        ops = sched.ScheduleInterleaved1F1B._calculate_single_rank_operations(state, rank)  # type: ignore[arg-type]
        kinds = [a.computation_type for a in ops if a is not None]
    else:  # Schedule1F1B._step_microbatches: min(m, p - rank) warm-up forwards, then backward before forward
        warm = min(m, p - rank)
        kinds = [sched._ComputationType.FORWARD] * warm
        for _ in range(m - warm):
            kinds += [sched._ComputationType.FULL_BACKWARD, sched._ComputationType.FORWARD]
        kinds += [sched._ComputationType.FULL_BACKWARD] * warm
    now = peak = 0
    for kind in kinds:
        now += 1 if kind == sched._ComputationType.FORWARD else -1
        peak = max(peak, now)
    return peak / v


@pytest.mark.parametrize("schedule,p,v,m", [
    ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 4), ("interleaved", 4, 2, 8), ("interleaved", 8, 2, 8),
    ("interleaved", 8, 2, 32), ("interleaved", 4, 4, 16), ("interleaved", 8, 4, 64), ("interleaved", 2, 24, 32),
])
def test_in_flight_table_follows_torch_action_lists(schedule: str, p: int, v: int, m: int) -> None:
    first, last = IN_FLIGHT[schedule](np.float64(p), np.float64(v), np.float64(m))  # type: ignore[index]
    assert float(first) == pytest.approx(_torch_peak_chunks(schedule, p, v, m, 0))
    assert float(last) == pytest.approx(_torch_peak_chunks(schedule, p, v, m, p - 1))


def test_fused_optimizer_step_adds_nothing_to_the_traced_peak() -> None:
    """`stratagem trace` of llama3-8b, 2 x H100, seq 1024, dp2 z0 full-ac (the harness's AdamW, fused as on CUDA):
    peak 134.42 GiB = weights 43.89 (fp32 29.92 + autocast's bf16 casts 13.98) + gradients 29.92 + Adam states
    59.83 + activations 0.78, in backward; the step adds nothing (with foreach it added exp_avg_sq_sqrt, 29.92, and
    the peak was the step's, 149.58). The analytic peak without its overhead is the same but for its activations
    (2.02 against the traced 0.78)."""
    scn = _scn("llama3-8b", "torch", gpus=2, seq_len=1024)
    scn = scn.model_copy(update={"training": scn.training.model_copy(update={"global_batch_size": 2})})
    f = evaluate_many(scn, [Plan(dp=2, zero_stage=0, activation_checkpointing="full")])
    assert f.peak_gib[0] - f.overhead_gib[0] == pytest.approx(134.42 - 0.78 + 2.02, abs=0.01)


def test_megatron_loss_keeps_its_fp32_softmax_whatever_the_calibration() -> None:
    """Megatron's cross-entropy saves exp_logits in fp32 (tensor_parallel/cross_entropy.py save_for_backward): 4
    bytes per logit on the last stage, not the calibration's fitted logits_bytes, which other stacks read."""
    from stratagem.evaluators.calibration import DEFAULT_CALIBRATION
    from stratagem.evaluators.memory import rank_memory_columns

    plan = PlanColumns.from_plans([Plan(dp=8)])
    for stack, moved in (("megatron", False), ("nanotron", True)):
        scn = _scn("tiny", stack)
        acts = [float(rank_memory_columns(scn, plan, DEFAULT_CALIBRATION.model_copy(update={"logits_bytes": lb}),
                                          "last")["activations"][0]) for lb in (0.0, 12.0)]
        assert (acts[1] != acts[0]) == moved
    scn = _scn("tiny", "megatron", seq_len=8)
    one = DEFAULT_CALIBRATION.model_copy(update={"logits_bytes": 0.0})
    a1 = float(rank_memory_columns(scn, plan, one, "last")["activations"][0])
    bare = scn.model_copy(update={"model": scn.model.model_copy(update={"vocab_size": 128})})
    a0 = float(rank_memory_columns(bare, plan, one, "last")["activations"][0])
    assert a1 - a0 == pytest.approx(4.0 * 8 * 1 * 128)  # s 8, micro-batch 1: 128 more logits per token
