"""The tiny MoE example searched with real runs (Ray local cluster): at least one expert-parallel plan measured,
and none skipped: the torch stack's space holds only plans the harness runs (spaces/stacks.py PlanExclusion,
issue 24). Slow: about 3.5 min on a shared 2-core machine (Ray start, screening,
two 4-rank real runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tiny_moe_search_measures_expert_parallel_plans(tmp_path: Path) -> None:
    import optuna

    from stratagem.search.run_order import measured_trials
    from stratagem.spaces import parse_plan

    url = f"sqlite:///{tmp_path / 's.db'}"
    scenario = shutil.copy(ROOT / "examples" / "tiny-moe-cpu.yaml", tmp_path)  # run logs go beside it, not in the repo
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [sys.executable, "-m", "stratagem.cli", "search", str(scenario), "--real-runs",
         "2", "--remeasure", "0", "--steps", "3", "--max-runs", "60", "--storage", url, "--no-report"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipped" not in out.stdout, out.stdout[-3000:]  # "skipped N plan(s) the harness cannot run, e.g. ..."
    (name,) = optuna.get_all_study_names(url)
    study = optuna.load_study(study_name=name, storage=url)
    plans = [parse_plan(t.user_attrs["plan"]) for t in measured_trials(study).values()
             if t.state == optuna.trial.TrialState.COMPLETE]
    assert any(p.ep > 1 for p in plans), plans
