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
batch over data-parallel ranks and micro-batches (a batch-wise loss is not). It enters through its gradient
only (`AuxLoss`, as DeepSeek's AddAuxiliaryLoss): the reported loss stays the language-model cross-entropy.
`aux_rows` scales it as the cross-entropy is scaled: the rows one backward's loss is the mean over.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.spaces.model import ModelSpec

__all__ = ["AUX_LOSS_COEF", "AuxLoss", "GroupedExperts", "MoE"]

AUX_LOSS_COEF = 1e-3
"""alpha of the sequence-wise balance loss (DeepSeek-V3 uses 1e-4; larger here so 5 steps move the router)."""


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` receives gradient 1 (its gradient joins the model's)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as grouped weights: w1 (gate), w3 (up) [E, f, h], w2 (down) [E, h, f]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, h] sorted by expert, counts[e] rows for expert e -> [n, h]."""
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):  # rows [n_e, h]
            outs.append((F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)) @ self.w2[e].T)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


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
            from stratagem.launch.model import FeedForward

            self.shared = FeedForward(spec, moe.shared_experts * moe.shared_ffn)
        self.aux_rows = 1
        """Rows (sequences) the loss of one backward averages over: the balance loss is summed over its
        sequences and divided by this, as the cross-entropy is (set by the harness per plan)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [b, s, h]
        b, s, h = x.shape
        tokens = x.reshape(-1, h)  # [T, h], T = b s
        probs = F.softmax(self.gate(tokens).float(), dim=-1)  # [T, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        flat = chosen.flatten()  # [T k]
        order = flat.argsort(stable=True)
        source = order // self.top_k  # token of each routed copy, sorted by expert
        counts = torch.bincount(flat, minlength=self.num_experts)  # [E]
        routed = self.experts(tokens[source], counts.tolist())  # [T k, h]
        routed = routed * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add_(0, source, routed)  # [T, h]
        if self.shared is not None:
            out = out + self.shared(tokens)
        out = out.view(b, s, h)
        if self.training and torch.is_grad_enabled():
            out = AuxLoss.apply(out, self.balance_loss(probs.view(b, s, -1), chosen.view(b, s, -1)))  # type: ignore[no-untyped-call]
        return out

    def balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """alpha sum over sequences of sum_e f_e P_e, / aux_rows; probs [b, s, E], chosen [b, s, k]."""
        b, s, e = probs.shape
        hits = F.one_hot(chosen, e).sum(dim=2).float()  # [b, s, E] copies of each token routed to e
        f = hits.sum(dim=1) * e / (self.top_k * s)  # [b, E]
        p = probs.mean(dim=1)  # [b, E]
        return AUX_LOSS_COEF * (f * p).sum() / self.aux_rows
