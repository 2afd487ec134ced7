"""The traced phase of a search (stratagem.search.traced) with the real tracer (stratagem.launch.trace).

  ORDER      the front first (by tokens/s), then the plans nearest the memory limit; traced plans are skipped
  TRIALS     traced trials stand beside the analytic ones and win (records.standing: traced beats analytic);
             their memory is the traced worst role + the analytic overhead; logits_bytes is refitted
  RESUME     `stratagem search --traced K` SIGKILLed after its first traced trial: the rerun loses nothing
             and traces no plan twice
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from sessions import run_traced

from stratagem.launch.trace.run import trace_plan
from stratagem.search.records import plan_key, standings, trial_fidelity
from stratagem.search.screening import screen
from stratagem.search.storage import open_storage, parse_storage
from stratagem.search.traced import TRACED_CALIBRATION, traced_order
from stratagem.spaces import SearchConfig, load_scenario

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"


def tiny():
    """tiny-cpu on 4 CPU ranks, a narrow space (dp=4, zero 0-3, mbs 1-2: 8 plans)."""
    s = load_scenario(TINY)
    cfg = SearchConfig(pp=1, cp=1, tp=1, precision=["bf16"], activation_checkpointing=["none"],
                       micro_batch_size=[1, 2], memory_margin_gib=0.0, stored_sample=2)
    return s.model_copy(update={"search": cfg, "plan": None})


def study_of(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(parse_storage(url)))


def test_order_front_first_then_nearest_the_limit() -> None:
    sc = screen(tiny())
    order = traced_order(sc, set(), 100)
    cols = sc.columns
    n_front = len(sc.front)
    assert [r for _, r in order[:n_front]] == ["front"] * n_front
    index = {plan_key(sc.plan(i)): i for i in range(len(sc.plans))}
    speeds = [cols.tokens_per_s[index[plan_key(p)]] for p, _ in order[:n_front]]
    assert speeds == sorted(speeds, reverse=True)
    assert {plan_key(p) for p, _ in order[:n_front]} == {plan_key(sc.plan(i)) for i in sc.front}
    rest = [p for p, r in order if r == "boundary"]
    gaps = [abs(cols.peak_gib[index[plan_key(p)]] - sc.usable_gib) for p in rest]
    assert gaps == sorted(gaps)
    skip = {plan_key(order[0][0])}
    assert plan_key(traced_order(sc, skip, 1)[0][0]) not in skip


def test_traced_trials_stand_beside_analytic(tmp_path: Path) -> None:
    url, name = f"sqlite:///{tmp_path}/s.db", "t"
    result = run_traced(tiny(), url, name, trace_plan, 2)
    assert result.traced == 2 and not result.skipped
    study = study_of(url, name)
    traced = [t for t in study.get_trials() if trial_fidelity(t) == "traced"]
    assert len(traced) == 2
    stand = standings(study.get_trials())
    for t in traced:
        s = stand[t.user_attrs["plan"]]
        assert s.trial.number == t.number  # traced beats the analytic trial of the same plan
        assert s.latest("analytic") is not None
        ev = t.user_attrs["evaluation"]
        roles = ev["measurements"]["traced_roles"]
        worst = max(r["peak_gib"] for r in roles)
        mem = ev["memory"]
        assert mem["peak_gib"] == pytest.approx(worst + mem["overhead_gib"])
        assert ev["prediction"]["fidelity"] == "analytic"
    assert study.user_attrs[TRACED_CALIBRATION]["logits_bytes"] == result.calibration.logits_bytes > 0


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_search_traced_resumes_after_sigkill(tmp_path: Path) -> None:
    scn = tiny()
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(scn.model_dump(mode="json", exclude_none=True)))
    url, name = f"sqlite:///{tmp_path}/s.db", "k"
    cmd = [sys.executable, "-m", "stratagem.cli", "search", str(path), "--storage", url, "--study", name,
           "--traced", "3", "--no-report"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def traced_keys() -> list[str]:
        try:
            study = study_of(url, name)
        except KeyError:  # the study does not exist yet
            return []
        return [t.user_attrs["plan"] for t in study.get_trials(deepcopy=False) if trial_fidelity(t) == "traced"]

    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    deadline = time.monotonic() + 1200
    try:
        while p.poll() is None and time.monotonic() < deadline and not traced_keys():
            time.sleep(0.2)
        assert p.poll() is None, "the search ended before it could be killed"
        p.send_signal(signal.SIGKILL)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(30)
    first = traced_keys()
    assert 1 <= len(first) < 3
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    assert done.returncode == 0, done.stderr
    keys = traced_keys()
    assert len(keys) == 3 and len(set(keys)) == 3, keys  # nothing lost, nothing traced twice
    assert keys[: len(first)] == first
