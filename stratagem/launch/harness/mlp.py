"""The harness's SwiGLU MLP, shared by the dense layers (harness.model) and the MoE layers' shared experts
(harness.moe): down(silu(gate(x)) * up(x)). Its own module so that model and moe import it without importing
each other. Names as in harness.model: b micro-batch, s sequence, h hidden, f MLP inner, `/t` a TP shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.spaces.model import ModelSpec

__all__ = ["DownProjection", "FeedForward"]


class DownProjection(nn.Module):
    """down(silu(g) * u): the region selective recompute re-runs in backward (its inputs g, u are kept)."""

    def __init__(self, spec: ModelSpec, ffn: int | None = None) -> None:
        super().__init__()
        self.w2 = nn.Linear(ffn or spec.ffn_hidden_size, spec.hidden_size, bias=False)

    def forward(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # g, u [b, s, f/t] -> [b, s, h]
        """w2(silu(g) * u)."""
        return self.w2(F.silu(g) * u)  # type: ignore[no-any-return]


class FeedForward(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: ModelSpec, ffn: int | None = None) -> None:
        super().__init__()
        f = ffn or spec.ffn_hidden_size
        self.w1 = nn.Linear(spec.hidden_size, f, bias=False)  # gate
        self.w3 = nn.Linear(spec.hidden_size, f, bias=False)  # up
        self.down = DownProjection(spec, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [b, s, h]
        """The SwiGLU MLP of x."""
        return self.down(self.w1(x), self.w3(x))  # type: ignore[no-any-return]
