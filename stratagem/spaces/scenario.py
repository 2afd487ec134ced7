"""A scenario: the fixed problem (model, cluster, training job), loadable from one YAML file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from stratagem.errors import StratagemError
from stratagem.spaces.hardware import ClusterSpec
from stratagem.spaces.model import ModelSpec, model_preset
from stratagem.spaces.plan import Plan
from stratagem.spaces.space import SearchConfig
from stratagem.spaces.training import TrainingSpec

__all__ = ["Scenario", "load_scenario", "scenario_from_dict"]


class Scenario(BaseModel):
    """Model + cluster + training job; optionally a plan to evaluate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    """The model: a preset name, `{preset: NAME, field: value...}`, `{hf_config: PATH}`, or the fields."""
    cluster: ClusterSpec
    """The cluster: `{gpu: PRESET, num_nodes: N, gpus_per_node: G, ...}`."""
    training: TrainingSpec = TrainingSpec()
    """The training job."""
    plan: Plan | None = None
    """A plan to evaluate (`stratagem evaluate` uses it unless --plan is given)."""
    search: SearchConfig | None = None
    """How `stratagem search` explores plans: fixed or narrowed axes, cross-node TP, memory margin (optional)."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" in data:
            data = dict(data)
            data["model"] = _resolve_model(data["model"])
        return data

    @property
    def name(self) -> str:
        return f"{self.model.name} on {self.cluster.num_gpus}x {self.cluster.gpu.name}"

    def problem_hash(self) -> str:
        """Hash of model + cluster + training (not the plan nor the search section): identifies the problem."""
        blob = json.dumps(self.model_dump(exclude={"plan", "search"}, mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _resolve_model(value: Any) -> Any:
    if isinstance(value, str):
        return model_preset(value)
    if isinstance(value, dict):
        # Return the merged fields (not a ModelSpec) so that pydantic validates overrides and names a bad
        # one as model.<field>.
        if "hf_config" in value:
            base = ModelSpec.from_hf_config(value["hf_config"])
            return {**base.model_dump(), **{k: v for k, v in value.items() if k != "hf_config"}}
        if "preset" in value:
            base = model_preset(value["preset"])
            return {**base.model_dump(), **{k: v for k, v in value.items() if k != "preset"}}
    return value


def scenario_from_dict(data: Any, source: str = "scenario") -> Scenario:
    """Validate a parsed YAML/JSON mapping; errors become one line naming the field."""
    if not isinstance(data, dict):
        raise StratagemError(f"{source}: expected a mapping with model, cluster and training sections")
    try:
        return Scenario(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        shown = "" if isinstance(given, dict | list) or given is None else f" ({given!r})"
        where = f"{loc}{shown}: " if loc else ""
        raise StratagemError(f"{source}: {where}{msg}") from None
    except StratagemError as e:
        raise StratagemError(f"{source}: {e}") from None


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise StratagemError(f"scenario ({p}): file not found") from None
    except IsADirectoryError:
        raise StratagemError(f"scenario ({p}): is a directory; give a YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise StratagemError(f"scenario ({p}): not valid YAML{where}") from None
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
        # A relative hf_config path is relative to the scenario file, not to the working directory.
        data["model"] = {**model, "hf_config": str((p.parent / model["hf_config"]).resolve())
                         if not Path(model["hf_config"]).is_absolute() else model["hf_config"]}
    return scenario_from_dict(data, source=str(p))
