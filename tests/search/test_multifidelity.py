"""The real-run loop (SearchSession.measure: search/measure.py + claims.py) with a stand-in measured evaluator (tests/search/
standin.py: the analytic model at known constants; the path through Ray is tests/launch/test_ray_runs.py):
candidates restrict the runs, plans the harness refuses are skipped and counted, the refit starts from a given
calibration and can be off, infra failures are retried and never stored as the plan's verdict, several worker
processes on one study measure each plan once, and a SIGKILLed worker's claim is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from sessions import run_multifidelity
from standin import SCENARIO, TRUTH, KnownConstants

from stratagem.errors import StratagemError
from stratagem.evaluators.calibration import default_calibration
from stratagem.search.claims import live_claims
from stratagem.search.records import plan_key
from stratagem.search.run_order import measured_trials
from stratagem.search.storage import open_storage, parse_storage
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.plan import format_plan

STANDIN = Path(__file__).with_name("standin.py")
ROOT = Path(__file__).resolve().parents[2]
PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(dp=4, micro_batch_size=2)]


def _study(url: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=url)


def test_candidates_restrict_runs_and_unsupported_plans_are_skipped(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    allowed = [Plan(dp=4), Plan(dp=4, zero_stage=3), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=4, micro_batch_size=2)]
    ev = KnownConstants()
    url = f"sqlite:///{tmp_path / 's.db'}"
    mf = run_multifidelity(scn, url, "mf", ev, real_runs=10, candidates=PlanColumns.from_plans(allowed))
    assert {plan_key(p) for p in ev.ran} <= {plan_key(p) for p in allowed}
    assert mf.measured == 3 and mf.runs == 3  # every allowed plan but the refused one
    assert mf.skipped == 1 and "ZeRO-3 is not in this harness" in mf.skipped_example
    st = _study(url, "mf")
    assert plan_key(Plan(dp=4, zero_stage=3)) not in measured_trials(st)
    assert st.metric_names == ["tokens_per_s", "headroom_gib", "goodput_loss"]
    from stratagem.reports import pareto_info, render_report

    info = pareto_info(st)
    assert info.not_run == (f"not runnable by the harness: 1 plan(s), e.g. {mf.skipped_example}",)
    assert info.not_run[0] in render_report(info, "md")


def test_refit_starts_from_the_given_calibration_and_can_be_off(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    plans = PlanColumns.from_plans(PLANS)
    fixed = run_multifidelity(scn, f"sqlite:///{tmp_path / 'a.db'}", "a", KnownConstants(), real_runs=2,
                              candidates=plans, initial_calibration=TRUTH, recalibrate=False)
    assert fixed.calibration == TRUTH
    assert all(h.step_error_before < 1e-6 and h.step_error_after < 1e-6 for h in fixed.history)
    off = run_multifidelity(scn, f"sqlite:///{tmp_path / 'b.db'}", "b", KnownConstants(), real_runs=2,
                            candidates=plans, recalibrate=False)
    assert off.calibration == default_calibration(scn.cluster.gpu.name)  # the device's defaults, unchanged
    assert off.history[-1].step_error_after == off.history[-1].step_error_before > 0.2  # TRUTH is elsewhere
    refit = run_multifidelity(scn, f"sqlite:///{tmp_path / 'c.db'}", "c", KnownConstants(), real_runs=4,
                              candidates=plans)
    assert any(h.adopted for h in refit.history)  # a refit earned its place (held-out error below the defaults)
    assert refit.history[-1].step_error_after < 0.5 * refit.history[0].step_error_before


def test_candidates_outside_the_space_are_a_user_error(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    with pytest.raises(StratagemError, match="outside the scenario's search space"):
        run_multifidelity(scn, f"sqlite:///{tmp_path / 'd.db'}", "d", KnownConstants(), real_runs=1,
                          candidates=PlanColumns.from_plans([Plan(dp=1, tp=4)]))
    assert not (tmp_path / "d.db").exists()  # checked before anything is written


def test_infra_failure_is_retried_not_stored_as_the_plans_verdict(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 'i.db'}"
    ev = KnownConstants(infra={Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2).short()})
    mf = run_multifidelity(scn, url, "i", ev, real_runs=4, candidates=PlanColumns.from_plans(PLANS))
    assert mf.measured == 4 and mf.statuses == {"ok": 4, "infra": 1}
    assert mf.ok_runs == 4 and mf.runs == 5 and mf.first_failure.startswith(f"{Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2).short()}: infra: ")
    st = _study(url, "i")
    mine = [t for t in st.trials if t.user_attrs.get("plan") == plan_key(Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2))
            and t.user_attrs.get("fidelity") == "measured"]
    assert sorted(t.state.name for t in mine) == ["COMPLETE", "FAIL"]
    failed = next(t for t in mine if t.state == TrialState.FAIL)
    assert failed.user_attrs["released"].startswith("infra: ActorUnavailableError")


def test_max_runs_and_timeout_bound_one_call(tmp_path: Path) -> None:
    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 'n.db'}"
    plans = PlanColumns.from_plans(PLANS)
    first = run_multifidelity(scn, url, "n", KnownConstants(), real_runs=4, candidates=plans, max_runs=1)
    assert first.runs == 1 and first.measured == 1
    timed = run_multifidelity(scn, url, "n", KnownConstants(delay_s=1.5), real_runs=4, candidates=plans,
                              timeout=1.0)
    assert timed.runs == 1 and timed.measured == 2  # one batch (4 slots, 4-rank plans: one plan) started in time


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A storage several worker processes share: an SQLite file, or a database on the throw-away PostgreSQL
    server (tests/search/conftest.py; skips saying why when it cannot start)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return str(request.getfixturevalue("fresh_postgres"))


def _worker(url: str, name: str, k: int, delay: float, plans: list[Plan]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(STANDIN), url, name, str(k), str(delay),
                             *[format_plan(p) for p in plans]], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.timeout(300)
def test_workers_on_one_study_measure_each_plan_once(shared_url: str) -> None:
    url = shared_url
    many = PLANS + [Plan(dp=1, tp=2, pp=2, sequence_parallel=True), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2, micro_batch_size=2)]
    workers = [_worker(url, "w", 5, 2.0, many) for _ in range(2)]
    outs = [w.communicate(timeout=240) for w in workers]
    for w, (_, err) in zip(workers, outs, strict=True):
        assert w.returncode == 0, err[-2000:]
    st = _study(url, "w")
    measured = [t for t in st.trials if t.user_attrs.get("fidelity") == "measured"]
    keys = [t.user_attrs["plan"] for t in measured]
    assert len(keys) == 5 == len(set(keys))  # together K, none twice
    runs = [int(out.split("runs=")[1].split()[0]) for out, _ in outs]
    assert sum(runs) == 5 and all(r > 0 for r in runs), outs  # both worked, on disjoint plans


@pytest.mark.timeout(300)
def test_a_killed_workers_claim_is_taken_over(shared_url: str) -> None:
    url = shared_url
    plans = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2)]
    open_storage(parse_storage(url))  # Optuna's tables first: the polling below must not create them racing the worker
    victim = _worker(url, "k", 1, 120.0, plans)  # claims one plan, then sleeps in its "run"
    deadline = time.monotonic() + 120
    claimed: dict = {}
    while time.monotonic() < deadline and not claimed:
        time.sleep(0.5)
        try:
            claimed = live_claims(_study(url, "k"))
        except KeyError:  # the study is not created yet
            claimed = {}
    assert claimed, victim.communicate(timeout=5)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    scn = load_scenario(SCENARIO)
    mf = run_multifidelity(scn, url, "k", KnownConstants(), real_runs=1, candidates=PlanColumns.from_plans(plans))
    assert mf.measured == 1 and mf.runs == 1
    st = _study(url, "k")
    key = next(iter(claimed))
    states = sorted(t.state.name for t in st.trials if t.user_attrs.get("plan") == key
                    and t.user_attrs.get("fidelity") == "measured")
    assert states == ["COMPLETE", "FAIL"]  # the dead claim expired, the plan was measured by the new worker
    assert not live_claims(st)


class _Role:
    """A traced rank role (launch.trace.TracedRole's fields) built from the analytic blocks, `extra_gib` added
    to its activations: a trace that disagrees with the analytic model by that much."""

    def __init__(self, scenario, plan: Plan, extra_gib: float) -> None:
        from stratagem.evaluators import evaluate

        mem = evaluate(scenario, plan).memory
        gib = {"weights": mem.weights_gib, "gradients": mem.gradients_gib, "optimizer": mem.optimizer_gib,
               "activations": mem.activations_gib + extra_gib, "rest": mem.transient_gib}
        self.role, self.blocks = "only", {k: int(v * 2**30) for k, v in gib.items()}
        self.peak_bytes = sum(self.blocks.values())

    def to_json(self) -> dict:
        return {"role": self.role, "peak_gib": self.peak_bytes / 2**30,
                "blocks_gib": {k: v / 2**30 for k, v in self.blocks.items()}}


def test_no_real_run_for_a_plan_whose_traced_memory_does_not_fit(tmp_path: Path) -> None:
    from sessions import run_traced

    scn = load_scenario(SCENARIO)
    over = Plan(dp=4, micro_batch_size=2)
    url = f"sqlite:///{tmp_path / 's.db'}"
    hbm = scn.cluster.gpu.hbm_gib

    def tracer(scenario, plan):
        return [_Role(scenario, plan, extra_gib=2 * hbm if plan_key(plan) == plan_key(over) else 0.0)]

    run_traced(scn, url, "mf", tracer, 1000)  # every plan of the space: the stand-in traces in no time
    assert plan_key(over) in {plan_key(p) for p in PLANS}
    ev = KnownConstants()
    mf = run_multifidelity(scn, url, "mf", ev, real_runs=10, candidates=PlanColumns.from_plans(PLANS))
    assert plan_key(over) not in {plan_key(p) for p in ev.ran}  # the analytic model says it fits; the trace not
    assert mf.traced_out == 1 and mf.traced_out_example.startswith(over.short() + ": traced peak")
    assert mf.runs == len(PLANS) - 1
    from stratagem.reports import pareto_info

    assert pareto_info(_study(url, "mf")).not_run == (
        f"not run: traced memory does not fit: 1 plan(s), e.g. {mf.traced_out_example}",)
