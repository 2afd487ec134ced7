"""Expert layouts: the expert grid ep x etp x edp that re-partitions the tp x dp x cp ranks (Megatron-Core MoE
parallel folding), as rules on integers.

Megatron-Core megatron/core/parallel_state.py initialize_model_parallel builds two rank generators over the same
ranks of each pipeline stage: the attention grid tp x cp x dp and the expert grid etp x ep x edp (order
"tp-ep-dp-pp": etp innermost, then ep), and requires the attention world tp*cp*dp to be a multiple of etp*ep; the
expert data-parallel size is the quotient, edp = tp*dp*cp / (ep*etp). megatron/core/transformer/moe/moe_layer.py
(BaseMoELayer) asserts num_moe_experts % ep == 0; each expert's matmuls are split over etp ranks, so etp must
divide the expert MLP size. torchtitan's ExpertParallel / ExpertTensorParallel (torchtitan/distributed/
expert_parallel.py) fold the same way over the dp_shard x cp (x tp) mesh dimensions.
"""

from __future__ import annotations

from stratagem.spaces.factors import divisors
from stratagem.spaces.model import ModelSpec

__all__ = ["expert_grid_problem", "grid_layout_problem", "expert_layouts"]


def expert_grid_problem(model: ModelSpec, tp: int, dp: int, cp: int, ep: int, etp: int,
                        grid: str = "folding") -> str | None:
    """Why this ep x etp layout cannot be built (one line naming the fields and the fix), or None. `grid` is the
    stack's StackRecord.expert_grid: folding (Megatron-Core), etp_1_or_tp (torchtitan ParallelDims._validate),
    data_parallel (DeepSpeed/nanotron: expert groups inside the data-parallel ranks)."""
    moe = model.moe
    if moe is None:
        if ep > 1 or etp > 1:
            return f"ep ({ep}) and etp ({etp}): expert parallelism needs an MoE model; {model.name} is dense: set ep=1, etp=1"
        return None
    world = tp * dp * cp
    if moe.num_experts % ep:
        ok = [d for d in divisors(moe.num_experts) if world % d == 0]
        return (f"ep ({ep}) must divide num_experts ({moe.num_experts}) (Megatron moe_layer.py); valid: "
                f"{', '.join(map(str, ok))}")
    if moe.expert_ffn_hidden_size % etp:
        return (f"etp ({etp}) must divide the expert MLP size ({moe.expert_ffn_hidden_size}); valid: "
                f"{', '.join(map(str, divisors(moe.expert_ffn_hidden_size)[:12]))}")
    if world % (ep * etp):
        ok = [e for e in divisors(moe.num_experts) if world % (e * etp) == 0]
        return (f"ep*etp ({ep}*{etp}) must divide tp*dp*cp ({tp}*{dp}*{cp} = {world}): the expert grid re-partitions "
                f"those ranks (Megatron parallel_state.py); valid ep with etp={etp}: {', '.join(map(str, ok))}")
    return grid_layout_problem(tp, dp, cp, ep, etp, grid)


def grid_layout_problem(tp: int, dp: int, cp: int, ep: int, etp: int, grid: str) -> str | None:
    """The stack-specific part of the expert grid rules (no model needed): see `expert_grid_problem`."""
    if grid != "folding" and ep > 1 and etp not in (1, tp):
        return f"etp ({etp}) must be 1 or tp ({tp}) with ep > 1; set etp=1 or etp={tp}"
    if grid == "etp_1_or_tp" and ep > 1:
        borrowed = cp * (tp if etp == 1 else 1)  # ParallelDims: ep takes cp (and tp when etp = 1) whole
        if ep % borrowed:  # (that ep*etp divides tp*dp*cp is the generic rule)
            return (f"ep ({ep}) must be a multiple of {'cp*tp' if etp == 1 else 'cp'} ({borrowed}) with "
                    f"etp={etp}; change ep or set etp={tp}")
    if grid == "data_parallel" and (dp * cp) % ep:
        return f"ep ({ep}) must divide dp*cp ({dp * cp}): expert groups are taken from the data-parallel ranks"
    return None


def expert_layouts(model: ModelSpec, tp: int, dp: int, cp: int, grid: str = "folding") -> list[tuple[int, int]]:
    """Every (ep, etp) the rules allow on this attention grid ((1, 1) for a dense model)."""
    moe = model.moe
    if moe is None:
        return [(1, 1)]
    world = tp * dp * cp
    return [(e, t) for e in divisors(moe.num_experts) for t in divisors(world)
            if expert_grid_problem(model, tp, dp, cp, e, t, grid) is None]
