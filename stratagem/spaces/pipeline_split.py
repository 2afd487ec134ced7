"""Pipeline layer accounting as the stacks do it: transformer layers per model chunk for a plan.

Three ways to cut L layers into p x v model chunks (chunk c runs on pipeline rank c % p, in model order):
  layers          L split evenly, the remainder on the first chunks (torch.distributed.pipelining's default split;
                  Megatron runs it through --pipeline-model-parallel-layout when L % (p v) != 0).
  embedding_loss  the embedding and the loss each count as one layer: L + 2 units split evenly, the first chunk's
                  first unit is the embedding and the last chunk's last unit the loss. Megatron
                  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
                  [megatron/core/transformer/transformer_layer.py get_transformer_layer_offset: num_layers += 1
                  for each, offset -= 1 past the first stage; megatron/core/transformer/transformer_config.py
                  __post_init__: (num_layers + 2) must divide evenly by p (x v)]; torchtitan's
                  generate_llm_fqn_per_model_part (torchtitan/distributed/pipeline_parallel.py, input_weight =
                  output_weight = 1) splits the same way.
  uneven          first/last stage layer counts given (Megatron --decoder-first-pipeline-num-layers /
                  --decoder-last-pipeline-num-layers): the remaining layers spread evenly over the middle stages,
                  each stage's layers split evenly over its v chunks [get_transformer_layer_offset, uneven branch;
                  transformer_config.py __post_init__ asserts the middle and per-chunk divisions are exact and
                  refuses the account-for flags together with explicit first/last counts].
"""

from __future__ import annotations

__all__ = ["chunk_layers", "split_problem", "rank_layers", "rank_layer_ranges"]


def split_problem(num_layers: int, pp: int, virtual: int, first: int, last: int, split: str) -> str | None:
    """Why this split cannot be built (one line naming the fields and the fix), or None."""
    uneven = first > 0 or last > 0
    chunks = pp * virtual
    if uneven and pp == 1:
        return "first_stage_layers/last_stage_layers need pp > 1: set them to 0"
    if split == "embedding_loss":
        if uneven:
            return ("pp_split embedding_loss cannot be combined with first_stage_layers/last_stage_layers "
                    "(Megatron transformer_config.py refuses the account-for flags with uneven stages): set "
                    "pp_split=layers or both counts to 0")
        if pp > 1 and (num_layers + 2) % chunks:
            return (f"pp_split embedding_loss: num_layers + 2 ({num_layers + 2}) must divide evenly into "
                    f"pp*virtual_stages ({chunks}) chunks (Megatron transformer_config.py); use pp_split=layers "
                    "or another pp/virtual_stages")
        return None
    if not uneven:
        if chunks > num_layers:
            return (f"pp*virtual_stages ({pp}*{virtual}) exceeds num_layers ({num_layers}); every model chunk needs "
                    "at least one layer (or count the embedding and loss: pp_split=embedding_loss)")
        return None
    middle_stages = pp - (first > 0) - (last > 0)
    middle = num_layers - first - last
    if middle < 0 or (middle_stages == 0 and middle != 0):
        return (f"first_stage_layers + last_stage_layers ({first} + {last}) must leave the {num_layers} layers to "
                f"the {middle_stages} middle stage(s); with pp={pp} they must sum to {num_layers}"
                if middle_stages == 0 else
                f"first_stage_layers + last_stage_layers ({first} + {last}) exceed num_layers ({num_layers})")
    if middle_stages and (middle % middle_stages or middle // middle_stages == 0):
        return (f"the {middle} layers left after first_stage_layers={first} and last_stage_layers={last} must split "
                f"evenly (at least one each) over the {middle_stages} middle stages (Megatron "
                "transformer_config.py); change the counts")
    per_middle = middle // middle_stages if middle_stages else 0
    for name, n in (("first_stage_layers", first), ("last_stage_layers", last), ("middle stage layers", per_middle)):
        if n and n % virtual:
            return (f"{name} ({n}) must be a multiple of virtual_stages ({virtual}): each stage's layers split "
                    "evenly over its model chunks (Megatron transformer_config.py)")
    return None


def chunk_layers(num_layers: int, pp: int, virtual: int, first: int = 0, last: int = 0,
                 split: str = "layers") -> tuple[int, ...]:
    """Transformer layers of each of the pp * virtual model chunks, in model order (see the module docstring).
    The split must be valid (`split_problem` is None), except that an uneven remainder is spread over the first
    chunks for the plain and embedding_loss splits."""
    chunks = pp * virtual
    if pp == 1:
        return tuple(_even(num_layers, chunks))
    if first > 0 or last > 0:
        middle_stages = pp - (first > 0) - (last > 0)
        per_middle = (num_layers - first - last) // middle_stages if middle_stages else 0
        per_rank = [per_middle] * pp
        if first > 0:
            per_rank[0] = first
        if last > 0:
            per_rank[-1] = last
        return tuple(per_rank[c % pp] // virtual for c in range(chunks))
    if split == "embedding_loss":
        units = _even(num_layers + 2, chunks)
        units[0] = max(0, units[0] - 1)
        units[-1] = max(0, units[-1] - 1)
        return tuple(units)
    return tuple(_even(num_layers, chunks))


def _even(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def rank_layers(chunks: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """Transformer layers held by each pipeline rank (chunk c runs on rank c % pp)."""
    out = [0] * pp
    for c, n in enumerate(chunks):
        out[c % pp] += n
    return tuple(out)


def rank_layer_ranges(chunks: tuple[int, ...], pp: int) -> tuple[tuple[range, ...], ...]:
    """Per pipeline rank, the ranges of layer indices of its chunks (for per-layer parameter sums)."""
    out: list[list[range]] = [[] for _ in range(pp)]
    start = 0
    for c, n in enumerate(chunks):
        out[c % pp].append(range(start, start + n))
        start += n
    return tuple(tuple(r) for r in out)
