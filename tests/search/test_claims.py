"""Claims (search/claims.py): a lost run (released or expired) leaves its plan `orphaned` until it is measured or
claimed again; oldest loss first, with the role the search gave it."""

from __future__ import annotations

from pathlib import Path

import optuna
from standin import SCENARIO

from stratagem.search.claims import claim, expire_claims, finish, orphaned, release
from stratagem.search.records import DIRECTIONS, plan_key
from stratagem.search.storage import open_storage, parse_storage
from stratagem.search.study import evaluation_trial
from stratagem.spaces import Plan, SearchSpace, load_scenario


def test_lost_runs_are_orphaned_until_measured_or_claimed(tmp_path: Path) -> None:
    from stratagem.evaluators import evaluate

    scn = load_scenario(SCENARIO)
    space = SearchSpace(scn)
    backend = open_storage(parse_storage(f"sqlite:///{tmp_path / 'c.db'}"))
    study = optuna.create_study(storage=backend, study_name="c", directions=list(DIRECTIONS))
    a, b, c = Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2)
    claim(backend, study, space, a, "front")
    cb = claim(backend, study, space, b, "boundary")
    claim(backend, study, space, c, "candidate")
    release(backend, cb, "infra: ActorDiedError")
    assert orphaned(study) == [(b, "boundary")]
    assert expire_claims(study, backend, now=1e12) == 2  # a and c: not renewed
    assert orphaned(study) == [(a, "front"), (b, "boundary"), (c, "candidate")]
    again = claim(backend, study, space, a, "front")  # another worker runs it again
    ev = evaluate(scn, c).model_copy(update={"fidelity": "measured"})
    finish(backend, claim(backend, study, space, c, "candidate"), evaluation_trial(space, ev, 100.0, "candidate", {}))
    assert orphaned(study) == [(b, "boundary")]
    release(backend, again, "stopped by signal 2")
    assert [plan_key(p) for p, _ in orphaned(study)] == [plan_key(b), plan_key(a)]  # b was lost before a's rerun


def test_a_killed_worker_not_yet_reaped_is_dead() -> None:
    """A SIGKILLed worker whose parent has not reaped it yet (a zombie) holds no claim: its plan can be taken over
    at once rather than after CLAIM_TTL_S."""
    import subprocess
    import time

    from stratagem.procfs import start_ticks
    from stratagem.search.study import worker_alive, worker_id

    child = subprocess.Popen(["sleep", "60"])
    worker = {"host": worker_id()["host"], "pid": child.pid, "started": start_ticks(child.pid)}
    assert worker_alive(worker) is True
    child.kill()
    time.sleep(0.5)  # a zombie now: killed, not reaped
    assert worker_alive(worker) is False
    child.wait()
    assert worker_alive(worker) is False
    assert worker_alive({**worker, "host": "elsewhere"}) is None  # another host: unknown


def test_a_lost_plan_runs_again_before_the_ranking_moves_on(tmp_path: Path) -> None:
    """A worker's run was lost (it died; its claim expired): the next worker measures that plan first, though the
    ranking now puts another plan ahead, so a budget of K runs never leaves a chosen plan unmeasured."""
    from sessions import run_multifidelity
    from standin import KnownConstants

    from stratagem.search.run_order import measured_trials
    from stratagem.spaces.columns import PlanColumns

    scn = load_scenario(SCENARIO)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    plans = [Plan(dp=4), Plan(dp=2, tp=2, sequence_parallel=True, zero_stage=2), Plan(dp=2, pp=2, zero_stage=2)]
    cols = PlanColumns.from_plans(plans)
    first = run_multifidelity(scn, url, "o", KnownConstants(), real_runs=1, candidates=cols, max_runs=0)
    backend = open_storage(parse_storage(url))
    study = optuna.load_study(study_name="o", storage=backend)
    top = run_multifidelity(scn, f"sqlite:///{tmp_path / 'p.db'}", "p", KnownConstants(), real_runs=1,
                            candidates=cols)  # what the ranking runs first, in a study of its own
    ranked_first = next(iter(measured_trials(optuna.load_study(study_name="p", storage=f"sqlite:///{tmp_path / 'p.db'}"))))
    lost = next(p for p in plans if plan_key(p) != ranked_first)
    claim(backend, study, SearchSpace(scn), lost, "candidate")
    assert expire_claims(study, backend, now=1e12) == 1  # its worker stopped renewing
    ran = KnownConstants()
    run_multifidelity(scn, url, "o", ran, real_runs=1, candidates=cols)
    assert [plan_key(p) for p in ran.ran] == [plan_key(lost)]
    assert list(measured_trials(optuna.load_study(study_name="o", storage=url))) == [plan_key(lost)]
    assert first.runs == 0 and top.runs == 1
