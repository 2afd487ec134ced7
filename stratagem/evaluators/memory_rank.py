"""The quantities every memory term of one pipeline rank reads (built once by memory.rank_memory_columns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.calibration import Calibration
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import sp_divisor
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import StackRecord

__all__ = ["Rank"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class Rank:
    """One rank of the first or last pipeline stage of every plan: shapes and counts the terms share. Arrays have
    one value per plan; parameters are counts on this rank (TP/EP split, before ZeRO sharding)."""

    scn: Scenario
    pc: PlanColumns
    cal: Calibration
    rec: StackRecord
    last: bool
    """The last pipeline stage (False: the first; the same rank when pp = 1)."""
    fp32: NDArray[np.bool_]
    layers: Array
    """Transformer layers on this rank (all its chunks)."""
    redone: Array
    """Of them, the layers that recompute (partial recompute: recompute_layers per chunk)."""
    dense: Array
    """Non-expert parameters (layers, embedding / head as the stage holds them)."""
    expert: Array
    """Routed-expert parameters (split over ep x etp)."""
    unit: Array
    """The largest FSDP unit's parameters (a layer, the embedding or the head)."""
    layer_linear: Array
    """One layer's linear weights on this rank."""
    shard: Array
    """ZeRO/FSDP shard group of the dense parameters (dp x cp / dp_replicate)."""
    expert_shard: Array
    """ZeRO shard group of the expert parameters (expert data parallel / dp_replicate)."""
    opt_bytes: float
    """Optimizer state bytes per parameter."""
    microbatches: Array
    """Micro-batches per optimizer step per pipeline."""
    in_flight: Array
    """Micro-batches whose activations the rank holds at its peak (memory_pipeline.in_flight)."""
    act_bytes: Array
    """Bytes per activation element (compute dtype)."""
    s: Array
    """Tokens per sequence on this rank (seq_len / cp)."""
    b: Array
    """Sequences per micro-batch."""

    @property
    def sbh(self) -> Array:
        """Elements of one [s, b, h] tensor."""
        return self.s * self.b * self.scn.model.hidden_size

    @property
    def sp_div(self) -> Array:
        """tp with sequence parallelism, else 1: what sequence-sharded tensors are divided by."""
        return sp_divisor(self.pc)

    @property
    def has_head(self) -> NDArray[np.bool_]:
        """The rank holds the output projection and the loss (last stage, or the only one)."""
        return np.asarray(self.last | (self.pc.pp == 1))
