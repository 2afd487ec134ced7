"""Engine copies and step transients beside the model states: what an engine allocates that is neither a state
nor an activation. Vectorised over `PlanColumns` like stratagem.evaluators.memory.

Sources:
  [ADAM]  torch/optim/adam.py _multi_tensor_adam (torch.optim.AdamW's implementation on CUDA by default:
          torch/optim/optimizer.py _default_to_fused_or_foreach picks foreach when every parameter is a CUDA
          tensor and fused was not asked for): the moments are updated in place (_foreach_lerp_, _foreach_mul_,
          _foreach_addcmul_), then `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` allocates one
          tensor per parameter, the second moment's size and dtype, live until _foreach_addcdiv_ updates the
          parameters. Per (device, dtype) group, so one list over all the rank's parameters of one dtype.
          _single_tensor_adam (CPU): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` allocates
          sqrt and div while the previous parameter's denom is still bound: three parameter-sized temporaries.
          Both measured op by op (tests/evaluators/test_memory_terms.py).
  [FUSED] torch._fused_adamw_ (fused=True: torchtitan's default, torchtitan/config/job_config.py
          Optimizer.implementation = "fused", components/optimizer.py build_optimizers; the harness's on CUDA),
          transformer_engine/pytorch/optimizers/fused_adam.py and apex FusedAdam (multi_tensor_apply): in place, no
          per-parameter intermediates (measured: tests/evaluators/test_memory_terms.py).
  [TEW]   Megatron passes is_first_microbatch to Transformer Engine (megatron/core/extensions/
          transformer_engine.py TELinear.forward), which caches the quantized weight, row- and column-wise, in
          `_fp8_workspaces["weight"]` (transformer_engine/pytorch/module/linear.py Linear.forward, cache_name).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["optimizer_step_bytes", "adamw_step_bytes", "fp8_weight_cache_bytes"]

Array = NDArray[np.float64]


def optimizer_step_bytes(scn: Scenario, pc: PlanColumns, state_bytes: Array, largest_tensor: Array) -> Array:
    """Bytes `optimizer.step()` allocates beyond the states, on the GPU, for the AdamW implementation the plan's
    stack runs (`adamw_step_bytes`): StackRecord.optimizer_step on a GPU; on the CPU device (the harness's gloo
    runs) torch's default there, the for-loop. Other optimizers and offloaded states (the step runs on the
    host): 0. `state_bytes`: the rank's Adam moments (the optimizer block without master copies)."""
    if scn.training.optimizer != "adamw":
        return np.zeros(len(pc))
    on_cpu = scn.cluster.gpu.name == "cpu"
    implementation = "for-loop" if on_cpu else stack_record(scn.training.stack).optimizer_step
    return adamw_step_bytes(implementation, state_bytes, largest_tensor) * (1.0 - pc.optimizer_offload)


def adamw_step_bytes(implementation: str, state_bytes: Array, largest_tensor: Array) -> Array:
    """AdamW's step transient by implementation [ADAM, FUSED]: foreach, exp_avg_sq_sqrt, as large as the second
    moments (half of `state_bytes`); for-loop, three fp32 temporaries of the largest parameter tensor; fused, 0."""
    if implementation == "foreach":
        return 0.5 * state_bytes
    if implementation == "for-loop":
        return 3.0 * 4.0 * largest_tensor
    return np.zeros_like(state_bytes)


def fp8_weight_cache_bytes(scn: Scenario, pc: PlanColumns, linear_params: Array) -> Array:
    """Bytes of the fp8 weight copies an fp8 plan's engine keeps across micro-batches [TEW]:
    StackRecord.fp8_weight_cache_bytes per linear weight element on this rank (`linear_params`)."""
    rec = stack_record(scn.training.stack)
    return np.where(pc.fp8, rec.fp8_weight_cache_bytes * linear_params, 0.0)
