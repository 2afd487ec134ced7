"""The parts of a step's time: one table every view reads (the time model's columns, `TimeBreakdown`,
`PlanFigures`, explain, zones, compare, the CSV and the report's script).

One meaning per name: a `*_comm_s` part is the communication the step waits for (exposed, after overlap) for
every parallelism; what the engine hides behind compute is the part's `*_hidden_s` companion, so the traffic
before overlap is their sum. The step is the sum of the `term` parts; `exposed_comm_s` the sum of the `comm`
terms. Adding a mechanism: its term in the time model (evaluators.step_terms / timing.time_columns) and one row
here (TimeBreakdown and PlanFigures declare the same names; tests/evaluators/test_step_parts.py holds them to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

__all__ = ["Meaning", "StepPart", "STEP_PARTS", "TIME_TERMS", "COMM_TERMS", "TIME_KEYS", "step_part",
           "before_overlap", "term_seconds"]

Array = NDArray[np.float64]

Meaning = Literal["in_step", "exposed", "hidden", "total"]
"""in_step: time the step spends on it; exposed: communication the step waits for (after overlap); hidden:
communication under compute (not in the step); total: a sum of other parts."""


@dataclass(frozen=True)
class StepPart:
    """One part of a step's time."""

    name: str
    """Column / field name (seconds per optimizer step on the slowest pipeline rank)."""
    meaning: Meaning
    """What the figure counts (Meaning)."""
    label: str
    """How the views name it."""
    doc: str
    """One sentence on what it is."""
    group: str = ""
    """For communication: the group's short name (TP, EP, CP, PP, DP); empty otherwise."""
    hidden: str = ""
    """For an exposed part: the name of its hidden companion (empty when the engine hides none of it)."""
    unit: Literal["s"] = "s"
    """Unit of the figure."""

    @property
    def term(self) -> bool:
        """Whether the part adds to step_s (in_step and exposed parts)."""
        return self.meaning in ("in_step", "exposed")


STEP_PARTS: tuple[StepPart, ...] = (
    StepPart("compute_s", "in_step", "compute", "Forward + backward matmul and attention time at achieved "
             "efficiency."),
    StepPart("recompute_s", "in_step", "recompute", "Extra forward compute for activation recomputation."),
    StepPart("tp_comm_s", "exposed", "TP comm (exposed)", "Tensor-parallel collectives the step waits for.",
             group="TP", hidden="tp_hidden_s"),
    StepPart("ep_comm_s", "exposed", "EP comm (exposed)", "MoE expert dispatch / combine over the expert-parallel "
             "group, and the etp gathers, that the step waits for.", group="EP", hidden="ep_hidden_s"),
    StepPart("cp_comm_s", "exposed", "CP comm (exposed)", "Context-parallel KV exchange.", group="CP"),
    StepPart("pp_comm_s", "exposed", "PP comm (exposed)", "Pipeline point-to-point transfers on the critical "
             "path.", group="PP"),
    StepPart("dp_comm_s", "exposed", "DP comm (exposed)", "Data-parallel gradient all-reduce or ZeRO/FSDP "
             "reduce-scatter + all-gather that the step waits for.", group="DP", hidden="dp_hidden_s"),
    StepPart("bubble_s", "in_step", "pipeline bubble", "Pipeline warm-up and drain idle time."),
    StepPart("optimizer_s", "in_step", "optimizer step", "Optimizer step (state read/write over HBM bandwidth, "
             "or over PCIe and host memory when offloaded)."),
    StepPart("overhead_s", "in_step", "step overhead", "Fixed per-step cost plus time the GPU waits on kernel "
             "launches."),
    StepPart("tp_hidden_s", "hidden", "TP comm hidden", "Tensor-parallel traffic pipelined with its GEMMs (TE "
             "userbuffers, async TP).", group="TP"),
    StepPart("ep_hidden_s", "hidden", "EP comm hidden", "Expert traffic hidden behind another micro-batch's "
             "compute.", group="EP"),
    StepPart("dp_hidden_s", "hidden", "DP comm hidden", "Data-parallel traffic hidden behind compute (FSDP "
             "prefetch, gradient buckets under backward).", group="DP"),
    StepPart("exposed_comm_s", "total", "exposed communication", "Communication not hidden behind compute: the "
             "sum of the exposed parts."),
    StepPart("step_s", "total", "step", "Wall time of one optimizer step: the sum of the in-step and exposed "
             "parts."),
)
"""Every part, in the order the views list them."""

TIME_TERMS: tuple[str, ...] = tuple(p.name for p in STEP_PARTS if p.term)
"""The parts whose sum is step_s, each with its own multiplier (Calibration.time_multipliers; a term's multiplier
scales its hidden companion too)."""
COMM_TERMS: tuple[str, ...] = tuple(p.name for p in STEP_PARTS if p.meaning == "exposed")
"""The exposed communication parts; their sum is exposed_comm_s."""
TIME_KEYS: tuple[str, ...] = tuple(p.name for p in STEP_PARTS)
"""Every part's name: the time model's second-per-step columns."""


def step_part(name: str) -> StepPart:
    """The row called `name`; KeyError when there is none."""
    for p in STEP_PARTS:
        if p.name == name:
            return p
    raise KeyError(f"no step-time part {name!r} (evaluators.step_parts.STEP_PARTS)")


def before_overlap(parts: Mapping[str, Array] | Mapping[str, float], name: str) -> Array:
    """Traffic of the exposed part `name` before overlap: the part plus its hidden companion (if any)."""
    hidden = step_part(name).hidden
    return np.asarray(parts[name], dtype=np.float64) + (np.asarray(parts[hidden], dtype=np.float64) if hidden
                                                        else 0.0)


def term_seconds(cols: Mapping[str, Array]) -> Array:
    """(N, len(TIME_TERMS)) seconds each term adds to step_s, from the time model's (or evaluate_many's) columns;
    the rows sum to step_s."""
    return np.stack([np.asarray(cols[k], dtype=np.float64) for k in TIME_TERMS], axis=1)
