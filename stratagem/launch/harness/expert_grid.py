"""Where an MoE plan's routed experts live: the expert mesh, and the ranks that shard or replicate them.

    experts = expert_mesh(plan, "cpu") if uses_expert_mesh(plan, spec) else None   # dims (pp, edp_replicate,
    ...moe.apply_experts(part, experts)...                                          #  edp_shard, ep, etp)
    if shards_experts(plan, spec): shard_experts(block, expert_fsdp_mesh(plan, experts), plan, **fsdp kwargs)
    else: moe.sync_expert_grads(parts, edp_group(experts), plan.dp)                 # after every backward

The experts are split over ep (and etp) by expert parallelism; the rest of a pipeline stage's ranks, edp =
dp*cp*tp / (ep*etp), hold the same expert shard (expert data parallelism; Megatron-Core parallel folding,
stratagem.spaces.groups `expert_data_parallel`). Under ZeRO-2/3 FSDP2 shards the experts over those edp
ranks, in an FSDP unit of their own nested in the block's [torchtitan, experiments/llama4/infra/parallelize.py
`apply_fsdp` of Aug 2025 (commit 7354848): fully_shard(transformer_block.moe.experts, mesh=dp_mod_ep_mesh);
torchtitan/distributed/fsdp.py `apply_fsdp_to_decoder` today: the routed experts on the sparse mesh (dp_replicate,
efsdp, ep), efsdp = dp_shard*cp*tp/ep]. With HSDP (dp_replicate > 1) they are sharded within a replica, over
edp / dp_replicate ranks, and all-reduced across replicas, as the dense weights are. Otherwise (ZeRO-0/1, edp = 1,
or replicas that do not split edp evenly) they stay out of DDP/FSDP and their gradients are all-reduced over edp.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stratagem.spaces.groups import expert_data_parallel, uses_fsdp
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.plan import Plan

__all__ = ["uses_expert_mesh", "expert_mesh", "expert_replicas", "shards_experts", "expert_fsdp_mesh", "edp_group",
           "shard_experts", "expert_layout"]


def uses_expert_mesh(plan: Plan, spec: ModelSpec) -> bool:
    """Whether the routed experts live on the expert mesh (DTensors split over ep / etp): an MoE model under
    expert parallelism or TP."""
    return spec.moe is not None and (plan.ep > 1 or plan.tp > 1)


def expert_replicas(plan: Plan) -> int:
    """Expert replicas under HSDP: dp_replicate when it splits the edp ranks evenly (each replica then holds
    whole ep groups, as torchtitan's sparse mesh (dp_replicate, efsdp, ep) requires), else 1."""
    edp = expert_data_parallel(plan)
    return plan.dp_replicate if edp % plan.dp_replicate == 0 else 1


def expert_mesh(plan: Plan, device_type: str) -> Any:
    """A second DeviceMesh over all ranks for the experts, dims (pp, edp_replicate, edp_shard, ep, etp) and the
    flattened "edp" (edp_replicate x edp_shard): each pipeline stage's dp x cp x tp ranks, in the main mesh's
    order (tp fastest), re-partitioned as edp x ep x etp with etp fastest (Megatron-Core parallel folding, order
    tp-ep-dp; torchtitan's ParallelDims gives the same groups for etp = 1 or tp). So with etp = tp the etp groups
    are the TP groups and an ep group takes ep consecutive dp ranks; with etp = 1 an ep group takes consecutive
    (dp, tp) ranks (ep borrows tp); edp links the ranks holding the same expert shard. edp_replicate is the
    main mesh's dp_replicate coordinate (`expert_replicas`): a replica's ranks are contiguous in both meshes."""
    from torch.distributed.device_mesh import init_device_mesh

    rep = expert_replicas(plan)
    shape = (plan.pp, rep, expert_data_parallel(plan) // rep, plan.ep, plan.etp)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp_replicate", "edp_shard", "ep", "etp"))
    mesh["edp_replicate", "edp_shard"]._flatten("edp")
    return mesh


def shards_experts(plan: Plan, spec: ModelSpec) -> bool:
    """Whether FSDP2 shards the experts over their edp ranks (ZeRO-2/3 with more than one expert shard per
    replica, the replicas splitting edp evenly: torchtitan's efsdp = dp_shard*cp*tp/ep); else they are kept whole
    on each edp rank, outside DDP/FSDP (memory.py's expert shard max(1, edp / dp_replicate) is then 1)."""
    edp = expert_data_parallel(plan)
    return uses_expert_mesh(plan, spec) and uses_fsdp(plan) and edp % plan.dp_replicate == 0 \
        and edp // plan.dp_replicate > 1


def expert_fsdp_mesh(plan: Plan, experts_mesh: Any) -> Any:
    """The mesh FSDP2 shards the experts over: edp_shard, or with expert replicas the 2-D (edp_replicate,
    edp_shard) mesh (HSDP: shard within a replica, all-reduce across). Named dims of the expert mesh's root, so
    that FSDP2 can join it with the experts' own (ep, etp) mesh."""
    return experts_mesh["edp_replicate", "edp_shard"] if expert_replicas(plan) > 1 else experts_mesh["edp_shard"]


def edp_group(experts_mesh: Any) -> Any:
    """The process group of the ranks holding the same expert shard (None: edp = 1)."""
    return experts_mesh["edp"].get_group() if experts_mesh["edp"].size() > 1 else None


def shard_experts(block: nn.Module, mesh: Any, plan: Plan, num_experts: int, **fsdp: Any) -> None:
    """FSDP2 over `mesh` for each GroupedExperts of `block`, before the block's own fully_shard (which then
    skips their parameters). Experts already split on dim 0 over ep are sharded by FSDP on dim 1 once
    edp_shard * ep exceeds the number of experts, so that no shard is padding [torchtitan commit 7354848:
    `dp_mod_ep_mesh.size() * ep_degree > num_experts` -> Shard(1)]. Their gradients are divided by the data
    ranks dp*cp, not by the edp ranks, so they are the same dp-mean the dense weights get [torchtitan:
    `set_gradient_divide_factor(gradient_divide_factor)`]; on gloo (no PREMUL_SUM) as a sum then a division."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import Shard

    from stratagem.launch.harness.moe import GroupedExperts

    shard_size = mesh.size(-1)  # edp_shard
    placement = Shard(1) if shard_size * plan.ep > num_experts else Shard(0)

    def place(_param: nn.Parameter) -> Shard:
        return placement

    for sub in list(block.modules()):
        if not isinstance(sub, GroupedExperts):
            continue
        unit = fully_shard(sub, mesh=mesh, shard_placement_fn=place, **fsdp)
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(float(plan.dp * plan.cp))
        if mesh.device_type == "cpu":
            unit.set_force_sum_reduction_for_comms(True)


def expert_layout(plan: Plan, spec: ModelSpec) -> str:
    """How the harness places the experts, in words (the result file's `expert_parallel`)."""
    if not uses_expert_mesh(plan, spec):
        return "none"
    edp = expert_data_parallel(plan)
    out = f"experts sharded over ep={plan.ep} (DTensor Shard(0))" + (" and etp (Shard on f)" if plan.etp > 1 else "")
    if plan.ep > 1:
        out += ", all_to_all_single dispatch/combine"
    if shards_experts(plan, spec):
        rep = expert_replicas(plan)
        out += f", FSDP2 over edp={edp}" + (f" (HSDP: replicate {rep}, shard {edp // rep})" if rep > 1 else "")
    else:
        out += f", gradients summed over edp={edp}"
    if plan.tp > 1:
        out += f"; MoE under TP: router replicated, {'expert f dim over etp' if plan.etp > 1 else 'tokens split over tp'}"
    return out
