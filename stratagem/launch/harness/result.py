"""The harness's result JSON as a model: written by `stratagem.launch.harness` (rank 0, `--out`), read by the
runners (launch.real turns it into a measured Evaluation, whose `measurements` keep the `STORED` part), by
reproduce (recorded vs rerun) and by export (the recorded steps, warm-up and seed). No torch import.

Per rank, `peak_bytes` is what the harness's tracker saw (CPU: live tensor bytes at the tracked step; CUDA:
max_memory_allocated); on CUDA `peak_reserved_bytes` (the caching allocator's reservation) is the figure that
meets HBM, so `RankFigures.peak` prefers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from stratagem.errors import StratagemError
from stratagem.evaluators.spread import StepSpread
from stratagem.launch.harness.budget import StepBudget
from stratagem.spaces.plan import Plan
from stratagem.units import GIB

__all__ = ["RankFigures", "CheckpointTimes", "HarnessResult", "STORED", "read_result", "parse_result"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class RankFigures(BaseModel):
    """Memory of one rank at the tracked step (bytes)."""

    model_config = _FROZEN

    rank: int
    """Global rank."""
    stage_ids: list[int] = []
    """Pipeline stages this rank holds (0 = first)."""
    param_bytes: int = 0
    """Parameters resident on the rank (its shard)."""
    optimizer_bytes: int = 0
    """Optimizer states on the device."""
    host_state_bytes: int = 0
    """States kept in host memory (optimizer offload)."""
    unsharded_param_bytes: int = 0
    """Largest all-gathered (unsharded) parameter bytes held at once."""
    grad_bytes: int = 0
    """Gradient bytes after backward."""
    peak_bytes: int
    """Peak tracked bytes (CPU: live tensors; CUDA: max_memory_allocated)."""
    peak_tracked_bytes: int | None = None
    """The live-bytes tracker's peak (CPU runs)."""
    tracked_at_entry_bytes: int | None = None
    """Live bytes when the tracked step began."""
    peak_allocated_bytes: int | None = None
    """CUDA max_memory_allocated."""
    peak_reserved_bytes: int | None = None
    """CUDA max_memory_reserved: what the allocator took from HBM."""
    rss_bytes: int = 0
    """Resident set size of the rank's process at the end."""
    rss_peak_bytes: int = 0
    """Peak resident set size (VmHWM)."""

    @property
    def peak(self) -> int:
        """The peak that meets device memory: reserved when the allocator reports it, else tracked."""
        return self.peak_reserved_bytes if self.peak_reserved_bytes is not None else self.peak_bytes


class CheckpointTimes(BaseModel):
    """The timed checkpoint save and load (empty when the run skipped it)."""

    model_config = _FROZEN

    save_s: float | None = None
    """Blocking save."""
    async_save_blocking_s: float | None = None
    """Time training is blocked by an async save (staging)."""
    async_save_total_s: float | None = None
    """Async save end to end."""
    load_s: float | None = None
    """Load back."""
    load_scope: str | None = None
    """How the load was timed: "dcp" (every rank saw the coordinator's checkpoint: one node or a shared
    directory) or "rank-local" (per-node folders: each rank read its own state back; harness.checkpoint)."""
    async_save_error: str | None = None
    """Why the async save could not be timed here (the blocking save still was)."""


class HarnessResult(BaseModel):
    """What one harness run measured (rank 0 writes it)."""

    model_config = _FROZEN

    step_s: float
    """Median timed step, seconds."""
    tokens_per_s: float
    """tokens_per_step / step_s."""
    ranks: list[RankFigures]
    """Per rank memory."""
    step_times_s: list[float] = []
    """Every step's wall time (warm-up first)."""
    step_spread: StepSpread | None = None
    """Median and 95 % interval of the timed steps (None in results written before it existed)."""
    step_budget: StepBudget | None = None
    """The budget that chose the number of timed steps (None: a fixed --steps)."""
    host_load: list[float] | None = None
    """rank 0's host 1-minute load average when the timed steps began and when they ended (a loaded CPU host
    stretches steps: harness.budget's measurements)."""
    losses: list[float] = []
    """Loss per step."""
    tokens_per_step: int | None = None
    """Global batch x sequence length."""
    device: str | None = None
    """cpu, or the CUDA device name."""
    world_size: int | None = None
    """Ranks."""
    steps: int | None = None
    """Timed steps."""
    warmup: int | None = None
    """Untimed steps before them."""
    seed: int | None = None
    """Data and init seed."""
    versions: dict[str, str] = {}
    """torch, python, cuda."""
    checkpoint: CheckpointTimes = CheckpointTimes()
    """Timed checkpoint save/load."""
    mechanisms: dict[str, str] = {}
    """How each parallelism was realised (e.g. tensor_parallel: DTensor Colwise/Rowwise)."""
    plan: Plan | None = None
    """The plan run (absent from the part stored with a trial, which has the plan already)."""
    plan_text: str | None = None
    """format_plan(plan)."""
    backend: str | None = None
    """Process-group backend (gloo, nccl, none)."""
    lr: float | None = None
    """Learning rate."""
    build_s: float | None = None
    """Model build and parallelisation time."""
    memory_tracked_step: int | None = None
    """The step whose memory was tracked."""
    exit_fault: str | None = None
    """Set by the runner when a rank exited non-zero after rank 0 wrote this result (a fault at process exit,
    after the last collective): which ranks and signals. The figures stand; the fault is said, not hidden."""

    @property
    def worst_rank(self) -> RankFigures:
        """The rank with the highest peak."""
        return max(self.ranks, key=lambda r: r.peak)

    @property
    def peak_gib(self) -> float:
        """The highest rank peak, GiB."""
        return self.worst_rank.peak / GIB

    @property
    def spread(self) -> StepSpread:
        """The timed steps' spread: the stored one, else computed from step_times_s (older results), else a
        single-sample spread at step_s."""
        if self.step_spread is not None:
            return self.step_spread
        from stratagem.evaluators.spread import spread_of_samples

        timed = self.step_times_s[self.warmup or 0:] or [self.step_s]
        return spread_of_samples(timed)

    def stored(self) -> dict[str, Any]:
        """The part kept in a measured Evaluation's `measurements` (JSON-able)."""
        return self.model_dump(mode="json", include=set(STORED), exclude_none=True)


STORED: tuple[str, ...] = ("step_s", "step_spread", "step_budget", "host_load", "step_times_s", "losses", "tokens_per_s", "tokens_per_step", "device",
                           "world_size", "steps", "warmup", "seed", "versions", "checkpoint", "mechanisms", "ranks",
                           "exit_fault")
"""Fields of a HarnessResult stored with a measured trial."""


def parse_result(data: Any, source: str) -> HarnessResult:
    """A HarnessResult from decoded JSON; one line naming `source` when it is not one."""
    try:
        return HarnessResult.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise StratagemError(f"{source}: not a stratagem harness result ({where}: {first['msg']})") from None


def read_result(path: str | Path) -> HarnessResult:
    """Read a result file the harness wrote (`--out`); bounded (stratagem.files.read_json: a regular file of
    UTF-8 JSON, at most 16 MiB; a FIFO or /dev/zero is refused unread)."""
    from stratagem.files import read_json

    data = read_json(path, "harness result", hint="give the result JSON the harness wrote (--out)")
    return parse_result(data, str(path))
