"""Hand-built stratagem studies for the report tests (real Optuna studies, in memory or SQLite).

`full_evaluation` makes a complete Evaluation whose parts agree with each other (memory blocks sum to the
peak, step time follows from tokens/s) so the tests can state exactly what the report must show.
"""

from __future__ import annotations

from typing import Any

import optuna

from stratagem import __version__
from stratagem.evaluators.evaluation import (
    BLOCKS,
    CheckpointRisk,
    Evaluation,
    MemoryBreakdown,
    Throughput,
    TimeBreakdown,
    Zone,
    Zones,
)
from stratagem.search.records import CONSTRAINT, DIRECTIONS, objective_values, plan_distributions, plan_params
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset

optuna.logging.set_verbosity(optuna.logging.WARNING)

SHARES = {"weights": 0.2, "gradients": 0.2, "optimizer": 0.3, "activations": 0.2, "transient": 0.05,
          "overhead": 0.05}
EVIL = "<script>alert(1)</script>"


DISTRIBUTIONS = plan_distributions()
"""One fixed distribution per Plan field (a storage refuses a parameter whose distribution changes)."""


def scenario(name: str = "llama3-8b", gpus: int = 8) -> Scenario:
    model = model_preset("llama3-8b").model_copy(update={"name": name})
    return Scenario(model=model, cluster=cluster_preset("h100-sxm-80g", gpus),
                    training={"seq_len": 8192, "global_batch_size": 64, "training_tokens": 1e12})


def plan(**kw: Any) -> Plan:
    base: dict[str, Any] = {"dp": 8}
    base.update(kw)
    return Plan(**base)


def _level(bad: bool, warn: bool) -> str:
    return "bad" if bad else "warn" if warn else "ok"


def full_evaluation(
    p: Plan, *, tps: float, headroom: float, loss: float, hbm: float = 79.6, status: str = "ok",
    fidelity: str = "analytic", prediction: Evaluation | None = None, reason: str = "", gpus: int = 8,
    tokens_per_step: int = 8192 * 64,
) -> Evaluation:
    peak = hbm - headroom
    blocks = {b: peak * SHARES[b] for b in BLOCKS}
    cumulative, broken = 0.0, None
    for b in BLOCKS:
        cumulative += blocks[b]
        if broken is None and cumulative > hbm:
            broken = b
    step = tokens_per_step / tps
    frac = headroom / hbm
    zones = Zones(
        hbm=Zone(name="hbm", value=frac, level=_level(frac < 0.05, frac < 0.10),  # type: ignore[arg-type]
                 sentence=f"peak {peak:.1f} of {hbm:.1f} GiB"),
        communication=Zone(name="communication", value=0.1, level="ok", sentence="exposed comm 10% of the step"),
        bubbles=Zone(name="bubbles", value=0.05, level="ok", sentence="bubble 5% of the step"),
        checkpoint=Zone(name="checkpoint", value=loss, level=_level(loss >= 0.1, loss >= 0.03),  # type: ignore[arg-type]
                        sentence=f"expected goodput loss {loss:.1%}"),
        bottleneck="hbm" if frac < 0.10 else "communication",
    )
    return Evaluation(
        plan=p, status=status, reason=reason, fidelity=fidelity,  # type: ignore[arg-type]
        memory=MemoryBreakdown(**{f"{b}_gib": v for b, v in blocks.items()}, peak_gib=peak, hbm_gib=hbm,
                               headroom_gib=headroom, first_block_to_break=broken, worst_stage=0),
        time=TimeBreakdown(compute_s=0.7 * step, recompute_s=0.05 * step, tp_comm_s=0.0, dp_comm_s=0.1 * step,
                           dp_hidden_s=0.1 * step,
                           pp_comm_s=0.0, cp_comm_s=0.0, bubble_s=0.05 * step, optimizer_s=0.1 * step,
                           exposed_comm_s=0.1 * step, step_s=step),
        throughput=Throughput(tokens_per_s=tps, tokens_per_s_per_gpu=tps / gpus, mfu=0.4),
        checkpoint=CheckpointRisk(state_gib=120.0, shard_gib=15.0, save_s=30.0, stall_s=3.0, load_s=20.0,
                                  job_mtbf_h=787.5, interval_s=1800.0, goodput_loss=loss),
        zones=zones, prediction=prediction,
    )


def new_study(scn: Scenario, storage: str | None = None, name: str = "test") -> optuna.Study:
    study = optuna.create_study(directions=list(DIRECTIONS), storage=storage, study_name=name)
    study.set_user_attr("scenario", scn.model_dump(mode="json"))
    study.set_user_attr("scenario_hash", scn.problem_hash())
    study.set_user_attr("stratagem_version", __version__)
    return study


def add(study: optuna.Study, ev: Evaluation | None, *, p: Plan | None = None,
        state: optuna.trial.TrialState = optuna.trial.TrialState.COMPLETE,
        values: list[float] | None = None) -> None:
    """Store one trial the way records.py describes (params, values, constraint, user attrs)."""
    pl = ev.plan if ev is not None else p
    assert pl is not None
    params = plan_params(pl)
    dists = {k: DISTRIBUTIONS[k] for k in params}
    if values is None and ev is not None and state == optuna.trial.TrialState.COMPLETE:
        try:
            values = objective_values(ev)
        except ValueError:
            values = None
    user: dict[str, Any] = {"plan": pl.short(), "fidelity": ev.fidelity if ev else "analytic",
                            "status": ev.status if ev else "ok"}
    constraints: dict[str, float] | None = None
    if ev is not None:
        user["evaluation"] = ev.model_dump(mode="json")
        if ev.memory is not None:
            constraints = {CONSTRAINT: ev.memory.peak_gib - ev.memory.hbm_gib}
    if state == optuna.trial.TrialState.COMPLETE and values is None:
        state = optuna.trial.TrialState.PRUNED  # Optuna needs values on a complete multi-objective trial
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dists, values=values if state == optuna.trial.TrialState.COMPLETE else None,
        user_attrs=user, constraints=constraints, state=state))


def small_study(name: str = "llama3-8b", storage: str | None = None, study_name: str = "test") -> optuna.Study:
    """Six plans: A and B on the front, C dominated, D ties A, E does not fit, F measured (analytic first)."""
    study = new_study(scenario(name), storage, study_name)
    add(study, full_evaluation(plan(zero_stage=1), tps=100_000, headroom=10.0, loss=0.01))  # A
    add(study, full_evaluation(plan(zero_stage=3), tps=90_000, headroom=20.0, loss=0.01))  # B
    add(study, full_evaluation(plan(zero_stage=2), tps=80_000, headroom=5.0, loss=0.02))  # C
    add(study, full_evaluation(plan(zero_stage=1, micro_batch_size=2), tps=100_000, headroom=10.0, loss=0.01))  # D
    add(study, full_evaluation(plan(zero_stage=0), tps=150_000, headroom=-12.0, loss=0.01, status="oom",
                               reason="activations do not fit"))  # E
    analytic = full_evaluation(plan(zero_stage=3, activation_checkpointing="full"), tps=60_000, headroom=30.0,
                               loss=0.01)
    add(study, analytic)  # F, predicted
    measured = full_evaluation(plan(zero_stage=3, activation_checkpointing="full"), tps=95_000, headroom=15.0,
                               loss=0.005, fidelity="measured", prediction=analytic)
    add(study, measured)  # F, measured: now on the front
    return study


def add_many(n: int) -> optuna.Study:
    """n distinct plans (micro-batch 1..n) with spread-out figures; every seventh does not fit."""
    study = new_study(scenario())
    trials = []
    for k in range(1, n + 1):
        tps = 50_000 + (k * 7919) % 60_000
        headroom = -5.0 + (k * 104729) % 300 / 10.0
        ev = full_evaluation(plan(micro_batch_size=k), tps=tps, headroom=headroom if k % 7 else -abs(headroom) - 1,
                             loss=0.001 + (k * 31) % 97 / 1000, status="ok" if k % 7 and headroom >= 0 else "oom")
        trials.append(ev)
    for ev in trials:
        add(study, ev)
    return study
