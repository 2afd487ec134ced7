"""The driver's side of a run's rank actors (ray_rank.RankWorker): collecting their outcomes, telling a lost actor
from a rank that exited, and ending them so that each rank's work dir goes with its run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["END_WAIT_S", "collect", "lost", "end_actors", "first_line"]

END_WAIT_S = 2.0
"""How long ending a run's actors waits for their ranks' cleanup: within `ray job stop`'s 3 s between its SIGTERM
and its SIGKILL of the driver (ray dashboard/modules/job/job_supervisor.py, DEFAULT_RAY_JOB_STOP_WAIT_TIME_S)."""


def collect(refs: list[Any], log_dir: Path) -> list[dict[str, Any]]:
    """Each rank's outcome (code, log, result; a lost actor: code None and `lost`, its first line), each log
    written to rank<i>.log (replacing the streamed one) and rank 0's result to result.json."""
    import ray

    outcomes = []
    for rank, ref in enumerate(refs):
        try:
            outcomes.append(ray.get(ref, timeout=30))
        except Exception as e:  # noqa: BLE001 - a rank's actor lost: recorded, classified by RayRunner._verdict
            outcomes.append({"code": None, "log": "", "result": None, "lost": first_line(e)})
        (log_dir / f"rank{rank}.log").write_text(outcomes[-1]["log"])
    if outcomes[0].get("result"):
        (log_dir / "result.json").write_text(outcomes[0]["result"])
    return outcomes


def lost(ready: list[Any]) -> bool:
    """Whether one of these finished rank calls failed because its actor is gone (a Ray error: the actor or its
    node died), not because the rank exited (that returns an outcome)."""
    import ray

    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except Exception as e:  # noqa: BLE001 - only Ray's own errors mean a lost actor; collect records any
            if type(e).__module__.startswith("ray"):
                return True
    return False


def end_actors(actors: list[Any]) -> None:
    """Kill the ranks of `actors` and wait up to END_WAIT_S for their runs to end (each removes its work dir in
    its `finally`), then kill the actors: ray.kill ends an actor at once, without that `finally` (what `ray job
    stop` left behind: a rank dir per rank). A dead actor is skipped."""
    import ray

    refs = []
    for a in actors:
        try:
            refs.append(a.kill.remote(END_WAIT_S))
        except Exception:  # noqa: BLE001 - an actor already gone: nothing to end
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=END_WAIT_S)
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 - cleanup must go on for the other actors (a dead one raises)
            pass


def first_line(e: BaseException) -> str:
    """`Type: message`, its first line: how a Ray error is named in a run's reason."""
    return f"{type(e).__name__}: {e}".splitlines()[0]
