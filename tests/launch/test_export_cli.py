"""`stratagem export`: from a real SQLite study built through records.py's schema, and from a scenario file;
stdout vs -o; one-line errors; and the exported torchrun command run for real on this machine (gloo)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.errors import StratagemError
from stratagem.evaluators import evaluate
from stratagem.launch.export import choose_trial
from stratagem.search.records import (
    CONSTRAINT,
    DIRECTIONS,
    OBJECTIVES,
    objective_values,
    plan_distributions,
    plan_key,
    plan_params,
)
from stratagem.spaces import Plan, Scenario, parse_plan

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
optuna.logging.set_verbosity(optuna.logging.WARNING)
runner = CliRunner()

DISTRIBUTIONS = plan_distributions()
SCENARIO = Scenario(
    model="tiny-4l", cluster={"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 4},
    training={"seq_len": 128, "global_batch_size": 8, "training_tokens": 1e6},
)


def _trial(plan: Plan, fidelity: str = "analytic", values: list[float] | None = None, status: str = "ok",
           state: optuna.trial.TrialState = optuna.trial.TrialState.COMPLETE, over_gib: float = -1.0,
           measurements: dict[str, Any] | None = None, provenance: dict[str, Any] | None = None
           ) -> optuna.trial.FrozenTrial:
    ev = evaluate(SCENARIO, plan)
    assert ev.status == "ok"
    ev = ev.model_copy(update={"fidelity": fidelity, "measurements": measurements, "provenance": provenance})
    params = plan_params(plan)
    complete = state == optuna.trial.TrialState.COMPLETE
    return optuna.trial.create_trial(
        state=state, params=params, distributions={k: DISTRIBUTIONS[k] for k in params},
        values=(values or objective_values(ev)) if complete else None,
        user_attrs={"plan": plan_key(plan), "fidelity": fidelity, "status": status,
                    "evaluation": ev.model_dump(mode="json"), "provenance": provenance or {}},
        constraints={CONSTRAINT: over_gib},
    )


def make_study(path: Path, name: str, trials: list[optuna.trial.FrozenTrial]) -> str:
    url = f"sqlite:///{path}"
    study = optuna.create_study(storage=url, study_name=name, directions=list(DIRECTIONS))
    study.set_user_attr("scenario", SCENARIO.model_dump(mode="json"))
    study.set_user_attr("scenario_hash", SCENARIO.problem_hash())
    for t in trials:
        study.add_trial(t)
    return url


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite file with two studies: `mixed` (analytic and measured trials, infeasible ones with the
    highest tokens/s) and `analytic` (analytic trials only)."""
    path = tmp_path_factory.mktemp("study") / "s.db"
    p = parse_plan
    mixed = [
        _trial(p("dp=4")),                                                       # 0
        _trial(p("dp=2,tp=2")),                                                  # 1
        _trial(p("dp=4,zero=3")),                                                # 2
        _trial(p("dp=2,tp=2,zero=1"), fidelity="measured", values=[10.0, 3.0, 0.01],
               measurements={"step_s": 0.5, "step_times_s": [0.5, 0.5, 0.5, 0.5], "tokens_per_s": 2048.0,
                             "ranks": [{"rank": r, "peak_bytes": 1 << 20} for r in range(4)]},  # a harness result
               provenance={"seed": 7}),  # 3
        _trial(p("dp=1,pp=4"), status="oom", state=optuna.trial.TrialState.PRUNED),                     # 4
        _trial(p("dp=2,pp=2"), values=[1e9, 1e9, 0.0], over_gib=0.5),            # 5: breaks the memory constraint
        _trial(p("dp=2,pp=2,zero=1"), fidelity="measured", values=[1e9, 1e9, 0.0], status="failed"),   # 6
    ]
    url = make_study(path, "mixed", mixed)
    make_study(path, "analytic", [_trial(p(x)) for x in ("dp=4", "dp=2,tp=2", "dp=4,zero=3", "dp=1,pp=2,cp=2")])
    return url


def export(*args: str) -> Any:
    return runner.invoke(app, ["export", *args])


def files_of(stdout: str) -> dict[str, str]:
    """Split `==> path <==` sections."""
    out: dict[str, str] = {}
    name = None
    for line in stdout.splitlines(keepends=True):
        if line.startswith("==> ") and line.rstrip().endswith(" <=="):
            name = line[4:].rstrip()[:-4]
            out[name] = ""
        elif name is not None:
            out[name] += line
    return out


def test_best_prefers_measured_feasible_trials(storage: str) -> None:
    result = export("--storage", storage, "--study", "mixed", "--best", "tokens", "--to", "torchrun")
    assert result.exit_code == 0, result.output
    files = files_of(result.stdout)
    assert set(files) == {"run.sh", "scenario.yaml"}
    assert "# source: study mixed trial #3 (best measured: " in files["run.sh"]  # search.noise.best_measured
    assert "exporting the study's best plan (--best tokens), trial #3: dp2 tp2" in result.stderr
    cmd = shlex.split(next(x for x in files["run.sh"].splitlines() if x.startswith("torchrun ")))
    assert cmd[cmd.index("--plan") + 1].startswith("dp=2,tp=2,pp=1,cp=1,ep=1,etp=1,dp_replicate=1,zero_stage=1,")
    assert (cmd[cmd.index("--steps") + 1], cmd[cmd.index("--seed") + 1]) == ("4", "7")  # from the measured run
    override = export("--storage", storage, "--study", "mixed", "--to", "torchrun", "--steps", "9", "--seed", "1")
    cmd = shlex.split(next(x for x in files_of(override.stdout)["run.sh"].splitlines() if x.startswith("torchrun")))
    assert (cmd[cmd.index("--steps") + 1], cmd[cmd.index("--seed") + 1]) == ("9", "1")


@pytest.mark.parametrize("best", ["tokens", "headroom", "risk"])
def test_best_by_each_objective(storage: str, best: str) -> None:
    study = optuna.load_study(study_name="analytic", storage=storage)
    i = OBJECTIVES.index({"tokens": "tokens_per_s", "headroom": "headroom_gib", "risk": "goodput_loss"}[best])
    pick = max if DIRECTIONS[i] == "maximize" else min
    expected = pick(study.trials, key=lambda t: t.values[i])
    chosen = choose_trial(study, best=best)
    assert chosen.trial == expected.number and chosen.plan == Plan(**expected.params)
    result = export("--storage", storage, "--study", "analytic", "--best", best, "--to", "megatron")
    assert result.exit_code == 0, result.output
    assert f"trial #{expected.number} (analytic; best" in result.stdout


def test_trial_to_a_directory(storage: str, tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    result = export("--storage", storage, "--study", "mixed", "--trial", "2", "--to", "torchtitan", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    doc = tomllib.loads((out / "torchtitan.toml").read_text())
    assert doc["parallelism"]["fsdp_reshard_after_forward"] == "always"  # trial 2 is dp=4, zero=3
    assert doc["parallelism"]["data_parallel_shard_degree"] == 4
    # the analytic evaluation's step time turns the checkpoint interval into steps: the full run's, in a comment,
    # since a throughput check writes no checkpoint
    assert doc["checkpoint"] == {"enable": False} and doc["metrics"]["log_freq"] == 1
    interval = re.search(r"the full run sets enable = true, .*interval = (\d+)", (out / "torchtitan.toml").read_text())
    assert interval is not None and int(interval.group(1)) >= 1
    assert sorted(p.name for p in out.iterdir()) == ["torchtitan.toml"]
    assert "wrote" in result.stderr and "torchtitan.toml" in result.stderr


def test_scenario_and_plan_without_a_study(tmp_path: Path) -> None:
    path = tmp_path / "scn.yaml"
    path.write_text(yaml.safe_dump(SCENARIO.model_dump(mode="json", exclude={"plan", "search"})))
    result = export("--scenario", str(path), "--plan", "tp=2,zero=2", "--to", "deepspeed")
    assert result.exit_code == 0, result.output
    files = files_of(result.stdout)
    cfg = json.loads(files["ds_config.json"])
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["tensor_parallel"] == {"autotp_size": 2}
    assert cfg["gradient_accumulation_steps"] == 4  # dp filled the cluster: 8 / (2 * 1)
    assert "README.md" in files
    assert "not expressible" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--trial", "99"], r"--trial \(99\): study 'mixed' has trials 0-6"),
    (["--trial", "1", "--best", "tokens"], "--trial and --best: give one of them"),
    (["--best", "speed"], r"--best \('speed'\): use one of tokens, headroom, risk"),
    (["--plan", "dp=4"], "--plan: needs the scenario"),
    (["--plan", "dp=4", "--trial", "1"], "--plan: give one of --plan, --trial, --best"),
    (["--to", "nemo"], r"--to \('nemo'\): unknown target"),
    (["--nodes", "3"], r"nodes \(3\): must divide the plan's world size \(4\)"),
])
def test_errors_name_the_option_and_the_fix(storage: str, args: list[str], message: str) -> None:
    base = ["--storage", storage, "--study", "mixed"]
    if "--to" not in args:
        args = [*args, "--to", "torchrun"]
    result = export(*base, *args)
    assert isinstance(result.exception, StratagemError)
    assert re.search(message, str(result.exception)), str(result.exception)


def test_unknown_study_and_storage(storage: str, tmp_path: Path) -> None:
    result = export("--storage", storage, "--study", "nope", "--to", "torchrun")
    assert isinstance(result.exception, StratagemError) and "studies there: mixed, analytic" in str(result.exception)
    result = export("--storage", f"sqlite:///{tmp_path}/missing.db", "--study", "x", "--to", "torchrun")
    assert isinstance(result.exception, StratagemError) and "not found" in str(result.exception)
    result = export("a.yaml", "--scenario", "x.yaml", "--to", "torchrun")
    assert isinstance(result.exception, StratagemError) and "--scenario: give the scenario once" in str(
        result.exception)


def test_output_that_is_a_file_is_refused(storage: str, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_text("keep me")
    result = export("--storage", storage, "--study", "mixed", "--to", "megatron", "-o", str(target))
    assert isinstance(result.exception, StratagemError) and "is not a directory" in str(result.exception)
    assert target.read_text() == "keep me"


def test_command_line_exits_2_with_one_line(storage: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from stratagem.cli import main; main()", "export", "--storage", storage,
         "--study", "mixed", "--trial", "42", "--to", "torchrun"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --trial (42): study 'mixed' has trials 0-6"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_exported_torchrun_command_runs_the_harness(tmp_path: Path) -> None:
    """The real thing: export a 2-process plan, run the generated run.sh (torchrun + harness over gloo)."""
    scn = SCENARIO.model_copy(update={"cluster": SCENARIO.cluster.model_copy(update={"gpus_per_node": 2})})
    path = tmp_path / "scn.yaml"
    path.write_text(yaml.safe_dump(scn.model_dump(mode="json", exclude={"plan", "search"})))
    out = tmp_path / "job"
    result = export("--scenario", str(path), "--plan", "dp=1,tp=2,sp=true", "--to", "torchrun", "--steps", "2",
                    "--seed", "5", "-o", str(out))
    assert result.exit_code == 0, result.output
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", str(out / "run.sh")], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "result.json").read_text())
    assert res["world_size"] == 2 and res["seed"] == 5 and res["steps"] == 2
    got = res["plan"]
    assert (Plan(**got) if isinstance(got, dict) else parse_plan(got)) == parse_plan("dp=1,tp=2,sp=true")
