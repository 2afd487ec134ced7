"""The harness model: a Llama-style decoder built from any `ModelSpec`, seeded init, synthetic batches.

RMSNorm, rotary embeddings, GQA attention through `scaled_dot_product_attention`, SwiGLU MLP (or, in the MoE
layers of an MoE spec, stratagem.launch.harness.moe.MoE: router + grouped experts), optional tied embeddings. Layers live in a `ModuleDict` keyed "0".."L-1" so that a pipeline stage that keeps only some of
them (and drops the embedding or the head, set to None) has the same parameter names as the whole model:
checkpoints and parameter comparisons work across plans.

Build on the meta device (`build_model(spec, device="meta")`), parallelise, then `materialize(model, device,
seed)`: every parameter's value comes from (seed, canonical name) alone, generated whole and cut to the
rank's shard with `distribute_tensor(..., src_data_rank=None)`, so any plan starts from the same weights as
the single-process reference.

Names: b micro-batch, s sequence, h hidden, a query heads, k kv heads, d head dim, f MLP inner, V vocab;
a `/t` suffix marks a tensor-parallel shard.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stratagem.errors import StratagemError
from stratagem.launch.harness.mlp import FeedForward
from stratagem.launch.harness.moe import MoE
from stratagem.launch.harness.support import model_refusal
from stratagem.spaces.model import ModelSpec
from stratagem.spaces.training import TrainingSpec

__all__ = [
    "RMSNorm", "Attention", "Block", "Transformer",
    "check_supported", "build_model", "materialize", "canonical_fqn", "named_parameters",
    "synthetic_batch", "INIT_STD", "ROPE_THETA",
]

INIT_STD = 0.02
ROPE_THETA = 500000.0  # Llama 3
_WRAPPER_TOKENS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def check_supported(spec: ModelSpec) -> None:
    """Raise StratagemError for model features the harness does not build (see stratagem.launch.harness.support)."""
    reason = model_refusal(spec)
    if reason:
        raise StratagemError(reason)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Llama's), with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s(/t with SP), h]: saves x and rstd [b, s, 1]
        """x / rms(x) * weight over the last dimension."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on x [b, s, heads, d] (half-split convention), computed on the fly for
    `positions` [s] (default 0..s-1; under context parallelism this rank's positions of the sequence)."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    pos = torch.arange(s, device=x.device) if positions is None else positions
    angles = torch.outer(pos.to(torch.float32), inv)  # [s, d/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.dim_head
        self.wq = nn.Linear(spec.hidden_size, spec.q_size, bias=False)
        self.wk = nn.Linear(spec.hidden_size, spec.kv_size, bias=False)
        self.wv = nn.Linear(spec.hidden_size, spec.kv_size, bias=False)
        self.wo = nn.Linear(spec.q_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:  # x [b, s, h]
        """Attention output projected back to the hidden size (a TP rank holds its heads' share). Under
        context parallelism x holds this rank's positions of the sequence and SDPA runs as ring attention."""
        b, s, _ = x.shape
        d = self.head_dim
        q = _rotary(self.wq(x).view(b, s, -1, d), positions)  # [b, s, a/t, d]
        k = _rotary(self.wk(x).view(b, s, -1, d), positions)  # [b, s, k/t, d]
        v = self.wv(x).view(b, s, -1, d)  # [b, s, k/t, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)  # [b, a/t, s, d]
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]  # [b, s, h]


class Block(nn.Module):
    """One decoder layer: attention and MLP (or MoE), each behind an RMSNorm with a residual."""

    def __init__(self, spec: ModelSpec, moe: bool = False) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden_size)
        self.feed_forward: nn.Module = FeedForward(spec)
        if moe:  # router + grouped experts (stratagem.launch.harness.moe)
            self.feed_forward = MoE(spec)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s(/t with SP), h] plus attention, then plus the MLP, each on the normalised input."""
        x = x + self.attention(self.attention_norm(x), positions=positions)
        return x + self.feed_forward(self.ffn_norm(x))  # type: ignore[no-any-return]


class Transformer(nn.Module):
    """Decoder; a pipeline stage is the same class with some parts set to None.

    forward(tokens [b, s] int64) -> logits [b, s, V] on the whole model; a middle stage maps hidden states
    [b, s, h] to hidden states. `autocast_dtype` runs the forward under torch.autocast (bf16 without FSDP).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.autocast_dtype: torch.dtype | None = None
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(spec, spec.is_moe_layer(i)) for i in range(spec.num_layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.hidden_size)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (or a previous stage's hidden states) -> logits (or hidden states), under autocast.
        `positions` [b, s]: the sequence positions x holds, the same in every row (context parallelism);
        None: 0..s-1."""
        device_type = x.device.type
        if positions is not None:
            positions = positions[0]  # [s]
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # [b, s, h]
            for layer in self.layers.values():
                h = layer(h, positions=positions) if positions is not None else layer(h)
            if self.norm is not None:
                h = self.norm(h)
            return self.output(h) if self.output is not None else h  # [b, s, V] or [b, s, h]


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> Transformer:
    """The whole model, on `device` (meta: no memory until `materialize`)."""
    check_supported(spec)
    with torch.device(device):
        return Transformer(spec)


def canonical_fqn(name: str) -> str:
    """A parameter name without wrapper prefixes (checkpoint_wrapper, DDP's `module.`, torch.compile)."""
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name.removeprefix("module.")


def named_parameters(parts: Sequence[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """(canonical name, parameter) over the model parts held by this rank, each parameter once. With tied
    embeddings the last pipeline stage's output.weight is the embedding's copy: named tok_embeddings.weight."""
    seen: set[int] = set()
    for part in parts:
        spec = getattr(getattr(part, "module", part), "spec", None)
        tied = spec is not None and spec.tied_embeddings
        for name, p in part.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                fqn = canonical_fqn(name)
                yield ("tok_embeddings.weight" if tied and fqn == "output.weight" else fqn), p


def _init_value(name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """The full initial value of parameter `name`: ones for norms, N(0, 0.02) otherwise; from (seed, name)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape, device=device).normal_(0.0, INIT_STD, generator=gen)


@torch.no_grad()
def materialize(parts: Sequence[nn.Module], device: torch.device, seed: int) -> None:
    """Allocate meta parameters on `device` and fill them with the plan-independent initial values.

    A sharded parameter (a DTensor from TP and/or FSDP2) receives its shard of the full value, cut locally
    by `distribute_tensor(full, mesh, placements, src_data_rank=None)` (no communication).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for part in parts:
        shared = _shared_parameters(part)
        part.to_empty(device=device)
        for owners in shared:  # to_empty gives each owner its own tensor: share the first owner's again
            first, first_name = owners[0]
            for module, name in owners[1:]:
                module._parameters[name] = first._parameters[first_name]
    for name, p in named_parameters(parts):
        if isinstance(p, DTensor):
            full = _init_value(name, p.shape, seed, device)
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(_init_value(name, p.shape, seed, device))


def _shared_parameters(part: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, name) owners of each parameter registered in more than one place (tied embeddings)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in part.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    return [o for o in owners.values() if len(o) > 1]


def synthetic_batch(spec: ModelSpec, training: TrainingSpec, seed: int, step: int,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step `step`: (inputs, targets), each [global_batch, seq_len] int64.

    Learnable synthetic text: each next token follows a fixed random permutation of the vocabulary (drawn
    from `seed`) half of the time and is uniform otherwise, so the loss falls as the model learns. Tokens
    come from a generator seeded with (seed, step): every plan and a resumed run see the same data.
    """
    vocab, rows, cols = spec.vocab_size, training.global_batch_size, training.seq_len + 1
    gen = torch.Generator()
    gen.manual_seed(zlib.crc32(f"vocab:{seed}".encode()))
    successor = torch.randperm(vocab, generator=gen)  # [V]
    gen.manual_seed(zlib.crc32(f"batch:{seed}:{step}".encode()))
    noise = torch.randint(0, vocab, (rows, cols), generator=gen)  # [B, s+1]
    follow = torch.rand(rows, cols, generator=gen) < 0.5  # [B, s+1]
    tokens = noise.clone()
    for i in range(1, cols):
        tokens[:, i] = torch.where(follow[:, i], successor[tokens[:, i - 1]], noise[:, i])
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]
