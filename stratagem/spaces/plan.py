"""A plan: one way to run a scenario. Parsed from `dp=8,tp=2,...` strings or YAML."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from stratagem.errors import StratagemError

__all__ = [
    "Plan",
    "Precision",
    "Recompute",
    "Schedule",
    "PipelineSplit",
    "PRECISIONS",
    "RECOMPUTES",
    "SCHEDULES",
    "PIPELINE_SPLITS",
    "RecomputeModule",
    "RECOMPUTE_MODULES",
    "parse_plan",
    "format_plan",
    "parse_label",
    "is_label",
]

Precision = Literal["fp32", "bf16", "fp8"]
Recompute = Literal["none", "selective", "full", "op"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
PipelineSplit = Literal["layers", "embedding_loss"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
RECOMPUTES: tuple[Recompute, ...] = get_args(Recompute)
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
PIPELINE_SPLITS: tuple[PipelineSplit, ...] = get_args(PipelineSplit)
# Megatron --recompute-modules (megatron/core/transformer/transformer_config.py recompute_modules)
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]
RECOMPUTE_MODULES: tuple[RecomputeModule, ...] = get_args(RecomputeModule)


class Plan(BaseModel):
    """Parallel degrees, sharding, micro-batch, precision and recomputation for one run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(default=1, ge=1)
    """Data-parallel degree (replicas of each model shard)."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (Megatron-style column/row split of every matmul)."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree (stages of consecutive layers)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree (sequence split with ring attention)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree (MoE only): experts split over ep ranks of the expert grid ep x etp x edp, which
    re-partitions the tp x dp x cp ranks (Megatron-Core MoE parallel folding)."""
    etp: int = Field(default=1, ge=1)
    """Expert tensor-parallel degree (MoE only): each expert's matmuls split over etp ranks, independent of tp."""
    dp_replicate: int = Field(default=1, ge=1)
    """HSDP: replicas among the dp ranks; ZeRO shards over dp / dp_replicate ranks."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """0 DDP; 1 optimizer states sharded; 2 + gradients; 3 + parameters (FSDP full shard)."""
    sequence_parallel: bool = False
    """Shard norm/dropout activations along the sequence across the TP group (needs tp > 1)."""
    micro_batch_size: int = Field(default=1, ge=1)
    """Sequences per micro-batch per data-parallel rank; accumulation steps are derived."""
    precision: Precision = "bf16"
    """Compute precision: fp32, bf16 mixed precision, or fp8 matmuls (bf16 elsewhere)."""
    activation_checkpointing: Recompute = "none"
    """none; selective (recompute the MLP activation and its down projection); full (keep layer inputs only);
    op (torchtitan's op-level policy: save the outputs of chosen matmul/attention ops, recompute the rest)."""
    recompute_layers: int = Field(default=0, ge=0)
    """Layers per pipeline stage that are recomputed (0: all of them). Partial recompute, as Megatron's
    `--recompute-num-layers` with the block method and torchtitan's every-k-th-layer checkpointing."""
    recompute_modules: tuple[RecomputeModule, ...] = ()
    """With activation_checkpointing selective: the modules recomputed, Megatron's `--recompute-modules`
    (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts; megatron/core/transformer/
    transformer_config.py). () keeps stratagem's selective (the MLP activation and its down projection).
    A set: kept in RECOMPUTE_MODULES order; written `layernorm+moe_act`."""
    pp_schedule: Schedule = "1f1b"
    """Pipeline schedule (pp > 1): gpipe, 1f1b, interleaved (virtual stages), zero_bubble (ZB-H1)."""
    virtual_stages: int = Field(default=1, ge=1)
    """Model chunks per pipeline rank (interleaved schedule only)."""
    first_stage_layers: int = Field(default=0, ge=0)
    """Transformer layers on the first pipeline stage (0: an even split). Megatron's
    `--decoder-first-pipeline-num-layers`."""
    last_stage_layers: int = Field(default=0, ge=0)
    """Transformer layers on the last pipeline stage (0: an even split). Megatron's
    `--decoder-last-pipeline-num-layers`."""
    pp_split: PipelineSplit = "layers"
    """layers: only transformer layers are split into stages; embedding_loss: the embedding and the loss each
    count as one layer in the split (Megatron's `--account-for-embedding-in-pipeline-split` and
    `--account-for-loss-in-pipeline-split`)."""
    optimizer_offload: Literal["none", "cpu"] = "none"
    """Keep optimizer states (and master weights) in host memory (ZeRO-Offload)."""

    @field_validator("recompute_modules", mode="before")
    @classmethod
    def _module_set(cls, value: Any) -> Any:
        """`a+b` strings and lists to one sorted tuple (a set of modules: order and repeats carry no meaning)."""
        if isinstance(value, str):
            value = [v for v in re.split(r"[+\s]+", value) if v]
        if isinstance(value, (list, tuple)):
            known = {m: i for i, m in enumerate(RECOMPUTE_MODULES)}
            return tuple(sorted(set(value), key=lambda v: (known.get(v, len(known)), str(v))))
        return value

    @property
    def world_size(self) -> int:
        """Ranks the plan needs: dp*tp*pp*cp (ep and etp fold into them)."""
        return self.dp * self.tp * self.pp * self.cp

    def short(self) -> str:
        """Compact label of the canonical plan, e.g. `dp8 tp2 z1 mb2 bf16 sel-ac`; valid `--plan` input
        (`parse_plan` reads it back as `self.canonical()`)."""
        return format_plan(self.canonical(), compact=True)

    def canonical(self) -> Plan:
        """The plan with every field that has no effect in this combination set to its default, from the plan
        alone (no scenario): one Plan per job for these fields. `spaces.canonical.canonical_plan(scenario, plan)`
        adds what needs the model and the stack (pipeline splits that give the same chunks, recompute_layers
        covering whole chunks, GPipe = 1F1B with one micro-batch). Reset here, each proved inert in the harness
        (stratagem/launch/harness) and in the memory/time model (stratagem/evaluators):
          sequence_parallel with tp = 1   SP shards activations over the TP group; the harness applies TP/SP only
                                          when tp > 1 (harness/parallelize.py parallelize); the rules refuse it.
          pp = 1: pp_schedule, virtual_stages, pp_split, first/last_stage_layers
                                          no pipeline is built (harness/pipeline.py only for pp > 1); the model's
                                          schedule terms are all under pp > 1 (memory.py _in_flight, timing.py
                                          bubble_fraction), its stage split is the whole model (pipeline_split
                                          chunk_layers with pp = 1 ignores the split fields).
          recompute_layers with activation_checkpointing none
                                          nothing is recomputed (harness parallelize.apply_ac returns; memory.py
                                          uses the no-recompute elements for every layer, timing.py 0 s per layer).
        Every other field (including any added later) is kept: a field is reset only once proved inert."""
        update: dict[str, Any] = {}
        if self.tp == 1 and self.sequence_parallel:
            update["sequence_parallel"] = False
        if self.pp == 1:
            default = Plan()
            for name in ("pp_schedule", "virtual_stages", "pp_split", "first_stage_layers", "last_stage_layers"):
                if getattr(self, name) != getattr(default, name):
                    update[name] = getattr(default, name)
        if self.activation_checkpointing == "none" and self.recompute_layers:
            update["recompute_layers"] = 0
        return self.model_copy(update=update) if update else self


_FIELDS = list(Plan.model_fields)
_BOOL_TRUE = {"1", "true", "yes", "on"}
_BOOL_FALSE = {"0", "false", "no", "off"}
_ALIASES = {"zero": "zero_stage", "mbs": "micro_batch_size", "sp": "sequence_parallel",
            "ac": "activation_checkpointing", "recompute": "activation_checkpointing",
            "schedule": "pp_schedule", "vpp": "virtual_stages", "v": "virtual_stages",
            "offload": "optimizer_offload", "recompute_num_layers": "recompute_layers"}


def parse_plan(text: str | dict[str, Any] | None, base: Plan | None = None) -> Plan:
    """A Plan from `"dp=8,tp=2,zero=1"` (aliases: zero, mbs, sp, ac, schedule, vpp, offload), a dict, or a
    compact label as `Plan.short()` prints it (`"dp2 pp2 z1 mb4 bf16 1f1b"`, see `parse_label`). The key=value
    fields are set over `base`; a label is a whole plan (fields it does not show take the Plan default), so
    `base` does not apply to it."""
    if isinstance(text, str) and is_label(text):
        return parse_label(text)
    values: dict[str, Any] = dict(base.model_dump()) if base else {}
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        # Pairs are separated by commas or whitespace; spaces around "=" are allowed ("dp = 8").
        for part in re.sub(r"\s*=\s*", "=", (text or "").strip()).replace(" ", ",").split(","):
            if not part:
                continue
            if "=" not in part or part.startswith("="):
                raise StratagemError(f"plan ({part!r}): write key=value pairs, e.g. dp=8,tp=2,zero=1")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    seen: set[str] = set()
    for key, value in items:
        name = _ALIASES.get(key, key)
        if name not in Plan.model_fields:
            raise StratagemError(f"plan.{key}: unknown field; valid: {', '.join(_FIELDS)}")
        if name in seen:
            raise StratagemError(f"plan.{name}: given twice; give each field once")
        seen.add(name)
        if name == "sequence_parallel" and isinstance(value, str):
            low = value.lower()
            if low not in _BOOL_TRUE | _BOOL_FALSE:
                raise StratagemError(f"plan.sequence_parallel ({value!r}): use true or false")
            value = low in _BOOL_TRUE
        elif isinstance(value, str) and value.isdigit():
            value = int(value)
        values[name] = value
    return _build(values)


def format_plan(plan: Plan, compact: bool = False) -> str:
    """The plan as `key=value` pairs, omitting defaults; `compact` gives a short human label that `parse_plan`
    reads back (fields the label grammar does not know are appended as `key=value`)."""
    default = Plan()
    if not compact:
        parts = [f"{k}={_fmt(getattr(plan, k))}" for k in _FIELDS if getattr(plan, k) != getattr(default, k)]
        return ",".join(parts) or "dp=1"
    p = plan
    bits = [f"dp{p.dp}"]
    bits += [f"{k}{getattr(p, k)}" for k in ("tp", "pp", "cp", "ep", "etp") if getattr(p, k) > 1]
    if p.dp_replicate > 1:
        bits.append(f"rep{p.dp_replicate}")
    bits += [f"z{p.zero_stage}", f"mb{p.micro_batch_size}", p.precision]
    if p.sequence_parallel:
        bits.append("sp")
    if p.activation_checkpointing != "none":
        label = {"selective": "sel", "full": "full", "op": "op"}[p.activation_checkpointing] + "-ac"
        bits.append(label + (f"{p.recompute_layers}L" if p.recompute_layers else ""))
    if p.pp > 1:
        bits.append(p.pp_schedule + (f"x{p.virtual_stages}" if p.virtual_stages > 1 else ""))
        if p.first_stage_layers or p.last_stage_layers:
            bits.append(f"split{p.first_stage_layers or '-'}/{p.last_stage_layers or '-'}")
        if p.pp_split != "layers":
            bits.append("emb+loss")
    if p.optimizer_offload != "none":
        bits.append("offload")
    shown = set(_LABELLED) | ({"pp_schedule", "virtual_stages", "first_stage_layers", "last_stage_layers",
                               "pp_split"} if p.pp > 1 else set())
    shown |= {"recompute_layers"} if p.activation_checkpointing != "none" else set()
    bits += [f"{k}={_fmt(getattr(p, k))}" for k in _FIELDS if k not in shown and getattr(p, k) != getattr(default, k)]
    return " ".join(bits)


# Fields the compact label always shows (when they differ from the default); the pipeline fields only with
# pp > 1 and recompute_layers only with recomputation: elsewhere format_plan writes them as key=value.
_LABELLED = ("dp", "tp", "pp", "cp", "ep", "etp", "dp_replicate", "zero_stage", "micro_batch_size", "precision",
             "sequence_parallel", "activation_checkpointing", "optimizer_offload")
_AC_LABELS = {"sel": "selective", "full": "full", "op": "op"}
_LABEL_TOKEN = re.compile(
    r"(?P<deg>dp|tp|pp|cp|etp|ep|rep|z|mb)(?P<n>\d+)$"
    r"|(?P<prec>fp32|bf16|fp8)$"
    r"|(?P<sp>sp)$"
    r"|(?P<ac>sel|full|op)-ac(?:(?P<acl>\d+)L)?$"
    r"|(?P<sched>gpipe|1f1b|interleaved|zero_bubble)(?:x(?P<v>\d+))?$"
    r"|split(?P<first>\d+|-)/(?P<last>\d+|-)$"
    r"|(?P<emb>emb\+loss)$"
    r"|(?P<off>offload)$")
_DEGREE_FIELDS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp", "rep": "dp_replicate",
                  "z": "zero_stage", "mb": "micro_batch_size"}


def is_label(text: str) -> bool:
    """Whether `text` is a compact label rather than key=value pairs: its first word is `dp<N>`, as every label
    format_plan writes begins (`dp8 tp2 ...`)."""
    words = text.replace(",", " ").split()
    return bool(words) and re.fullmatch(r"dp\d+", words[0]) is not None


def parse_label(text: str) -> Plan:
    """The Plan a compact label (`Plan.short()`, `format_plan(compact=True)`) names: `dp8 tp2 pp2 z1 mb2 bf16 sp
    sel-ac 1f1b split3/- emb+loss offload`, plus `key=value` words for fields the grammar does not show. Fields
    the label leaves out take the Plan default."""
    values: dict[str, Any] = {}
    pairs: list[str] = []

    def put(name: str, value: Any, word: str) -> None:
        if name in values:
            raise StratagemError(f"plan label ({word!r}): {name} given twice; give each field once")
        values[name] = value

    for word in text.replace(",", " ").split():
        if "=" in word:
            pairs.append(word)
            continue
        m = _LABEL_TOKEN.match(word)
        if m is None:
            raise StratagemError(
                f"plan label ({word!r}): not a label part; labels read like `dp8 tp2 pp2 z1 mb2 bf16 sp sel-ac "
                "1f1b split3/- emb+loss offload` (or write key=value pairs, e.g. dp=8,tp=2)")
        g = m.groupdict()
        if g["deg"]:
            put(_DEGREE_FIELDS[g["deg"]], int(g["n"]), word)
        elif g["prec"]:
            put("precision", g["prec"], word)
        elif g["sp"]:
            put("sequence_parallel", True, word)
        elif g["ac"]:
            put("activation_checkpointing", _AC_LABELS[g["ac"]], word)
            if g["acl"]:
                put("recompute_layers", int(g["acl"]), word)
        elif g["sched"]:
            put("pp_schedule", g["sched"], word)
            if g["v"]:
                put("virtual_stages", int(g["v"]), word)
        elif g["first"]:
            put("first_stage_layers", 0 if g["first"] == "-" else int(g["first"]), word)
            put("last_stage_layers", 0 if g["last"] == "-" else int(g["last"]), word)
        elif g["emb"]:
            put("pp_split", "embedding_loss", word)
        else:
            put("optimizer_offload", "cpu", word)
    if pairs:
        extra = parse_plan(",".join(pairs))
        for name in extra.model_fields_set:
            put(name, getattr(extra, name), name)
    return _build(values)


def _build(values: dict[str, Any]) -> Plan:
    """A Plan from parsed field values; the first validation error as one line naming the field."""
    try:
        return Plan(**values)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise StratagemError(f"plan.{loc} ({err.get('input')!r}): {err['msg']}") from None


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):  # recompute_modules: a+b
        return "+".join(str(x) for x in v)
    return str(v).lower() if isinstance(v, bool) else str(v)
