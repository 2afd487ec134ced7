"""Plans as columns of numpy arrays, so one formula evaluates one plan or a million."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
from numpy.typing import NDArray

from stratagem.spaces.plan import (
    PIPELINE_SPLITS,
    PRECISIONS,
    RECOMPUTE_MODULES,
    RECOMPUTES,
    SCHEDULES,
    Plan,
    Recompute,
    RecomputeModule,
    Schedule,
)

__all__ = ["PlanColumns", "PRECISION_CODE", "RECOMPUTE_CODE", "SCHEDULE_CODE", "PP_SPLIT_CODE"]

Array = NDArray[np.float64]

PRECISION_CODE = {p: i for i, p in enumerate(PRECISIONS)}  # fp32 0, bf16 1, fp8 2
RECOMPUTE_CODE = {r: i for i, r in enumerate(RECOMPUTES)}  # none 0, selective 1, full 2, op 3
SCHEDULE_CODE = {s: i for i, s in enumerate(SCHEDULES)}  # gpipe 0, 1f1b 1, interleaved 2, zero_bubble 3
PP_SPLIT_CODE = {s: i for i, s in enumerate(PIPELINE_SPLITS)}  # layers 0, embedding_loss 1
# Columns added after the first version: optional at construction (they default to the Plan's default value),
# so code that builds columns for the original axes keeps working.
_LATER = {"etp": 1.0, "recompute_layers": 0.0, "first_stage_layers": 0.0, "last_stage_layers": 0.0,
          "pp_split": 0.0, "recompute_modules": 0.0}


@dataclass(frozen=True)
class PlanColumns:
    """One float64 array per Plan field; enums as codes (see the *_CODE maps), booleans as 0/1."""

    dp: Array
    tp: Array
    pp: Array
    cp: Array
    ep: Array
    dp_replicate: Array
    zero_stage: Array
    sequence_parallel: Array
    micro_batch_size: Array
    precision: Array
    activation_checkpointing: Array
    pp_schedule: Array
    virtual_stages: Array
    optimizer_offload: Array
    etp: Array = field(default=None)  # type: ignore[arg-type]
    recompute_layers: Array = field(default=None)  # type: ignore[arg-type]
    first_stage_layers: Array = field(default=None)  # type: ignore[arg-type]
    last_stage_layers: Array = field(default=None)  # type: ignore[arg-type]
    pp_split: Array = field(default=None)  # type: ignore[arg-type]
    recompute_modules: Array = field(default=None)  # type: ignore[arg-type]  # bit i: RECOMPUTE_MODULES[i]

    def __post_init__(self) -> None:
        for name, default in _LATER.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.full(self.dp.shape, default))

    # ---- predicates: name the codes once (boolean arrays, one per plan) ----------------------------------------
    @property
    def fp32(self) -> NDArray[np.bool_]:
        """Plans computing in fp32."""
        return np.asarray(self.precision == PRECISION_CODE["fp32"])

    @property
    def fp8(self) -> NDArray[np.bool_]:
        """Plans with fp8 matmuls."""
        return np.asarray(self.precision == PRECISION_CODE["fp8"])

    def recompute_is(self, mode: Recompute) -> NDArray[np.bool_]:
        """Plans whose activation_checkpointing is `mode` (none | selective | full | op)."""
        return np.asarray(self.activation_checkpointing == RECOMPUTE_CODE[mode])

    def schedule_is(self, schedule: Schedule) -> NDArray[np.bool_]:
        """Plans whose pp_schedule is `schedule` (gpipe | 1f1b | interleaved | zero_bubble)."""
        return np.asarray(self.pp_schedule == SCHEDULE_CODE[schedule])

    def recomputes_module(self, module: RecomputeModule) -> NDArray[np.bool_]:
        """Plans whose recompute_modules include `module` (Megatron --recompute-modules)."""
        bits = self.recompute_modules.astype(np.int64)  # sums of distinct powers of 2 (from_plans): exact
        return np.asarray((bits >> RECOMPUTE_MODULES.index(module)) & 1 == 1)

    @property
    def by_module(self) -> NDArray[np.bool_]:
        """Plans that recompute a list of modules (selective with recompute_modules set)."""
        return np.asarray(self.recompute_modules > 0)

    @property
    def offload(self) -> NDArray[np.bool_]:
        """Plans that keep optimizer states in host memory."""
        return np.asarray(self.optimizer_offload > 0)

    @classmethod
    def from_plans(cls, plans: Sequence[Plan]) -> PlanColumns:
        """Columns of the given plans, row i = plans[i]."""
        def col(values: list[float]) -> Array:
            return np.asarray(values, dtype=np.float64)

        return cls(
            dp=col([p.dp for p in plans]),
            tp=col([p.tp for p in plans]),
            pp=col([p.pp for p in plans]),
            cp=col([p.cp for p in plans]),
            ep=col([p.ep for p in plans]),
            dp_replicate=col([p.dp_replicate for p in plans]),
            zero_stage=col([p.zero_stage for p in plans]),
            sequence_parallel=col([float(p.sequence_parallel) for p in plans]),
            micro_batch_size=col([p.micro_batch_size for p in plans]),
            precision=col([PRECISION_CODE[p.precision] for p in plans]),
            activation_checkpointing=col([RECOMPUTE_CODE[p.activation_checkpointing] for p in plans]),
            pp_schedule=col([SCHEDULE_CODE[p.pp_schedule] for p in plans]),
            virtual_stages=col([p.virtual_stages for p in plans]),
            optimizer_offload=col([float(p.optimizer_offload == "cpu") for p in plans]),
            etp=col([p.etp for p in plans]),
            recompute_layers=col([p.recompute_layers for p in plans]),
            first_stage_layers=col([p.first_stage_layers for p in plans]),
            last_stage_layers=col([p.last_stage_layers for p in plans]),
            pp_split=col([PP_SPLIT_CODE[p.pp_split] for p in plans]),
            recompute_modules=col([sum(2 ** RECOMPUTE_MODULES.index(m) for m in p.recompute_modules)
                                   for p in plans]),
        )

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    def take(self, index: NDArray[np.intp] | slice) -> PlanColumns:
        """The rows at `index`."""
        return PlanColumns(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def plan(self, i: int) -> Plan:
        """Row i back as a Plan."""
        return Plan(
            dp=int(self.dp[i]), tp=int(self.tp[i]), pp=int(self.pp[i]), cp=int(self.cp[i]),
            ep=int(self.ep[i]), dp_replicate=int(self.dp_replicate[i]),
            zero_stage=int(self.zero_stage[i]),  # type: ignore[arg-type]
            sequence_parallel=bool(self.sequence_parallel[i]),
            micro_batch_size=int(self.micro_batch_size[i]),
            precision=PRECISIONS[int(self.precision[i])],
            activation_checkpointing=RECOMPUTES[int(self.activation_checkpointing[i])],
            pp_schedule=SCHEDULES[int(self.pp_schedule[i])],
            virtual_stages=int(self.virtual_stages[i]),
            optimizer_offload="cpu" if self.optimizer_offload[i] else "none",
            etp=int(self.etp[i]), recompute_layers=int(self.recompute_layers[i]),
            first_stage_layers=int(self.first_stage_layers[i]), last_stage_layers=int(self.last_stage_layers[i]),
            pp_split=PIPELINE_SPLITS[int(self.pp_split[i])],
            recompute_modules=tuple(m for j, m in enumerate(RECOMPUTE_MODULES)
                                    if int(self.recompute_modules[i]) >> j & 1),
        )
