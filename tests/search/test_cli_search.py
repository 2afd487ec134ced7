"""`stratagem search` as a user runs it: real subprocesses, real SQLite and journal files, SIGKILL."""

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from stratagem.search import front_trials, plan_key, screen, select_plans
from stratagem.search.storage import open_storage, parse_storage
from stratagem.spaces import load_scenario

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "stratagem.cli", "search"]
ENV = {**os.environ, "COLUMNS": "160", "PYTHONUNBUFFERED": "1"}


def write_scenario(tmp_path: Path, sample: int = 60, **search) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "llama3-8b-8xh100.yaml").read_text())
    data["search"] = {"precision": ["bf16", "fp8"], "stored_sample": sample, **search}
    path = tmp_path / "scn.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def url_of(tmp_path: Path, kind: str) -> str:
    return f"sqlite:///{tmp_path}/s.db" if kind == "sqlite" else f"journal:{tmp_path}/s.log"


_seen: dict[Path, tuple[int, int]] = {}


def trial_count(tmp_path: Path, kind: str) -> int:
    """Trials written so far, read behind the writer's back (sqlite read / new journal lines)."""
    try:
        if kind == "sqlite":
            con = sqlite3.connect(f"file:{tmp_path}/s.db?mode=ro", uri=True, timeout=0.05)
            try:
                return int(con.execute("SELECT count(*) FROM trials").fetchone()[0])
            finally:
                con.close()
        log = tmp_path / "s.log"
        offset, count = _seen.get(log, (0, 0))
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # whole lines only
        count += chunk[:end].count(b'"op_code":4,')
        _seen[log] = (offset + end, count)
        return count
    except (sqlite3.Error, OSError):
        return 0


def kill_when(args: list[str], ready, deadline: float = 90) -> int:
    """Start the CLI, SIGKILL it as soon as ready() holds; returns its exit status (-9 when killed)."""
    p = subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)
    t0 = time.monotonic()
    try:
        while p.poll() is None and time.monotonic() - t0 < deadline:
            if ready(time.monotonic() - t0):
                p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.005)
    finally:
        if p.poll() is None and time.monotonic() - t0 >= deadline:
            p.kill()
        p.wait(30)
    return p.returncode


def expected(path: Path) -> tuple[list[str], set[str]]:
    """What an uninterrupted search stores: the selected plan keys in order, and the front's keys."""
    s = load_scenario(path)
    sc = screen(s)
    chosen = [plan_key(sc.plan(i)) for i, _ in select_plans(sc, s.search.stored_sample, 0)]
    return chosen, {plan_key(sc.plan(i)) for i in sc.front}


def study_of(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(parse_storage(url)))


def check_complete(url: str, name: str, chosen: list[str], front: set[str]) -> None:
    study = study_of(url, name)
    keys = [t.user_attrs["plan"] for t in study.trials]
    assert len(keys) == len(set(keys)), "a plan was stored twice"
    assert set(keys) == set(chosen), "a plan is missing"
    assert {t.user_attrs["plan"] for t in front_trials(study)} == front
    assert all(t.state.is_finished() for t in study.trials)
    assert "scenario" in study.user_attrs


def resume_after_kills(tmp_path: Path, kind: str, fractions: list[float]) -> None:
    # a journal trial costs ~2 ms, a SQLite one 15-80 ms: store enough to be killed mid-way
    path = write_scenario(tmp_path, sample=40 if kind == "sqlite" else 300)
    url = url_of(tmp_path, kind)
    args = [str(path), "--storage", url, "--study", "k"]
    total = len(expected(path)[0])
    # killed during start-up, before the study exists
    assert kill_when(args, lambda t: t > 0.1) == -signal.SIGKILL
    assert trial_count(tmp_path, kind) == 0
    # killed while storing, after a fraction of the trials
    for f in fractions:
        k = max(1, int(f * total))
        before = trial_count(tmp_path, kind)
        assert kill_when(args, lambda t, k=k: trial_count(tmp_path, kind) >= k) == -signal.SIGKILL
        after = trial_count(tmp_path, kind)
        assert before <= after < total, (before, after, total)
    # then a rerun finishes the job: same front, nothing twice, nothing missing
    done = cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    chosen, front = expected(path)  # an uninterrupted search of the same scenario
    assert out["already"] + out["stored"] == len(chosen) and out["already"] > 0
    check_complete(url, "k", chosen, front)
    # and once more: nothing left to do
    assert json.loads(cli(*args, "--json").stdout)["stored"] == 0


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_resume_after_sigkill_at_several_points(tmp_path, kind) -> None:
    resume_after_kills(tmp_path, kind, [0.05, 0.5])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_resume_after_sigkill_at_random_points(tmp_path, kind, seed) -> None:
    rng = random.Random(seed)
    resume_after_kills(tmp_path, kind, sorted(rng.uniform(0.02, 0.9) for _ in range(3)))


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_concurrent_searches_share_one_study(tmp_path, kind) -> None:
    path = write_scenario(tmp_path, sample=60)
    url = url_of(tmp_path, kind)
    procs = [subprocess.Popen([*CLI, str(path), "--storage", url, "--study", "c", "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT) for _ in range(2)]
    outs = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout))
    chosen, front = expected(path)
    assert sum(o["stored"] for o in outs) == len(chosen)  # together every plan, none twice (slices of one lock)
    assert outs[0]["front"] == outs[1]["front"]
    check_complete(url, "c", chosen, front)


def test_table_and_default_storage_beside_the_scenario(tmp_path) -> None:
    path = write_scenario(tmp_path, sample=10, tp=[1, 2], pp=1)
    r = cli(str(path), "--top", "5")
    assert r.returncode == 0, r.stderr
    assert "Pareto front" in r.stdout and "tok/s/GPU" in r.stdout and "bottleneck" in r.stdout
    assert "valid plans" in r.stdout and "pruned" in r.stdout and "optuna-dashboard sqlite:///" in r.stdout
    assert (tmp_path / "stratagem.db").exists()
    again = cli(str(path), "--json")
    assert json.loads(again.stdout)["stored"] == 0  # the default study name resumes


@pytest.mark.parametrize("case", ["missing", "yaml", "field", "search", "url", "dir", "sampler", "trials", "order"])
def test_bad_input_is_one_line_and_leaves_no_study(tmp_path, case) -> None:
    path = write_scenario(tmp_path)
    store = tmp_path / "out.db"
    args = [str(path), "--storage", f"sqlite:///{store}"]
    if case == "missing":
        args[0] = str(tmp_path / "nope.yaml")
    elif case == "yaml":
        path.write_text("model: [unclosed\n")
    elif case == "field":
        path.write_text(path.read_text().replace("global_batch_size: 64", "global_batch_size: -3"))
    elif case == "search":
        path.write_text(path.read_text().replace("stored_sample: 60", "stored_sample: 60\n  tp: 5"))
    elif case == "url":
        args[2] = "postgresqlx://nowhere/db"
    elif case == "dir":
        args[2] = f"sqlite:///{tmp_path}/no/such/dir.db"
    elif case == "sampler":
        args += ["--sampler", "grid"]
    elif case == "trials":
        args += ["--n-trials", "-4"]
    elif case == "order":
        args += ["--real-runs", "1", "--run-order", "fastest"]
    r = cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    assert not store.exists()


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """`stratagem ARGS` in this process through the entry point: (exit status, stdout, stderr)."""
    from stratagem.cli import main

    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write (root writes anywhere: /proc/sys is a read-only mount here)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):
        ro = Path("/proc/sys")
    if os.access(ro, os.W_OK):
        pytest.skip("no read-only directory for this user on this machine")
    return ro


@pytest.mark.parametrize("case", ["real-runs", "top", "steps", "budget", "report-dir", "report-ro", "report-md",
                                  "journal", "sqlite", "postgres-driver", "storage-ro", "usage"])
def test_every_option_and_storage_is_checked_before_any_work(tmp_path, capsys, monkeypatch, case) -> None:
    """Issue 12 items 1, 2, 4, 5, 6: one line, exit 2, within a second (no screening, no Ray), nothing written."""
    path = write_scenario(tmp_path, sample=10, tp=[1, 2], pp=1)
    mine = tmp_path / "mine"
    mine.write_bytes(b"user data, not a storage\n")
    db = tmp_path / "users.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE users (name TEXT)")
    con.close()
    originals = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    args = {
        "real-runs": ["--real-runs", "-1"], "top": ["--top", "-5"], "steps": ["--real-runs", "1", "--steps", "0"],
        "budget": ["--real-runs", "1", "--budget-minutes", "0"],
        "report-dir": ["--report", str(tmp_path / "missing" / "r.html")],
        "report-ro": ["--report", str(read_only_dir(tmp_path) / "r.html")] if case == "report-ro" else [],
        "report-md": ["--report", str(tmp_path / "r.md")],
        "journal": ["--storage", f"journal:{mine}"], "sqlite": ["--storage", f"sqlite:///{db}"],
        "postgres-driver": ["--storage", "postgresql://u:p@127.0.0.1:1/x", "--real-runs", "2"],
        "storage-ro": ["--storage", f"sqlite:///{read_only_dir(tmp_path)}/s.db"] if case == "storage-ro" else [],
        "usage": ["--top", "many"],
    }[case]
    words = {"real-runs": "--real-runs", "top": "--top", "steps": "--steps", "budget": "--budget-minutes",
             "report-dir": "does not exist", "report-ro": "cannot write in", "report-md": "name it .html",
             "journal": "is not an Optuna journal", "sqlite": "is an SQLite database but not an Optuna storage",
             "postgres-driver": "stratagem[postgres]", "storage-ro": "not writable", "usage": "--top"}[case]
    monkeypatch.setitem(sys.modules, "psycopg", None)  # the driver is missing, installed or not
    t0 = time.monotonic()
    code, out, err = run_main(capsys, "search", str(path), *args)
    assert time.monotonic() - t0 < 5, "checked after work started"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], err
    assert out == "" and "Traceback" not in err
    # nothing written: no storage, lock, runs/ folder or report; the user's files byte-identical
    left = {p.name for p in tmp_path.iterdir()} - {"ro"}
    assert left == {"scn.yaml", *originals}, left
    assert all((tmp_path / n).read_bytes() == b for n, b in originals.items())


def test_report_and_export_on_an_interrupted_study_say_so(tmp_path, capsys) -> None:
    """Issue 12 item 8: a search killed while storing: report and export still work and say it did not finish;
    the rerun completes it and the notice goes."""
    path = write_scenario(tmp_path, sample=300)
    url = url_of(tmp_path, "journal")
    total = len(expected(path)[0])
    args = [str(path), "--storage", url, "--study", "k", "--no-report"]
    assert kill_when(args, lambda t: trial_count(tmp_path, "journal") >= total // 3) == -signal.SIGKILL
    stored = len(study_of(url, "k").trials)
    assert 0 < stored < total
    note = f"note: the search of this study did not finish: {stored} of {total} planned screened plans stored; " \
           "rerun the search to complete it"
    code, out, err = run_main(capsys, "report", "--storage", url, "-o", str(tmp_path / "r.md"))
    assert code == 0 and note in err and (tmp_path / "r.md").stat().st_size > 0, err
    code, out, err = run_main(capsys, "export", "--storage", url, "--to", "torchrun")
    assert code == 0 and note in err and "torchrun" in out, err
    assert cli(*args).returncode == 0
    code, out, err = run_main(capsys, "report", "--storage", url, "-o", str(tmp_path / "r.md"))
    assert code == 0 and "did not finish" not in err


def test_printed_commands_are_shell_quoted_and_counts_add_up(tmp_path) -> None:
    """Issue 12 items 9 and 12: a study named `a;touch X` is printed safely (pasting the hint runs nothing
    else), and the trial counts say what every trial is."""
    import shlex

    path = write_scenario(tmp_path, sample=10, tp=[1, 2], pp=1)
    weird = tmp_path / "my dir"
    weird.mkdir()
    name = "a;touch X"
    r = cli(str(path), "--storage", f"journal:{weird}/s.log", "--study", name, "--no-report")
    assert r.returncode == 0, r.stderr
    hint = next(ln for ln in r.stdout.splitlines() if ln.startswith("report:"))
    argv = shlex.split(hint.removeprefix("report:"))
    assert argv == ["stratagem", "report", "--storage", f"journal:{weird}/s.log", "--study", name]
    watch = next(ln for ln in r.stdout.splitlines() if ln.startswith("watch it:"))
    assert shlex.split(watch.removeprefix("watch it:")) == ["optuna-dashboard", f"{weird}/s.log"]
    counts = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"study {name!r}"))
    study = study_of(f"journal:{weird}/s.log", name)
    total = len(study.trials)
    assert f"{total} in all: {total} screened plans" in counts, counts
    # a study holding other kinds of trials: each is named and the parts add up to the whole
    from stratagem.search.counts import trial_kinds

    t = study.trials[0]
    study.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, values=t.values,
                                              user_attrs={**t.user_attrs, "role": "recalibrated"}))
    study.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, values=t.values,
                                              user_attrs={**t.user_attrs, "fidelity": "measured"}))
    again = cli(str(path), "--storage", f"journal:{weird}/s.log", "--study", name, "--no-report", "--json")
    kinds = json.loads(again.stdout)["kinds"]
    assert kinds == trial_kinds(study_of(f"journal:{weird}/s.log", name).trials)
    assert kinds == {"screened": total, "measured": 1, "recalibrated": 1}
    assert sum(kinds.values()) == json.loads(again.stdout)["trials"] == total + 2
    assert not (ROOT / "X").exists() and not (tmp_path / "X").exists()


def test_search_and_report_default_to_the_same_storage(tmp_path, capsys, monkeypatch) -> None:
    """Issue 12 item 12: `search SCENARIO` then `report SCENARIO` (any working directory) find one study."""
    path = write_scenario(tmp_path, sample=10, tp=[1, 2], pp=1)
    monkeypatch.chdir(ROOT)
    code, out, err = run_main(capsys, "search", str(path), "--json", "--no-report")
    assert code == 0, err
    searched = json.loads(out)
    assert searched["storage"] == f"sqlite:///{tmp_path}/stratagem.db"
    code, out, err = run_main(capsys, "report", str(path), "-f", "json")
    assert code == 0, err
    assert json.loads(out)["study"] == searched["study"]


def test_the_demo_shows_the_mission() -> None:
    """Issue 12 item 14: in examples/demo-cpu.yaml memory is the constraint: the analytic model (from the demo's
    fitted CPU calibration) prunes part of the space, the first real runs include plans predicted near the
    per-worker limit, and the front trades throughput against headroom."""
    import numpy as np

    from stratagem.evaluators.calibration_file import resolve_calibration
    from stratagem.search.run_order import rank_candidates

    scn = load_scenario(ROOT / "examples" / "demo-cpu.yaml")
    cal, label = resolve_calibration(scn, None)
    assert cal is not None and "demo-cpu-calibration.yaml" in label
    sc = screen(scn, cal)
    c = sc.counts
    assert 0.1 * c.valid < c.pruned < 0.5 * c.valid, c  # memory prunes part of the space, not all of it
    first = rank_candidates(sc, set(), 6)  # what `make demo` (--real-runs 6) runs first
    cap = scn.cluster.gpu.hbm_gib
    keys = {plan_key(sc.plan(i)): i for i in range(len(sc.plans))}
    heads = [float(sc.columns.headroom_gib[keys[plan_key(p)]]) for p, _ in first]
    assert min(abs(h) for h in heads) < 0.15 * cap, heads  # a run near the limit
    front = sc.columns.objectives(("tokens_per_s", "headroom_gib", "goodput_loss"))[sc.front]
    for k in range(2):  # throughput and headroom trade off along the front
        assert np.ptp(front[:, k]) > 0.3 * np.abs(front[:, k]).max()
    # the checkpoint objective splits ties only: every plan writes the same state, only the async staging
    # stall of each rank's shard differs (evaluators/checkpoint.py)
    assert np.ptp(front[:, 2]) > 0


def test_a_real_run_search_opens_its_storage_once(tmp_path, monkeypatch) -> None:
    """Issue 11 item 1 / issue 23 item 1: screening, the real-run loop, the run table and the report share one
    open study (a SearchSession opens it once; nothing loads it again)."""
    from standin import SCENARIO, KnownConstants

    from stratagem.search import session, storage
    from stratagem.spaces import Plan
    from stratagem.spaces.columns import PlanColumns

    opened: list[str] = []

    def counting(spec, **kw):
        opened.append(spec.url)
        return storage.open_storage(spec, **kw)

    monkeypatch.setattr(session, "open_storage", counting)
    loads: list[str] = []
    real_load = optuna.load_study
    monkeypatch.setattr(optuna, "load_study", lambda **kw: loads.append(kw["study_name"]) or real_load(**kw))
    url = f"sqlite:///{tmp_path / 's.db'}"
    from sessions import run_multifidelity

    mf = run_multifidelity(load_scenario(SCENARIO), url, "once", KnownConstants(), real_runs=1,
                           candidates=PlanColumns.from_plans([Plan(dp=4)]))
    assert mf.measured == 1 and opened == [url] and loads == []
    assert mf.search.study is not None and mf.search.study.study_name == "once"


RAY_SCENARIO = {
    "model": {"name": "oom-test", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
              "ffn_hidden_size": 128, "vocab_size": 256},
    "cluster": {"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 4},
    "training": {"seq_len": 32, "global_batch_size": 8, "stack": "torch"},
    "search": {"pp": 1, "tp": 1, "precision": "fp32", "memory_margin_gib": 0.0},
}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_oom_only_real_run_search_exits_0(tmp_path) -> None:
    """Issue 22 item 6 / 27 item 7, through Ray and the CLI: the one real run ends OOM (the harness's memory cap
    set below the plan's peak by the private fault hook): exit 0, the run is a result, and its batch line says
    there was no step time to fit rather than "step-time error 0% -> 0%"."""
    from stratagem.search.run_order import rank_candidates
    from stratagem.spaces import scenario_from_dict

    path = tmp_path / "oom.yaml"
    path.write_text(yaml.safe_dump(RAY_SCENARIO))
    scn = scenario_from_dict(RAY_SCENARIO)
    first = rank_candidates(screen(scn), set(), 1)[0][0]
    env = {**ENV, "STRATAGEM_FAULTS": json.dumps({plan_key(first): "cap=1e-6"})}
    res = subprocess.run([*CLI, str(path), "--real-runs", "1", "--no-report", "--steps", "2"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=540)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert f"measured 1/1: {first.short()} oom" in out and "0% -> 0%" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_resumed_real_run_search_measures_k_more_plans(tmp_path) -> None:
    """Issue 34 item 6, through Ray and the CLI: a second `search --real-runs 1` measures one more plan and says
    so ("measured 2/2", not "measured 2/1" with nothing run); the plan re-measured in the first call keeps its
    trial number in the run table and in status, which reports run time as the sum of the runs' durations."""
    import re

    path = tmp_path / "resume.yaml"
    path.write_text(yaml.safe_dump(RAY_SCENARIO))
    common = [str(path), "--no-report", "--steps", "6", "--storage", f"sqlite:///{tmp_path / 'r.db'}", "--study", "r"]
    first = subprocess.run([*CLI, *common, "--real-runs", "1", "--remeasure", "1"], capture_output=True, text=True,
                           env=ENV, cwd=ROOT, timeout=400)
    out1 = first.stdout + first.stderr
    assert first.returncode == 0, out1[-3000:]
    best = re.search(r"best measured: trial (\d+): ", subprocess.run(
        [sys.executable, "-m", "stratagem.cli", "status", "--storage", f"sqlite:///{tmp_path / 'r.db'}", "--study",
         "r"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120).stdout)
    assert best is not None, out1[-3000:]
    second = subprocess.run([*CLI, *common, "--real-runs", "1", "--remeasure", "0"], capture_output=True, text=True,
                            env=ENV, cwd=ROOT, timeout=400)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-3000:]
    assert "real runs: 1 more plan(s) (--real-runs 1): the study holds 1 measured plan(s), its target is now 2" in out2
    assert "measured 2/2: " in out2, out2[-3000:]
    table = out2[out2.index("Real runs: 2 plans"):]
    assert re.search(rf"^\s*{best.group(1)}\s", table, re.M), table  # the re-measured plan kept its number
    status = subprocess.run([sys.executable, "-m", "stratagem.cli", "status", "--storage",
                             f"sqlite:///{tmp_path / 'r.db'}", "--study", "r"], capture_output=True, text=True,
                            env=ENV, cwd=ROOT, timeout=120).stdout
    assert "2 of 2 done (the last call's --real-runs 1" in status and "(the sum of 3 runs' durations)" in status, status
