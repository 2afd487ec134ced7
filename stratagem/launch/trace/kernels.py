"""What a traced step patches so that its live bytes are those of the GPU run it stands for.

The trace runs the harness's step on CPU FakeTensors. Three things would count bytes that a GPU run does not hold,
or name them wrongly:

  `gpu_rms_norm`       CPU has no fused RMSNorm: `F.rms_norm` decomposes (aten/src/ATen/native/layer_norm.cpp
                       rms_norm_symint: fused `_fused_rms_norm` on CUDA/MPS only), and the decomposition saves an
                       fp32 upcast and the fp32 normalised tensor for backward. The fused kernel saves the input
                       and rstd [..., 1] (tools/autograd/derivatives.yaml `_fused_rms_norm`); the trace runs a
                       function that saves exactly those.
  `no_propagation_bytes`  DTensor's sharding propagation runs some ops (loss_parallel's log-softmax and NLL,
                       embedding backward) on full-size fake tensors to learn their output shapes
                       (torch/distributed/tensor/_sharding_prop.py `_propagate_tensor_meta_non_cached`); in a real
                       run those are fake tensors of their own mode and take no memory. The tracker ignores them.
  `label_gradients`    gradients held between micro-batches: DDP's accumulated `.grad` outside its buckets under
                       `no_sync` (the reducer copies them into the buckets on the synced backward only) and FSDP2's
                       unsharded (accumulated) gradients while gradient sync is off (pipelining: every micro-batch
                       but the last; torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py post_backward) are
                       labelled gradients when they appear.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.launch.trace.fake import BlockBytes

__all__ = ["gpu_rms_norm", "no_propagation_bytes", "label_gradients", "gpu_step", "bounded_routing", "routing_bound"]


class _FusedRMSNorm(torch.autograd.Function):
    """y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps) in fp32, saving (x, rstd, weight) as CUDA's
    `_fused_rms_norm` does. x [..., h] (a sequence shard under SP), rstd [..., 1] fp32."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
        y = (xf * rstd).to(x.dtype)
        if weight is not None:
            y = y * weight
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        xhat = x.float() * rstd
        g = gy.float() * weight.float() if weight is not None else gy.float()
        gx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        gw = None
        if weight is not None:
            gw = (gy.float() * xhat).sum(dim=tuple(range(gy.dim() - 1))).to(weight.dtype)
        return gx.to(x.dtype), gw, None


def _rms_norm(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    out: torch.Tensor = _FusedRMSNorm.apply(x, weight, 1e-6 if eps is None else eps)  # type: ignore[no-untyped-call]
    return out


@contextmanager
def gpu_rms_norm() -> Iterator[None]:
    """`F.rms_norm` saves what CUDA's fused kernel saves (see the module docstring)."""
    original = F.rms_norm
    F.rms_norm = _rms_norm  # type: ignore[assignment]
    try:
        yield
    finally:
        F.rms_norm = original


@contextmanager
def no_propagation_bytes(tracker: BlockBytes) -> Iterator[None]:
    """Storages made by DTensor's sharding propagation (shape inference on fake tensors) are not counted."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.ignoring += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.ignoring -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextmanager
def label_gradients(tracker: BlockBytes, params: Iterable[nn.Parameter]) -> Iterator[None]:
    """Label gradients as they accumulate (see the module docstring): `.grad` of every parameter after each
    accumulation, and FSDP2's unsharded (accumulated) gradients after each post-backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    handles = [p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
        lambda p: tracker.label([p.grad], "gradients")) for p in params if p.requires_grad]
    original = FSDPParamGroup.post_backward

    def post_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        for fp in self.fsdp_params:
            acc = fp.unsharded_accumulated_grad
            unsharded = getattr(fp, "_unsharded_param", None)
            tracker.label([acc, unsharded.grad if unsharded is not None else None], "gradients")
        return out

    FSDPParamGroup.post_backward = post_backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPParamGroup.post_backward = original  # type: ignore[method-assign]
        for h in handles:
            h.remove()


def routing_bound(scenario: Any, plan: Any) -> float:
    """Busiest expert rank's copies over the balanced share: the analytic model's load imbalance (balls into
    bins, capped by the capacity factor: evaluators/experts.py `load_imbalance`)."""
    from stratagem.evaluators.experts import load_imbalance
    from stratagem.spaces.columns import PlanColumns

    return float(load_imbalance(scenario, PlanColumns.from_plans([plan]))[0])


@contextmanager
def bounded_routing(scenario: Any, plan: Any) -> Iterator[None]:
    """The MoE router's data-dependent sizes, set for fake tensors (which hold no routing to count: bincount
    has no fake kernel and `.tolist()` no data). `routed_counts`: a rank's T k copies split evenly over the
    E experts; `received_counts`: the traced rank is the busiest expert rank, receiving `routing_bound` x the
    balanced share from every source rank (rounded up). Both are the sizes the analytic memory model assumes."""
    import math

    import torch.distributed as dist

    from stratagem.launch.harness import moe

    factor = routing_bound(scenario, plan)

    def routed(flat: torch.Tensor, num_experts: int) -> list[int]:
        n = flat.numel()
        return [n // num_experts + (1 if e < n % num_experts else 0) for e in range(num_experts)]

    def received(counts: list[int], device: torch.device, group: Any) -> list[int]:
        ep = dist.get_world_size(group)
        local = len(counts) // ep
        mine = counts[:local]  # balanced: every source sends each of this rank's experts the same share
        return [math.ceil(c * factor) for _ in range(ep) for c in mine]

    originals = moe.routed_counts, moe.received_counts
    moe.routed_counts, moe.received_counts = routed, received
    try:
        yield
    finally:
        moe.routed_counts, moe.received_counts = originals


@contextmanager
def gpu_step(tracker: BlockBytes, params: Iterable[nn.Parameter], kernels: str) -> Iterator[None]:
    """All of the above for one traced step; `kernels="cpu"` keeps CPU's rms_norm (to compare with a CPU run)."""
    with ExitStack() as stack:
        if kernels == "cuda":
            stack.enter_context(gpu_rms_norm())
        stack.enter_context(no_propagation_bytes(tracker))
        stack.enter_context(label_gradients(tracker, params))
        yield
