"""What an exporter returns (`ExportBundle`), the facts every exporter derives from a plan (`Layout`), and
writing a bundle to a directory without leaving half-written files."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stratagem.errors import StratagemError
from stratagem.evaluators.evaluation import Evaluation
from stratagem.files import check_inside, check_owned, disk_error, stamped
from stratagem.spaces.factors import divisors
from stratagem.spaces.groups import micro_batches
from stratagem.spaces.pipeline_split import chunk_layers
from stratagem.spaces.plan import Plan, format_plan
from stratagem.spaces.rules import capability_violations, check_plan
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import stack_record

__all__ = ["Target", "TARGETS", "FieldNote", "ExportBundle", "Layout", "layout", "comment_safe",
           "note_lines", "header_lines", "master_addr_line", "write_bundle", "checkpoint_interval_steps",
           "RDZV_PORT", "TARGET_STACK", "refuse_unrunnable"]

Target = Literal["torchrun", "torchtitan", "deepspeed", "megatron", "automodel"]
TARGETS: tuple[Target, ...] = ("torchrun", "torchtitan", "deepspeed", "megatron", "automodel")
# The stack record (spaces/stacks.py) whose capabilities each target has: torchrun runs stratagem's own harness
# (FSDP2/DDP, torch.distributed.pipelining) and torchtitan composes the same torch APIs.
TARGET_STACK: dict[str, str] = {"torchrun": "torch", "torchtitan": "torch", "deepspeed": "deepspeed",
                                "megatron": "megatron", "automodel": "automodel"}
RDZV_PORT = 29500
"""The c10d rendezvous port on node 0 used by every exported launch command."""


@dataclass(frozen=True)
class FieldNote:
    """A scenario or plan field the target could not express exactly, and why.

    `field` is a dotted path: `plan.pp_schedule`, `training.optimizer`, `model`, ...
    """

    field: str
    why: str

    def line(self) -> str:
        """The note as one `field: why` line for a bundle's header."""
        return f"{self.field}: {self.why}"


@dataclass(frozen=True)
class ExportBundle:
    """Files for one target, relative path -> text, and the fields the target could not express.

    unexpressed   fields the target has no setting for: left out of the files (and said so in them).
    approximated  fields mapped to the target's closest setting, which behaves differently (said how).
    Both lists are also written as comments into `main` (for JSON, into its `_stratagem` key and README.md).
    """

    target: Target
    main: str
    """The file to start with (the config or launch script)."""
    files: dict[str, str]
    unexpressed: list[FieldNote] = field(default_factory=list)
    approximated: list[FieldNote] = field(default_factory=list)

    @property
    def notes(self) -> list[FieldNote]:
        """Every field the target could not express or only approximated."""
        return [*self.unexpressed, *self.approximated]


@dataclass(frozen=True)
class Layout:
    """What every exporter needs to know about a valid plan in its scenario, computed once."""

    scenario: Scenario
    plan: Plan
    nodes: int
    """Nodes the job is launched on."""
    procs_per_node: int
    """Processes (GPUs) per node: world size / nodes."""
    grad_accum: int
    """Micro-batches per optimizer step per data-parallel rank: global_batch / (dp * micro_batch)."""
    stage_layers: tuple[int, ...]
    """Transformer layers of each model chunk in model order (pp * virtual_stages chunks; chunk i runs on
    pipeline rank i % pp), as spaces/pipeline_split.py splits them (an even split puts the extra layers on the
    first chunks; with pp_split embedding_loss the first and last chunk hold one layer fewer, possibly none)."""
    train_steps: int
    """Optimizer steps to train the scenario's training_tokens (rounded up)."""
    source: str
    """Where the plan came from (study and trial, or the scenario file), for the header."""
    run_steps: int = 50
    """Optimizer steps the exported run takes: a throughput check (model_fields.throughput_steps), not
    train_steps, unless --steps says otherwise."""

    def steps_comment(self) -> str:
        """One line: the run's step count and the full run's, for a comment beside the engine's step setting."""
        from stratagem.launch.export.model_fields import THROUGHPUT_TIMED, THROUGHPUT_WARMUP, throughput_steps

        tr = self.scenario.training
        what = (f"a throughput check ({THROUGHPUT_WARMUP} warm-up + {THROUGHPUT_TIMED} timed steps; --steps N "
                "to change)" if self.run_steps == throughput_steps() else "as --steps asked")
        return (f"{self.run_steps} steps, {what}; the full run is {self.train_steps} steps (training_tokens "
                f"{tr.training_tokens:g} / {tr.tokens_per_step} tokens per step)")

    @property
    def throughput_check(self) -> bool:
        """Whether the exported run is a throughput check (fewer steps than the full run): it logs every step with
        its throughput and writes no checkpoint inside the timed steps; the full run's checkpoint settings go in a
        comment."""
        return self.run_steps < self.train_steps

    @property
    def world(self) -> int:
        """Ranks the plan needs (dp*tp*pp*cp)."""
        return self.plan.world_size

    @property
    def even_stages(self) -> bool:
        """Whether every pipeline stage holds the same number of layers."""
        return len(set(self.stage_layers)) == 1


def refuse_unrunnable(lay: Layout, target: str) -> None:
    """Raise StratagemError with the capability line when the target's engine cannot run the plan."""
    broken = capability_violations(stack_record(TARGET_STACK[target]), lay.plan)
    if broken:
        raise StratagemError(f"--to {target}: {broken[0]}")


def layout(scenario: Scenario, plan: Plan, nodes: int | None = None, source: str = "",
           steps: int | None = None) -> Layout:
    """Check the plan against the scenario's rules and derive the launch layout on `nodes` nodes; the run takes
    `steps` optimizer steps (default: a throughput check, model_fields.throughput_steps)."""
    from stratagem.launch.export.model_fields import throughput_steps

    check_plan(scenario, plan)
    world = plan.world_size
    n = scenario.cluster.num_nodes if nodes is None else nodes
    if n < 1 or world % n:
        ok = ", ".join(map(str, divisors(world)))
        raise StratagemError(f"nodes ({n}): must divide the plan's world size ({world}); valid: {ok}")
    # spaces/pipeline_split.py: even, embedding+loss counted as layers, or explicit first/last stage counts
    stages = chunk_layers(scenario.model.num_layers, plan.pp, plan.virtual_stages, plan.first_stage_layers,
                          plan.last_stage_layers, plan.pp_split)
    run_steps = steps
    tokens_per_step = scenario.training.tokens_per_step
    steps = -(-int(scenario.training.training_tokens) // tokens_per_step)
    return Layout(
        scenario=scenario, plan=plan, nodes=n, procs_per_node=world // n,
        grad_accum=micro_batches(plan, scenario.training.global_batch_size),
        stage_layers=stages, train_steps=max(1, steps), source=source,
        run_steps=run_steps if run_steps is not None else throughput_steps(),
    )


def master_addr_line(nodes: int) -> str:
    """The shell lines that set or require MASTER_ADDR (node 0's address) and set MASTER_PORT (default
    RDZV_PORT) for the c10d rendezvous."""
    port = f'MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"'
    if nodes == 1:
        return 'MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"\n' + port
    return ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"\n' + port


def checkpoint_interval_steps(evaluation: Evaluation | None) -> int | None:
    """The evaluation's checkpoint interval in optimizer steps, from its step time (measured if it has one,
    else predicted); None when it has no step time or checkpoint figures."""
    if evaluation is None:
        return None
    pred = evaluation.prediction
    ck = evaluation.checkpoint or (pred.checkpoint if pred is not None else None)
    step_s: float | None = None
    if evaluation.time is not None:
        step_s = evaluation.time.step_s
    elif evaluation.measurements and isinstance(evaluation.measurements.get("step_s"), int | float):
        step_s = float(evaluation.measurements["step_s"])
    elif pred is not None and pred.time is not None:
        step_s = pred.time.step_s
    if ck is None or step_s is None or step_s <= 0:
        return None
    return max(1, round(ck.interval_s / step_s))


_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]+")


def comment_safe(text: str) -> str:
    """Text safe inside a one-line `#` comment: control characters and line breaks become spaces."""
    return _CONTROL.sub(" ", text)


def header_lines(lay: Layout, target_line: str) -> list[str]:
    """The lines every exported file starts with (without comment markers)."""
    s, p = lay.scenario, lay.plan
    lines = [
        f"stratagem export for {target_line}",
        f"scenario: {s.name}",
        f"plan: {format_plan(p)}",
        f"launch: {lay.nodes} node(s) x {lay.procs_per_node} processes = world {lay.world}; "
        f"{lay.grad_accum} micro-batch(es) of {p.micro_batch_size} per step per data-parallel rank",
    ]
    if lay.source:
        lines.append(f"source: {lay.source}")
    return [comment_safe(x) for x in lines]


def note_lines(unexpressed: list[FieldNote], approximated: list[FieldNote], target_name: str,
               unexpressed_title: str = "") -> list[str]:
    """The notes as comment lines (without comment markers)."""
    lines: list[str] = []
    if unexpressed:
        lines.append(unexpressed_title or f"Not expressible in {target_name} (left out):")
        lines += [f"  - {n.line()}" for n in unexpressed]
    if approximated:
        lines.append(f"Approximated in {target_name} (closest setting; differs as said):")
        lines += [f"  - {n.line()}" for n in approximated]
    if not lines:
        lines.append(f"Every plan field is expressed exactly in {target_name}.")
    return [comment_safe(x) for x in lines]


def write_bundle(bundle: ExportBundle, out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write the bundle's files under `out_dir` (created). Every file is checked first (stratagem.files.
    check_owned: an existing file stratagem did not write, or one edited since, is refused unless `force`; no
    path through a link), then written with its digest (stratagem.files.stamped) to a temporary name in its
    directory and renamed only when all were written, so a refusal or a failure (disk full) leaves no file
    changed and no file or directory behind."""
    root = Path(out_dir)
    if root.exists() and not root.is_dir():
        raise StratagemError(f"-o ({root}): exists and is not a directory")
    targets = [(check_inside(root, rel), text, rel) for rel, text in bundle.files.items()]
    for dest, _, _ in targets:
        if dest.parent.is_dir():
            check_owned(dest, force)
    staged: list[tuple[str, Path]] = []
    made: list[Path] = []
    try:
        for dest, text, rel in targets:
            for d in reversed([dest.parent, *dest.parent.parents]):
                if not d.exists():
                    d.mkdir()
                    made.append(d)
            for path, raw in stamped(dest, text):  # with its digest: ours to replace only while unchanged
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=dest.parent)
                staged.append((tmp, path))
                with os.fdopen(fd, "wb") as f:
                    f.write(raw)
                os.chmod(tmp, 0o755 if rel.endswith(".sh") else 0o644)
    except OSError as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise StratagemError(f"-o ({root}): cannot write: {disk_error(e)}; nothing was changed") from None
    for tmp, dest in staged:
        os.replace(tmp, dest)
    return [dest for dest, _, _ in targets]
