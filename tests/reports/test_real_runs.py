"""The report's "Real runs" section (issue 26 item 1): every measured run with its predictions, the calibration's
refits and the plans the runs left out, in Markdown and HTML; a measured plan's card shows its measured step."""

from __future__ import annotations

import re
from typing import Any

import optuna
import pytest
from report_studies import add, full_evaluation, new_study, plan, scenario

from stratagem.evaluators import evaluate
from stratagem.evaluators.calibration import default_calibration
from stratagem.evaluators.evaluation import Evaluation, MemoryBreakdown, Throughput
from stratagem.evaluators.spread import spread_of_samples
from stratagem.quantities import duration_unit, sig
from stratagem.reports import pareto_info, render_html, render_markdown
from stratagem.reports.html import decode_payload
from stratagem.reports.runs import real_runs
from stratagem.search.calibrate import CalibrationStep

TOKENS = 8192 * 64
IN_FORCE = default_calibration("h100-sxm-80g").model_copy(update={"matmul_efficiency": 0.45})
"""The refit a study adopted: slower matmuls than the defaults the runs were predicted with."""
STEPS = [0.52, 0.50, 0.51, 0.55, 0.49, 0.50, 0.53, 0.51]


def measured(p: Any, prediction: Evaluation, *, status: str = "ok", reason: str = "") -> Evaluation:
    """A measured evaluation as the real-run evaluator stores it (launch/runners/real.py measured_evaluation):
    no time breakdown, the median step and its spread in `measurements`."""
    if status != "ok":
        return Evaluation(plan=p, status=status, reason=reason, fidelity="measured",  # type: ignore[arg-type]
                          prediction=prediction)
    spread = spread_of_samples(STEPS)
    step = spread.median_s
    peak = 61.0
    memory = MemoryBreakdown(weights_gib=10, gradients_gib=10, optimizer_gib=20, activations_gib=21,
                             transient_gib=0, overhead_gib=0, peak_gib=peak, hbm_gib=79.6, headroom_gib=79.6 - peak,
                             first_block_to_break=None, worst_stage=0)
    return Evaluation(
        plan=p, status="ok", fidelity="measured", memory=memory,
        throughput=Throughput(tokens_per_s=TOKENS / step, tokens_per_s_per_gpu=TOKENS / step / 8, mfu=0.3),
        checkpoint=prediction.checkpoint, zones=prediction.zones, prediction=prediction,
        measurements={"step_s": step, "step_spread": spread.model_dump(), "step_times_s": STEPS,
                      "tokens_per_step": TOKENS, "tokens_per_s": TOKENS / step})


def runs_study() -> optuna.Study:
    """Four plans predicted; three measured (ok, oom, failed); the ok plan re-predicted after a refit."""
    study = new_study(scenario())
    ok_plan, oom_plan, bad_plan = plan(zero_stage=3), plan(zero_stage=0), plan(zero_stage=1)
    preds = {}
    for p, tps in ((ok_plan, 1_200_000), (oom_plan, 1_500_000), (bad_plan, 1_300_000), (plan(zero_stage=2), 900_000)):
        preds[p] = full_evaluation(p, tps=tps, headroom=20.0, loss=0.01)
        add(study, preds[p])
    add(study, measured(ok_plan, preds[ok_plan]))
    add(study, measured(oom_plan, preds[oom_plan], status="oom", reason="peak 81.2 GiB over 79.6 GiB HBM"))
    add(study, measured(bad_plan, preds[bad_plan], status="failed", reason="rank 3 exited 1: gloo timeout"))
    # a later calibration re-predicts the stored plans (role "recalibrated"); the report re-predicts every run
    # with the calibration in force itself (a measured plan gets no recalibrated trial)
    add(study, full_evaluation(ok_plan, tps=1_010_000, headroom=18.0, loss=0.01))
    study.set_user_attr("calibration", IN_FORCE.model_dump(mode="json"))
    study.set_user_attr("calibration_history", [
        CalibrationStep(measured=3, runs_used=1, step_error_before=0.35, step_error_after=0.02,
                        memory_error_before=0.3, memory_error_after=0.05, adopted=True, calibration_id="c-1a2b",
                        ooms=1, step_error_held_out=0.04).model_dump(mode="json"),
        CalibrationStep(measured=3, runs_used=1, step_error_before=0.02, step_error_after=0.03,
                        memory_error_before=0.05, memory_error_after=0.05, adopted=False,
                        note="refit predicts held-out runs worse").model_dump(mode="json"),
    ])
    study.set_user_attr("not_run", {"harness": {"count": 2, "example": "dp2 pp4 zb"}})
    return study


@pytest.fixture(scope="module")
def info():
    return pareto_info(runs_study())


def test_every_measured_run_is_listed_with_its_predictions(info) -> None:
    runs = {r.status: r for r in real_runs(info)}
    assert set(runs) == {"ok", "oom", "failed"}
    ok = runs["ok"]
    spread = spread_of_samples(STEPS)
    assert ok.step_s.measured == pytest.approx(spread.median_s)
    assert ok.step_s.before == pytest.approx(TOKENS / 1_200_000)  # the prediction it ran on
    # re-predicted with the calibration in force (the adopted refit), every run, oom and failed ones included
    for r in runs.values():
        now = evaluate(info.scenario, info.plans[r.plan_index].plan, IN_FORCE)
        assert r.step_s.after == pytest.approx(now.time.step_s) and r.peak_gib.after == pytest.approx(now.memory.peak_gib)
    assert ok.step_s.after != pytest.approx(ok.step_s.before)
    assert ok.step_s.error("after") == pytest.approx((ok.step_s.after - ok.step_s.measured) / ok.step_s.measured)
    assert ok.spread is not None and ok.spread.n == len(STEPS)
    assert ok.peak_gib.measured == pytest.approx(61.0)
    assert runs["oom"].step_s.measured is None and runs["oom"].step_s.before is not None


def test_markdown_real_runs_section(info) -> None:
    md = render_markdown(info)
    section = md.split("## Real runs", 1)[1]
    assert "3 real runs of 3 plans: 1 failed, 1 ok, 1 oom." in section
    assert "gloo timeout" in section and "peak 81.2 GiB over 79.6 GiB HBM" in section
    spread = spread_of_samples(STEPS)
    # the ok run: measured median in ms (one unit for the table) with its interval, predicted before and after
    ok_row = next(line for line in section.splitlines() if "| ok |" in line)
    after = evaluate(info.scenario, plan(zero_stage=3), IN_FORCE).time.step_s
    unit = duration_unit(*(x for r in real_runs(info) for x in (r.step_s.before, r.step_s.after, r.step_s.measured)))
    ms = 1.0 / unit[1]  # one unit for the whole table
    assert f"step measured ({unit[0]}, 95% interval)" in section
    assert f"{sig(spread.median_s * ms)} ({sig(spread.low_s * ms)}–{sig(spread.high_s * ms)}, n=8)" in ok_row
    assert f"| {sig(TOKENS / 1_200_000 * ms)} | {sig(after * ms)} |" in ok_row
    # refits: before -> after, adopted or not, and why not
    assert "35.0% → 2.00%" in section and "| yes |" in section and "| no |" in section
    assert "refit predicts held-out runs worse" in section
    assert "not runnable by the harness: 2 plan(s), e.g. dp2 pp4 zb" in section


def test_html_real_runs_section_and_payload(info) -> None:
    page = render_html(info)
    assert 'id="runs-table"' in page and 'id="history-table"' in page and 'id="parity-plot"' in page
    data = decode_payload(re.search(r'id="stratagem-data">([^<]+)<', page).group(1))  # type: ignore[union-attr]
    runs = data["runs"]
    assert sorted(runs["status"]) == ["failed", "ok", "oom"]
    k = runs["status"].index("ok")
    assert runs["measured"][k] == pytest.approx(spread_of_samples(STEPS).median_s)
    assert runs["n"][k] == len(STEPS)


def test_without_an_adopted_refit_nothing_is_re_predicted() -> None:
    """The calibration stored but no refit adopted: the starting calibration stands, no re-predicted column."""
    study = runs_study()
    study.set_user_attr("calibration_history", [
        CalibrationStep(measured=3, runs_used=1, step_error_before=0.3, step_error_after=0.3, memory_error_before=0.3,
                        memory_error_after=0.3, adopted=False, note="refit predicts held-out runs worse"
                        ).model_dump(mode="json")])
    assert all(r.step_s.after is None for r in real_runs(pareto_info(study)))


def test_no_runs_says_so() -> None:
    study = new_study(scenario())
    add(study, full_evaluation(plan(zero_stage=1), tps=100_000, headroom=10.0, loss=0.01))
    md = render_markdown(pareto_info(study))
    assert "No real runs in this study" in md.split("## Real runs", 1)[1]
