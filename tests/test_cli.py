"""`stratagem evaluate`, `presets` and the study options every study command shares, through the real entry
point (`stratagem.cli:main`).

Exit 0 with a table or JSON; a user mistake exits 2 with one line on stderr naming the field and the fix,
never a traceback.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import cli
from stratagem.evaluators import Evaluation
from stratagem.spaces import GPU_PRESETS, MODEL_PRESETS, Plan

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama3-8b-8xh100.yaml"


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run `stratagem ARGS` in-process through main(); (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["stratagem", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_evaluate_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(monkeypatch, capsys, "evaluate", str(EXAMPLE))
    assert code == 0, err
    assert "llama3-8b on 8x h100-sxm-80g" in out
    for word in ("weights", "gradients", "optimizer", "activations", "transient", "overhead", "peak", "HBM",
                 "headroom"):
        assert word in out
    assert "fits" in out


def test_evaluate_json_is_an_evaluation(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(monkeypatch, capsys, "evaluate", str(EXAMPLE), "--plan", "tp=2,zero=1,mbs=2", "--json")
    assert code == 0
    ev = Evaluation.model_validate_json(out)
    assert ev.plan.tp == 2 and ev.plan.dp == 4 and ev.plan.zero_stage == 1  # dp fills the cluster
    assert ev.memory is not None and ev.status in ("ok", "oom")
    m = ev.memory
    total = m.weights_gib + m.gradients_gib + m.optimizer_gib + m.activations_gib + m.transient_gib + m.overhead_gib
    assert m.peak_gib == pytest.approx(total)
    assert m.headroom_gib == pytest.approx(m.hbm_gib - m.peak_gib)


def test_evaluate_oom_names_first_block(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("model: llama3-70b\ncluster: {gpu: h100-sxm-80g}\ntraining: {seq_len: 8192}\n")
    # Pure DP (torch stack: fp32 params + bf16 copy = 6 B/param): 423 GB of weights on each GPU.
    code, out, _ = run(monkeypatch, capsys, "evaluate", str(path), "--json")
    assert code == 0
    ev = Evaluation.model_validate_json(out)
    assert ev.status == "oom" and ev.memory is not None
    assert ev.memory.first_block_to_break == "weights"
    # FSDP over 8: fp32 params 4/8 + grads 4/8 = 66 GiB fit, Adam's 8/8 more do not.
    code, out, _ = run(monkeypatch, capsys, "evaluate", str(path), "--plan", "zero=3", "--json")
    ev = Evaluation.model_validate_json(out)
    assert ev.status == "oom" and ev.memory is not None
    assert ev.memory.first_block_to_break == "optimizer"
    assert "optimizer is the first block" in ev.reason
    code, out, _ = run(monkeypatch, capsys, "evaluate", str(path), "--plan", "zero=3")
    assert code == 0 and "OOM" in out and "first to break" in out


@pytest.mark.parametrize("args,fragments", [
    (["evaluate", "missing.yaml"], ["scenario (missing.yaml): file not found"]),
    (["evaluate", str(EXAMPLE), "--plan", "tp=3"], ["tp (3) must divide num_attention_heads (32)", "valid: 1, 2"]),
    (["evaluate", str(EXAMPLE), "--plan", "dp8 qq"], ["plan label ('qq'): not a label part", "key=value pairs"]),
    (["evaluate", str(EXAMPLE), "--plan", "zero=7"], ["plan.zero_stage (7)"]),
    (["evaluate", str(EXAMPLE), "--plan", "dp=4,mbs=3"], ["dp*tp*pp*cp (4*1*1*1 = 4)"]),
])
def test_evaluate_bad_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
                            fragments: list[str]) -> None:
    code, _, err = run(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, *fragments)


def test_evaluate_bad_yaml(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                           tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: 1\n")
    code, _, err = run(monkeypatch, capsys, "evaluate", str(bad))
    assert_one_line_error(code, err, "not valid YAML at line")
    bad.write_text("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: zero}\n")
    code, _, err = run(monkeypatch, capsys, "evaluate", str(bad))
    assert_one_line_error(code, err, "cluster.num_nodes ('zero')")


def test_presets(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(monkeypatch, capsys, "presets")
    assert code == 0
    for name in (*MODEL_PRESETS, *GPU_PRESETS):
        assert name in out
    assert "8.03B" in out and "722k" in out  # llama3-8b's and tiny-4l's parameter counts (quantities.count)
    assert "HBM GiB" in out and "79.6" in out  # one memory unit for the column
    code, out, _ = run(monkeypatch, capsys, "presets", "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data["models"]) == set(MODEL_PRESETS) and set(data["gpus"]) == set(GPU_PRESETS)
    assert data["gpus"]["h100-sxm-80g"]["peak_tflops_bf16"] == 989.5


def test_console_script_exit_codes(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it: one line and exit 2 for a mistake, exit 0 otherwise."""
    entry = [sys.executable, "-c", "from stratagem.cli import main; main()"]
    bad = subprocess.run([*entry, "evaluate", str(tmp_path / "none.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"error: scenario ({tmp_path / 'none.yaml'}): file not found"]
    ok = subprocess.run([*entry, "evaluate", str(EXAMPLE), "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert Evaluation.model_validate_json(ok.stdout).status == "ok"


@pytest.mark.parametrize("args,fragments", [
    (["search"], ["stratagem search", "Missing argument", "--help"]),
    (["evaluate", str(EXAMPLE), "--bogus"], ["No such option: --bogus"]),
    (["search", str(EXAMPLE), "--top", "many"], ["Invalid value for '--top'"]),
    (["frobnicate"], ["No such command 'frobnicate'"]),
])
def test_usage_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                   args: list[str], fragments: list[str]) -> None:
    """Issue 12 item 5: typer's usage errors follow the same contract as ours (one line, exit 2)."""
    code, out, err = run(monkeypatch, capsys, *args)
    assert out == ""
    assert_one_line_error(code, err, *fragments)


def test_help_keeps_exit_zero(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(monkeypatch, capsys, "search", "--help")
    assert code == 0 and "--real-runs" in out


def test_bottleneck_names_a_zone_only_at_warn_or_bad(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 12 item 10: all four zones ok -> no zone is named the bottleneck (it said "hbm")."""
    from stratagem.evaluators import evaluate
    from stratagem.evaluators.zones import ALL_OK, bottleneck_label
    from stratagem.spaces import load_scenario

    scn = load_scenario(EXAMPLE)
    calm = evaluate(scn)  # the example's plan: every zone ok
    assert calm.zones is not None and {calm.zones.hbm.level, calm.zones.communication.level,
                                       calm.zones.bubbles.level, calm.zones.checkpoint.level} == {"ok"}
    assert bottleneck_label(calm.zones) == ALL_OK
    code, out, _ = run(monkeypatch, capsys, "explain", str(EXAMPLE))
    assert code == 0 and f"bottleneck: {ALL_OK}" in out
    from stratagem.spaces import resolve_plan

    oom = evaluate(scn, resolve_plan(scn, "zero=1"))
    assert oom.zones is not None and oom.zones.hbm.level == "bad" and bottleneck_label(oom.zones) == "hbm"


TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"


def test_every_study_command_finds_the_study_beside_the_scenario(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One default rule (issue 23 item 2): `search` writes stratagem.db beside the scenario; status, report and
    export given the scenario read it from there, from any working directory; none of them needs --storage."""
    scenario = tmp_path / "runs" / "s.yaml"
    scenario.parent.mkdir()
    scenario.write_text(TINY.read_text())
    code, _, err = run(monkeypatch, capsys, "search", str(scenario), "--no-report")
    assert code == 0, err
    assert (scenario.parent / "stratagem.db").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(monkeypatch, capsys, "status", str(scenario), "--json")
    assert code == 0, err
    assert json.loads(out)["study"].startswith("s-")
    code, out, err = run(monkeypatch, capsys, "report", str(scenario), "-f", "json")
    assert code == 0 and json.loads(out), err
    code, out, err = run(monkeypatch, capsys, "export", str(scenario), "--to", "torchrun")
    assert code == 0 and "==> run.sh <==" in out, err
    assert list(elsewhere.iterdir()) == []  # nothing created where the commands ran


@pytest.mark.parametrize("args,fragments", [
    (["status"], ["stratagem status: give the scenario the search ran", "stratagem status SCENARIO.yaml",
                  "--storage sqlite:///DIR/stratagem.db"]),
    (["report", "-f", "md"], ["stratagem report: give the scenario the search ran"]),
    (["export", "--to", "torchrun"], ["stratagem export: give the scenario the search ran"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "a/b"], ["--study ('a/b'): no '/'", "e.g. a-b"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "../x"], ["--study ('../x'): no '/'"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "x" * 5000], ["at most 128 characters"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "a\x1bb"], ["control characters"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "s", "--storage-retry-minutes", "nan"],
     ["Invalid value for '--storage-retry-minutes'"]),
    (["status", "--storage", "sqlite:///x.db", "--study", "s"], ["file x.db not found"]),
])
def test_study_options_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str], args: list[str], fragments: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, *fragments)
    assert list(tmp_path.iterdir()) == []  # a mistyped storage is never created


def test_every_plan_command_takes_a_trial_and_says_where_the_plan_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 items 3 and 6: --trial N on evaluate, explain, trace and export (the study beside the scenario);
    `#` is the trial number; --plan over a scenario's plan: section says which fields came from where; export
    with no plan option exports the study's best plan, or says it exports the scenario's plan when no search ran."""
    from stratagem.search.storage import default_storage
    from stratagem.search.view import StudyView

    scenario = tmp_path / "s.yaml"
    scenario.write_text(TINY.read_text())
    code, out, err = run(monkeypatch, capsys, "export", str(scenario), "--to", "megatron")
    assert code == 0, err
    assert "exporting the scenario's plan dp4 z3 mb1 fp32: no study s-" in err and "--train-iters 50" in out
    code, out, err = run(monkeypatch, capsys, "evaluate", str(scenario), "--plan", "tp=2")
    assert code == 0, err
    assert ("plan merged: --plan gave tp; the scenario's plan: section gave micro_batch_size, precision, "
            "zero_stage; dp=2 fills the cluster; other fields default") in out
    code, out, err = run(monkeypatch, capsys, "evaluate", str(scenario), "--plan", "dp2 tp2 z1 mb1 fp32")
    assert code == 0 and "plan from the --plan label, the whole plan (its plan: section is not used)" in out, err

    code, _, err = run(monkeypatch, capsys, "search", str(scenario), "--no-report")
    assert code == 0, err
    view = StudyView.open(default_storage(scenario))
    n = min(s.trial.number for s in view.standings().values() if s.feasible)
    label = Plan(**view.study.trials[n].params).short()
    for command in ("evaluate", "explain"):
        code, out, err = run(monkeypatch, capsys, command, str(scenario), "--trial", str(n))
        assert code == 0, err
        assert f"plan from trial #{n} of study {view.name} (" in out and f"plan: {label}  trial #{n}" in out
    code, out, err = run(monkeypatch, capsys, "explain", str(scenario), "--trial", str(n), "--json")
    assert code == 0 and json.loads(out)["evaluation"] and f"plan from trial #{n}" in err
    code, out, err = run(monkeypatch, capsys, "trace", str(scenario), "--trial", str(n), "--json")
    assert code == 0 and json.loads(out) and f"plan from trial #{n}" in err, err
    code, out, err = run(monkeypatch, capsys, "export", str(scenario), "--trial", str(n), "--to", "torchtitan")
    assert code == 0 and f"exporting trial #{n}: {label}" in err and f"trial #{n} (" in out, err
    code, out, err = run(monkeypatch, capsys, "export", str(scenario), "--to", "torchrun")
    assert code == 0 and "exporting the study's best plan (--best tokens), trial #" in err, err
    code, _, err = run(monkeypatch, capsys, "evaluate", str(scenario), "--trial", "1", "--plan", "tp=2")
    assert_one_line_error(code, err, "--plan and --trial: give one of them")
    code, _, err = run(monkeypatch, capsys, "explain", str(scenario), "--trial", "100000")
    assert_one_line_error(code, err, "--trial (100000): study", "has trials 0-")


DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo-cpu.yaml"


def test_explain_prints_the_demo_in_mib_and_ms(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 item 2: the 10 MiB CPU demo's memory table reads in MiB (it read "0.00 GiB" for most blocks), its
    0.3 s step in ms, shares and zones as percentages, every figure 3 significant figures (stratagem.quantities)."""
    from stratagem import quantities as q
    from stratagem.evaluators import evaluate
    from stratagem.evaluators.calibration_file import resolve_calibration
    from stratagem.spaces import load_scenario
    from stratagem.units import MIB

    code, out, err = run(monkeypatch, capsys, "explain", str(DEMO))
    assert code == 0, err
    assert "GiB" not in out, out
    scn = load_scenario(DEMO)
    ev = evaluate(scn, None, resolve_calibration(scn)[0])
    assert ev.memory is not None and ev.time is not None and ev.throughput is not None and ev.zones is not None
    mib = ("MiB", MIB)
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.splitlines() if line.startswith("│")}
    assert rows["peak"] == [q.memory_in(ev.memory.peak_gib, mib), q.percent(ev.memory.peak_gib / ev.memory.hbm_gib)]
    assert rows["HBM"] == ["10.2", "100%"]  # hbm_gib 0.01 = 10.24 MiB
    assert rows["headroom"] == [q.memory_in(ev.memory.headroom_gib, mib), q.percent(ev.memory.headroom_fraction)]
    assert "┃ block                        ┃   MiB ┃" in out
    assert 0.1 < ev.time.step_s < 1.0  # the demo's step: hundreds of ms, so the column is in ms
    assert f"Step time: {q.duration_in(ev.time.step_s, ('ms', 1e-3))}" in out and "┃   ms ┃" in out
    assert rows["compute"] == [q.sig(ev.time.compute_s * 1e3), q.percent(ev.time.compute_s / ev.time.step_s)]
    assert (f"{q.sig(ev.throughput.tokens_per_s)} tokens/s ({q.sig(ev.throughput.tokens_per_s_per_gpu)} per GPU), "
            f"MFU {q.percent(ev.throughput.mfu)}") in out
    assert rows["checkpoint"][1] == q.percent(ev.zones.checkpoint.value) != "0.0%"  # it printed 0.0% before


def test_trace_prints_the_demo_in_mib(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 item 2: `stratagem trace` of the 10 MiB demo on fake tensors (a few seconds) prints its table and
    its worst-rank line in MiB, HBM included (it printed "traced peak 0.02 GiB ... against 0.01 GiB HBM")."""
    code, out, err = run(monkeypatch, capsys, "trace", str(DEMO))
    assert code == 0, err
    assert "GiB" not in out, out
    assert "traced MiB" in out and "analytic MiB" in out and "difference MiB" in out
    text = " ".join(out.split())  # (the console may wrap the line: its width is fixed when it is first made)
    worst = text[text.index("worst rank:"):]
    assert re.match(r"worst rank: [^:]*, traced peak 1[\d.]+ MiB .*? against 10\.2 MiB HBM", worst), worst


def test_calibrate_lines_are_percentages_and_significant_figures() -> None:
    """`stratagem calibrate`'s summary: errors as percentages, moved constants to 3 significant figures, more
    only where 3 would print one figure twice."""
    from stratagem import quantities as q
    from stratagem.cli.calibrate import errors_line, moved_constants
    from stratagem.evaluators import Calibration

    line = errors_line({"step_error_before": 0.8123, "step_error_after": 0.0456, "peak_error_before": 0.25,
                        "peak_error_after": 3e-5}, 10, 11)
    assert line == ("median step-time error 81.2% -> 4.56%, peak-memory error 25.0% -> 0.00300% "
                    "(10 of 11 runs fitted)")
    base = Calibration()
    fitted = base.model_copy(update={"matmul_efficiency": 0.0123456, "overlap": base.overlap * (1 + 1e-4)})
    moved = moved_constants(base, fitted)
    assert moved[0] == f"matmul_efficiency {q.sig(base.matmul_efficiency)} -> 0.0123"
    name, before, _, after = moved[1].split()  # overlap moved by 1e-4: 3 figures would print it twice
    assert name == "overlap" and before != after and len(moved) == 2


def test_calibrate_run_table_of_the_demo_is_in_mib() -> None:
    """`stratagem calibrate`'s run table (launch/runners/calibrate.run_table) for the demo's own calibration file
    (11 measured CPU runs of ~4 MiB): peaks in MiB, one duration unit for the step columns, errors as signed
    percentages; it printed 'peak GiB 0.003511' and '+121582%'."""
    from stratagem import quantities as q
    from stratagem.evaluators.calibration_file import load_calibration
    from stratagem.launch.runners.calibrate import run_table
    from stratagem.units import MIB

    cf = load_calibration(DEMO.with_name("demo-cpu-calibration.yaml"))
    lines = run_table(cf.runs).splitlines()
    assert "GiB" not in lines[0] and "peak MiB" in lines[0] and "step s" in lines[0], lines[0]
    assert len(lines) == 2 + len(cf.runs)
    first, cells = cf.runs[0], lines[2].split()
    assert first.measured_peak_gib is not None and first.measured_step_s is not None
    assert first.predicted_step_s_after is not None
    assert q.memory_in(first.measured_peak_gib, ("MiB", MIB)) in cells
    assert q.sig(first.measured_step_s) in cells
    err = first.predicted_step_s_after / first.measured_step_s - 1
    assert ("+" if err > 0 else "") + q.percent(err) in cells


def test_explain_says_what_a_studys_runs_taught(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """A calibration file a search wrote (its runs taught TP comm x1.4) makes explain predict with the multiplier
    and say so under the calibration line; its JSON carries the same lines."""
    import math

    from stratagem.evaluators.calibration import LogMultipliers, default_calibration
    from stratagem.evaluators.calibration_file import study_calibration_file, write_calibration
    from stratagem.evaluators.priors import prior_for
    from stratagem.evaluators.step_parts import TIME_TERMS
    from stratagem.spaces import load_scenario

    prior = prior_for("cpu").time()  # the other terms unmoved, as wide as the prior: nothing to say about them
    tp = TIME_TERMS.index("tp_comm_s")
    post = LogMultipliers(names=TIME_TERMS, mean=tuple(math.log(1.4) if t == "tp_comm_s" else 0.0 for t in TIME_TERMS),
                          cov=tuple(tuple(0.01 if i == j == tp else v for j, v in enumerate(row))
                                    for i, row in enumerate(prior.cov)), noise_sd=0.1, runs=5)
    scn = load_scenario(DEMO)
    cal = default_calibration("cpu").model_copy(update={"time_multipliers": post})
    path = write_calibration(tmp_path / "calibration.yaml", study_calibration_file(scn, cal, [], "demo"))
    code, out, err = run(monkeypatch, capsys, "explain", str(DEMO), "--calibration", str(path), "--plan", "dp=2,tp=2")
    assert code == 0, err
    assert "on this cluster: TP comm x1.41 +- 0.14 from 5 runs" in out, out
    code, out, err = run(monkeypatch, capsys, "explain", str(DEMO), "--calibration", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["taught"] == ["on this cluster: TP comm x1.41 +- 0.14 from 5 runs"]


def test_presets_keeps_every_name_whole_at_80_columns(monkeypatch, capsys) -> None:
    """Issue 34 item 7: `presets` cut names ('llama3-7…') on an 80-column terminal; a name is what --model takes."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys, "argv", ["stratagem", "presets"])
    try:
        cli.main()
    except SystemExit as e:
        assert not e.code
    out = capsys.readouterr().out
    assert "…" not in out
    cells = {line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")}
    assert set(MODEL_PRESETS) | set(GPU_PRESETS) <= cells, set(MODEL_PRESETS) - cells


@pytest.mark.parametrize("command", ["presets", "evaluate", "explain", "compare", "report", "capacity", "search",
                                     "status", "export", "calibrate", "clean", "trace", "reproduce"])
def test_help_shows_no_type_for_a_flag(monkeypatch, capsys, command) -> None:
    """Issue 34 item 7: flags (--json, --force, --help) showed a `<bool>` metavar; presets' --json said it printed
    'the Evaluation'."""
    monkeypatch.setattr(sys, "argv", ["stratagem", command, "--help"])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main()
    out = capsys.readouterr().out
    assert "<bool>" not in out and "--help" in out
    if command == "presets":
        assert "Print every model and GPU preset as JSON." in out and "Evaluation" not in out


def test_an_unknown_key_lists_the_valid_ones(monkeypatch, capsys, tmp_path) -> None:
    """Issue 34 item 7: an unknown cluster key said only 'Extra inputs are not permitted'."""
    path = tmp_path / "s.yaml"
    path.write_text("model: llama3-8b\ncluster: {gpu: h100-sxm-80g, num_nodes: 1, nodes: 2}\n"
                    "training: {seq_len: 8192, global_batch_size: 64}\n")
    code, _, err = run(monkeypatch, capsys, "evaluate", str(path))
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "cluster.nodes (2): no such key; valid keys: " in line and "num_nodes" in line and "gpus_per_node" in line
