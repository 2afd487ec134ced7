"""`PlanFigures`: what `evaluate_many` returns, one named float64 array per figure, one row per plan.

The columns follow the Evaluation's parts (MemoryBreakdown, TimeBreakdown, Throughput, CheckpointRisk, Zones),
so `evaluate` (one plan) and screening (a million) read the same names. Codes have names: `fits`,
`broken_block(i)`, `zone_level(name)`, `zone_is(name, level)`, `bottleneck_name(i)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.evaluation import BLOCKS, LEVELS, ZONE_NAMES, Block, Level, ZoneName

__all__ = ["PlanFigures"]

Array = NDArray[np.float64]


@dataclass(frozen=True)
class PlanFigures:
    """Every figure of many plans (row i is plan i of the columns evaluated)."""

    # memory of the worst rank, GiB (MemoryBreakdown)
    weights_gib: Array
    """Parameters resident on the rank."""
    gradients_gib: Array
    """Gradient buffers."""
    optimizer_gib: Array
    """Optimizer states and fp32 master weights."""
    activations_gib: Array
    """Saved activations of the in-flight micro-batches."""
    transient_gib: Array
    """Communication buffers and the backward working set."""
    overhead_gib: Array
    """Allocator fragmentation and runtime context."""
    peak_gib: Array
    """Sum of the blocks: the predicted peak."""
    hbm_gib: Array
    """Device memory."""
    headroom_gib: Array
    """hbm - peak (negative when the plan does not fit)."""
    worst_stage: Array
    """Pipeline stage of the worst rank (0 = first)."""
    first_block_to_break: Array
    """Index into BLOCKS of the block whose addition first crosses HBM, -1 when the plan fits (`broken_block`)."""
    # seconds per optimizer step (TimeBreakdown; the parts' meanings: step_parts.STEP_PARTS)
    compute_s: Array
    """Forward + backward compute."""
    recompute_s: Array
    """Extra forward compute for activation recomputation."""
    tp_comm_s: Array
    """Exposed tensor-parallel communication."""
    ep_comm_s: Array
    """Exposed expert dispatch / combine communication."""
    cp_comm_s: Array
    """Exposed context-parallel KV exchange."""
    pp_comm_s: Array
    """Exposed pipeline point-to-point transfers."""
    dp_comm_s: Array
    """Exposed data-parallel communication."""
    bubble_s: Array
    """Pipeline bubble."""
    optimizer_s: Array
    """Optimizer step."""
    overhead_s: Array
    """Fixed per-step cost and launch-bound waiting."""
    tp_hidden_s: Array
    """Tensor-parallel communication pipelined with its GEMMs (TE userbuffers, async TP)."""
    ep_hidden_s: Array
    """Expert communication hidden behind another micro-batch's compute."""
    dp_hidden_s: Array
    """Data-parallel communication hidden behind compute."""
    exposed_comm_s: Array
    """Communication not hidden behind compute."""
    step_s: Array
    """Wall time of one optimizer step."""
    micro_batches: Array
    """Micro-batches per step per pipeline."""
    model_flops: Array
    """Model FLOPs per token (6N + attention, no recompute)."""
    # throughput (Throughput)
    tokens_per_s: Array
    """Cluster-wide tokens per second."""
    tokens_per_s_per_gpu: Array
    """Tokens per second per GPU."""
    mfu: Array
    """Model FLOP utilisation (against the dense bf16 peak)."""
    hfu: Array
    """Hardware FLOP utilisation (recompute included, against the peak of the matmul dtype)."""
    # checkpoint (CheckpointRisk)
    state_gib: Array
    """Full training state written per checkpoint."""
    shard_gib: Array
    """Largest per-rank shard."""
    save_s: Array
    """Time to write one checkpoint."""
    stall_s: Array
    """Training time lost per checkpoint."""
    load_s: Array
    """Time to read one checkpoint back."""
    job_mtbf_h: Array
    """Mean time between failures of the whole job."""
    interval_s: Array
    """Checkpoint interval."""
    goodput_loss: Array
    """Expected fraction of time lost to checkpoints and failures."""
    # zones (Zones; thresholds in evaluators.zones)
    zone_hbm_value: Array
    """Headroom / HBM."""
    zone_hbm_level: Array
    """Level code (LEVELS index) of the HBM zone."""
    zone_communication_value: Array
    """Exposed communication / step."""
    zone_communication_level: Array
    """Level code of the communication zone."""
    zone_bubbles_value: Array
    """Pipeline bubble / step."""
    zone_bubbles_level: Array
    """Level code of the bubbles zone."""
    zone_checkpoint_value: Array
    """Expected goodput loss."""
    zone_checkpoint_level: Array
    """Level code of the checkpoint zone."""
    bottleneck: Array
    """Index into ZONE_NAMES of the zone that limits the plan most (`bottleneck_name`)."""

    @classmethod
    def from_columns(cls, columns: Mapping[str, Array]) -> PlanFigures:
        """Pick the named figures out of the evaluator's working columns (extra working columns are left)."""
        missing = [f.name for f in fields(cls) if f.name not in columns]
        if missing:
            raise KeyError(f"PlanFigures: the evaluator computed no {', '.join(missing)}")
        return cls(**{f.name: np.asarray(columns[f.name]) for f in fields(cls)})

    @classmethod
    def concat(cls, parts: Sequence[PlanFigures]) -> PlanFigures:
        """Rows of several PlanFigures, in order (screening evaluates in chunks)."""
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def __len__(self) -> int:
        return int(self.step_s.shape[0])

    def take(self, index: NDArray[np.intp] | slice) -> PlanFigures:
        """The rows at `index`."""
        return PlanFigures(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def block_gib(self, block: Block) -> Array:
        """One memory block's column, GiB."""
        return np.asarray(getattr(self, f"{block}_gib"))

    @property
    def fits(self) -> NDArray[np.bool_]:
        """Plans whose peak fits in HBM."""
        return np.asarray(self.headroom_gib >= 0)

    def broken_block(self, i: int) -> Block | None:
        """The block that first breaks HBM in row i, None when the plan fits."""
        code = int(self.first_block_to_break[i])
        return BLOCKS[code] if code >= 0 else None

    def zone_value(self, name: ZoneName) -> Array:
        """One zone's figure per plan."""
        return np.asarray(getattr(self, f"zone_{name}_value"))

    def zone_level(self, name: ZoneName) -> Array:
        """One zone's level code per plan (LEVELS index)."""
        return np.asarray(getattr(self, f"zone_{name}_level"))

    def zone_is(self, name: ZoneName, level: Level) -> NDArray[np.bool_]:
        """Plans whose zone `name` is at `level`."""
        return np.asarray(self.zone_level(name) == LEVELS.index(level))

    def level(self, name: ZoneName, i: int) -> Level:
        """Row i's level of zone `name`."""
        return LEVELS[int(self.zone_level(name)[i])]

    def bottleneck_name(self, i: int) -> ZoneName:
        """Row i's bottleneck zone."""
        return ZONE_NAMES[int(self.bottleneck[i])]

    def objectives(self, names: Sequence[str]) -> Array:
        """(n, len(names)) matrix of the named figures (the search's objectives, e.g. records.OBJECTIVES)."""
        return np.stack([np.asarray(getattr(self, k), dtype=np.float64) for k in names], axis=1)
