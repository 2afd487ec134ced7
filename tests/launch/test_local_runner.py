"""run_local (launch/runners/local.py) on real gloo ranks: when one rank raises, the error gives every failed
rank's traceback, not only a peer's "Connection closed by peer" (which often arrives first), and names the
ranks still running that were killed."""

from __future__ import annotations

import re
import time

import pytest

from stratagem.launch.runners.local import LocalRunError, run_local


def _rank_one_breaks(rank: int) -> int:
    """Rank 1 raises; rank 0 waits on a receive from it and fails when its connection closes; rank 2 runs on
    (no collective) until it is killed."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one broke")
    if rank == 0:
        dist.recv(torch.zeros(1), src=1)
    time.sleep(60)
    return rank


def test_every_failed_rank_is_reported_and_the_running_ones_named() -> None:
    started = time.monotonic()
    with pytest.raises(LocalRunError) as info:
        run_local(_rank_one_breaks, 3, timeout_s=60.0, pg_timeout_s=30.0)
    message = str(info.value)
    assert time.monotonic() - started < 40.0, "the survivor was not killed after the grace period"
    assert "rank 1 failed:" in message and "ValueError: rank one broke" in message, message
    assert "rank 0 failed:" in message and "dist.recv(torch.zeros(1), src=1)" in message, message
    assert re.search(r"Connection (closed|reset) by peer", message), message
    assert "rank 2 failed:" not in message, message
    summary = message.splitlines()[-1]
    assert summary.startswith("2 of 3 ranks failed (ranks [2] were still running and were killed), "
                              "in order of arrival: "), summary
    assert "rank 1 (ValueError: rank one broke)" in summary and "rank 0 (" in summary, summary
