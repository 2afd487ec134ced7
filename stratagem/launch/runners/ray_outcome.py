"""What a RayRunner run's ranks returned, as a RunResult: the status (ok | oom | failed | timeout | infra), a
one-line reason and the harness result; classify reads the ranks' exit codes and log tails (ray_runner.py's
docstring says what each status means).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["RunStatus", "RunResult", "classify", "rank_summary", "exit_fault_reason"]

RunStatus = Literal["ok", "oom", "failed", "timeout", "infra"]
_TAIL_LINES = 20
# What a rank prints when another rank died under it (gloo/NCCL): not the cause.
_PEER_FAILURE = ("remote worker", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                 "NCCL communicator was aborted", "ProcessGroupNCCL")


@dataclass
class RunResult:
    """What one real run produced."""

    status: RunStatus
    reason: str
    result: dict[str, Any] | None
    """The harness JSON (rank 0's), when the run finished."""
    log_dir: str
    """The driver's folder of this run: per-rank logs (rank<i>.log), scenario.yaml, result.json."""
    command: str
    """The harness command each rank ran (paths relative to the rank's temp dir; environment separate)."""
    wall_s: float
    """Wall time from submission to the end of the run (scheduling + process start + training)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: exit code and log tail."""


def rank_summary(outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: its exit code and the last _TAIL_LINES lines of its log (RunResult.ranks)."""
    return [{"code": o["code"], "tail": o["log"].splitlines()[-_TAIL_LINES:]} for o in outcomes]


def classify(ranks: list[dict[str, Any]], log_dir: str, command: str, wall_s: float) -> RunResult:
    """A finished run from its ranks' outcomes (code, log, result): `oom` (a rank's OOM line), `infra` (a rank's
    INFRA: line with a non-zero exit), `ok` with the exit fault named when rank 0 wrote its result but a rank
    then exited non-zero, `failed` (the rank that raised, not its peers), else `ok`."""
    summary = rank_summary(ranks)
    for rank, r in enumerate(summary):
        oom = [line for line in r["tail"] if "OOM:" in line or "OutOfMemoryError" in line]
        if oom:
            return RunResult("oom", f"rank {rank}: {oom[-1].strip()}", None, log_dir, command, wall_s, summary)
    for rank, r in enumerate(summary):  # the harness's exit 4: the environment failed the run (its checkpoint)
        infra = [line for line in r["tail"] if line.startswith("INFRA:")]
        if infra and r["code"] != 0:
            return RunResult("infra", f"rank {rank}: {infra[-1].strip()}", None, log_dir, command, wall_s, summary)
    failed = [(i, r) for i, r in enumerate(summary) if r["code"] != 0]
    text = ranks[0]["result"]
    if failed and text:
        return _exit_fault(json.loads(text), failed, log_dir, command, wall_s, summary)
    if failed:
        # The rank that raised explains best; its peers only report the broken collective.
        def own_error(r: dict[str, Any]) -> bool:
            text = "\n".join(r["tail"])
            return "Error" in text and not any(m in text for m in _PEER_FAILURE)

        rank, r = next(((i, r) for i, r in failed if own_error(r)), failed[0])
        last = "\n".join(r["tail"][-8:])
        return RunResult("failed", f"rank {rank} exited with {r['code']}:\n{last}", None, log_dir, command,
                         wall_s, summary)
    if not text:
        return RunResult("failed", "rank 0 finished but wrote no result", None, log_dir, command, wall_s, summary)
    return RunResult("ok", "", json.loads(text), log_dir, command, wall_s, summary)


def exit_fault_reason(failed: Sequence[tuple[int, int | None]]) -> str:
    """One line for ranks that exited non-zero after rank 0 wrote the result: (rank, exit code) pairs."""
    def code(c: int | None) -> str:
        if c is not None and c < 0:
            try:
                return f"{c} ({signal.Signals(-c).name})"
            except ValueError:
                return str(c)
        return str(c)

    what = ", ".join(f"rank {r} exited {code(c)}" for r, c in failed)
    return (f"{what} after rank 0 wrote the result (after the last collective): a fault at process exit, "
            "the measurement is kept")


def _exit_fault(result: dict[str, Any], failed: list[tuple[int, dict[str, Any]]], log_dir: str, command: str,
                wall_s: float, summary: list[dict[str, Any]]) -> RunResult:
    """Rank 0 wrote its result (every rank had trained and sent its figures: the result gathers them) but a
    rank then exited non-zero (an abort in interpreter teardown with gloo threads alive: harness/cli.py cli).
    The run is `ok` and says so:
    the reason and the result's `exit_fault` (kept in the stored measurements) name the ranks and signals."""
    reason = exit_fault_reason([(i, r["code"]) for i, r in failed])
    return RunResult("ok", reason, {**result, "exit_fault": reason}, log_dir, command, wall_s, summary)
