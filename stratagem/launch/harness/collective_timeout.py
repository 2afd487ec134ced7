"""How long a rank waits in one collective before it gives up, so that a rank whose peer is gone (its node lost,
frozen or cut off: no connection closes, nothing arrives) leaves within seconds instead of at the run's timeout.

Every collective of a process group fails after the group's timeout (torch.distributed: gloo raises in the
waiting rank; NCCL's watchdog aborts the communicator). The harness starts its group with SETUP_TIMEOUT_S:
the first collectives wait for the slowest rank's build, the traced step and the checkpoint, whose length is
not known before they run. Once the warm-up has run, a step's collectives wait at most for the slowest rank's
step, so the timed steps run under step_timeout_s: STEP_TIMEOUT_STEPS times the slowest step so far (the
warm-up's first step allocates and the traced step is the slowest: a generous bound), at least
STEP_TIMEOUT_FLOOR_S (a rank descheduled on a loaded host must not read as a lost peer). After the timed steps
the setup timeout is back for the result gathering and the checkpoint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import timedelta

__all__ = ["SETUP_TIMEOUT_S", "STEP_TIMEOUT_STEPS", "STEP_TIMEOUT_FLOOR_S", "step_timeout_s", "set_timeout", "tighten"]

SETUP_TIMEOUT_S = float(os.environ.get("STRATAGEM_PG_TIMEOUT_S", "300"))
"""The group's timeout from init through the warm-up, and again after the timed steps."""
STEP_TIMEOUT_STEPS = 10.0
"""The timed steps' timeout in steps: the slowest rank's step is what a collective waits for."""
STEP_TIMEOUT_FLOOR_S = 10.0
"""The timed steps' timeout at least: scheduling stalls of seconds on a loaded host are not a lost peer."""


def step_timeout_s(step_times: Sequence[float]) -> float:
    """The timeout of the timed steps, from the step times measured so far on this rank (warm-up first)."""
    return max(STEP_TIMEOUT_FLOOR_S, STEP_TIMEOUT_STEPS * max(step_times, default=0.0))


def set_timeout(seconds: float) -> None:
    """Set the timeout of every process group of this process (the default group and the mesh's subgroups:
    each took the default's timeout when it was made) for the collectives issued from now on."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    if not hasattr(c10d, "_set_pg_timeout"):  # torch >= 2.3 (distributed_c10d.py); older: the setup timeout stays
        return
    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def tighten(step_times: Sequence[float]) -> float:
    """Set the timed steps' timeout (step_timeout_s) and say it in one line on stderr, so that a rank that leaves
    on it names why in its log; the seconds set."""
    seconds = step_timeout_s(step_times)
    set_timeout(seconds)
    print(f"timed steps: collective timeout {seconds:.0f} s ({STEP_TIMEOUT_STEPS:g} x the slowest step so far, "
          f"{max(step_times, default=0.0):.3f} s; at least {STEP_TIMEOUT_FLOOR_S:g} s)", file=sys.stderr, flush=True)
    return seconds
