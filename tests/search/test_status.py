"""`stratagem status`: the counts an on-call person reads, from a study a stand-in real-run search wrote.

Nothing here depends on which plans the search runs first (that follows the predictions, which move with the
device's default calibration and the ranking rules): every candidate's first run is an infra failure, so each
measured plan stands beside exactly one released run, and the plan this test claims is one the search left."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from standin import SCENARIO, KnownConstants
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.search.claims import claim
from stratagem.search.multifidelity import measured_trials, run_multifidelity
from stratagem.search.records import plan_key
from stratagem.search.status import study_status
from stratagem.search.storage import open_storage, parse_storage
from stratagem.spaces import Plan, SearchSpace, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = [Plan(dp=4), Plan(dp=2, tp=2), Plan(dp=2, pp=2), Plan(dp=4, micro_batch_size=2)]


def test_status_counts_measured_claimed_infra_and_budget(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 's.db'}"
    run_multifidelity(scn, url, "s", KnownConstants(infra={p.short() for p in PLANS}), real_runs=2, budget_minutes=30,
                      candidates=PlanColumns.from_plans(PLANS))
    backend = open_storage(parse_storage(url))
    study = optuna.load_study(study_name="s", storage=backend)
    left = [p for p in PLANS if plan_key(p) not in measured_trials(study)]
    claim(backend, study, SearchSpace(scn), left[0], "front")  # a worker (this process) measuring a plan left
    s = study_status(study)
    assert s.measured == {"ok": 2} and s.claimed == 1 and s.infra == 2 and s.expired == 0  # each plan failed once
    assert len(s.workers) == 1 and s.workers[0].endswith(f":{__import__('os').getpid()}")
    assert s.best_measured and "tok/s" in s.best_measured and s.best_predicted
    assert s.analytic > 0 and len(s.calibration_trend) >= 1
    assert s.elapsed_s is not None and 0 < s.budget_left_s <= 30 * 60
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["measured"] == {"ok": 2}
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "s"])
    assert res.exit_code == 0 and f"1 running (claimed); {s.infra} infra failure(s)" in res.output, res.output
    res = CliRunner().invoke(app, ["status", "--storage", url, "--study", "nope"])
    assert res.exit_code != 0
