"""The analytic model's few fitted constants, in one frozen object.

Defaults are fitted on `../shared/reference/` only (bench/memory_accuracy.py, bench/throughput_accuracy.py);
a search may refit them on its own measured trials (real runs) and pass the result to the evaluator.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Calibration", "DEFAULT_CALIBRATION"]


class Calibration(BaseModel):
    """Constants the formulas cannot derive: allocator behaviour, runtime overheads, kernel efficiency."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fragmentation: float = Field(default=0.05, ge=0, le=1)
    """Allocator fragmentation/caching as a fraction of the allocated peak (reserved vs allocated)."""
    context_gib: float = Field(default=0.0, ge=0)
    """Per-rank runtime memory outside the allocator's statistics (CUDA context, NCCL), GiB."""
    logits_bytes: float = Field(default=10.0, ge=0)
    """Bytes per logit element alive at the loss: bf16 logits (2) + fp32 upcast (4) + fp32 gradient (4)."""


DEFAULT_CALIBRATION = Calibration()
