"""Apply a Plan to one model part with PyTorch's own mechanisms, in torchtitan's fixed order.

    mesh = build_mesh(plan, "cpu")                 # one DeviceMesh, dims (pp, dp_replicate, dp_shard, cp, tp)
    part = parallelize(part, plan, mesh, spec)     # TP/SP -> activation checkpointing -> FSDP2 (zero 2/3)
    ...materialize...                              # DDP (zero 0/1) wraps after the weights exist

Data parallel by zero stage (over the mesh's "dp" dim):
  0: DistributedDataParallel(gradient_as_bucket_view=True) (wrapped by `wrap_ddp` after materialisation;
     with TP, over local shards that each owning module turns into DTensors for its forward)
  1: the same DDP + ZeroRedundancyOptimizer over the dp group (optimizer states partitioned by whole
     parameters, greedily balanced: a rank's share is 1/dp to within one parameter; see `build_optimizer`)
  2: FSDP2 fully_shard(reshard_after_forward=False): params and grads sharded at rest, unsharded params kept
     from forward to backward
  3: FSDP2 fully_shard(reshard_after_forward=True)
Expert parallelism (MoE, ep > 1 or tp > 1; stratagem.launch.harness.moe, expert_grid): experts DTensor-sharded over
the ep (and etp) ranks of a second mesh (pp, edp_replicate, edp_shard, ep, etp), all_to_all_single dispatch/combine;
under ZeRO-2/3 FSDP2 shards them over edp in units of their own (torchtitan's dp_mod_ep / efsdp mesh); DDP (and
FSDP2 where edp / dp_replicate = 1) leaves them out, their gradients summed over edp. MoE under TP: torchtitan's apply_moe_ep_tp (see tensor_parallel.apply_tp). Loss-parallel under TP (with pp too): vocabulary-sharded logits and torch's
loss_parallel cross-entropy. Offload: FSDP2 CPUOffloadPolicy (zero 2/3).
HSDP (dp_replicate > 1): FSDP2 on the 2-D (dp_replicate, dp_shard) mesh (shard within a replica, all-reduce
across replicas); zero 1 partitions optimizer states over dp_shard. ZeRO's divisor is dp / dp_replicate.
bf16: FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) under zero 2/3, torch.autocast
otherwise (the model's `autocast_dtype`). fp8 is rejected on hardware without it (see `check_applicable`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stratagem.errors import StratagemError
from stratagem.launch.harness.expert_grid import uses_expert_mesh
from stratagem.launch.harness.model import Transformer
from stratagem.launch.harness.moe import MoE
from stratagem.launch.harness.support import optimizer_refusal, plan_refusals
from stratagem.launch.harness.tensor_parallel import apply_tp
from stratagem.spaces.groups import dp_shard, uses_fsdp
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan

# The flattened "dp" dim is sliced from the root mesh (mesh["dp"]) on every torch from 2.5 to 2.13; newer
# versions may ask for the flattened mesh to be kept instead: a warning only.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")

__all__ = ["MESH_DIMS", "check_applicable", "build_mesh", "apply_ac", "apply_fsdp",
           "parallelize", "wrap_ddp", "op_sac_context", "recomputed_layers", "uses_loss_parallel", "hold_tp_params_local", "build_optimizer", "shard_mesh",
           "grad_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def check_applicable(plan: Plan, spec: ModelSpec, device: torch.device) -> None:
    """Raise StratagemError naming the field for what the harness cannot apply to this plan here (the first
    of stratagem.launch.harness.support.plan_refusals; fp8 on CUDA also needs sm89+ and torchao)."""
    found = plan_refusals(plan, spec, device.type)
    if found:
        raise StratagemError(found[0])
    if plan.precision == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise StratagemError("plan.precision (fp8): needs a GPU with FP8 tensor cores (sm89+); use bf16")
        try:
            import torchao  # noqa: F401
        except ImportError:
            raise StratagemError("plan.precision (fp8): needs torchao's Float8Linear (pip install torchao); "
                                 "or use bf16") from None


def build_mesh(plan: Plan, device_type: str) -> Any:
    """One DeviceMesh over all ranks, dims (pp, dp_replicate, dp_shard, cp, tp), tp varying fastest (inside a
    node); "dp" is the flattened (dp_replicate, dp_shard) pair: every data-parallel rank, as torchtitan's
    ParallelDims builds it (dp = dp_replicate * dp_shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (plan.pp, plan.dp_replicate, dp_shard(plan), plan.cp, plan.tp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if plan.cp > 1:  # torchtitan's dp_shard_cp: gradients are reduced over the dp and cp ranks together
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh


def shard_mesh(plan: Plan, mesh: Any) -> Any:
    """The mesh ZeRO shards over: the dp ranks, or with HSDP (dp_replicate > 1) the 2-D (replicate, shard)
    mesh, on which FSDP2 shards over dp_shard and all-reduces gradients over dp_replicate."""
    if plan.dp_replicate > 1:
        return mesh["dp_replicate", "dp_shard"]
    return grad_mesh(plan, mesh)


def grad_mesh(plan: Plan, mesh: Any) -> Any:
    """The ranks whose gradients are averaged: dp, or dp x cp under context parallelism (each cp rank's loss is
    the mean over its share of the sequence; torchtitan shards FSDP over dp_shard_cp)."""
    return mesh["dp_cp"] if plan.cp > 1 else mesh["dp"]


def uses_loss_parallel(plan: Plan) -> bool:
    """Vocabulary-parallel logits and cross-entropy (torch.distributed.tensor.parallel.loss_parallel) under
    TP, as the analytic model assumes (logits / t); with pp > 1 too, as torchtitan runs it (train.py: the
    loss_parallel context around the whole pipeline step; the last stage's logits go to the loss inside the
    stage, never to another rank)."""
    return plan.tp > 1


def _blocks(part: Transformer) -> list[tuple[str, nn.Module]]:
    return list(part.layers.items())


def _op_save_list() -> set[Any]:
    """Ops whose outputs torchtitan's op-level SAC saves: every mm (but every second one), attention, reduce-
    scatter, max [torchtitan torchtitan/distributed/activation_checkpoint.py `_save_list` of the 2025 releases];
    plus the CPU flash kernel SDPA dispatches to here (torchtitan lists the CUDA kernels only)."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops: set[Any] = {aten.mm.default, aten.max.default}
    ops |= {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


def op_sac_context() -> Any:
    """A fresh (forward, recompute) context pair of torchtitan's op-level policy for one checkpointed block:
    save the outputs of the save-list ops except every second mm (counted separately in forward and in
    recompute), recompute the rest [torchtitan activation_checkpoint.py `_get_custom_policy`]."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _op_save_list()
    mm = torch.ops.aten.mm.default
    counts = {False: 0, True: 0}  # mm calls so far, keyed by ctx.is_recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func == mm:
            counts[ctx.is_recompute] += 1
        keep = func in save and not (func == mm and counts[ctx.is_recompute] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def recomputed_layers(part: Transformer, recompute_layers: int) -> list[str]:
    """Names of the blocks of this part (a pipeline chunk) that recompute: all, or the first
    `recompute_layers` (Megatron's --recompute-method block --recompute-num-layers N, per model chunk)."""
    names = [name for name, _ in _blocks(part)]
    return names if recompute_layers <= 0 else names[:recompute_layers]


def apply_ac(part: Transformer, mode: str, recompute_layers: int = 0) -> None:
    """Activation checkpointing with `checkpoint_wrapper` (non-reentrant) on the blocks `recomputed_layers`
    picks (partial recompute: the others keep every activation).

    full: each whole block (only its input is kept). selective: the region down(silu(g) * u) of each MLP
    (in an MoE layer: of each routed expert, moe.down, and of the shared experts), whose inputs g and u are
    kept: what stratagem.evaluators.memory `_layer_elements` counts as selective.
    op: each whole block under torchtitan's op-level selective policy (`op_sac_context`): the outputs of
    wq, wv, w1, w2 (mm 1, 3, 5, 7), of attention and of SP's reduce-scatters are kept, the rest recomputed.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "none":
        return
    for name in recomputed_layers(part, recompute_layers):
        block = part.layers[name]
        if mode == "full":
            part.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
        elif mode == "op":
            part.layers.register_module(name, checkpoint_wrapper(block, context_fn=op_sac_context,
                                                                 preserve_rng_state=False))
        else:
            ff: nn.Module | None = block.get_submodule("feed_forward")
            if isinstance(ff, MoE):  # each expert's region (moe.down), and the shared experts' DownProjection
                ff.experts.recompute_down = True
                ff = ff.shared
            if ff is not None:
                ff.register_module("down", checkpoint_wrapper(ff.get_submodule("down"), preserve_rng_state=False))


def apply_fsdp(part: Transformer, dp_mesh: Any, reshard_after_forward: bool, precision: str,
               offload: bool = False, ignored: set[nn.Parameter] | None = None,
               expert_units: Callable[..., None] | None = None) -> None:
    """FSDP2 units: each block, the embedding, the final norm + output, then the root (tied embeddings
    stay in the root unit, the only one that spans both ends). `offload`: FSDP2's CPUOffloadPolicy, which
    keeps the sharded parameters, their gradients and so the optimizer states and step in host memory and
    copies each unit to the device for its forward/backward (pinned host memory when there is a GPU).
    MoE experts on the expert mesh are either `ignored` (kept whole, their gradients summed by
    moe.sync_expert_grads) or made units of their own by `expert_units(block, **fsdp kwargs but the mesh)`
    (expert_grid.shard_experts over edp) before their block."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision != "fp32" else MixedPrecisionPolicy()
    kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp,
                          "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload
                          else OffloadPolicy()}
    if ignored:  # expert-parallel experts: sharded over ep, their gradients synced by moe.sync_expert_grads
        kw["ignored_params"] = ignored
    for _, block in _blocks(part):
        if expert_units is not None:
            expert_units(block, **{k: v for k, v in kw.items() if k != "mesh"})
        fully_shard(block, **kw)
    if not part.spec.tied_embeddings:
        if part.tok_embeddings is not None:
            fully_shard(part.tok_embeddings, **kw)
        head: list[nn.Module] = [m for m in (part.norm, part.output) if m is not None]
        if head:
            fully_shard(head, **kw)
    fully_shard(part, **kw)


def _expert_fsdp(part: Transformer, plan: Plan, experts_mesh: Any) -> dict[str, Any]:
    """apply_fsdp's expert arguments: none for experts FSDP shards with their block (no expert mesh), units of
    their own over edp (expert_grid.shards_experts), else the experts left out of FSDP (`ignored`)."""
    from stratagem.launch.harness.expert_grid import expert_fsdp_mesh, shard_experts, shards_experts
    from stratagem.launch.harness.moe import expert_parameters

    if experts_mesh is None:
        return {}
    if shards_experts(plan, part.spec):
        assert part.spec.moe is not None  # an expert mesh exists for MoE models only
        return {"expert_units": functools.partial(shard_experts, mesh=expert_fsdp_mesh(plan, experts_mesh), plan=plan,
                                                  num_experts=part.spec.moe.num_experts)}
    return {"ignored": set(expert_parameters(part))}


def parallelize(part: Transformer, plan: Plan, mesh: Any, experts_mesh: Any = None) -> Transformer:
    """TP/SP, then activation checkpointing, then FSDP2 for zero 2/3 (order matters: FSDP must see the
    DTensor parameters TP made and the wrappers AC inserted). DDP for zero 0/1 comes after
    materialisation (`wrap_ddp`): it broadcasts real weights at construction."""
    if plan.tp > 1:  # 1. tensor (+ sequence) parallel, loss-parallel logits
        apply_tp(part, mesh["tp"], plan.sequence_parallel, loss_parallel=uses_loss_parallel(plan),
                 expert_tp=plan.etp > 1)
    if experts_mesh is not None:  # 1b. MoE experts on the expert mesh: sharded over ep (and etp)
        from stratagem.launch.harness.moe import apply_experts

        apply_experts(part, experts_mesh)
    if plan.cp > 1:  # MoE balance loss: per-sequence statistics summed over the cp ranks
        for sub in part.modules():
            if isinstance(sub, MoE):
                sub.cp_group = mesh["cp"].get_group()
    apply_ac(part, plan.activation_checkpointing, plan.recompute_layers)  # 2. activation checkpointing
    if uses_fsdp(plan):  # 3. ZeRO-2/3 with FSDP2
        # torchtitan/models/llama3/infra/parallelize.py apply_fsdp: reshard_after_forward = not pp_enabled (a
        # pipeline stage runs every micro-batch's forward before their backwards: resharding would re-gather the
        # stage's parameters for each one); the analytic model (evaluators/memory.py) follows the same rule
        apply_fsdp(part, shard_mesh(plan, mesh), plan.zero_stage == 3 and plan.pp == 1, plan.precision,
                   offload=plan.optimizer_offload == "cpu", **_expert_fsdp(part, plan, experts_mesh))
    elif plan.precision != "fp32":  # bf16 without FSDP: autocast in the model's forward
        part.autocast_dtype = torch.bfloat16
    if plan.precision == "fp8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(part)
    return part


def wrap_ddp(part: nn.Module, plan: Plan, mesh: Any) -> nn.Module:
    """DDP over the dp group for zero 0/1 (dp > 1); identity otherwise.

    With TP, DDP gets plain local parameters (`hold_tp_params_local`) and the dp process group, not the dp
    mesh: given a mesh sliced from a larger one, DDP would apply torch's TP+DDP transform
    (torch.distributed.tensor.parallel.ddp), which swaps DTensor weights in and out with hooks on the
    root module only. Activation checkpointing recomputes inside backward, after the root's post-forward hook
    has put the local shards back, so the recompute ran on the local shard ([h, f/t]) instead of the DTensor
    ([h, f]) the forward saved, and torch.utils.checkpoint rejected it (CheckpointError: different metadata).
    """
    if plan.dp * plan.cp == 1 or plan.zero_stage >= 2:
        return part
    from torch.nn.parallel import DistributedDataParallel

    from stratagem.launch.harness.moe import expert_parameters

    spec = getattr(part, "spec", None)
    experts = {id(p) for p in expert_parameters(part)} if spec is not None and uses_expert_mesh(plan, spec) else set()
    hold_tp_params_local(part, skip=experts)
    if experts:  # expert-parallel experts are not replicated over dp: moe.sync_expert_grads reduces them
        names = [n for n, p in part.named_parameters() if id(p) in experts]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(part, names)  # type: ignore[no-untyped-call]
    ddp = DistributedDataParallel(part, process_group=grad_mesh(plan, mesh).get_group(), gradient_as_bucket_view=True)
    if plan.pp > 1:
        # torch.distributed.pipelining runs each micro-batch's forward under ddp.no_sync() and reduces on the last
        # backward only (PipelineStage.backward_maybe_with_nosync calls reducer.prepare_for_backward itself); but
        # its first step's shape inference (_forward_metadata_inference, torch 2.13) calls the module directly,
        # outside no_sync, so DDP armed its reducer for a backward that never came: the next no_sync backward
        # then marked every parameter ready (an extra all-reduce) and, with no forward before the last backward
        # (m = pp under 1F1B, any m under GPipe), the bucket rebuild saw each parameter twice (reducer.cpp
        # INTERNAL ASSERT "rebuilt parameter indices size is not same as original model parameters size").
        # Every forward of a pipeline stage is meant to be a no_sync one: make it so for that one too.
        ddp.require_backward_grad_sync = False
    return ddp


def _wait_grad(grad: torch.Tensor) -> torch.Tensor:
    """A gradient that DTensor's from_local backward may return as an async collective: wait for it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return grad.wait() if isinstance(grad, AsyncCollectiveTensor) else grad


def hold_tp_params_local(module: nn.Module, skip: set[int] | None = None) -> None:
    """Register each TP (DTensor) parameter as a plain parameter holding its local shard, for DDP.

    The local parameter shares the DTensor's storage and carries its DTensorSpec as `_st_info` (as torch's
    own TP+DDP transform does; see `stratagem.launch.harness.train.as_dtensor`). Every module that owns such a
    parameter sees it as a DTensor during its own forward only: a pre-forward hook puts
    `DTensor.from_local(local)` in the module's instance dict, where attribute lookup finds it before the
    registered parameter, and a post-forward hook removes it. Because the swap is made per owning module,
    a forward that activation checkpointing re-runs in backward gets the same DTensor weights as the
    original forward; and the module always lists its parameters (state dicts, optimizers, checkpoints).
    A parameter shared by several modules (tied embeddings) becomes one local parameter in all of them.
    """
    from torch.distributed.tensor import DTensor

    local_of: dict[int, nn.Parameter] = {}
    for owner in list(module.modules()):
        held: list[tuple[str, nn.Parameter]] = []
        for name, p in list(owner._parameters.items()):
            if not isinstance(p, DTensor) or (skip and id(p) in skip):
                continue
            local = local_of.get(id(p))
            if local is None:
                local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                local._st_info = p._spec
                if local.requires_grad:
                    local.register_hook(_wait_grad)
                local_of[id(p)] = local
            owner.register_parameter(name, local)
            held.append((name, local))
        if held:
            owner.register_forward_pre_hook(functools.partial(_put_dtensors, held))
            owner.register_forward_hook(functools.partial(_drop_dtensors, [n for n, _ in held]),
                                        always_call=True)


def _put_dtensors(held: list[tuple[str, nn.Parameter]], owner: nn.Module, _args: Any) -> None:
    from torch.distributed.tensor import DTensor

    for name, local in held:
        spec = local._st_info  # type: ignore[attr-defined]
        owner.__dict__[name] = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                                  shape=spec.shape, stride=spec.stride)


def _drop_dtensors(names: list[str], owner: nn.Module, _args: Any, _output: Any) -> None:
    for name in names:
        owner.__dict__.pop(name, None)


def build_optimizer(params: list[nn.Parameter], plan: Plan, optimizer: str, mesh: Any,
                    lr: float, eps: float = 1e-8) -> torch.optim.Optimizer:
    """The scenario's optimizer; ZeroRedundancyOptimizer over the dp group for zero 1. AdamW on CUDA runs its
    fused kernel, as torchtitan builds it (torchtitan/config/job_config.py Optimizer.implementation = "fused",
    components/optimizer.py build_optimizers: fused=True); on the CPU torch's default (the for-loop)."""
    fused: dict[str, Any] = {"fused": True} if params and params[0].device.type == "cuda" else {}
    kinds: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
        "adamw": (torch.optim.AdamW, {"lr": lr, "weight_decay": 0.1, "eps": eps, **fused}),
        "sgd": (torch.optim.SGD, {"lr": lr, "momentum": 0.9}),
        "adafactor": (torch.optim.Adafactor, {"lr": lr}),
    }
    reason = optimizer_refusal(optimizer)
    if reason:
        raise StratagemError(reason)
    cls, kwargs = kinds[optimizer]
    if plan.zero_stage == 1 and plan.dp * plan.cp > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # HSDP: states partitioned within a replica; else over all of dp (x cp)
        group = (mesh["dp_shard"] if plan.dp_replicate > 1 else grad_mesh(plan, mesh)).get_group()
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=group,
                                       **kwargs)
    return cls(params, **kwargs)
