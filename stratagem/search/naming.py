"""What a search is called and how it samples, from what the user gave: the default study name (rerunning the
same scenario resumes its study) and the --sampler choice."""

from __future__ import annotations

from pathlib import Path

from stratagem.errors import StratagemError
from stratagem.search.samplers import SAMPLERS
from stratagem.search.screening import Mode
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.space import SearchSpace

__all__ = ["default_study_name", "check_sampler"]


def default_study_name(scenario_path: str | Path, scenario: Scenario) -> str:
    """<scenario file stem>-<space digest>: rerunning the same scenario resumes its study."""
    return f"{Path(scenario_path).stem}-{SearchSpace(scenario).digest()[:8]}"


def check_sampler(name: str) -> Mode:
    """The sampler mode named by --sampler; one-line error listing the choices otherwise."""
    choices = ("auto", "exhaustive", *SAMPLERS)
    if name not in choices:
        raise StratagemError(f"--sampler ({name!r}): use one of {', '.join(choices)}")
    return name  # type: ignore[return-value]
