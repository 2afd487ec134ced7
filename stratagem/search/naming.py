"""What a search is called and how it samples, from what the user gave: the default study name (rerunning the
same scenario resumes its study) and the --sampler choice."""

from __future__ import annotations

from pathlib import Path

from stratagem.errors import StratagemError
from stratagem.search.samplers import SAMPLERS
from stratagem.search.screening import Mode
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["default_study_name", "check_sampler", "check_study_name", "STUDY_NAME_MAX"]

STUDY_NAME_MAX = 128
"""Characters in a study name (it names run folders and appears in every printed command)."""


def default_study_name(scenario_path: str | Path, scenario: Scenario) -> str:
    """<scenario file stem>-<space digest>: rerunning the same scenario resumes its study."""
    return f"{Path(scenario_path).stem}-{SearchSpace(scenario).digest()[:8]}"


def check_study_name(name: str) -> str:
    """A study name as given: 1-STUDY_NAME_MAX printable characters, no path separator, not '.' or '..'
    (run folders are named after it). One-line error naming the rule otherwise."""
    shown = name if len(name) <= 40 else f"{name[:40]}... ({len(name)} characters)"
    if not name.strip():
        raise StratagemError("--study (''): give a name, e.g. my-search")
    if len(name) > STUDY_NAME_MAX:
        raise StratagemError(f"--study ({shown!r}): at most {STUDY_NAME_MAX} characters")
    if "/" in name or "\\" in name or name in (".", ".."):
        raise StratagemError(f"--study ({shown!r}): no '/' or '\\' and not '.' or '..' (run folders are named "
                             "after the study); e.g. " + (name.replace("/", "-").replace("\\", "-").strip(".") or "my-search"))
    if not name.isprintable():
        raise StratagemError(f"--study ({shown!r}): control characters are not allowed")
    return name


def check_sampler(name: str) -> Mode:
    """The sampler mode named by --sampler; one-line error listing the choices otherwise."""
    choices = ("auto", "exhaustive", *SAMPLERS)
    if name not in choices:
        raise StratagemError(f"--sampler ({name!r}): use one of {', '.join(choices)}")
    return name  # type: ignore[return-value]
