"""The harness's MoE MLP: token-choice top-k router, sequence-wise load-balancing loss, grouped experts.

    MoE(spec) replaces FeedForward in the layers `spec.is_moe_layer(i)` names. forward(x [b, s, h]) -> [b, s, h]

Router: softmax over the E expert logits of each token (fp32), its top_k experts, weights renormalised over
them (Mixtral; torchtitan's TokenChoiceTopKRouter with route_norm). Experts: three grouped parameters
w1, w3 [E, f, h] and w2 [E, h, f] (torchtitan GroupedExperts' layout), run expert by expert over the tokens
sorted by expert (torchtitan's for-loop path, the one that runs on CPU). Shared experts: one dense SwiGLU MLP
of shared_experts x shared_ffn inner size every token passes through. Dropless: every routed copy is computed,
so a token's output does not depend on the other tokens of its batch and any plan matches the reference.

Load balancing: the complementary sequence-wise balance loss of DeepSeek-V3 (sec. 2.1.2, eqs. 17-20),
L = alpha sum_e f_e P_e per sequence, f_e = E / (k s) x tokens of the sequence routed to e, P_e = mean router
probability of e over the sequence. Being a sum of per-sequence terms it is the same for every split of the
batch over data-parallel ranks and micro-batches (a batch-wise loss is not); under context parallelism its
per-sequence sums are taken over the cp ranks (`MoE.balance_loss`). It enters through its gradient
only (`AuxLoss`, as DeepSeek's AddAuxiliaryLoss): the reported loss stays the language-model cross-entropy.
`aux_rows` scales it as the cross-entropy is scaled: the rows one backward's loss is the mean over.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.launch.harness.mlp import FeedForward
from stratagem.spaces.model import ModelSpec

__all__ = ["AUX_LOSS_COEF", "AuxLoss", "GroupedExperts", "MoE", "apply_experts", "expert_parameters", "sync_expert_grads",
           "routed_counts", "received_counts", "down"]

AUX_LOSS_COEF = 1e-3
"""alpha of the sequence-wise balance loss (DeepSeek-V3 uses 1e-4; larger here so 5 steps move the router)."""


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` receives gradient 1 (its gradient joins the model's)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Pass `out` through unchanged; remember the auxiliary loss's shape for backward."""
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient 1 for the auxiliary loss (added to the training loss), `grad` for `out`."""
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def down(g: torch.Tensor, u: torch.Tensor, w2: torch.Tensor, recompute: bool) -> torch.Tensor:
    """(silu(g) * u) @ w2.T: g, u [n, f], w2 [h, f] -> [n, h]. `recompute`: checkpointed (non-reentrant), so
    only g and u are kept and silu(g), silu(g) * u are re-made in backward: selective recompute, the region the
    dense MLP's DownProjection wraps (evaluators/memory_activations.py `_mlp_group`: act_input kept, act_mid
    and act_output recomputed)."""
    if not recompute:
        return (F.silu(g) * u) @ w2.T
    from torch.utils.checkpoint import checkpoint

    return checkpoint(down, g, u, w2, False, use_reentrant=False, preserve_rng_state=False)  # type: ignore[no-any-return]


class GroupedExperts(nn.Module):
    """E SwiGLU experts as grouped weights: w1 (gate), w3 (up) [E, f, h], w2 (down) [E, h, f]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.recompute_down = False
        """Selective recompute: each expert's down(silu(g) * u) re-run in backward (`down`)."""

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, h] sorted by (local) expert, counts[e] rows for local expert e -> [n, h]. Under expert
        parallelism the weights are DTensors sharded over the ep group (Shard(0)): this rank's experts."""
        # [E/ep, f, h], [E/ep, f, h], [E/ep, h, f]; in the compute dtype (bf16 under FSDP2's MixedPrecisionPolicy,
        # which does not manage expert-parallel experts; a no-op cast otherwise)
        w1, w3, w2 = (_local(w).to(x.dtype) for w in (self.w1, self.w3, self.w2))
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):  # rows [n_e, h]
            outs.append(down(rows @ w1[e].T, rows @ w3[e].T, w2[e], self.recompute_down))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tp_replicated(w: torch.Tensor, tp_mesh: Any) -> torch.Tensor:
    """`w` (identical on every TP rank) for local use: forward unchanged, backward the sum over TP of the
    partial gradients (DTensor from_local(Replicate) / to_local(grad_placements=Partial))."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(_local(w), tp_mesh, (Replicate(),), run_check=False).to_local(
        grad_placements=(Partial(),))


class MoE(nn.Module):
    """Router + grouped routed experts (+ shared experts) for one MoE layer."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None  # built only for MoE layers of an MoE spec
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = GroupedExperts(moe.num_experts, spec.hidden_size, moe.expert_ffn_hidden_size)
        self.shared: nn.Module | None = None
        if moe.shared_experts:
            self.shared = FeedForward(spec, moe.shared_experts * moe.shared_ffn)
        self.ep_group: Any = None
        """The expert-parallel process group (set by `apply_experts`); None: every expert is local."""
        self.ep = 1
        self.tp_mesh: Any = None
        """The TP mesh when the layer runs under tensor parallelism (set by parallelize.apply_tp): its input
        arrives replicated over it and its output leaves as a partial sum (Partial) over it."""
        self.split_tokens = False
        """etp = 1 under TP: each TP rank routes its 1/tp of the tokens (torchtitan ReordererSequenceParallel)."""
        self.aux_rows = 1
        """Rows (sequences) the loss of one backward averages over: the balance loss is summed over its
        sequences and divided by this, as the cross-entropy is (set by the harness per plan)."""
        self.cp_group: Any = None
        """Context parallelism: the cp ranks holding the other shards of this rank's sequences (set by
        parallelize); the balance loss's per-sequence statistics are summed over them (None: whole sequences)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [b, s, h]
        """Route each token to its top-k experts and combine their outputs by the gate weights.

        Under TP (`tp_mesh`) x arrives as a replicated DTensor and is used locally with a Partial gradient, and
        the output is this rank's partial sum [torchtitan MoE.forward: x.to_local(grad_placements=(Partial(),))]:
        with etp = tp every rank computes its f/etp slice of every expert and shared expert; with etp = 1 it
        computes its 1/tp of the tokens (`split_tokens`) with whole experts, and its slice of the shared experts.
        The router runs whole on every TP rank; its weight's gradient (partial, as every gradient inside the
        layer) is summed over TP in backward, and the balance loss enters 1/tp per rank."""
        from torch.distributed.tensor import DTensor, Partial

        if isinstance(x, DTensor):
            x = x.to_local(grad_placements=(Partial(),))
        b, s, h = x.shape
        tokens = x.reshape(-1, h)  # [T, h], T = b s
        probs = F.softmax(self._router(tokens).float(), dim=-1)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        mine, first = weights, 0
        if self.split_tokens:  # [T/tp, k]: this TP rank's tokens [r T/tp, (r+1) T/tp)
            share = tokens.shape[0] // self.tp_mesh.size()
            first = self.tp_mesh.get_local_rank() * share
            mine, chosen_mine = weights[first:first + share], chosen[first:first + share]
        else:
            chosen_mine = chosen
        flat = chosen_mine.flatten()  # [T' k]
        order = flat.argsort(stable=True)
        source = order // self.top_k + first  # token of each routed copy, sorted by expert
        counts = routed_counts(flat, self.num_experts)  # [E]
        if self.ep_group is None:
            routed = self.experts(tokens[source], counts)  # [T' k, h]
        else:
            routed = self._dispatch_combine(tokens[source], counts)  # [T' k, h]
        routed = routed * mine.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add_(0, source, routed)  # [T, h]
        if self.shared is not None:
            out = out + self._shared(tokens)
        out = out.view(b, s, h)
        if self.training and torch.is_grad_enabled():
            aux = self.balance_loss(probs.view(b, s, -1), chosen.view(b, s, -1))
            if self.tp_mesh is not None:  # every TP rank computes it whole; their gradients are summed
                aux = aux / self.tp_mesh.size()
            out = AuxLoss.apply(out, aux)  # type: ignore[no-untyped-call]
        return out

    def _router(self, tokens: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E]. Under TP the gate is replicated and its gradient, partial on each rank, is
        summed over TP by DTensor (a Replicate weight used locally with a Partial gradient: all-reduce in
        backward; torchtitan's NoParallel router with local_output_grad_placements=(Partial(),))."""
        if self.tp_mesh is None:
            return self.gate(tokens)  # type: ignore[no-any-return]
        w, bias = self.gate.weight, self.gate.bias
        return F.linear(tokens, _tp_replicated(w, self.tp_mesh),
                        None if bias is None else _tp_replicated(bias, self.tp_mesh))

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """Shared experts [T, h]; under TP on this rank's column (w1, w3) / row (w2) shards: a partial sum
        (torchtitan: ColwiseParallel w1/w3, RowwiseParallel(output_layouts=Partial()) w2)."""
        assert self.shared is not None
        if self.tp_mesh is None:
            return self.shared(tokens)  # type: ignore[no-any-return]
        ff = self.shared
        w1, w3, w2 = (_local(w).to(tokens.dtype) for w in (ff.get_parameter("w1.weight"),
                                                          ff.get_parameter("w3.weight"),
                                                          ff.get_parameter("down.w2.weight")))
        return down(tokens @ w1.T, tokens @ w3.T, w2, self.experts.recompute_down)  # [T, f/t] -> [T, h] partial

    def _dispatch_combine(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Expert parallelism: the routed copies x [n, h] (sorted by expert, counts [E]) go to the ep rank that
        holds their expert (all_to_all_single with split sizes), run there, and come back in the same order.

        Rank r holds experts [r E/ep, (r+1) E/ep). What a rank receives is grouped by source rank, then by
        expert; it is regrouped by expert for the grouped experts, and back again before the return trip
        (torchtitan's expert_parallel dispatch/combine, without its token-group padding)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, local_e = self.ep, self.num_experts // self.ep
        send = [sum(counts[d * local_e:(d + 1) * local_e]) for d in range(ep)]  # copies for each destination
        got_counts = received_counts(counts, x.device, self.ep_group)  # [ep * local_e]: source s, local expert e
        grid = [got_counts[s * local_e:(s + 1) * local_e] for s in range(ep)]  # [source][local expert]
        recv = [sum(row) for row in grid]
        got = all_to_all_single_autograd(x, recv, send, self.ep_group)  # [sum(recv), h]
        blocks = torch.split(got, got_counts)  # block s * local_e + e
        by_expert = [blocks[s * local_e + e] for e in range(local_e) for s in range(ep)]
        out = self.experts(torch.cat(by_expert), [sum(row[e] for row in grid) for e in range(local_e)])
        done = torch.split(out, [grid[s][e] for e in range(local_e) for s in range(ep)])  # block e * ep + s
        by_source = torch.cat([done[e * ep + s] for s in range(ep) for e in range(local_e)])
        return all_to_all_single_autograd(by_source, send, recv, self.ep_group)  # [n, h]

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """alpha sum over sequences of sum_e f_e P_e, / aux_rows; probs [b, s, E], chosen [b, s, k] (s: this
        rank's tokens of each sequence). Under context parallelism the per-sequence sums (routed copies, router
        probabilities) are summed over the cp ranks, which hold the rest of each sequence [Megatron-Core
        moe/router.py: the aux losses' tokens_per_expert all-reduced over the tensor x context parallel group].
        Each cp rank differentiates only through its own tokens' probabilities (the others' sum enters as a
        constant), so its gradient is its share of the loss's; the dp x cp gradient average divides those shares
        by cp, which the loss therefore enters cp times (as under TP, where every rank has the whole, 1/tp)."""
        b, s, e = probs.shape
        hits = F.one_hot(chosen, e).sum(dim=2).float().sum(dim=1)  # [b, E] copies routed to e, per sequence
        mass = probs.sum(dim=1)  # [b, E] router probability of e summed over the sequence
        scale = 1
        if self.cp_group is not None:
            import torch.distributed as dist

            scale = dist.get_world_size(self.cp_group)
            total = mass.detach().clone()
            for t in (hits, total):
                dist.all_reduce(t, group=self.cp_group)
            mass = mass + (total - mass.detach())  # the whole sequence's value, this rank's gradient path
            s = s * scale
        f = hits * e / (self.top_k * s)  # [b, E]
        return AUX_LOSS_COEF * scale * (f * mass / s).sum() / self.aux_rows


def routed_counts(flat: torch.Tensor, num_experts: int) -> list[int]:
    """Routed copies per expert [E] (bincount of the chosen experts), the split sizes the experts run. The trace
    replaces it (launch/trace/kernels.py `bounded_routing`: fake tensors hold no data to count)."""
    return torch.bincount(flat, minlength=num_experts).tolist()


def received_counts(counts: list[int], device: torch.device, group: Any) -> list[int]:
    """Copies this rank receives [ep * local_e], from source rank s for local expert e at s * local_e + e: an
    all-to-all of every rank's `counts`. Replaced by the trace as `routed_counts` is."""
    import torch.distributed as dist

    sent = torch.tensor(counts, dtype=torch.int64, device=device)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    return got.tolist()


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights in `module` (what expert parallelism shards)."""
    return [p for sub in module.modules() if isinstance(sub, GroupedExperts) for p in sub.parameters()]


def apply_experts(part: nn.Module, experts_mesh: Any) -> None:
    """Expert parallelism over `experts_mesh` (dims pp, edp_replicate, edp_shard, ep, etp; see
    expert_grid.expert_mesh): each GroupedExperts weight becomes a DTensor sharded on the expert dim over ep
    (Shard(0): this rank's E/ep experts) and, with etp > 1, on its f dim over etp (w1, w3 Shard(1), w2 Shard(2): torchtitan
    ExpertTensorParallel on the [ep, etp] mesh); materialise fills it with its slice of the seeded full value.
    Each MoE layer dispatches over the ep group. Call on the meta-device model, before FSDP."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh, etp = experts_mesh["ep"], experts_mesh["etp"].size()
    mesh = experts_mesh["ep", "etp"] if etp > 1 else ep_mesh
    for sub in part.modules():
        if isinstance(sub, MoE):
            sub.ep = ep_mesh.size()
            sub.ep_group = ep_mesh.get_group() if sub.ep > 1 else None
        if isinstance(sub, GroupedExperts):
            for name, p in list(sub.named_parameters(recurse=False)):
                placements = [Shard(0)] + ([Shard(2 if name == "w2" else 1)] if etp > 1 else [])
                sharded = distribute_tensor(p.data, mesh, placements, src_data_rank=None)
                sub.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))


def sync_expert_grads(parts: list[nn.Module], edp_group: Any, dp: int) -> None:
    """Expert gradients after backward: summed over the expert-data-parallel group (the ranks holding the same
    expert shard), then divided by `dp`, the data ranks dp x cp, so they equal the mean gradient that DDP/FSDP
    give the dense weights (an expert's local gradient already sums what every rank of its ep group sent it;
    under TP with etp = 1 the TP ranks of a replica, which routed disjoint tokens, are in its edp group too, as
    are the cp ranks, which routed disjoint shards of the sequences)."""
    import torch.distributed as dist

    for part in parts:
        for p in expert_parameters(part):
            if p.grad is None:
                continue
            g = _local(p.grad)
            if edp_group is not None:
                dist.all_reduce(g, group=edp_group)
            g.div_(dp)
