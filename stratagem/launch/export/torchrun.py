"""torchrun target: the exact command that runs stratagem's own harness with this plan on N nodes, and the
scenario + plan YAML file it reads.

The harness entry point is `python -m stratagem.launch.harness --scenario S.yaml --plan "k=v,..." --steps N
--out result.json [--seed S]`. Every scenario and plan field is passed verbatim (the YAML file carries the
scenario and the plan; --plan repeats every plan field explicitly, defaults included). What the harness itself
does not apply (its checks: stratagem.launch.harness.parallelize.check_applicable, stratagem.launch.harness.model.check_supported,
stratagem.launch.harness.parallelize.build_optimizer) is listed as unexpressed: that run stops with the harness's error.
test_export_parsers.py keeps `harness_limits` in step with those checks.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from stratagem.launch.export.bundle import (
    ExportBundle,
    FieldNote,
    Layout,
    header_lines,
    master_addr_line,
    note_lines,
    refuse_unrunnable,
)
from stratagem.launch.export.model_fields import model_constants
from stratagem.spaces.plan import Plan

HARNESS_ROPE_THETA = 500000
"""The harness model's rotary base (launch/harness/model.py ROPE_THETA; not imported: it imports torch)."""
HARNESS_NORM_EPS = 1e-5
"""The harness model's RMSNorm epsilon (launch/harness/model.py RMSNorm)."""

__all__ = ["HARNESS_MODULE", "export_torchrun", "harness_limits", "plan_argument", "torchrun_command",
           "scenario_document"]

HARNESS_MODULE = "stratagem.launch.harness"
SCENARIO_FILE = "scenario.yaml"
SCRIPT_FILE = "run.sh"
RESULT_FILE = "result.json"


def plan_argument(plan: Plan) -> str:
    """Every plan field as `key=value`, defaults included, so the harness needs no default of its own."""
    parts = []
    for name in Plan.model_fields:
        value = getattr(plan, name)
        if isinstance(value, tuple):  # recompute_modules: a+b ("" for none), as parse_plan reads it
            value = "+".join(value)
        parts.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
    return ",".join(parts)


def torchrun_command(lay: Layout, steps: int, seed: int | None = None, scenario_path: str = SCENARIO_FILE,
                     out: str = RESULT_FILE, endpoint: str = "$MASTER_ADDR:$MASTER_PORT",
                     warmup: int | None = None) -> list[str]:
    """The torchrun command line as arguments (the endpoint is left for the shell to expand)."""
    cmd = [
        "torchrun", "--nnodes", str(lay.nodes), "--nproc-per-node", str(lay.procs_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "-m", HARNESS_MODULE, "--scenario", scenario_path, "--plan", plan_argument(lay.plan),
        "--steps", str(steps), "--out", out,
    ]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if warmup is not None:
        cmd += ["--warmup", str(warmup)]
    return cmd


def scenario_document(lay: Layout) -> dict[str, Any]:
    """The scenario with the plan in it, as the harness reads it (the search section is left out)."""
    s = lay.scenario
    data = s.model_dump(mode="json", exclude={"plan", "search"})
    if lay.nodes != s.cluster.num_nodes:
        data["cluster"] = {**data["cluster"], "num_nodes": lay.nodes, "gpus_per_node": lay.procs_per_node}
    data["plan"] = lay.plan.model_dump(mode="json")
    return data


def harness_limits(lay: Layout) -> list[FieldNote]:
    """Fields of this scenario and plan that stratagem's harness does not apply (it stops with an error)."""
    from stratagem.launch.harness.support import model_refusal, optimizer_refusal, plan_refusals

    s, p = lay.scenario, lay.plan
    device = "cpu" if s.cluster.gpu.kind == "cpu" else "cuda"
    found = [model_refusal(s.model), *plan_refusals(p, s.model, device), optimizer_refusal(s.training.optimizer)]
    out: list[FieldNote] = []
    for line in (r for r in found if r):  # "plan.cp (2): why; fix" -> FieldNote("plan.cp", "2: why; fix")
        head, _, why = line.partition(": ")
        field, _, value = head.partition(" (")
        out.append(FieldNote(field.split("/")[0].rstrip(":"),
                             f"{value.rstrip(')') + ': ' if value else ''}{why}: the harness stops with an error"))
    return out


def _shell_word(arg: str) -> str:
    return arg if arg.startswith("$MASTER_ADDR") else shlex.quote(arg)


def export_torchrun(lay: Layout, steps: int = 20, seed: int | None = 0, warmup: int | None = None) -> ExportBundle:
    """run.sh (the torchrun command, run on every node) and scenario.yaml (scenario + plan)."""
    refuse_unrunnable(lay, "torchrun")
    unexpressed = harness_limits(lay)
    approximated: list[FieldNote] = []
    s = lay.scenario
    consts = model_constants(s.model)
    if s.model.position_embedding == "rope" and (consts.rope_theta, consts.norm_eps) != (HARNESS_ROPE_THETA,
                                                                                        HARNESS_NORM_EPS):
        # launch/harness/model.py: ROPE_THETA and RMSNorm's eps are fixed (same cost, other numerics)
        approximated.append(FieldNote(
            "model.rope_theta",
            f"{s.model.name} has rope_theta {consts.rope_theta}, norm eps {consts.norm_eps:g}"
            + (f" ({consts.source})" if consts.source else " (not known)") + f"; the harness's model uses "
            f"{HARNESS_ROPE_THETA:g} and {HARNESS_NORM_EPS:g}: the same step cost, other numerics",
        ))
    if consts.rope_scaling is not None:  # the harness's rotary embedding has no scaling (launch/harness/model.py)
        approximated.append(FieldNote(
            "model.rope_scaling", f"{s.model.name} has {consts.rope_scaling.words()} ({consts.source}); the "
            "harness's rotary embedding has none: the same step cost, other numerics"))
    if lay.nodes != s.cluster.num_nodes:
        approximated.append(FieldNote(
            "cluster.num_nodes",
            f"launched on {lay.nodes} node(s) of {lay.procs_per_node} instead of the scenario's "
            f"{s.cluster.num_nodes} x {s.cluster.gpus_per_node}; scenario.yaml says so",
        ))
    head = header_lines(lay, f"torchrun + stratagem's harness ({HARNESS_MODULE})")
    notes = note_lines(unexpressed, approximated, "the harness",
                       "Not applied by the harness (passed on as given; the run stops with the harness's error):")
    cmd = torchrun_command(lay, steps, seed, warmup=warmup)
    rdzv = master_addr_line(lay.nodes)
    script = "\n".join([
        "#!/usr/bin/env bash",
        *[f"# {x}" for x in head],
        *[f"# {x}" for x in notes],
        f"# Run this script on each of the {lay.nodes} node(s); it writes {RESULT_FILE} next to it.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        rdzv,
        " ".join(_shell_word(a) for a in cmd),
        "",
    ])
    yaml_text = "\n".join([
        *[f"# {x}" for x in head],
        "# Read by: " + " ".join(cmd[cmd.index("-m"):cmd.index("--plan")]),
        yaml.safe_dump(scenario_document(lay), sort_keys=False, default_flow_style=False),
    ])
    return ExportBundle(
        target="torchrun", main=SCRIPT_FILE,
        files={SCRIPT_FILE: script, SCENARIO_FILE: yaml_text},
        unexpressed=unexpressed, approximated=approximated,
    )
