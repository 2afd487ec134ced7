"""A scenario: the fixed problem (model, cluster, training job), loadable from one YAML file."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from stratagem.errors import StratagemError
from stratagem.files import read_yaml
from stratagem.spaces.hardware import ClusterSpec
from stratagem.spaces.hf_config import read_hf_config
from stratagem.spaces.model import ModelSpec, model_preset
from stratagem.spaces.plan import Plan, is_label, parse_plan
from stratagem.spaces.search_config import SearchConfig
from stratagem.spaces.training import TrainingSpec

__all__ = ["Scenario", "load_scenario", "scenario_from_dict", "resolve_plan"]


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

    @model_validator(mode="after")
    def _bounded(self) -> Scenario:
        for field in ("global_batch_size", "seq_len"):
            value = getattr(self.training, field)
            if value > MAX_BATCH:
                raise StratagemError(f"training.{field} ({value}): at most {MAX_BATCH:,}; give the real value")
        if self.search is not None:
            _check_search(self.search)
        for field, text in (("model.name", self.model.name), ("cluster.gpu.name", self.cluster.gpu.name)):
            bad = _CONTROL.search(text)
            if bad:
                raise StratagemError(f"{field} ({text!r}): holds the control character {bad.group()!r}, which "
                                     "would reach the terminal raw; use printable characters")
        return self

    @property
    def name(self) -> str:
        """A label: the model on the cluster, e.g. `llama3-8b on 8x h100-sxm-80g`."""
        return f"{self.model.name} on {self.cluster.num_gpus}x {self.cluster.gpu.name}"

    def default_plan(self) -> Plan:
        """The plan judged when none is given: the scenario's own, else pure data parallelism over the cluster."""
        return self.plan or Plan(dp=self.cluster.num_gpus)

    def problem_hash(self) -> str:
        """Hash of model + cluster + training (not the plan, the search section nor the calibration file):
        identifies the problem."""
        blob = json.dumps(self.model_dump(exclude={"plan": True, "search": True, "cluster": {"calibration", "calibration_device_mismatch"}},
                                          mode="json"), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


SCENARIO_MAX_BYTES = 1 << 20  # a scenario is a few hundred bytes; a search section with long lists a few KB
MAX_BATCH = 1 << 24
"""Largest global_batch_size and seq_len accepted (16,777,216): 8,000x Llama 3 405B's 2,048 sequences of 8,192
tokens; beyond it enumerating their divisors (O(sqrt n)) would take minutes."""


def _resolve_model(value: Any) -> Any:
    if isinstance(value, str):
        return model_preset(value)
    if isinstance(value, dict):
        # Return the merged fields (not a ModelSpec) so that pydantic validates overrides and names a bad
        # one as model.<field>.
        if "hf_config" in value:
            base = read_hf_config(value["hf_config"])
            return {**base.model_dump(), **{k: v for k, v in value.items() if k != "hf_config"}}
        if "preset" in value:
            base = model_preset(value["preset"])
            return {**base.model_dump(), **{k: v for k, v in value.items() if k != "preset"}}
    return value


def resolve_plan(scenario: Scenario, text: str | None) -> Plan:
    """The plan a user means by `--plan TEXT` (None: the scenario's default plan): the given fields over the
    scenario's plan; when TEXT does not set dp, dp fills the cluster (num_gpus // (tp*pp*cp), at least 1). A
    compact label (`dp2 pp2 z1 mb4 bf16 1f1b`, as the front prints plans) is the whole plan it names."""
    if not text:
        return scenario.default_plan()
    if is_label(text):  # a label (`Plan.short()`, what the front prints) names a whole plan: nothing merged
        return parse_plan(text)
    base = scenario.default_plan()
    plan = parse_plan(text, base=Plan(**{**base.model_dump(), "dp": 1}))
    # The keys given, split as parse_plan splits them (commas or whitespace, spaces around "=" allowed).
    given = {part.split("=", 1)[0] for part in re.sub(r"\s*=\s*", "=", text.strip()).replace(" ", ",").split(",")}
    if "dp" not in given:
        rest = plan.tp * plan.pp * plan.cp
        plan = plan.model_copy(update={"dp": max(1, scenario.cluster.num_gpus // rest)})
    return plan


def scenario_from_dict(data: Any, source: str = "scenario") -> Scenario:
    """Validate a parsed YAML/JSON mapping; errors become one line naming the field."""
    if not isinstance(data, dict):
        raise StratagemError(f"{source}: expected a mapping with model, cluster and training sections")
    _check_finite(data, source)
    try:
        return Scenario(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        shown = "" if isinstance(given, dict | list) or given is None else f" ({given!r})"
        where = f"{loc}{shown}: " if loc else ""
        if err["type"] == "extra_forbidden" and (keys := _valid_keys(err["loc"])):
            msg = f"no such key; valid keys: {', '.join(keys)}"
        raise StratagemError(f"{source}: {where}{msg}") from None
    except StratagemError as e:
        raise StratagemError(f"{source}: {e}") from None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or the first model of a union / Optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in get_args(annotation) if (m := _model_of(a)) is not None), None)


def _valid_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section at loc[:-1] of a scenario takes (for an unknown key at loc), [] when not a model."""
    cls: type[BaseModel] | None = Scenario
    for part in loc[:-1]:
        field = cls.model_fields.get(str(part)) if cls is not None else None
        cls = _model_of(field.annotation) if field is not None else None
    return sorted(cls.model_fields) if cls is not None else []


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Control characters (C0, DEL, C1, line/paragraph separators): never in a name that is printed."""
_DEGREES = ("tp", "pp", "cp", "dp", "ep", "etp", "dp_replicate", "micro_batch_size", "virtual_stages")
"""search axes that are degrees or sizes (>= 1); zero_stage and the stage layer counts may be 0."""


def _check_search(cfg: Any) -> None:
    """search.seed >= 0 (numpy's generators take no negative seed) and degree axes >= 1 (a 0 would divide)."""
    if cfg.seed < 0:
        raise StratagemError(f"search.seed ({cfg.seed}): must be >= 0")
    for name in _DEGREES:
        axis = getattr(cfg, name, None)
        values = axis if isinstance(axis, list) else [axis] if isinstance(axis, int) else []  # a range holds divisors
        bad = [v for v in values if isinstance(v, int) and v < 1]
        if bad:
            raise StratagemError(f"search.{name} ({axis}): {bad[0]} is not a degree; every value must be >= 1")


def _check_finite(data: Any, source: str, where: str = "") -> None:
    """Refuse NaN and infinities anywhere in the scenario (YAML .nan/.inf): a price, MTBF, bandwidth or budget
    that is not a number would silently become a result."""
    if isinstance(data, float) and not math.isfinite(data):
        raise StratagemError(f"{source}: {where or 'value'} ({data}): must be a finite number")
    if isinstance(data, dict):
        for k, v in data.items():
            _check_finite(v, source, f"{where}.{k}" if where else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_finite(v, source, f"{where}.{i}")


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario YAML file (bounded: stratagem.files.read_yaml, SCENARIO_MAX_BYTES)."""
    p = Path(path)
    data = read_yaml(p, "scenario", SCENARIO_MAX_BYTES)
    model = data.get("model") if isinstance(data, dict) else None
    if isinstance(model, dict) and isinstance(model.get("hf_config"), str):
        # A relative hf_config path is relative to the scenario file, not to the working directory.
        data["model"] = {**model, "hf_config": str((p.parent / model["hf_config"]).resolve())
                         if not Path(model["hf_config"]).is_absolute() else model["hf_config"]}
    cluster = data.get("cluster") if isinstance(data, dict) else None
    if isinstance(cluster, dict) and isinstance(cluster.get("calibration"), str):
        # cluster.calibration too is relative to the scenario file.
        data["cluster"] = {**cluster, "calibration": str((p.parent / cluster["calibration"]).resolve())}
    return scenario_from_dict(data, source=str(p))
