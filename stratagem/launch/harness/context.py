"""Context parallelism: torch's `context_parallel` (ring attention over SDPA, load-balanced sequence sharding).

    with cp_context(cp_mesh, [inputs, targets]) as positions:   # shards them in place on the sequence dim
        loss = loss_fn(model(inputs, positions=positions), targets)
        loss.backward()

Each cp rank keeps 2 of the 2 x cp chunks of every sequence (chunks r and 2 cp - 1 - r: torch's round-robin load
balancing for causal attention), `positions` [b, s/cp] says which (the rotary embedding needs them, as
torchtitan shards freqs_cis among its CP buffers; one row per sequence so that a pipeline schedule splits them into
micro-batches with the inputs), and every F.scaled_dot_product_attention inside runs as torch's ring
attention over the cp group (`_templated_ring_attention`: K/V passed round the ring, partial outputs merged by
their log-sum-exp).

On CPU. torch 2.13's context_parallel dispatches only the CUDA SDPA kernels (flash, memory-efficient, cuDNN) to
the ring; on CPU, SDPA calls `aten._scaled_dot_product_flash_attention_for_cpu`, which DTensor cannot run on
sequence shards ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered"; the math backend fails on its plain causal mask: "aten.add.Tensor got mixed torch.Tensor
and DTensor"; the rotate method, all-gather or all-to-all, does not matter: the failure comes before any
collective). `cp_context` adds, while CP is on, DTensor op handlers for the CPU kernel and its backward that run
the same templated ring (forward and backward, with its load balancing) around the CPU kernel, as torch's
`_sdpa_handler` does around the CUDA ones. On CUDA torch's own handlers run unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cp_context", "CPU_RING_HANDLERS"]

aten = torch.ops.aten
SEQ_DIM = 2
"""The sequence dim of SDPA's [b, heads, s, d] operands (torch's CP hardcodes it too)."""


def _wrap(local: torch.Tensor, like: Any) -> Any:
    """A DTensor sharded like `like` (Shard(2) over the cp mesh) around a local result of the ring."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = list(local.shape)
    shape[SEQ_DIM] *= like.device_mesh.size()
    size = torch.Size(shape)
    stride = torch.empty(size, device="meta").stride()
    spec = DTensorSpec(like.device_mesh, like.placements, tensor_meta=TensorMeta(size, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _cpu_flash_ring(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale) on
    sequence shards -> (out, logsumexp), through torch's templated ring attention."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    q, k, v = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism on CPU: SDPA with an attention mask")
    out, lse = _templated_ring_attention(
        q.device_mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
        q.to_local(), k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"))
    return _wrap(out, q), _wrap(lse, q)


def _cpu_flash_ring_backward(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp, dropout_p,
    is_causal, *, attn_mask, scale) on sequence shards -> (grad_q, grad_k, grad_v), round the ring."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    names = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")
    a = dict(zip(names, args, strict=False)) | kwargs
    if a.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism on CPU: SDPA with an attention mask")
    q = a["query"]
    grads = _templated_ring_attention_backward(
        q.device_mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=a["grad_out"].to_local(), grad_out_name="grad_out", query=q.to_local(), key=a["key"].to_local(),
        value=a["value"].to_local(), out=a["out"].to_local(), logsumexp=a["logsumexp"].to_local(),
        is_causal=a["is_causal"], dropout_p=a["dropout_p"], scale=a.get("scale"))
    return tuple(_wrap(g, q) for g in grads[:3])


CPU_RING_HANDLERS: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash_ring,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash_ring_backward,
}


@contextlib.contextmanager
def cp_context(cp_mesh: Any, buffers: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Shard `buffers` ([b, s] each, in place, not restored) over `cp_mesh` and run the body's SDPA calls, forward
    and backward, as ring attention; yields this rank's sequence positions [b, s/cp]."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel

    rows, seq = buffers[0].shape
    positions = torch.arange(seq, device=buffers[0].device).expand(rows, seq).contiguous()
    every = [*buffers, positions]
    with context_parallel(cp_mesh, buffers=every, buffer_seq_dims=[1] * len(every),
                          no_restore_buffers=set(every)):
        if buffers[0].device.type == "cpu":  # context_parallel installed a fresh handler dict: extend it
            DTensor._op_dispatcher._custom_op_handlers.update(CPU_RING_HANDLERS)
        yield positions
