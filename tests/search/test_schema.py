"""The study schema (stratagem.search.records): every role, status and fidelity written through the one writer
(`evaluation_trial`) and read back through every reader (records.standings / front_trials, reports.pareto_info,
launch.export.choose_trial, run_order.measured_trials); they must agree on which trial stands for a plan and
whether it is feasible."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import optuna
import pytest

from stratagem.evaluators import Evaluation, evaluate
from stratagem.evaluators.evaluation import Fidelity, Status
from stratagem.launch.export import choose_trial
from stratagem.reports import pareto_info
from stratagem.search.records import (
    DIRECTIONS,
    FIDELITIES,
    ROLES,
    STATUSES,
    Role,
    front_trials,
    plan_key,
    standings,
    trial_feasible,
    trial_fidelity,
    trial_status,
)
from stratagem.search.run_order import measured_trials
from stratagem.search.study import evaluation_trial, provenance
from stratagem.spaces import Scenario, SearchSpace, parse_plan

optuna.logging.set_verbosity(optuna.logging.WARNING)

SCENARIO = Scenario(
    model="tiny-4l", cluster={"gpu": "cpu", "num_nodes": 1, "gpus_per_node": 4},
    training={"seq_len": 128, "global_batch_size": 8, "training_tokens": 1e6},
)
SPACE = SearchSpace(SCENARIO)
USABLE = SCENARIO.cluster.gpu.hbm_gib


def _ev(plan: str, fidelity: Fidelity = "analytic", status: Status = "ok", speed: float = 1.0) -> Evaluation:
    """The analytic evaluation of `plan`, relabelled (a real run or a trace of it) and scaled in tokens/s."""
    ev = evaluate(SCENARIO, parse_plan(plan))
    assert ev.status == "ok" and ev.throughput is not None
    if status == "infeasible":
        return Evaluation(plan=ev.plan, status="infeasible", reason="breaks a rule", fidelity=fidelity)
    tp = ev.throughput.model_copy(update={"tokens_per_s": ev.throughput.tokens_per_s * speed})
    return ev.model_copy(update={"fidelity": fidelity, "status": status, "throughput": tp,
                                 "reason": "" if status == "ok" else f"{status} in the run"})


# (plan, role, evaluation, usable GiB) in the order written; trial numbers are the positions.
WRITES: list[tuple[str, Role, Evaluation, float]] = [
    # A: predicted best, then its real run goes out of memory -> the measured oom stands, not feasible
    ("dp=4", "front", _ev("dp=4", speed=100.0), USABLE),                                       # 0
    ("dp=4", "front", _ev("dp=4", "measured", "oom"), USABLE),                                 # 1
    # B: a prediction, then a recalibrated one -> the latest analytic stands
    ("dp=2,tp=2,sp=true,zero=2", "sample", _ev("dp=2,tp=2,sp=true,zero=2"), USABLE),                                         # 2
    ("dp=2,tp=2,sp=true,zero=2", "recalibrated", _ev("dp=2,tp=2,sp=true,zero=2", speed=2.0), USABLE),                        # 3
    # C: predicted, traced, predicted again -> traced beats the later analytic
    ("dp=4,zero=3", "boundary", _ev("dp=4,zero=3"), USABLE),                                   # 4
    ("dp=4,zero=3", "boundary", _ev("dp=4,zero=3", "traced", speed=1.5), USABLE),              # 5
    ("dp=4,zero=3", "recalibrated", _ev("dp=4,zero=3", speed=3.0), USABLE),                    # 6
    # D: the sampler's measured plan that ran fine -> the only feasible measured plan
    ("dp=1,pp=4", "sampler", _ev("dp=1,pp=4", "measured", speed=0.5), USABLE),                 # 7
    # E: breaks a rule
    ("dp=2,pp=2,zero=2", "boundary", _ev("dp=2,pp=2,zero=2", status="infeasible"), USABLE),                  # 8
    # F: failed, then timed out -> the latest measured stands
    ("dp=2,pp=2,zero=2,ac=full", "front", _ev("dp=2,pp=2,zero=2,ac=full", "measured", "failed"), USABLE),      # 9
    ("dp=2,pp=2,zero=2,ac=full", "front", _ev("dp=2,pp=2,zero=2,ac=full", "measured", "timeout"), USABLE),     # 10
    # G: fits HBM but not the search's margin -> PRUNED, constraint > 0
    ("dp=2,tp=2,sp=true,zero=3", "candidate", _ev("dp=2,tp=2,sp=true,zero=3"), 1e-6),                                 # 11
    # D again: re-measured (search/noise.py pools its runs) -> the latest measured stands
    ("dp=1,pp=4", "remeasured", _ev("dp=1,pp=4", "measured", speed=0.6), USABLE),             # 12
]
STANDS = {"dp=4": (1, False), "dp=2,tp=2,sp=true,zero=2": (3, True), "dp=4,zero=3": (5, True), "dp=1,pp=4": (12, True),
          "dp=2,pp=2,zero=2": (8, False), "dp=2,pp=2,zero=2,ac=full": (10, False), "dp=2,tp=2,sp=true,zero=3": (11, False)}
"""plan -> (number of the trial that stands for it, feasible)."""


def key(plan: str) -> str:
    return plan_key(parse_plan(plan))


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> optuna.Study:
    url = f"sqlite:///{tmp_path_factory.mktemp('schema') / 's.db'}"
    study = optuna.create_study(storage=url, study_name="schema", directions=list(DIRECTIONS))
    study.set_user_attr("scenario", SCENARIO.model_dump(mode="json"))
    study.set_user_attr("scenario_hash", SCENARIO.problem_hash())
    prov = provenance(SCENARIO, SPACE)
    for _, role, ev, usable in WRITES:
        study.add_trial(evaluation_trial(SPACE, ev, usable, role, prov))
    return optuna.load_study(study_name="schema", storage=url)


def test_the_writes_cover_the_schema() -> None:
    assert {role for _, role, _, _ in WRITES} == set(ROLES) and "recalibrated" in ROLES
    assert {ev.status for _, _, ev, _ in WRITES} == set(STATUSES) == set(get_args(Status)) - {"infra"}
    assert {ev.fidelity for _, _, ev, _ in WRITES} == set(FIDELITIES) == {"analytic", "traced", "measured"}
    assert FIDELITIES.index("measured") > FIDELITIES.index("traced") > FIDELITIES.index("analytic")


def test_every_trial_reads_back_as_written(study: optuna.Study) -> None:
    trials = study.get_trials()
    assert len(trials) == len(WRITES)
    for t, (plan, role, ev, _) in zip(trials, WRITES, strict=True):
        assert (t.user_attrs["plan"], t.user_attrs["role"]) == (key(plan), role)
        assert (trial_fidelity(t), trial_status(t)) == (ev.fidelity, ev.status)
        assert Evaluation.model_validate(t.user_attrs["evaluation"]) == ev


def test_records_standings(study: optuna.Study) -> None:
    got = standings(study.get_trials())
    assert {k: (s.trial.number, s.feasible) for k, s in got.items()} == {key(p): v for p, v in STANDS.items()}
    assert got[key("dp=4,zero=3")].latest("analytic").number == 6  # type: ignore[union-attr]
    front = front_trials(study)
    assert front and all(trial_feasible(t) for t in front)
    assert {t.number for t in front} <= {n for n, ok in STANDS.values() if ok}
    assert 0 not in {t.number for t in front}  # the out-of-memory plan's prediction is not on the front


def test_report_reader_agrees(study: optuna.Study) -> None:
    info = pareto_info(study, advice_limit=0)
    rows = {p.key: p for p in info.plans}
    assert {k: (r.trial_number, r.feasible) for k, r in rows.items()} == {key(p): v for p, v in STANDS.items()}
    for k, r in rows.items():
        stand = WRITES[r.trial_number][2]
        assert (r.fidelity, r.status) == (stand.fidelity, stand.status), k
    # the traced plan's prediction is its latest analytic trial; the measured oom's is its prediction
    assert rows[key("dp=4,zero=3")].prediction == WRITES[6][2]
    assert rows[key("dp=4")].prediction == WRITES[0][2]
    assert {t.number: (t.fidelity, t.status) for t in info.trials} == {
        n: (ev.fidelity, ev.status) for n, (_, _, ev, _) in enumerate(WRITES)}
    assert {info.plans[i].trial_number for i in info.front} == {t.number for t in front_trials(study)}


def test_export_reader_agrees(study: optuna.Study) -> None:
    chosen = choose_trial(study, best="tokens")
    assert chosen.trial == 12 and chosen.plan == parse_plan("dp=1,pp=4")  # the one feasible measured plan (latest run)
    assert "measured" in chosen.source


def test_export_never_picks_a_superseded_prediction(tmp_path: Path) -> None:
    """Without a feasible measured plan, the best feasible standing plan wins, not the fastest prediction of
    a plan whose real run failed."""
    url = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=url, study_name="x", directions=list(DIRECTIONS))
    study.set_user_attr("scenario", SCENARIO.model_dump(mode="json"))
    prov = provenance(SCENARIO, SPACE)
    for n in (0, 1, 2):  # A predicted fastest, measured oom; B predicted
        _, role, ev, usable = WRITES[n]
        study.add_trial(evaluation_trial(SPACE, ev, usable, role, prov))
    assert choose_trial(study, best="tokens").plan == parse_plan("dp=2,tp=2,sp=true,zero=2")


def test_multifidelity_reader_agrees(study: optuna.Study) -> None:
    got = measured_trials(study)
    assert {k: t.number for k, t in got.items()} == {key("dp=4"): 1, key("dp=1,pp=4"): 12,
                                                     key("dp=2,pp=2,zero=2,ac=full"): 10}


def test_a_plan_without_trials_has_no_standing() -> None:
    from stratagem.search.records import standing

    with pytest.raises(ValueError):
        standing([])
    assert standings([]) == {}


def test_attribute_keys_are_spelled_once() -> None:
    """Study and trial attribute keys come from records.StudyKey / TrialKey: no module but records.py spells a
    key as a string literal where it reads or writes user attributes (a renamed key cannot be missed)."""
    import re

    import stratagem

    literal = re.compile(r"""attrs\[["']|attrs\.get\(["']|set_user_attr\(["']|"""
                         r"""set_trial_user_attr\([^,]+,\s*["']|["'][a-z_]+["'] (not )?in [\w.]*user_attrs""")
    package = Path(stratagem.__file__).parent
    found = [f"{p.relative_to(package)}:{n}: {line.strip()}" for p in sorted(package.rglob("*.py"))
             if p.name != "records.py" for n, line in enumerate(p.read_text().splitlines(), 1)
             if literal.search(line)]
    assert found == []
