"""The report's headline "highest tokens/s" is risk-aware (issue 34 items 1 and 4), read through the real CLI."""

from __future__ import annotations

from report_studies import add, full_evaluation, new_study, plan, scenario
from typer.testing import CliRunner

from stratagem.cli import app
from stratagem.evaluators.analytic import evaluate_many
from stratagem.evaluators.posterior import predictive_from_figures
from stratagem.evaluators.risk_pick import GAP_Z


def _headline(md: str) -> str:
    return next(line for line in md.splitlines() if line.startswith("| highest tokens/s |"))


def _best_predicted(storage: str, study: str = "test") -> str:
    """`status`'s "best predicted:" line (the same rules as the report's headline: search.headline)."""
    res = CliRunner().invoke(app, ["status", "--storage", storage, "--study", study], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    return " ".join(next(x for x in res.stdout.split("\n\n") if "best predicted:" in x).split())


def _report(storage: str) -> str:
    res = CliRunner().invoke(app, ["report", "--storage", storage, "--study", "test", "-f", "md"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.stdout


def test_an_unmeasured_plan_in_the_bad_hbm_zone_where_a_run_oomed_is_not_the_headline(tmp_path) -> None:
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = new_study(scenario(), storage)
    fast = plan(zero_stage=0, micro_batch_size=4)
    add(study, full_evaluation(fast, tps=150_000, headroom=2.0, loss=0.01))  # predicted bad (2.5 % of HBM)
    oomed = plan(zero_stage=0, micro_batch_size=2)
    predicted = full_evaluation(oomed, tps=140_000, headroom=3.0, loss=0.01)  # predicted bad too ...
    add(study, predicted)
    add(study, full_evaluation(oomed, tps=140_000, headroom=-1.0, loss=0.01, status="oom", fidelity="measured",
                               prediction=predicted))  # ... and a real run ran out of memory
    safe = plan(zero_stage=1)
    add(study, full_evaluation(safe, tps=100_000, headroom=20.0, loss=0.01))
    md = _report(storage)
    assert f"`{safe.short()}`" in _headline(md) and fast.short() not in _headline(md)
    assert "1 unmeasured plan(s) left out: an unmeasured plan predicted in the HBM zone's bad level" in md
    status = _best_predicted(storage)
    assert f"best predicted: {safe.short()} (" in status and "1 unmeasured plan(s) left out" in status, status


def test_a_plan_in_a_bad_zone_loses_to_one_within_the_models_noise(tmp_path) -> None:
    scn = scenario()
    risky, safe = plan(zero_stage=1), plan(zero_stage=1, activation_checkpointing="selective")
    figs = evaluate_many(scn, [risky, safe])
    pred = predictive_from_figures(scn, figs).log_tokens
    d = pred.shares[1] - pred.shares[0]
    noise = GAP_Z * float((d @ pred.cov @ d) ** 0.5)  # the model's 95 % band on the gap between the two
    assert noise > 0.002, noise
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = new_study(scn, storage)
    add(study, full_evaluation(risky, tps=100_000, headroom=3.0, loss=0.01))  # hbm bad
    add(study, full_evaluation(safe, tps=100_000 * (1 - noise / 4), headroom=20.0, loss=0.01))
    md = _report(storage)
    assert f"`{safe.short()}`" in _headline(md), _headline(md)
    assert f"chosen over {risky.short()} (hbm bad)" in md and "risk-aware pick" in md
    status = _best_predicted(storage)
    assert f"best predicted: {safe.short()} (" in status and f"chosen over {risky.short()} (hbm bad)" in status, status
    # outside the noise the faster plan stays, and the report says it was kept although bad
    study2 = new_study(scn, storage, name="far")
    add(study2, full_evaluation(risky, tps=100_000, headroom=3.0, loss=0.01))
    add(study2, full_evaluation(safe, tps=100_000 * (1 - 3 * noise), headroom=20.0, loss=0.01))
    res = CliRunner().invoke(app, ["report", "--storage", storage, "--study", "far", "-f", "md"])
    assert res.exit_code == 0, res.output
    assert f"`{risky.short()}`" in _headline(res.stdout) and "kept although hbm bad" in res.stdout


def test_export_best_tokens_is_risk_aware(tmp_path) -> None:
    """Issue 34 item 1: `export --best tokens` over analytic trials applies the same rule as capacity and the
    report: the plan in the bad HBM zone loses to the plan within the model's noise that is not."""
    scn = scenario()
    risky, safe = plan(zero_stage=1), plan(zero_stage=1, activation_checkpointing="selective")
    figs = evaluate_many(scn, [risky, safe])
    pred = predictive_from_figures(scn, figs).log_tokens
    d = pred.shares[1] - pred.shares[0]
    noise = GAP_Z * float((d @ pred.cov @ d) ** 0.5)
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = new_study(scn, storage)
    add(study, full_evaluation(risky, tps=100_000, headroom=3.0, loss=0.01))
    add(study, full_evaluation(safe, tps=100_000 * (1 - noise / 4), headroom=20.0, loss=0.01))
    res = CliRunner().invoke(app, ["export", "--storage", storage, "--study", "test", "--best", "tokens", "--to",
                                   "torchrun", "-o", str(tmp_path / "out")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "trial #1" in text and f"chosen over {risky.short()} (hbm bad)" in text, text
