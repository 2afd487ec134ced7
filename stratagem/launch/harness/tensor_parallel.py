"""Tensor parallelism for one model part (`apply_tp`): Megatron-style DTensor TP of the embedding, the blocks
(attention, dense MLP or MoE layer, sequence-parallel norms) and the output projection, after torchtitan's
apply_tp / apply_moe_ep_tp [torchtitan/models/llama3/infra/parallelize.py, llama4/infra/parallelize.py].
`parallelize.parallelize` calls it first, before activation checkpointing and FSDP2."""

from __future__ import annotations

from typing import Any

from torch import nn

from stratagem.launch.harness.model import Transformer
from stratagem.launch.harness.moe import MoE

__all__ = ["apply_tp"]


def apply_tp(part: Transformer, tp_mesh: Any, sequence_parallel: bool, loss_parallel: bool = False,
             expert_tp: bool = False) -> None:
    """Megatron-style TP with DTensor: column-parallel QKV / gate / up, row-parallel O / down; with SP the
    norms run on sequence shards and the blocks exchange [b, s/t, h] activations (all-gather before attention
    and MLP, reduce-scatter after). With `loss_parallel` the output projection leaves the logits sharded over
    the vocabulary ([b, s, V/t] DTensor, Shard(-1)) for torch's loss_parallel cross-entropy; otherwise it
    all-gathers them ([b, s, V] on every TP rank).

    MoE layers [torchtitan apply_moe_ep_tp]: the layer's input is made Replicate (all-gathered under SP) and
    its output is a Partial sum over TP, reduce-scattered (SP) or all-reduced back to the residual layout
    (PrepareModuleInputOutput); inside, stratagem.launch.harness.moe.MoE computes locally: the router whole
    on every rank, the shared experts on Colwise (w1, w3) / Rowwise (w2) shards, the routed experts on their
    f/etp slice (`expert_tp`, etp = tp; weights placed by moe.apply_experts) or, with etp = 1, on 1/tp of the
    tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream [b, s, h]
    _tp_ends(part, tp_mesh, between, sequence_parallel, loss_parallel)
    for block in part.layers.values():
        parallelize_module(block, tp_mesh, _tp_block_plan(block, tp_mesh, between, sequence_parallel, expert_tp))


def _tp_ends(part: Transformer, tp_mesh: Any, between: Any, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The embedding (row-parallel over the vocabulary), the final norm (SP) and the output projection (logits
    vocabulary-sharded for loss_parallel, else all-gathered); tied embeddings re-tied after sharding."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top: dict[str, Any] = {}
    if part.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if part.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if part.output is not None and loss_parallel:  # vocabulary-sharded logits [b, s, V/t] (a DTensor)
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    elif part.output is not None:  # full logits on every TP rank: [b, s, V]
        top["output"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(part, tp_mesh, top)
    if part.spec.tied_embeddings and part.output is not None and part.tok_embeddings is not None:
        part.output.weight = part.tok_embeddings.weight  # both Shard(0) over the vocabulary: re-tie


def _tp_block_plan(block: nn.Module, tp_mesh: Any, between: Any, sequence_parallel: bool,
                   expert_tp: bool) -> dict[str, Any]:
    """One block's parallelize_module plan: column-parallel QKV, row-parallel O; the dense MLP column/row
    parallel, or the MoE layer prepared by _tp_moe; with SP the norms on sequence shards and the attention and
    MLP inputs all-gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=between),
    }
    moe = block.get_submodule("feed_forward")
    if isinstance(moe, MoE):
        plan["feed_forward"] = _tp_moe(moe, tp_mesh, between, expert_tp)
    else:
        plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                     "feed_forward.down.w2": RowwiseParallel(output_layouts=between)})
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": gather})
        if not isinstance(moe, MoE):
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),))
    return plan


def _tp_moe(moe: MoE, tp_mesh: Any, between: Any, expert_tp: bool) -> Any:
    """An MoE layer under TP (apply_tp's docstring): its shared experts' weights sharded now; the layer's
    input/output preparation (Replicate in, Partial out, back to the residual layout) returned for the plan."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    prepare = PrepareModuleInputOutput(
        input_layouts=(between,), desired_input_layouts=(Replicate(),), use_local_input=False,
        output_layouts=(Partial(),), desired_output_layouts=(between,), use_local_output=True)
    moe.tp_mesh, moe.split_tokens = tp_mesh, not expert_tp
    if moe.shared is not None:  # column shards of w1, w3 [f/t, h], row shards of w2 [h, f/t]
        for name, dim in (("w1", 0), ("w3", 0), ("down.w2", 1)):
            owner = moe.shared.get_submodule(name)
            full = owner.get_parameter("weight").data
            owner.register_parameter("weight", nn.Parameter(
                distribute_tensor(full, tp_mesh, [Shard(dim)], src_data_rank=None)))
    return prepare
