"""`stratagem clean`: remove what killed stratagem runs left on this machine, for this user only.

A search killed with SIGKILL cannot clean up after itself: Ray's per-node agents outlive their raylet, the
session's temp dir (/tmp/stratagem-ray-<driver pid>-*) stays, and a rank's work dir (stratagem-rank-<pid>-*)
stays when its actor died. The next RayRunner start reaps them (launch/runners/ray_runner.py); this command
does it now. It touches only this user's leftovers of stratagem sessions whose processes are gone: helpers
that inherited the session variable (ray_runner.SESSION_ENV) and whose raylet is dead, session dirs no live
process names whose driver is dead, rank dirs whose actor is dead. A live search, another user's or another
program's Ray are never touched.
"""

from __future__ import annotations

from rich.console import Console

from stratagem.cli.app import app

__all__ = ["clean_cmd"]


@app.command("clean")
def clean_cmd() -> None:
    """Remove this user's leftovers of killed stratagem runs: Ray helper processes whose session is gone, Ray
    session temp dirs and rank work dirs no live process uses. Never touches a live run."""
    from stratagem.launch.runners.ray_runner import reap_orphans, reap_rank_dirs, reap_session_dirs

    out = Console(highlight=False)
    killed = reap_orphans(only_ours=True)
    dirs = reap_session_dirs()
    ranks = reap_rank_dirs()
    for pid in killed:
        out.print(f"killed Ray helper process {pid} (its session is gone)", markup=False)
    for d in [*dirs, *ranks]:
        out.print(f"removed {d}", markup=False, soft_wrap=True)
    out.print(f"clean: {len(killed)} helper process(es) killed, {len(dirs)} Ray session dir(s) and {len(ranks)} "
              "rank dir(s) removed" if killed or dirs or ranks else "clean: nothing left by earlier runs",
              markup=False)
