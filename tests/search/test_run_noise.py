"""Run-to-run noise (search/noise.py run_noise): estimated from the study's plans measured more than once, it
widens every measured plan's interval, decides which plans are re-measured, and K counts plans while the
re-measurements are counted apart (--remeasure). No refit here (recalibrate=False): the rule is about runs, and
the fit is the slow part."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from standin import SCENARIO, KnownConstants

from stratagem.search.noise import RunNoise, best_measured, plan_interval, run_noise, study_groups, t_975
from stratagem.search.noise_floor import pooled, read_groups
from stratagem.search.run_order import RankedOrder
from stratagem.search.session import SearchSession
from stratagem.spaces import Plan, load_scenario
from stratagem.spaces.columns import PlanColumns

PLANS = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2), Plan(tp=4, sequence_parallel=True)]


def _session(tmp_path: Path) -> SearchSession:
    s = SearchSession(load_scenario(SCENARIO), f"sqlite:///{tmp_path / 'n.db'}", "n")
    s.screen()
    s.store()
    return s


def test_t_quantiles_match_the_table() -> None:
    """NIST/SEMATECH 1.3.6.7.2: t(0.975) = 12.706 at 1 dof, 2.228 at 10, 2.042 at 30; the normal's 1.96 beyond."""
    assert t_975(1) == 12.706 and t_975(10) == 2.228 and t_975(30) == 2.042 and t_975(500) == 1.96
    with pytest.raises(ValueError):
        t_975(0)


def test_rerun_band_is_the_prediction_interval_of_one_more_run() -> None:
    noise = RunNoise(sd=0.05, dof=4, plans=2)
    assert noise.rerun_band(2) == pytest.approx(math.expm1(2.776 * 0.05 * math.sqrt(1.5)))
    assert noise.half_width(4) == pytest.approx(2.776 * 0.05 / 2)
    assert RunNoise(sd=None, dof=0, plans=0).rerun_band(1) is None
    assert "unknown" in RunNoise(sd=None, dof=0, plans=0).describe()


def test_k_counts_plans_and_re_measurements_are_apart(tmp_path: Path) -> None:
    """--real-runs 3 measures three different plans; --remeasure 2 then runs the best once more (one run cannot
    show how far a rerun moves) and one more run of a plan within its noise."""
    s = _session(tmp_path)
    mf = s.measure(3, KnownConstants(noise=0.02, run_noise=0.3, seed=3), RankedOrder(PlanColumns.from_plans(PLANS)),
                   remeasure=2, recalibrate=False)
    measured = [t for t in s.study.trials if t.user_attrs.get("fidelity") == "measured"]
    assert mf.plans == 3 and mf.remeasured == 2 and mf.measured == 5
    assert len({t.user_attrs["plan"] for t in measured}) == 3
    roles = [t.user_attrs.get("role") for t in measured]
    assert roles.count("remeasured") == 2


def test_run_noise_is_estimated_from_repeated_runs(tmp_path: Path) -> None:
    """Steps 2 % apart within a run, whole runs 30 % apart (lognormal): the within-run intervals of two runs of
    one plan do not overlap, yet the estimate of run-to-run noise is of the injected size, and the best's
    interval is widened to it."""
    s = _session(tmp_path)
    s.measure(2, KnownConstants(noise=0.02, run_noise=0.3, seed=5, steps=12),
              RankedOrder(PlanColumns.from_plans(PLANS[:2])), remeasure=4, recalibrate=False)
    noise = run_noise(s.study)
    assert noise.plans >= 1 and noise.dof >= 2 and noise.sd is not None
    assert 0.05 < noise.sd < 1.0  # injected 0.3 (few samples: only its order is testable)
    best = best_measured(s.study)
    assert best is not None and best.noise == noise and "run-to-run noise" in best.note
    assert best.spread is not None and best.runs >= 2
    run_lo = best.tokens_per_s * math.exp(-noise.half_width(best.runs))
    within_lo = best.tokens_per_s * best.spread.median_s / best.spread.high_s
    assert run_lo < within_lo  # runs 30 % apart, steps 2 % apart: the run-to-run term is the wider one
    interval = plan_interval(best.tokens_per_s, best.spread, best.runs, noise)
    assert interval is not None and np.isclose(interval[0], run_lo)


def test_without_repeats_the_noise_is_unknown_and_said(tmp_path: Path) -> None:
    s = _session(tmp_path)
    s.measure(2, KnownConstants(noise=0.02, seed=1), RankedOrder(PlanColumns.from_plans(PLANS[:2])), remeasure=0, recalibrate=False)
    assert run_noise(s.study) == RunNoise(sd=None, dof=0, plans=0)
    best = best_measured(s.study)
    assert best is not None and "run-to-run noise unknown" in best.note


def test_the_cli_default_is_the_library_default() -> None:
    """`search --remeasure` defaults to search.session.DEFAULT_REMEASURE (written as a literal there so the CLI
    does not import the search package at start)."""
    import inspect

    from stratagem.cli.search import search_cmd
    from stratagem.search.session import DEFAULT_REMEASURE

    default = inspect.signature(search_cmd).parameters["remeasure"].default
    assert default == DEFAULT_REMEASURE


def _study_at(folder: Path) -> SearchSession:
    """A study that keeps its repeated runs in the host's noise file, as the CLI's real runs do."""
    folder.mkdir(parents=True, exist_ok=True)
    s = _session(folder)
    s.host_noise = True
    return s


def test_noise_is_pooled_over_the_hosts_studies(tmp_path: Path) -> None:
    """Each study's plans measured more than once join the host's noise file; a later study's run-to-run noise
    pools them with its own (pooled variance: sum of squares about each plan's mean over sum (n_i - 1)), so its
    dof is the sum of both studies' and the best's line says over how many studies."""
    order = RankedOrder(PlanColumns.from_plans(PLANS))
    a = _study_at(tmp_path / "a")
    a.measure(3, KnownConstants(noise=0.02, run_noise=0.1, seed=3), order, remeasure=4, recalibrate=False)
    first = run_noise(a.study)
    assert first.dof >= 2 and first.studies == 1
    b = _study_at(tmp_path / "b")
    b.measure(3, KnownConstants(noise=0.02, run_noise=0.1, seed=4), RankedOrder(PlanColumns.from_plans(PLANS)),
              remeasure=4, recalibrate=False)
    own = pooled(study_groups(b.study))
    both = run_noise(b.study)
    assert both.dof == first.dof + own[1] and both.studies == 2 and both.plans == first.plans + own[2]
    groups = read_groups("cpu")  # what the file holds: both studies' groups, each plan's runs by trial
    assert {g.study for g in groups} == {g.study for g in study_groups(a.study) + study_groups(b.study)}
    squares = sum(sum((x - np.mean(list(g.runs.values()))) ** 2 for x in g.runs.values()) for g in groups)
    dof = sum(len(g.runs) - 1 for g in groups)
    assert dof == both.dof and both.sd == pytest.approx(math.sqrt(squares / dof))
    best = best_measured(b.study)
    assert best is not None and f"2 studies on this host, {both.dof} dof" in best.note
    assert run_noise(a.study) == both  # the earlier study reads the later one's runs too


RESUMED = [*PLANS[:3], Plan(dp=4, micro_batch_size=2)]
"""Four plans of the scenario's space."""


def test_real_runs_on_resume_are_k_more_plans_and_records_keep_their_numbers(tmp_path: Path) -> None:
    """`--real-runs K` on a resumed study measures K more plans (and says so); a re-measured plan keeps the
    number of its first run in the run table and status, though the re-measurement's trial holds the pooled
    figures; status reports run time as the sum of the runs' durations, the wall span apart."""
    from typer.testing import CliRunner

    from stratagem.cli import app
    from stratagem.search.events import BatchDone, Notice
    from stratagem.search.records import standings
    from stratagem.search.status import run_seconds, study_status

    s = _session(tmp_path)
    events: list[object] = []
    s.listener = events.append
    order = RankedOrder(PlanColumns.from_plans(RESUMED))
    first = s.measure(2, KnownConstants(noise=0.02, run_noise=0.3, seed=3), order, remeasure=1, recalibrate=False)
    assert (first.plans, first.target, first.remeasured) == (2, 2, 1)
    numbers = {k: st.number for k, st in standings(s.study.get_trials()).items() if st.fidelity == "measured"}
    remeasured = [st for st in standings(s.study.get_trials()).values() if st.fidelity == "measured"
                  and st.trial.number != st.number]
    assert len(remeasured) == 1  # its pooled trial stands for it, its first run's number names it
    best = best_measured(s.study)
    assert best is not None and best.number == numbers[best.key]
    events.clear()
    again = s.measure(2, KnownConstants(noise=0.02, run_noise=0.3, seed=4), RankedOrder(PlanColumns.from_plans(RESUMED)),
                      remeasure=0, recalibrate=False)
    assert (again.plans, again.target, again.runs) == (4, 4, 2)  # two more plans, not "measured 2/2" and none
    said = [e.text for e in events if isinstance(e, Notice)]
    assert any("2 more plan(s) (--real-runs 2): the study holds 2 measured plan(s), its target is now 4" in t
               for t in said), said
    assert [e.target for e in events if isinstance(e, BatchDone)] == [4] * len([e for e in events
                                                                               if isinstance(e, BatchDone)])
    now = {k: st.number for k, st in standings(s.study.get_trials()).items() if st.fidelity == "measured"}
    assert all(now[k] == n for k, n in numbers.items())  # the records kept their numbers
    status = study_status(s.study)
    run_s, runs = run_seconds(s.study.get_trials())
    assert status.run_s == run_s and status.runs == runs == 5 and status.target == 4 and status.k == 2
    spans = [(t.datetime_complete - t.datetime_start).total_seconds() for t in s.study.get_trials()
             if t.user_attrs.get("fidelity") == "measured"]
    assert run_s == pytest.approx(sum(spans))  # the stand-in records no wall_s: each run's claim-to-finish span
    res = CliRunner().invoke(app, ["status", "--storage", s.storage, "--study", "n"])
    assert res.exit_code == 0, res.output
    assert "(the sum of 5 runs' durations)" in res.output and "4 of 4 done (the last call's --real-runs 2" in \
        res.output, res.output
    assert f"best measured: trial {best_measured(s.study).number}: " in res.output  # type: ignore[union-attr]
    assert read_groups("cpu") == []  # a stand-in's runs never join the host's noise file (host_noise off)
