"""Bad input and faults through the real CLI (issue 28): every case ends in exit 2 with one line naming the file
or field and the fix, leaves every file it was given byte-identical (sha256), and leaves nothing behind.

  OVERWRITE  export / calibrate / report / capacity / trace -o never replace a file stratagem did not write, or
             one edited since (proven by the digest in its first line or beside it, not guessed from a marker
             or a name) unless --force; never through a symbolic link (28.1, 37.1)
  CALIBRATE  options and output are checked before the first run; a failed calibrate leaves the previous file
             byte-identical and writes nothing (28.3)
  DEVICE     a calibration fitted on another GPU preset is refused, or used with a warning when the scenario
             says cluster.calibration_device_mismatch: allow (28.4)
  READS      scenario / calibration files that are /dev/zero, a FIFO, endless stdin, huge, not UTF-8, deeply
             nested or an alias bomb: refused unread, quickly (28.6)
  INPUT      hf_config zero divisions and null/list sections, search.seed -1, search.etp [0], a 1e18 batch,
             NaN/inf prices and MTBF, export --steps 0, control characters in a name (28.7)
  DISK FULL  `ulimit -f` (EFBIG) on capacity, export and calibrate's write: one line, nothing half-written (28.7)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from stratagem import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-cpu.yaml"
H100 = ROOT / "examples" / "llama3-8b-8xh100.yaml"
CPU_CAL = ROOT / "examples" / "demo-cpu-calibration.yaml"


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`stratagem ARGS` in-process through the entry point main(); (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["stratagem", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        cli.main()
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def sub(*args: str, cwd: Path, stdin: int | None = None, limit_kib: int | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`stratagem ARGS` in a fresh interpreter (optionally under `ulimit -f limit_kib`)."""
    code = f"from stratagem.cli import main; main({list(args)!r})"
    cmd = [sys.executable, "-c", code]
    if limit_kib is not None:
        cmd = ["bash", "-c", f'ulimit -f {limit_kib}; exec "$0" "$@"', *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, stdin=stdin, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)


def one_line(code: int, err: str, *fragments: str) -> str:
    """The one `error:` line of a refusal, checked for exit 2, no traceback and every fragment."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root -> sha256 of a file, 'dir' or 'link -> target' (what 'unchanged' compares)."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = f"link -> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "special"
    return out


def scenario(tmp_path: Path, name: str = "s.yaml", base: Path = TINY, **changes: dict) -> Path:
    data = yaml.safe_load(base.read_text())
    for section, fields in changes.items():
        data[section] = {**(data.get(section) or {}), **fields} if isinstance(fields, dict) else fields
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


# ---- 28.1: never overwrite what the user made ------------------------------------------------------------------

def _user_dir(tmp_path: Path) -> Path:
    d = tmp_path / "job"
    d.mkdir()
    (d / "scenario.yaml").write_text("# my hand-edited scenario\nmodel: llama3-8b\n")
    (d / "run.sh").write_text("#!/bin/sh\necho mine\n")
    return d


OVERWRITES: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    # export -o DIR holding the user's own scenario.yaml and run.sh
    "export-user-files": lambda t: (["export", "--scenario", str(TINY), "--to", "torchrun", "-o",
                                     str(_user_dir(t))], "was not written by stratagem"),
    # the same directory reached through a symbolic link
    "export-through-linked-dir": lambda t: (["export", "--scenario", str(TINY), "--to", "torchrun", "-o",
                                             str(_linked(t))], "was not written by stratagem"),
    # run.sh inside -o is a link to a file elsewhere: never written through
    "export-link-inside": lambda t: (["export", "--scenario", str(TINY), "--to", "torchrun", "-o",
                                      str(_link_inside(t))], "symbolic link"),
    "calibrate-onto-notes": lambda t: (["calibrate", str(scenario(t)), "-o", str(_notes(t, "notes.txt"))],
                                       "was not written by stratagem"),
    "capacity-onto-notes": lambda t: (["capacity", str(H100), "-o", str(_notes(t, "notes.md"))],
                                      "was not written by stratagem"),
    "report-onto-notes": lambda t: (["report", "--storage", f"sqlite:///{t / 'none.db'}", "-o",
                                     str(_notes(t, "index.html"))], "was not written by stratagem"),
    "trace-onto-notes": lambda t: (["trace", str(TINY), "--plan", "dp=4", "--json", "-o",
                                    str(_notes(t, "roles.json"))], "was not written by stratagem"),
    "capacity-onto-directory": lambda t: (["capacity", str(H100), "-o", str(_dir(t, "out.md"))],
                                          "is a directory"),
    # issue 37.1: a marker string anywhere near the start is no proof; only a matching digest is
    "report-onto-stratagem-notes": lambda t: (["report", "--storage", f"sqlite:///{t / 'none.db'}", "-o",
                                               str(_notes(t, "n.md", "# stratagem: my notes\n"))], "--force"),
    "report-onto-titled-page": lambda t: (["report", "--storage", f"sqlite:///{t / 'none.db'}", "-o", str(_notes(
        t, "p.html", "<!DOCTYPE html><title>stratagem runs</title>\n"))], "was not written by stratagem"),
    "capacity-onto-quoting-page": lambda t: (["capacity", str(H100), "-o", str(_notes(
        t, "q.html", "<p>we pasted 'stratagem export for llama' here</p>\n"))], "was not written by stratagem"),
    "report-onto-csv-with-header": lambda t: (["report", "--storage", f"sqlite:///{t / 'none.db'}", "-o", str(_notes(
        t, "mine.csv", "trial,plan_key,label,fidelity,status\n1,x,y,z,ok\n"))], "was not written by stratagem"),
    "export-onto-edited-run-sh": lambda t: (["export", "--scenario", str(TINY), "--to", "torchrun", "--plan", "dp=4",
                                             "-o", str(_edited_export(t))], "run.sh"),
    "report-onto-edited-report": lambda t: (["report", "--storage", f"sqlite:///{t / 'none.db'}", "-o",
                                             str(_edited_capacity(t))], "edited since"),
}


def _edited_export(t: Path) -> Path:
    """A real export whose run.sh the user then edited (its digest line kept)."""
    from stratagem.launch.export import export_plan, write_bundle
    from stratagem.spaces import load_scenario, parse_plan

    out = t / "job"
    write_bundle(export_plan(load_scenario(TINY), parse_plan("dp=4"), "torchrun", source="test"), out)
    script = out / "run.sh"
    script.write_text(script.read_text().replace("\n", "\nexport NCCL_DEBUG=INFO  # mine\n", 3))
    return out


def _edited_capacity(t: Path) -> Path:
    """stratagem's own Markdown page with one line the user added at its end."""
    from stratagem.files import write_owned

    page = t / "page.md"
    write_owned(page, "# capacity\n| nodes |\n")
    page.write_text(page.read_text() + "my note\n")
    return page


def _linked(t: Path) -> Path:
    target = _user_dir(t)
    link = t / "link"
    link.symlink_to(target, target_is_directory=True)
    return link


def _link_inside(t: Path) -> Path:
    d = t / "job"
    d.mkdir()
    (t / "elsewhere.sh").write_text("precious\n")
    (d / "run.sh").symlink_to(t / "elsewhere.sh")
    return d


def _notes(t: Path, name: str, text: str = "my notes\n") -> Path:
    (t / name).write_text(text)
    return t / name


def _dir(t: Path, name: str) -> Path:
    (t / name).mkdir()
    return t / name


@pytest.mark.parametrize("case", list(OVERWRITES))
def test_user_files_are_never_overwritten(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv, words = OVERWRITES[case](tmp_path)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    code, _, err = run(monkeypatch, capsys, *argv)
    one_line(code, err, words)
    assert "--force" in err or "directory" in err or "link" in err
    assert snapshot(tmp_path) == before, "a file or directory changed or appeared"
    assert time.monotonic() - t0 < 60, "refused before the work (runs, trace), not after"


def test_own_output_is_recognised_by_content_and_force_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job"
    args = ["export", "--scenario", str(TINY), "--to", "torchrun", "-o", str(out)]
    assert run(monkeypatch, capsys, *args)[0] == 0
    first = snapshot(out)
    code, _, err = run(monkeypatch, capsys, *args, "--steps", "7")  # its own earlier output: replaced
    assert code == 0, err and snapshot(out) != first
    renamed = tmp_path / "renamed.md"  # recognised by its digest, whatever its name
    assert run(monkeypatch, capsys, "capacity", str(H100), "-o", str(tmp_path / "cap.md"))[0] == 0
    (tmp_path / "cap.md").rename(renamed)
    assert run(monkeypatch, capsys, "capacity", str(H100), "-o", str(renamed))[0] == 0
    user = _notes(tmp_path, "notes.md")
    code, _, err = run(monkeypatch, capsys, "capacity", str(H100), "-o", str(user), "--force")
    assert code == 0, err
    assert user.read_text().startswith("<!-- generator: stratagem, stratagem-sha256:")
    assert run(monkeypatch, capsys, "capacity", str(H100), "-o", str(user))[0] == 0, "ours now, while unchanged"
    page = tmp_path / "cap.html"  # HTML keeps its digest in a comment line before the doctype
    for _ in range(2):
        code, _, err = run(monkeypatch, capsys, "capacity", str(H100), "-o", str(page))
        assert code == 0, err
    assert page.read_text().split("\n", 2)[1] == "<!DOCTYPE html>"
    page.unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job", "notes.md", "renamed.md"]


# ---- 28.3: atomic calibration ----------------------------------------------------------------------------------

@pytest.mark.parametrize("option,value,words", [
    ("--budget-minutes", "nan", "--budget-minutes (nan)"),
    ("--budget-minutes", "inf", "--budget-minutes (inf)"),
    ("--budget-minutes", "-1", "--budget-minutes (-1)"),
    ("--gpus", "0", "--gpus (0)"),
    ("--gpus", "64", "--gpus (64): this node has"),  # 37.5: bounded by the node, not grown without bound
    ("--steps", "0", "--steps (0)"),
])
def test_calibrate_options_refused_before_runs(option: str, value: str, words: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    scn = scenario(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run(monkeypatch, capsys, "calibrate", str(scn), option, value)
    one_line(code, err, words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("text,words", [
    (None, "rates.yaml): file not found; write it with `torchrun"),
    ("format: other\n", "format is not stratagem-rate-tables/1"),
    ("format: stratagem-rate-tables/1\nrate_tables: {source: x, collectives: [{collective: all_gather, ranks: 1, "
     "placement: inter_node, sizes_bytes: [1], busbw_gbps: [1]}]}\n", "rate_tables.collectives.0.ranks"),
])
def test_calibrate_rate_tables_refused_before_runs(text: str | None, words: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    scn = scenario(tmp_path)
    rates = tmp_path / "rates.yaml"
    if text is not None:
        rates.write_text(text)
    before = snapshot(tmp_path)
    code, _, err = run(monkeypatch, capsys, "calibrate", str(scn), "--rate-tables", str(rates))
    one_line(code, err, words)
    assert snapshot(tmp_path) == before


def test_calibrate_output_refused_before_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    scn = scenario(tmp_path)
    (tmp_path / "adir").mkdir()
    code, _, err = run(monkeypatch, capsys, "calibrate", str(scn), "-o", str(tmp_path / "adir"))
    one_line(code, err, "is a directory")
    # the scenario in a directory nothing can be created in (immutable as root, read-only otherwise): the
    # default output beside it is refused before the runs
    locked = tmp_path / "locked"
    locked.mkdir()
    inside = scenario(locked)
    lock = ["chattr", "+i", str(locked)] if os.geteuid() == 0 else ["chmod", "555", str(locked)]
    unlock = ["chattr", "-i", str(locked)] if os.geteuid() == 0 else ["chmod", "755", str(locked)]
    subprocess.run(lock, check=True)
    try:
        code, _, err = run(monkeypatch, capsys, "calibrate", str(inside))
        one_line(code, err, "cannot write in", str(locked))
    finally:
        subprocess.run(unlock, check=True)
    (tmp_path / "cal-runs").mkdir()  # a runs directory holding the user's file
    (tmp_path / "cal-runs" / "mine.txt").write_text("x")
    code, _, err = run(monkeypatch, capsys, "calibrate", str(scn), "-o", str(tmp_path / "cal.yaml"))
    one_line(code, err, "did not write", "mine.txt")
    assert not (tmp_path / "cal.yaml").exists()


def test_failed_calibrate_keeps_the_previous_file(tmp_path: Path) -> None:
    """The real command: a budget spent before the first run starts skips every run; the fit lacks its runs,
    so nothing is written and the previous calibration stays byte-identical."""
    scn = scenario(tmp_path)
    cal = tmp_path / "calibration.yaml"
    shutil.copy(CPU_CAL, cal)
    before = snapshot(tmp_path)
    proc = sub("calibrate", str(scn), "--gpus", "1", "--budget-minutes", "0.00001", "--steps", "1",
               "--warmup", "0", cwd=tmp_path, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "the fit needs" in err[0], proc.stderr
    assert "unchanged" in err[0] and "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(tmp_path) == before


# ---- 28.4: a calibration knows its device ----------------------------------------------------------------------

def test_cpu_calibration_on_h100_scenario(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(monkeypatch, capsys, "evaluate", str(H100), "--calibration", str(CPU_CAL))
    one_line(code, err, "fitted on cpu", "h100-sxm-80g", "calibration_device_mismatch: allow")
    linked = scenario(tmp_path, base=H100, cluster={"calibration": str(CPU_CAL)})
    code, _, err = run(monkeypatch, capsys, "search", str(linked), "--no-report", "--storage",
                       f"sqlite:///{tmp_path / 's.db'}")
    one_line(code, err, "fitted on cpu")
    assert not (tmp_path / "s.db").exists()
    allowed = scenario(tmp_path, "allow.yaml", base=H100, cluster={"calibration": str(CPU_CAL),
                                                                    "calibration_device_mismatch": "allow"})
    code, out, err = run(monkeypatch, capsys, "evaluate", str(allowed))
    assert code == 0, err
    assert err.startswith("warning: ") and "fitted on cpu" in err and len(err.strip().splitlines()) == 1
    assert str(CPU_CAL) in out
    # the opt-in is not part of the problem: the study key stays the same
    from stratagem.spaces import load_scenario

    assert load_scenario(allowed).problem_hash() == load_scenario(linked).problem_hash()


# ---- 28.6: bounded, typed reads --------------------------------------------------------------------------------

def _deep(t: Path) -> Path:
    (t / "deep.yaml").write_text("model: " + "[" * 200 + "]" * 200 + "\n")
    return t / "deep.yaml"


def _very_deep(t: Path) -> Path:
    (t / "deep.yaml").write_text("model: " + "[" * 50_000 + "]" * 50_000 + "\n")
    return t / "deep.yaml"


def _bomb(t: Path) -> Path:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    (t / "bomb.yaml").write_text("\n".join(lines) + "\nmodel: *a8\n")
    return t / "bomb.yaml"


def _fifo(t: Path) -> Path:
    os.mkfifo(t / "fifo.yaml")
    return t / "fifo.yaml"


def _huge(t: Path) -> Path:
    with open(t / "huge.yaml", "wb") as f:
        f.truncate(5 << 20)
    return t / "huge.yaml"


def _latin1(t: Path) -> Path:
    (t / "l1.yaml").write_bytes("model: tiny-cpu  # caf\xe9\n".encode("latin-1"))
    return t / "l1.yaml"


READS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "dev-zero": (lambda t: Path("/dev/zero"), "is a character device"),
    "fifo": (_fifo, "is a FIFO"),
    "huge": (_huge, "over the 1 MiB"),
    "not-utf8": (_latin1, "not a text file"),
    "deep": (_deep, "nested more than 64 levels"),
    "very-deep": (_very_deep, "nested too deeply"),
    "alias-bomb": (_bomb, "YAML aliases"),
    "directory": (lambda t: t, "is a directory"),
}


@pytest.mark.parametrize("case", list(READS))
def test_scenario_and_calibration_reads_are_bounded(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    make, words = READS[case]
    path = make(tmp_path)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    code, _, err = run(monkeypatch, capsys, "evaluate", str(path))
    one_line(code, err, f"scenario ({path})", words)
    if case in ("very-deep", "deep", "alias-bomb"):
        return  # YAML-specific: the calibration file is read by the same reader (below for the rest)
    code, _, err = run(monkeypatch, capsys, "evaluate", str(TINY), "--calibration", str(path))
    one_line(code, err, f"calibration ({path})", words)
    assert time.monotonic() - t0 < 20
    assert snapshot(tmp_path) == before


def test_endless_stdin_is_refused_unread(tmp_path: Path) -> None:
    endless = subprocess.Popen(["yes", "model: tiny-cpu"], stdout=subprocess.PIPE)
    try:
        t0 = time.monotonic()
        proc = sub("evaluate", "/dev/stdin", cwd=tmp_path, stdin=endless.stdout.fileno() if endless.stdout else None)
        assert time.monotonic() - t0 < 60
    finally:
        endless.kill()
        endless.wait()
    one_line(proc.returncode, proc.stderr, "scenario (/dev/stdin)", "is a FIFO")


# ---- 28.7: zero tracebacks -------------------------------------------------------------------------------------

LLAMA4_VISION = {"hidden_size": 1408, "intermediate_size": 5632, "image_size": 336, "patch_size": 14,
                 "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096, "projector_output_dim": 4096,
                 "vision_output_dim": 4096, "num_hidden_layers": 34}
LLAMA4_TEXT = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
               "vocab_size": 1000, "intermediate_size": 256, "intermediate_size_mlp": 1024, "num_local_experts": 4,
               "num_experts_per_tok": 1}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 256}
HF_CONFIGS: dict[str, tuple[dict, str]] = {
    "vision-null": ({"model_type": "llama4", "text_config": LLAMA4_TEXT, "vision_config": None},
                    "vision_config (NoneType) must be an object"),
    "text-list": ({"model_type": "llama4", "text_config": [LLAMA4_TEXT], "vision_config": LLAMA4_VISION},
                  "text_config (list) must be an object"),
    "text-null": ({"model_type": "llama4", "text_config": None, "vision_config": LLAMA4_VISION},
                  "text_config (NoneType)"),
    "pixel-shuffle-zero": ({"model_type": "llama4", "text_config": LLAMA4_TEXT,
                            "vision_config": {**LLAMA4_VISION, "pixel_shuffle_ratio": 0}}, "size of 0"),
    "patch-size-zero": ({"model_type": "llama4", "text_config": LLAMA4_TEXT,
                         "vision_config": {**LLAMA4_VISION, "patch_size": 0}}, "size of 0"),
    "heads-zero": ({**LLAMA, "num_attention_heads": 0}, "model."),
    "layers-null": ({**LLAMA, "num_hidden_layers": None}, "model."),
    "gpt2-heads-string": ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": "four",
                           "vocab_size": 256}, "model."),
}


@pytest.mark.parametrize("case", list(HF_CONFIGS))
def test_hf_config_inputs_are_one_line(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import json

    cfg, words = HF_CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    path = tmp_path / "s.yaml"
    path.write_text("model: {hf_config: config.json}\ncluster: {gpu: h100-sxm-80g}\n")
    code, _, err = run(monkeypatch, capsys, "evaluate", str(path))
    one_line(code, err, words)


INPUTS: dict[str, tuple[dict, str]] = {
    "seed-negative": ({"search": {"seed": -1}}, "search.seed (-1)"),
    "etp-zero": ({"search": {"etp": [0]}}, "search.etp ([0])"),
    "tp-zero": ({"search": {"tp": 0}}, "search.tp (0)"),
    "batch-1e18": ({"training": {"global_batch_size": 10**18}}, "training.global_batch_size"),
    "price-nan": ({"cluster": {"price_per_gpu_hour": float("nan")}}, "cluster.price_per_gpu_hour (nan)"),
    "mtbf-inf": ({"cluster": {"node_mtbf_hours": float("inf")}}, "cluster.node_mtbf_hours (inf)"),
    "bandwidth-nan": ({"cluster": {"inter_node_gbps": float("nan")}}, "cluster.inter_node_gbps (nan)"),
    "tokens-inf": ({"training": {"training_tokens": float("inf")}}, "training.training_tokens (inf)"),
    "price-negative": ({"cluster": {"price_per_gpu_hour": -5}}, "cluster.price_per_gpu_hour (-5)"),
    "mtbf-negative": ({"cluster": {"node_mtbf_hours": -1}}, "cluster.node_mtbf_hours (-1)"),
    "bandwidth-negative": ({"cluster": {"inter_node_gbps": -10}}, "cluster.inter_node_gbps (-10)"),
    "name-escape": ({"model": {"name": "tiny\x1b[2J\x1b[31mred"}}, "control character"),
    "gpu-name-bell": ({"cluster": {"gpu": {"preset": "cpu", "name": "cpu\x07"}}}, "control character"),
}


@pytest.mark.parametrize("case", list(INPUTS))
def test_scenario_inputs_are_one_line(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    changes, words = INPUTS[case]
    path = scenario(tmp_path, **changes)
    t0 = time.monotonic()
    for command in (["evaluate", str(path)], ["capacity", str(path)]):
        code, out, err = run(monkeypatch, capsys, *command)
        line = one_line(code, err, words)
        assert "\x1b" not in out + err and "\x07" not in out + err, line
    assert time.monotonic() - t0 < 30, "no hang (the divisor search of a huge batch)"


def test_export_steps_zero_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(monkeypatch, capsys, "export", "--scenario", str(TINY), "--to", "torchrun", "--steps", "0",
                       "-o", str(tmp_path / "job"))
    one_line(code, err, "--steps (0)")
    assert list(tmp_path.iterdir()) == []


# ---- disk full (ulimit -f: EFBIG) ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["capacity-html", "export", "trace-json"])
def test_disk_full_is_one_line_and_nothing_half_written(case: str, tmp_path: Path) -> None:
    previous = tmp_path / "out.html"
    if case == "capacity-html":  # the page embeds plotly.js (MBs): over a 64 KiB file limit
        assert sub("capacity", str(H100), "-o", str(previous), cwd=tmp_path).returncode == 0
        args = ["capacity", str(H100), "-o", str(previous), "--nodes", "1,2"]
    elif case == "export":
        args = ["export", "--scenario", str(TINY), "--to", "torchrun", "-o", str(tmp_path / "job")]
    else:
        args = ["trace", str(TINY), "--plan", "dp=4", "-o", str(tmp_path / "roles.json")]
    before = snapshot(tmp_path)
    proc = sub(*args, cwd=tmp_path, limit_kib=64 if case == "capacity-html" else 1, timeout=600)
    err = [x for x in proc.stderr.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "file too large" in err[0] and "Traceback" not in proc.stderr
    assert snapshot(tmp_path) == before, "nothing half-written, no temporary file left"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 64 KiB tmpfs filled to the last byte (root: a mounted filesystem gives ENOSPC)."""
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root and mount: a small filesystem to fill (ulimit -f covers EFBIG)")
    try:
        fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("case", ["efbig", "enospc"])
def test_calibrate_on_a_full_disk_fails_before_any_run(case: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """37.6: the output directory is probed with a run record's bytes before the runs: one line, exit 2, no
    run started, nothing left (the probe removed)."""
    scn = scenario(tmp_path)
    out = (request.getfixturevalue("full_disk") if case == "enospc" else tmp_path) / "cal.yaml"
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    proc = sub("calibrate", str(scn), "-o", str(out), "--gpus", "1", cwd=tmp_path,
               limit_kib=1 if case == "efbig" else None)
    words = "file too large" if case == "efbig" else "no space left"
    one_line(proc.returncode, proc.stderr, str(out), words, "no run started")
    assert "run(s)" not in proc.stdout and time.monotonic() - t0 < 60, proc.stdout
    assert snapshot(tmp_path) == before


# ---- 28.8: nothing of ours left after a kill -------------------------------------------------------------------

def _session_processes(temp_dir: str) -> list[int]:
    from stratagem import procfs
    from stratagem.launch.runners.ray_session import SESSION_ENV

    want = temp_dir.encode()
    return [pid for pid in procfs.user_pids() if procfs.alive(pid)
            and (procfs.environ(pid) or {}).get(SESSION_ENV.encode()) == want]


@pytest.mark.timeout(600)
def test_clean_reaps_a_killed_ray_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A driver that started a local Ray session is SIGKILLed; `stratagem clean` then kills the session's
    helpers that outlived it and removes its temp dir, and leaves every other Ray session alone."""
    import signal

    code = ("import os, sys, time; from stratagem.launch.runners.ray_runner import RayRunner; "
            f"r = RayRunner(run_dir={str(tmp_path / 'runs')!r}, num_cpus=1); "
            "print(r._temp_dir, flush=True); time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    others = set(Path("/tmp").glob("stratagem-ray-*"))
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert driver.stdout is not None
        session = driver.stdout.readline().strip()
        assert session.startswith("/tmp/stratagem-ray-") and Path(session).is_dir()
        assert _session_processes(session), "the session runs processes that carry its variable"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 60
    from stratagem import procfs

    while time.monotonic() < deadline and any(procfs.comm(p) == "raylet" for p in _session_processes(session)):
        time.sleep(1)  # Ray's fate sharing takes the raylet down with its driver
    code, out, err = run(monkeypatch, capsys, "clean")
    assert code == 0, err
    assert not Path(session).exists(), out
    assert _session_processes(session) == [], out
    assert f"removed {session}" in out
    print(out)
    for d in others:  # another run's session (live or starting) is untouched unless it too was dead
        assert d.exists() or not any(_session_processes(str(d)))


def _dead_rank_dir(parent: Path) -> Path:
    """A rank work dir whose maker (a process that made it and exited) is dead: what `clean` reaps."""
    code = ("import os, sys; from stratagem.launch.runners.ray_session import RANK_PREFIX, make_owned_dir; "
            "print(make_owned_dir(f'{RANK_PREFIX}{os.getpid()}-', sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(parent)], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return Path(proc.stdout.strip())


def test_clean_reports_only_what_it_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """37.6: a dead rank dir holding a file that cannot be removed (immutable as root, in a read-only dir
    otherwise) is reported left with the reason, never removed; a link named like a rank dir (to a dead rank
    dir elsewhere) is neither followed nor reported, even when it replaces a listed dir before the removal."""
    import tempfile

    from stratagem.launch.runners.ray_session import RANK_PREFIX, Leftovers, reap

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where clean looks for rank dirs
    gone, stuck = _dead_rank_dir(temp), _dead_rank_dir(temp)
    (stuck / "sub").mkdir()
    (stuck / "sub" / "ckpt").write_text("x")
    undo = _lock(stuck / "sub")
    elsewhere = _dead_rank_dir(tmp_path)
    link = temp / f"{RANK_PREFIX}1-link"
    link.symlink_to(elsewhere, target_is_directory=True)
    try:
        code, out, err = run(monkeypatch, capsys, "clean")
        assert code == 0 and "Traceback" not in err, err
        assert f"removed {gone}" in out and not gone.exists(), out
        assert f"removed {stuck}" not in out and f"left {stuck}: " in out and stuck.is_dir(), out
        assert str(link) not in out and link.is_symlink() and elsewhere.is_dir(), "a link is never followed"
        swapped = _dead_rank_dir(temp)  # listed as a dead rank dir, then replaced by a link before the removal
        found = Leftovers(processes={}, session_dirs=[], rank_dirs=[str(swapped)])
        shutil.rmtree(swapped)
        swapped.symlink_to(tmp_path / "missing", target_is_directory=True)  # dangling: os.path.exists is False
        done = reap(found)
        assert done.rank_dirs == [] and str(swapped) in done.left and swapped.is_symlink()
    finally:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "not-utf8", "huge"])
def test_result_json_reads_are_bounded(case: str, tmp_path: Path) -> None:
    """`reproduce --result FILE` reads the harness result through the same bounded reader."""
    from stratagem.errors import StratagemError
    from stratagem.launch.harness.result import read_result

    makers = {"dev-zero": lambda t: Path("/dev/zero"), "fifo": _fifo, "not-utf8": _latin1,
              "huge": lambda t: _sparse(t, 17 << 20)}
    path = makers[case](tmp_path)
    t0 = time.monotonic()
    with pytest.raises(StratagemError, match=r"harness result \(") as e:
        read_result(path)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 5


def _sparse(t: Path, size: int) -> Path:
    with open(t / "big.json", "wb") as f:
        f.truncate(size)
    return t / "big.json"


def test_disk_full_calibrate_keeps_the_previous_calibration(tmp_path: Path) -> None:
    """The real command under `ulimit -f 2` (KiB): every run succeeds, the calibration file (4 KB) cannot be
    written: one line, the previous calibration and its runs byte-identical, no temporary file left."""
    scn = scenario(tmp_path)
    shutil.copy(CPU_CAL, tmp_path / "calibration.yaml")
    shutil.copytree(CPU_CAL.with_name(CPU_CAL.stem + "-runs"), tmp_path / "calibration-runs")
    before = snapshot(tmp_path)
    proc = sub("calibrate", str(scn), "--gpus", "1", "--steps", "1", "--warmup", "0", cwd=tmp_path, limit_kib=2,
               timeout=400)
    err = [x for x in proc.stderr.strip().splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "file too large" in err[0] and "no run started" in err[0]  # checked before any run: the file is untouched
    assert "Traceback" not in proc.stderr + proc.stdout
    assert snapshot(tmp_path) == before


def test_disk_full_report_is_one_line(tmp_path: Path) -> None:
    """A searched study reported under a 64 KiB file limit (the HTML embeds plotly.js): one line, the previous
    report byte-identical, nothing else written."""
    scn = scenario(tmp_path)
    db = f"sqlite:///{tmp_path / 'study.db'}"
    assert sub("search", str(scn), "--no-report", "--storage", db, cwd=tmp_path, timeout=300).returncode == 0
    assert sub("report", "--storage", db, "-o", str(tmp_path / "r.html"), cwd=tmp_path).returncode == 0
    before = snapshot(tmp_path)
    proc = sub("report", "--storage", db, "-o", str(tmp_path / "r.html"), cwd=tmp_path, limit_kib=64)
    one_line(proc.returncode, proc.stderr, "r.html", "file too large")
    assert snapshot(tmp_path) == before


def test_search_budget_nan_is_refused_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`search --budget-minutes nan` (which once led a real-run search to prune every plan) is one line."""
    db = tmp_path / "s.db"
    code, _, err = run(monkeypatch, capsys, "search", str(scenario(tmp_path)), "--real-runs", "1",
                       "--budget-minutes", "nan", "--storage", f"sqlite:///{db}")
    one_line(code, err, "--budget-minutes (nan)")
    assert not db.exists()


# ---- 37.2: read-only commands write nothing; a database that is not this Optuna's is never written ------------

@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real study: `search` of the tiny scenario into study.db (one search for the module)."""
    d = tmp_path_factory.mktemp("searched")
    scn = scenario(d)
    proc = sub("search", str(scn), "--no-report", "--storage", f"sqlite:///{d / 'study.db'}", cwd=d, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "study.db"


def _foreign(t: Path) -> Path:
    """Another program's database whose tables happen to be named as Optuna's."""
    import sqlite3

    db = t / "other.db"
    with sqlite3.connect(db) as con:
        con.executescript("CREATE TABLE studies (id INTEGER, title TEXT); CREATE TABLE trials (id INTEGER, x REAL);"
                          "CREATE TABLE version_info (v TEXT); INSERT INTO studies VALUES (1, 'mine');")
    con.close()
    return db


def _older(t: Path, searched: Path) -> Path:
    """An Optuna storage whose schema is an older Optuna's (its alembic revision set back)."""
    import sqlite3

    db = t / "older.db"
    shutil.copy(searched, db)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = 'v3.0.0.d'")
    con.close()
    return db


def _readers(url: str, out: Path) -> dict[str, list[str]]:
    return {"status": ["status", "--storage", url], "report": ["report", "--storage", url, "-o", str(out / "r.md")],
            "export": ["export", "--storage", url, "--to", "torchrun", "--trial", "0", "-o", str(out / "job")]}


@pytest.mark.parametrize("kind,words", [("foreign", "is an SQLite database but not an Optuna storage"),
                                        ("older", "older schema (v3.0.0.d")])
def test_a_database_not_this_optunas_is_refused_untouched(kind: str, words: str, searched: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "data"
    d.mkdir()
    db = _foreign(d) if kind == "foreign" else _older(d, searched)
    shutil.copy(TINY, d / "s.yaml")
    url = f"sqlite:///{db}"
    before = snapshot(tmp_path)
    commands = {**_readers(url, tmp_path), "search": ["search", str(d / "s.yaml"), "--no-report", "--storage", url]}
    for name, argv in commands.items():
        code, _, err = run(monkeypatch, capsys, *argv)
        one_line(code, err, str(db), words)
        assert snapshot(tmp_path) == before, f"{name} wrote something"


def test_read_only_commands_write_nothing(searched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """status, report and export read a real study through a read-only connection: the database and its
    directory stay byte-identical (Optuna's RDBStorage would create tables and stamp its version on open)."""
    d = tmp_path / "data"
    shutil.copytree(searched.parent, d)
    db = d / searched.name
    before = snapshot(d)
    for name, argv in _readers(f"sqlite:///{db}", tmp_path).items():
        code, _, err = run(monkeypatch, capsys, *argv)
        assert code == 0, (name, err)
        assert snapshot(d) == before, f"{name} changed the storage's directory"
    empty = d / "empty.db"
    empty.touch()
    code, _, err = run(monkeypatch, capsys, "status", "--storage", f"sqlite:///{empty}")
    one_line(code, err, "not an Optuna storage")
    assert empty.stat().st_size == 0


# ---- 37.3 / 37.4: a damaged journal is repaired keeping every trial's number ------------------------------------

@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real study in a journal file: `search` of the tiny scenario (one search for the module)."""
    d = tmp_path_factory.mktemp("journal")
    scn = scenario(d)
    proc = sub("search", str(scn), "--no-report", "--storage", f"journal:{d / 'study.log'}", cwd=d, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d / "study.log"


def _garble_first_trial(lines: list[bytes]) -> list[bytes]:
    """The record that created trial 0, bytes in its middle overwritten (not JSON any more)."""
    i = next(k for k, x in enumerate(lines) if x.startswith(b'{"op_code":4,'))
    return [*lines[:i], lines[i][:300] + b"\xff}{" + lines[i][330:], *lines[i + 1:]]


def _foreign_record(lines: list[bytes]) -> list[bytes]:
    """A line of valid JSON that is no Optuna operation, and one with an op_code but none of its fields."""
    return [*lines[:5], b'{"hello": "world"}', b'{"op_code": 5}', *lines[5:]]


@pytest.mark.parametrize("damage,lost", [(_garble_first_trial, 0), (_foreign_record, None)])
def test_a_damaged_journal_keeps_trial_numbers(damage: Callable[[list[bytes]], list[bytes]], lost: int | None,
                                               journal: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Reading a damaged journal is one line; the search repairs it (Optuna's replay is the judge of a record);
    afterwards every trial exports the plan it exported before, and a trial whose creating record was lost is
    one line, not another trial's plan."""
    d = tmp_path / "data"
    d.mkdir()
    log = d / "study.log"
    shutil.copy(journal, log)
    url = f"journal:{log}"

    def export(n: int, out: str) -> tuple[int, str]:
        code, _, err = run(monkeypatch, capsys, "export", "--storage", url, "--to", "torchrun", "--trial", str(n),
                           "-o", str(tmp_path / out))
        return code, err

    for n in (0, 1, 7):
        assert export(n, f"before{n}")[0] == 0
    log.write_bytes(b"\n".join(damage(log.read_bytes().split(b"\n"))))
    code, err = export(1, "during")
    one_line(code, err, "damaged record", "rerun the search")
    assert not (tmp_path / "during").exists()
    code, _, err = run(monkeypatch, capsys, "search", str(scenario(d)), "--no-report", "--storage", url)
    assert code == 0 and "Traceback" not in err, err
    assert "damaged journal record" in err
    for n in (0, 1, 7):
        code, err = export(n, f"after{n}")
        if n == lost:
            one_line(code, err, f"trial #{n}", "damaged", "choose another trial")
        else:
            assert code == 0, err
            assert snapshot(tmp_path / f"after{n}") == snapshot(tmp_path / f"before{n}"), f"trial {n} moved"


def test_unexpected_trial_data_is_one_line(searched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A trial whose stored evaluation is not one stratagem writes (a study another program added to), and a
    search state with a foreign count: one line naming the trial, or a report that says what it can."""
    import optuna

    from stratagem.search.storage import open_storage, parse_storage

    db = tmp_path / "study.db"
    shutil.copy(searched, db)
    url = f"sqlite:///{db}"
    backend = open_storage(parse_storage(url))
    study = optuna.load_study(study_name=backend.get_all_studies()[0].study_name, storage=backend)
    study.set_user_attr("search_state", {"finished": False, "planned": "many"})
    code, _, err = run(monkeypatch, capsys, "report", "--storage", url, "-o", str(tmp_path / "r.md"))
    assert code == 0 and "of ? planned" in err, err
    study.set_user_attr("search_state", {"finished": True})
    t = study.trials[3]
    study.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, values=t.values,
                                              user_attrs={"plan": 42, "evaluation": {"bogus": 1}, "fidelity": "measured",
                                                          "status": "ok", "role": "front"}))
    for argv in (["status", "--storage", url], ["report", "--storage", url, "-o", str(tmp_path / "r.md")],
                 ["export", "--storage", url, "--to", "torchrun", "-o", str(tmp_path / "job")]):
        code, _, err = run(monkeypatch, capsys, *argv)
        assert code == 2, (argv, err)
        one_line(code, err, f"trial #{len(study.trials) - 1}", "not one stratagem writes")


# ---- 37.4: the rest of the tracebacks ----------------------------------------------------------------------------

def _lock(d: Path) -> list[str]:
    """Make `d` a directory nothing can be created in: immutable as root, read-only otherwise; the undo."""
    root = os.geteuid() == 0
    subprocess.run(["chattr", "+i", str(d)] if root else ["chmod", "555", str(d)], check=True)
    return ["chattr", "-i", str(d)] if root else ["chmod", "755", str(d)]


@pytest.mark.parametrize("where", ["runs-dir", "beside-scenario"])
def test_real_runs_into_a_read_only_directory(where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    scn = scenario(locked if where == "beside-scenario" else tmp_path)
    db = tmp_path / "s.db"
    extra = ["--runs-dir", str(locked / "runs")] if where == "runs-dir" else []
    before = snapshot(tmp_path)
    undo = _lock(locked)
    try:
        code, _, err = run(monkeypatch, capsys, "search", str(scn), "--real-runs", "1", "--no-report", "--storage",
                           f"sqlite:///{db}", *extra)
    finally:
        subprocess.run(undo, check=True)
    one_line(code, err, "cannot write in", str(locked))
    assert snapshot(tmp_path) == before, "refused before the search wrote its storage"


@pytest.mark.parametrize("value", ["inf", "nan", "1e9"])
def test_status_watch_interval_is_bounded(value: str, searched: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    code, _, err = run(monkeypatch, capsys, "status", "--watch", "--interval", value, "--storage",
                       f"sqlite:///{searched}")
    one_line(code, err, "--interval")
    assert time.monotonic() - t0 < 30, "no hang"


@pytest.mark.parametrize("argv", [["evaluate", str(TINY)], ["status", "--storage", "STUDY"],
                                  ["report", "--storage", "STUDY", "-f", "csv"]])
def test_stdout_to_a_full_disk_is_one_line(argv: list[str], searched: Path, tmp_path: Path) -> None:
    args = [f"sqlite:///{searched}" if a == "STUDY" else a for a in argv]
    with open("/dev/full", "w") as full:
        code = f"from stratagem.cli import main; main({args!r})"
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    one_line(proc.returncode, proc.stderr, "standard output", "no space left")


# ---- 37.5: every numeric field bounded by what a real job can hold (spaces/bounds.py), the bound in the error --

BOUNDS: dict[str, tuple[dict, str]] = {
    "layers-1e6": ({"model": {"num_layers": 10**6}}, "model.num_layers (1000000): Input should be less than or equal to 2048"),
    "hidden-1e9": ({"model": {"hidden_size": 10**9}}, "model.hidden_size"),
    "heads-1e6": ({"model": {"num_attention_heads": 10**6}}, "less than or equal to 4096"),
    "vocab-1e12": ({"model": {"vocab_size": 10**12}}, "model.vocab_size"),
    "ffn-1e12": ({"model": {"ffn_hidden_size": 10**12}}, "model.ffn_hidden_size"),
    "nodes-1e9": ({"cluster": {"num_nodes": 10**9}}, "cluster.num_nodes"),
    "gpus-in-job": ({"cluster": {"num_nodes": 100_000, "gpus_per_node": 4000}}, "at most 1,048,576"),
    "peak-tiny": ({"cluster": {"gpu": {"preset": "cpu", "peak_tflops_bf16": 1e-300}}},
                  "cluster.gpu.peak_tflops_bf16 (1e-300): Input should be greater than or equal to 0.001"),
    "hbm-bandwidth-tiny": ({"cluster": {"gpu": {"preset": "cpu", "hbm_tbps": 1e-300}}}, "cluster.gpu.hbm_tbps"),
    "hbm-huge": ({"cluster": {"gpu": {"preset": "cpu", "hbm_gib": 1e30}}}, "cluster.gpu.hbm_gib"),
    "mtbf-tiny": ({"cluster": {"node_mtbf_hours": 1e-12}}, "cluster.node_mtbf_hours"),
    "storage-tiny": ({"cluster": {"storage_write_gbps": 1e-300}}, "cluster.storage_write_gbps"),
    "latency-huge": ({"cluster": {"inter_node_latency_us": 1e300}}, "cluster.inter_node_latency_us"),
    "tokens-1e30": ({"training": {"training_tokens": 1e30}}, "training.training_tokens"),
}


@pytest.mark.parametrize("case", list(BOUNDS))
def test_numeric_fields_are_bounded(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    changes, words = BOUNDS[case]
    path = scenario(tmp_path, **changes)
    before = snapshot(tmp_path)
    t0 = time.monotonic()
    code, _, err = run(monkeypatch, capsys, "evaluate", str(path))
    one_line(code, err, words)
    assert time.monotonic() - t0 < 30, "refused before the work, not after"
    assert snapshot(tmp_path) == before


def test_a_locked_database_says_it_is_locked(searched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Another process holds the SQLite file in an exclusive transaction: one line that says so (37.6)."""
    import sqlite3

    db = tmp_path / "study.db"
    shutil.copy(searched, db)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        code, _, err = run(monkeypatch, capsys, "status", "--storage", f"sqlite:///{db}")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    one_line(code, err, str(db), "is locked by another process")
