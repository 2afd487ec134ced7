"""Export a plan to the engines people train with: torchrun (stratagem's own harness), torchtitan, DeepSpeed,
Megatron-LM and NeMo Automodel. Pure text generation: no torch import.

    bundle = export_plan(scenario, plan, "torchtitan")
    bundle.files        # {"torchtitan.toml": "..."}
    bundle.unexpressed  # fields the target cannot express, each with why (also written into the files)
"""

from __future__ import annotations

from stratagem.errors import StratagemError
from stratagem.evaluators.evaluation import Evaluation
from stratagem.launch.export.automodel import export_automodel
from stratagem.launch.export.bundle import (
    TARGETS,
    ExportBundle,
    FieldNote,
    Layout,
    Target,
    checkpoint_interval_steps,
    layout,
    write_bundle,
)
from stratagem.launch.export.deepspeed import export_deepspeed
from stratagem.launch.export.megatron import export_megatron
from stratagem.launch.export.source import BEST, Chosen, choose_trial
from stratagem.launch.export.torchrun import export_torchrun
from stratagem.launch.export.torchtitan import export_torchtitan
from stratagem.spaces.plan import Plan
from stratagem.spaces.scenario import Scenario

__all__ = [
    "TARGETS", "Target", "ExportBundle", "FieldNote", "Layout", "export_plan", "layout", "write_bundle",
    "checkpoint_interval_steps", "BEST", "Chosen", "choose_trial",
]


def export_plan(scenario: Scenario, plan: Plan, target: str, nodes: int | None = None, *,
                evaluation: Evaluation | None = None, steps: int | None = None, seed: int | None = 0,
                source: str = "", warmup: int | None = None) -> ExportBundle:
    """The files that run `plan` for `scenario` with `target` on `nodes` nodes (default: the scenario's).

    evaluation    the plan's evaluation, if known: its step time turns the checkpoint interval into steps.
    steps         optimizer steps of the run (default: torchrun 20 timed harness steps; the engines a
                  throughput check, model_fields.throughput_steps, with the full run's count in a comment).
    seed, warmup  seed and warm-up steps of the harness run (torchrun target only; default: the harness's).
    source        where the plan came from (study and trial), written into the header.
    Raises StratagemError when the plan breaks a validity rule, `nodes` does not divide the world size, or
    the target is unknown.
    """
    if target not in TARGETS:
        raise StratagemError(f"--to ({target!r}): unknown target; use one of {', '.join(TARGETS)}")
    if steps is not None and steps < 1:
        raise StratagemError(f"--steps ({steps}): must be at least 1")
    lay = layout(scenario, plan, nodes, source, steps=steps)
    interval = checkpoint_interval_steps(evaluation)
    if target == "torchrun":
        return export_torchrun(lay, steps=steps or 20, seed=seed, warmup=warmup)
    if target == "torchtitan":
        return export_torchtitan(lay, checkpoint_interval=interval)
    if target == "deepspeed":
        return export_deepspeed(lay, checkpoint_interval=interval)
    if target == "automodel":
        return export_automodel(lay, checkpoint_interval=interval)
    return export_megatron(lay, checkpoint_interval=interval)
