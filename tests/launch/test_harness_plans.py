"""Real multi-process training on gloo: every plan kind against the single-process reference.

The cases are data. Plans of one world size run one after the other in a single launch (`run_plans_local`),
one launch per world size (2, 4, 8), started once per test session; the tests below only read the results.

  CORRECT     the 5-step fp32 losses equal the reference within 1e-5 relative, and so do the parameters
  BF16        bf16 mixed precision trains (losses within 1e-3 of the fp32 reference)
  SHARDING    measured per-rank parameter / gradient / optimizer bytes against the analytic memory model
  RESUME      a checkpoint saved under dp=4 (3 steps) loads under other layouts, which continue (2 steps)
              with the reference's losses and end with its parameters
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stratagem import evaluate
from stratagem.launch.harness.verify import compare, reference, run_plans_local
from stratagem.spaces import Plan, Scenario, load_scenario, parse_plan
from stratagem.units import GIB

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
TOL = 1e-5
SAVE_AT = 3

CORRECT: dict[int, list[str]] = {
    2: [
        "dp=2,zero=0", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3", "dp=2,zero=1,mbs=2",
        "tp=2", "tp=2,sp=true",
        "pp=2,schedule=gpipe", "pp=2,schedule=1f1b", "pp=2,schedule=interleaved,v=2", "pp=2,schedule=zero_bubble",
        "dp=2,zero=0,ac=selective", "dp=2,zero=3,ac=full", "tp=2,sp=true,ac=selective", "pp=2,ac=full",
    ],
    4: [
        "dp=2,tp=2,zero=0", "dp=2,tp=2,zero=1,sp=true", "dp=2,tp=2,zero=2", "dp=2,tp=2,zero=3,sp=true,ac=full",
        "pp=2,dp=2,zero=3,schedule=gpipe", "pp=2,tp=2,sp=true,schedule=interleaved,v=2",
        # DDP x TP with recompute: the re-run forward must see the DTensor weights the first one used
        "dp=2,tp=2,zero=1,sp=true,mbs=4,ac=selective", "dp=2,tp=2,zero=0,ac=selective",
        "dp=2,tp=2,zero=0,sp=true,ac=full", "dp=2,tp=2,zero=1,mbs=1,ac=full",
        # DDP under a pipeline schedule with no forward between the first and the last backward (m = pp, 1F1B)
        "pp=2,dp=2,zero=0,mbs=2,schedule=1f1b,ac=full",
    ],
    8: [
        "pp=2,dp=2,tp=2,zero=3,sp=true,schedule=interleaved,v=2", "pp=2,dp=2,tp=2,zero=1,schedule=1f1b",
    ],
}
BF16: dict[int, list[str]] = {2: ["dp=2,zero=3", "dp=2,zero=0"], 4: ["pp=2,dp=2,zero=2"]}
SHARDING = ["dp=4,zero=0", "dp=4,zero=1", "dp=4,zero=2", "dp=4,zero=3", "dp=2,tp=2,zero=3,sp=true",
            "dp=2,pp=2,zero=3"]
RESUME_FROM = "dp=4,zero=3"
RESUME_INTO = ["dp=2,tp=2,zero=1,sp=true", "pp=2,dp=2,zero=2"]
TIMEOUT_S = {2: 300.0, 4: 300.0, 8: 300.0}

# Where the analytic model (stratagem/evaluators/memory.py) is known to differ from FSDP2/TP as run here.
ANALYTIC_GAPS: dict[tuple[str, str], str] = {  # (plan, block) -> why memory.py disagrees
    ("dp=2,pp=2,zero=3", "gradients"): (
        "memory.py counts FSDP2's unsharded gradient accumulation between micro-batches under PP (its peak); "
        "the harness measures gradient bytes after the step's last reduce-scatter, when only the shards remain"),
    **{(t, "gradients"): (
        "memory.py counts, at the peak, DDP's accumulated .grad tensors beside its buckets under no_sync (m > 1: "
        "memory_engine.ddp_accumulates); the harness measures gradient bytes after the synced backward, when the "
        "buckets alone hold them") for t in ("dp=4,zero=0", "dp=4,zero=1")},
}


def _plan(text: str, precision: str = "fp32") -> Plan:
    return parse_plan(f"{text},precision={precision}")


@pytest.fixture(scope="session")
def tiny() -> Scenario:
    return load_scenario(ROOT / "examples" / "tiny-cpu.yaml")


@pytest.fixture(scope="session")
def ref(tiny: Scenario) -> dict[str, Any]:
    return reference(tiny, STEPS)


@pytest.fixture(scope="session")
def launches(tiny: Scenario, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run every case, one launch per world size; results keyed by (kind, plan text). Launch errors are
    kept and re-raised by the tests that need them."""
    ckpt = str(tmp_path_factory.mktemp("resume") / "ckpt")
    jobs: dict[int, list[tuple[tuple[str, str], Plan, dict[str, Any]]]] = {}
    for world, texts in CORRECT.items():
        jobs.setdefault(world, []).extend((("correct", t), _plan(t), {}) for t in texts)
    for world, texts in BF16.items():
        jobs.setdefault(world, []).extend((("bf16", t), _plan(t, "bf16"), {}) for t in texts)
    jobs[4] += [(("sharding", t), _plan(t), {"measure": True, "steps": 1}) for t in SHARDING]
    jobs[4].append((("resume", RESUME_FROM), _plan(RESUME_FROM), {"steps": SAVE_AT, "save": ckpt}))
    jobs[4] += [(("resume", t), _plan(t), {"steps": STEPS - SAVE_AT, "start_step": SAVE_AT, "load": ckpt})
                for t in RESUME_INTO]
    out: dict[str, Any] = {"errors": {}, "wall_s": {}}
    for world, entries in sorted(jobs.items()):
        start = time.perf_counter()
        try:
            runs = run_plans_local(tiny, [p for _, p, _ in entries], STEPS, actions=[a for _, _, a in entries],
                                   timeout_s=TIMEOUT_S[world])
        except Exception as e:  # noqa: BLE001 - reported by every test of this world
            out["errors"][world] = e
            continue
        finally:
            out["wall_s"][world] = time.perf_counter() - start
            print(f"launch of {len(entries)} plans at world {world}: {out['wall_s'][world]:.1f} s")
        for (key, _, _), run in zip(entries, runs, strict=True):
            out[key] = run
    return out


def _result(launches: dict[str, Any], kind: str, text: str, world: int) -> dict[str, Any]:
    if world in launches["errors"]:
        raise launches["errors"][world]
    return launches[(kind, text)]  # type: ignore[no-any-return]


CORRECT_CASES = [(w, t) for w, texts in CORRECT.items() for t in texts]


@pytest.mark.parametrize("world,text", CORRECT_CASES, ids=[t for _, t in CORRECT_CASES])
def test_matches_single_process_reference(launches: dict[str, Any], ref: dict[str, Any], world: int,
                                          text: str) -> None:
    run = _result(launches, "correct", text, world)
    diff = compare(run, ref)
    assert diff["loss_rel"] <= TOL, f"losses {diff['losses']} vs reference {diff['reference']}"
    assert diff["param_rel"] <= TOL, f"{diff['worst_param']} differs by {diff['param_rel']:.2e} (relative)"
    assert ref["losses"][0] != ref["losses"][-1]  # the weights did move


BF16_CASES = [(w, t) for w, texts in BF16.items() for t in texts]


@pytest.mark.parametrize("world,text", BF16_CASES, ids=[t for _, t in BF16_CASES])
def test_bf16_trains_close_to_fp32(launches: dict[str, Any], ref: dict[str, Any], world: int, text: str) -> None:
    run = _result(launches, "bf16", text, world)
    diff = compare(run, ref)
    assert 0 < diff["loss_rel"] <= 1e-3, diff  # bf16 really ran (not bit-identical) and stays close


def _analytic(tiny: Scenario, plan: Plan) -> Any:
    cluster = tiny.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": plan.world_size})
    training = tiny.training.model_copy(update={"stack": "torch"})
    mem = evaluate(tiny.model_copy(update={"cluster": cluster, "training": training}), plan).memory
    assert mem is not None
    return mem


SHARDING_CASES = [(t, b) for t in SHARDING for b in ("weights", "gradients", "optimizer")]


@pytest.mark.parametrize("text,block", [
    pytest.param(t, b, marks=pytest.mark.xfail(reason=ANALYTIC_GAPS[(t, b)], strict=True))
    if (t, b) in ANALYTIC_GAPS else (t, b) for t, b in SHARDING_CASES
], ids=[f"{t}-{b}" for t, b in SHARDING_CASES])
def test_sharded_state_bytes_match_analytic_model(launches: dict[str, Any], tiny: Scenario, text: str,
                                                   block: str) -> None:
    plan = _plan(text)
    ranks = _result(launches, "sharding", text, 4)["ranks"]
    mem = _analytic(tiny, plan)
    expected = getattr(mem, f"{block}_gib") * GIB
    worst = [r for r in ranks if r["stage_ids"][0] == mem.worst_stage]  # the ranks the model describes
    assert worst, f"no rank holds the worst stage {mem.worst_stage}: {[r['stage_ids'] for r in ranks]}"
    key = {"weights": "param_bytes", "gradients": "grad_bytes", "optimizer": "optimizer_bytes"}[block]
    measured = [r[key] + (r["unsharded_param_bytes"] if block == "weights" else 0) for r in worst]
    if block == "optimizer" and plan.zero_stage == 1:
        # ZeroRedundancyOptimizer partitions whole parameters (greedily, largest first): each rank holds 1/dp
        # of the states to within one parameter's states; the model gives the fullest rank's (memory_engine.py).
        largest = max(tiny.model.vocab_size * tiny.model.hidden_size, tiny.model.hidden_size ** 2) * 8
        assert max(measured) == pytest.approx(expected, abs=0.5)
        assert all(abs(m - expected) <= largest for m in measured), (measured, expected)
    else:
        assert measured == [pytest.approx(expected, abs=0.5)] * len(worst), (measured, expected)


@pytest.mark.parametrize("text", RESUME_INTO)
def test_checkpoint_resumes_under_another_layout(launches: dict[str, Any], ref: dict[str, Any],
                                                 text: str) -> None:
    saved = _result(launches, "resume", RESUME_FROM, 4)
    assert np.allclose(saved["losses"], ref["losses"][:SAVE_AT], rtol=TOL, atol=0)
    resumed = _result(launches, "resume", text, 4)
    tail = {"losses": ref["losses"][SAVE_AT:], "params": ref["params"]}
    diff = compare(resumed, tail)
    assert diff["loss_rel"] <= TOL, f"resumed losses {diff['losses']} vs reference {diff['reference']}"
    assert diff["param_rel"] <= TOL, f"{diff['worst_param']} differs by {diff['param_rel']:.2e}"

