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
  [FUSED] torch._fused_adamw_ (fused=True), transformer_engine/pytorch/optimizers/fused_adam.py and apex
          FusedAdam (multi_tensor_apply): in place, no per-parameter intermediates.
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

__all__ = ["optimizer_step_bytes", "fp8_weight_cache_bytes"]

Array = NDArray[np.float64]


def optimizer_step_bytes(scn: Scenario, pc: PlanColumns, state_bytes: Array, largest_tensor: Array) -> Array:
    """Bytes `optimizer.step()` allocates beyond the states, on the GPU [ADAM, FUSED].

    AdamW foreach on a GPU: exp_avg_sq_sqrt, as large as the second moments the rank holds, i.e. half the Adam
    state bytes (`state_bytes`: the rank's optimizer block without master copies). On the CPU device (the
    harness's gloo runs) torch runs the for-loop: three temporaries of the largest parameter tensor (fp32).
    Fused kernels, other optimizers and offloaded states (the step runs on the host): 0."""
    rec = stack_record(scn.training.stack)
    if rec.optimizer_step != "foreach" or scn.training.optimizer != "adamw":
        return np.zeros(len(pc))
    on_gpu = 1.0 - pc.optimizer_offload
    if scn.cluster.gpu.name == "cpu":
        return 3.0 * 4.0 * largest_tensor * on_gpu
    return 0.5 * state_bytes * on_gpu


def fp8_weight_cache_bytes(scn: Scenario, pc: PlanColumns, linear_params: Array) -> Array:
    """Bytes of the fp8 weight copies an fp8 plan's engine keeps across micro-batches [TEW]:
    StackRecord.fp8_weight_cache_bytes per linear weight element on this rank (`linear_params`)."""
    rec = stack_record(scn.training.stack)
    return np.where(pc.fp8, rec.fp8_weight_cache_bytes * linear_params, 0.0)
