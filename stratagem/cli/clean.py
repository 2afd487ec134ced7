"""`stratagem clean`: remove what killed stratagem runs left on this machine, and only that.

A search killed with SIGKILL cannot clean up after itself: Ray's per-node agents outlive their raylet, the
session's temp dir (/tmp/stratagem-ray-<driver pid>-*) stays, and a rank's work dir (stratagem-rank-<pid>-*)
stays when its actor died. The next RayRunner start reaps them (launch/runners/ray_session.py); this command
does it now, or with --dry-run lists what it would do. It touches only what is provably ours: processes of
this user in this PID namespace that carry the marker of a session whose owner record is ours and whose
driver is dead, and dirs holding such a record. A live search, a search in another PID namespace (a
container), another user's processes and Ray clusters stratagem did not start are never touched.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from stratagem.cli.app import app

__all__ = ["clean_cmd"]


@app.command("clean")
def clean_cmd(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be killed and removed; touch "
                                          "nothing.")] = False,
) -> None:
    """Remove this user's leftovers of killed stratagem runs: processes of Ray sessions whose driver is dead,
    their temp dirs, and rank work dirs of dead actors; each proved ours by its owner record and marker, in
    this PID namespace. Never touches a live run, another user's or another namespace's processes."""
    from stratagem.launch.runners.ray_session import leftovers, reap

    out = Console(highlight=False)
    found = leftovers()
    done = found if dry_run else reap(found)
    verb = "would kill" if dry_run else "killed"
    for pid, session in done.processes.items():
        out.print(f"{verb} process {pid} of dead session {session}", markup=False, soft_wrap=True)
    for d in [*done.session_dirs, *done.rank_dirs]:
        out.print(f"{'would remove' if dry_run else 'removed'} {d}", markup=False, soft_wrap=True)
    for d, why in done.left.items():  # only what was removed is reported removed
        out.print(f"left {d}: {why}", markup=False, soft_wrap=True)
    n_proc, n_sess, n_rank = len(done.processes), len(done.session_dirs), len(done.rank_dirs)
    if not (n_proc or n_sess or n_rank or done.left):
        out.print("clean: nothing left by earlier runs", markup=False)
        return
    if dry_run:
        out.print(f"clean (dry run): would kill {n_proc} process(es), would remove {n_sess} Ray session dir(s) and "
                  f"{n_rank} rank dir(s)", markup=False, soft_wrap=True)
    else:
        left = f", {len(done.left)} dir(s) left (above)" if done.left else ""
        out.print(f"clean: {n_proc} process(es) killed, {n_sess} Ray session dir(s) and {n_rank} rank dir(s) removed"
                  f"{left}", markup=False, soft_wrap=True)
