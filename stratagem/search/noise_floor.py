"""The node's run-to-run noise floor: every study's repeated runs of one plan on this host, kept in one file so
that run-to-run noise is estimated with the degrees of freedom of all of them, not of one study's two
re-measurements (2 dof put Student's t at 4.30 and a rerun's 95 % band at x/÷3.8: a `reproduce` that can hardly
fail).

A group is one plan of one study on one device: the ln of each of its runs' median step (a study's measured
trials, and the reruns `reproduce` made of it). Pooled over the groups (pooled variance, the within-group mean
square of a one-way layout: Montgomery, *Design and Analysis of Experiments*, 9th ed., sec. 2.4.1 for two groups
and sec. 3.3.1, MS_E, for many):

    s^2 = sum_i sum_j (x_ij - mean_i)^2 / sum_i (n_i - 1),   dof = sum_i (n_i - 1),

with x_ij = ln(run j's median step) of group i; a group of one run adds nothing. On a log scale the plans' step
times need not be alike: only their relative run-to-run spread is assumed common (what host load, placement and
process start do to a run). Groups of other devices are not pooled.

The file: $STRATAGEM_NOISE_DIR/<host>.json, else ~/.stratagem/noise/<host>.json (`NodeNoise`, written whole
under a lock file and replaced atomically; several workers and studies write it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stratagem.errors import StratagemError

__all__ = ["NOISE_DIR_ENV", "NoiseGroup", "NodeNoise", "noise_file", "read_groups", "record_groups", "pooled"]

NOISE_DIR_ENV = "STRATAGEM_NOISE_DIR"
"""Environment variable naming the folder of the node noise files (default ~/.stratagem/noise)."""


class NoiseGroup(BaseModel):
    """Repeated runs of one plan of one study on one device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    study: str
    """The study: "<name>@<epoch seconds its real runs began>" (unique on a host)."""
    plan: str
    """The plan's key (records.plan_key)."""
    device: str
    """The cluster's device name (scenario.cluster.gpu.name): groups are pooled per device."""
    runs: dict[str, float] = Field(default_factory=dict)
    """Run id ("trial N", "reproduce <epoch s>") -> ln of the run's median step in seconds."""


class NodeNoise(BaseModel):
    """The noise file of one host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str
    """The host the runs were driven from."""
    groups: tuple[NoiseGroup, ...] = ()
    """Every group recorded, in the order first seen."""


def noise_file() -> Path:
    """This host's noise file ($STRATAGEM_NOISE_DIR or ~/.stratagem/noise, then <host>.json)."""
    folder = os.environ.get(NOISE_DIR_ENV)
    base = Path(folder).expanduser() if folder else Path.home() / ".stratagem" / "noise"
    return base / f"{socket.gethostname()}.json"


def _read(path: Path) -> NodeNoise:
    if not path.exists():
        return NodeNoise(host=socket.gethostname())
    try:
        return NodeNoise.model_validate(json.loads(path.read_text()))
    except (ValueError, ValidationError) as e:  # json.JSONDecodeError is a ValueError
        raise StratagemError(f"noise file {path}: not one stratagem writes ({str(e).splitlines()[0]}); delete it "
                             f"(later re-measurements rebuild it) or point ${NOISE_DIR_ENV} elsewhere") from None


def read_groups(device: str) -> list[NoiseGroup]:
    """The groups of this host's noise file on `device` (none when there is no file)."""
    return [g for g in _read(noise_file()).groups if g.device == device]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_groups(groups: Iterable[NoiseGroup]) -> Path | None:
    """Merge `groups` into this host's noise file (a group's runs by id: a run recorded again keeps one entry);
    only groups of two runs or more (one run adds no degree of freedom). Returns the file, None when nothing was
    written."""
    new = [g for g in groups if len(g.runs) >= 2]
    if not new:
        return None
    path = noise_file()
    with _locked(path):
        held = _read(path)
        merged = {(g.study, g.plan, g.device): g for g in held.groups}
        for g in new:
            old = merged.get((g.study, g.plan, g.device))
            merged[(g.study, g.plan, g.device)] = g if old is None else g.model_copy(update={"runs": {**old.runs,
                                                                                                       **g.runs}})
        text = NodeNoise(host=held.host, groups=tuple(merged.values())).model_dump_json(indent=1)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def pooled(groups: Iterable[NoiseGroup]) -> tuple[float | None, int, int, int]:
    """(s, dof, groups, studies) of the pooled variance over `groups` (module docstring); s None at 0 dof."""
    squares, dof, used, studies = 0.0, 0, 0, set()
    for g in groups:
        logs = list(g.runs.values())
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        squares += sum((x - mean) ** 2 for x in logs)
        dof += len(logs) - 1
        used += 1
        studies.add(g.study)
    return ((squares / dof) ** 0.5 if dof else None), dof, used, len(studies)
