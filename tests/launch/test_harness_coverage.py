"""Issue 15's mechanisms run for real on gloo, against the single-process fp32 reference (as
tests/launch/test_harness_plans.py: the cases are data, one launch per world size per test session).

  CORRECT    5-step fp32 losses and final parameters equal the reference within 1e-5 relative
  SHARDING   measured per-rank parameter / gradient / optimizer bytes equal the analytic memory model's
  OFFLOAD    FSDP2 CPUOffloadPolicy keeps every model state in host memory
for the dense tiny-cpu model, the tiny MoE model (examples/tiny-moe-cpu.yaml; also under TP, with etp = 1 and
etp = tp), the same with a shared expert and tiny-cpu with tied embeddings, each against its own single-process
reference. Seven launches (model x world size, worlds 2 and 4; the MoE model at world 8 too), about 2 min 45 s
on a 2-core machine shared with three other engineers (the MoE-under-TP cases add about 35 s of it), plus about
1 min 10 s for the MoE world-8 launch (experts FSDP2-sharded on dim 1 and inside HSDP replicas).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from stratagem import evaluate
from stratagem.launch.harness.verify import compare, reference, run_plans_local
from stratagem.spaces import Plan, Scenario, load_scenario, parse_plan
from stratagem.units import GIB

ROOT = Path(__file__).resolve().parents[2]
# The first test's setup runs every launch (2 min idle; 11 min on a machine shared by eight test runs): more than
# the suite's 600 s per-test limit allows on a loaded machine.
pytestmark = pytest.mark.timeout(1800)
STEPS = 5
TOL = 1e-5

CORRECT: dict[int, list[str]] = {
    2: [
        # op-level (torchtitan's policy) and partial recompute, alone, with FSDP/DDP, TP+SP and PP
        "dp=2,zero=3,ac=op", "tp=2,sp=true,ac=op", "pp=2,ac=op", "dp=2,zero=0,ac=full,recompute_layers=2",
        "pp=2,ac=op,recompute_layers=1", "tp=2,sp=true,ac=selective,recompute_layers=3",
        # optimizer offload: FSDP2 CPUOffloadPolicy (zero 2/3)
        "dp=2,zero=3,offload=cpu", "dp=2,zero=2,offload=cpu",
        # loss-parallel under TP (vocabulary-sharded logits), with gradient accumulation
        "tp=2,mbs=2",
        # uneven pipeline splits: Megatron's first/last stage counts and embedding+loss as layers
        "pp=2,first_stage_layers=1,last_stage_layers=3", "pp=2,pp_split=embedding_loss,schedule=gpipe",
        # context parallelism: torch's context_parallel ring attention (load-balanced shards), DDP / FSDP2 over cp
        "cp=2", "cp=2,zero=3,mbs=2,ac=full",
    ],
    4: [
        # HSDP: FSDP2 on the 2-D (replicate 2, shard 2) mesh; zero 1 partitions states within a replica
        "dp=4,dp_replicate=2,zero=3", "dp=4,dp_replicate=2,zero=2", "dp=4,dp_replicate=2,zero=1",
        # DDP x TP under op recompute (the re-run forward sees the DTensor weights), and op with pp x tp
        "dp=2,tp=2,zero=1,sp=true,ac=op", "pp=2,tp=2,sp=true,ac=op,recompute_layers=1",
        # HSDP with offload; loss-parallel with FSDP x TP x SP and op recompute
        "dp=4,dp_replicate=2,zero=3,offload=cpu", "dp=2,tp=2,zero=3,sp=true,ac=op",
        # cp x tp (with SP; with loss-parallel), cp x dp under ZeRO-1 over dp x cp and op recompute
        "cp=2,tp=2,sp=true", "cp=2,tp=2", "dp=2,cp=2,zero=1,ac=op",
        # cp under a pipeline schedule (positions split into micro-batches with the inputs): DDP, FSDP2 over cp
        "pp=2,cp=2,schedule=1f1b,ac=full", "pp=2,cp=2,zero=2,schedule=interleaved,v=2",
    ],
}
SHARDING: dict[int, list[str]] = {
    2: ["dp=2,zero=3,offload=cpu"],
    4: ["dp=4,dp_replicate=2,zero=3", "dp=4,dp_replicate=2,zero=2", "dp=4,dp_replicate=2,zero=1",
        "dp=4,dp_replicate=2,zero=3,offload=cpu", "dp=2,cp=2,zero=3"],
}
# Where the analytic model (stratagem/evaluators/memory.py) differs from what the harness measures.
_DDP_GAP = ("memory.py counts, at the peak, DDP's accumulated .grad tensors beside its buckets under no_sync (m > 1: "
            "memory_engine.ddp_accumulates); the harness measures gradient bytes after the synced backward, when the "
            "buckets alone hold them")
ANALYTIC_GAPS: dict[tuple[str, str], str] = {("dp=4,dp_replicate=2,zero=1", "gradients"): _DDP_GAP}
# The same checks on the tiny MoE model (examples/tiny-moe-cpu.yaml) against its own single-process reference.
MOE_CORRECT: dict[int, list[str]] = {
    2: ["dp=2,ep=2", "dp=2,ep=2,zero=3,ac=op", "dp=2,zero=2,ac=full", "pp=2,schedule=gpipe",
        # MoE under TP (torchtitan apply_moe_ep_tp): etp=1 splits the tokens over tp, etp=tp the experts' f dim
        "tp=2", "tp=2,etp=2,sp=true",
        # context parallelism: the balance loss's per-sequence sums over cp; ep borrows cp, experts FSDP over edp
        "cp=2,ep=2,zero=3,ac=op",
        # selective recompute: each routed expert's down(silu(g) * u) (moe.down), with ep and with etp = tp
        "dp=2,ep=2,ac=selective", "tp=2,etp=2,sp=true,ac=selective"],
    4: ["dp=4,ep=2", "dp=4,ep=4,zero=3", "dp=4,ep=2,dp_replicate=2,zero=3", "pp=2,dp=2,ep=2,zero=2,schedule=gpipe",
        "pp=2,dp=2,ep=2,zero=0,schedule=gpipe",  # DDP (experts ignored) under a pipeline schedule
        # ep borrows tp (etp=1) under DDP; ep x etp (torchtitan ExpertTensorParallel) under FSDP2
        "dp=2,tp=2,ep=2,sp=true", "dp=2,tp=2,ep=2,etp=2,sp=true,zero=3",
        # experts FSDP2-sharded over edp (expert_grid.shard_experts): edp 2 (dp), edp 2 spanning the TP ranks
        "dp=4,ep=2,zero=3", "dp=2,tp=2,ep=2,sp=true,zero=3",
        # MoE under cp: experts FSDP over edp (dp x cp / ep), cp x tp (tokens split over tp), under GPipe
        "dp=2,cp=2,ep=2,zero=3", "cp=2,tp=2,sp=true", "pp=2,cp=2,ep=2,zero=2,schedule=gpipe",
        "dp=4,ep=2,zero=3,ac=selective"],  # selective inside the experts' own FSDP unit
    # experts FSDP2-sharded on dim 1 (edp 4 x ep 2 > 4 experts), and within HSDP replicas (edp / dp_replicate = 2)
    8: ["dp=8,ep=2,zero=3", "dp=8,ep=2,dp_replicate=2,zero=3"],
}
MOE_SHARDING: dict[int, list[str]] = {
    2: ["dp=2,ep=2", "dp=2,ep=2,zero=3"], 4: ["dp=4,ep=4,zero=3", "dp=4,ep=2,zero=3", "dp=2,cp=2,ep=2,zero=3"],
    8: ["dp=8,ep=2,dp_replicate=2,zero=3"]}
# MoE under TP, against the analytic model plus ROUTER_TP: the router is replicated over TP in the harness, as in
# torchtitan (NoParallel) and Megatron-Core, while memory.py divides it by tp with the other non-expert weights.
MOE_TP_SHARDING: dict[int, list[str]] = {4: ["dp=2,tp=2,ep=2,etp=2,sp=true,zero=3", "dp=2,tp=2,ep=4,sp=true,zero=3",
                                             "dp=2,tp=2,ep=2,sp=true,zero=3"]}
MOE_GAPS: dict[tuple[str, str], str] = {("dp=2,ep=2", "gradients"): _DDP_GAP}
MOE_GAPS[("dp=8,ep=2,dp_replicate=2,zero=3", "gradients")] = (
    "one micro-batch (global batch 8 over dp 8): memory.py's gradients block at the peak is what remains beside the "
    "activations its backward frees (memory_engine.torch_freed_gradients), not the state bytes measured after it")
# Tied embeddings (tiny-cpu with tied_embeddings: true): with pp > 1 the two copies' gradients are summed.
TIED_CORRECT: dict[int, list[str]] = {2: ["pp=2,schedule=gpipe", "dp=2,zero=3", "tp=2"]}
# The tiny MoE model with one shared expert: under TP its w1/w3 are column and w2 row shards (a partial sum).
SHARED_CORRECT: dict[int, list[str]] = {2: ["tp=2,ep=2,sp=true,ac=op", "tp=2,ep=2,sp=true,ac=selective"]}
EXAMPLES = {"dense": "tiny-cpu", "moe": "tiny-moe-cpu"}
TIMEOUT_S = 600.0


def _plan(text: str) -> Plan:
    return parse_plan(f"{text},precision=fp32")


@pytest.fixture(scope="module")
def scenarios() -> dict[str, Scenario]:
    out = {k: load_scenario(ROOT / "examples" / f"{v}.yaml") for k, v in EXAMPLES.items()}
    dense, moe = out["dense"], out["moe"]
    out["tied"] = dense.model_copy(update={"model": dense.model.model_copy(update={"tied_embeddings": True})})
    assert moe.model.moe is not None
    shared = moe.model.moe.model_copy(update={"shared_experts": 1})
    out["shared"] = moe.model_copy(update={"model": moe.model.model_copy(update={"moe": shared})})
    return out


@pytest.fixture(scope="module")
def tiny(scenarios: dict[str, Scenario]) -> Scenario:
    return scenarios["dense"]


@pytest.fixture(scope="module")
def refs(scenarios: dict[str, Scenario]) -> dict[str, dict[str, Any]]:
    return {k: reference(scn, STEPS) for k, scn in scenarios.items()}


@pytest.fixture(scope="module")
def launches(scenarios: dict[str, Scenario]) -> dict[Any, Any]:
    """Every case, one launch per (model, world size); results keyed by (model, kind, plan text); launch
    errors kept and re-raised by the tests of that launch."""
    jobs: dict[tuple[str, int], list[tuple[tuple[str, str, str], Plan, dict[str, Any]]]] = {}
    measure = {"measure": True, "steps": 1}
    lists: tuple[tuple[str, str, dict[int, list[str]], dict[str, Any]], ...] = (
        ("dense", "correct", CORRECT, {}), ("dense", "sharding", SHARDING, measure),
        ("moe", "correct", MOE_CORRECT, {}), ("moe", "sharding", MOE_SHARDING, measure),
        ("moe", "sharding", MOE_TP_SHARDING, measure),
        ("tied", "correct", TIED_CORRECT, {}), ("shared", "correct", SHARED_CORRECT, {}))
    for model, kind, cases, action in lists:
        for world, texts in cases.items():
            jobs.setdefault((model, world), []).extend(((model, kind, t), _plan(t), dict(action)) for t in texts)
    out: dict[Any, Any] = {"errors": {}}
    for (model, world), entries in sorted(jobs.items()):
        start = time.perf_counter()
        try:
            runs = run_plans_local(scenarios[model], [p for _, p, _ in entries], STEPS,
                                   actions=[a for _, _, a in entries], timeout_s=TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - re-raised by every test of this launch
            out["errors"][(model, world)] = e
            continue
        finally:
            print(f"launch of {len(entries)} {model} plans at world {world}: {time.perf_counter() - start:.1f} s")
        for (key, _, _), run in zip(entries, runs, strict=True):
            out[key] = run
    return out


def _result(launches: dict[Any, Any], kind: str, text: str, model: str = "dense") -> dict[str, Any]:
    world = _plan(text).world_size
    if (model, world) in launches["errors"]:
        raise launches["errors"][(model, world)]
    return launches[(model, kind, text)]  # type: ignore[no-any-return]


CORRECT_CASES = [("dense", t) for texts in CORRECT.values() for t in texts] + \
    [("moe", t) for texts in MOE_CORRECT.values() for t in texts] + \
    [("tied", t) for texts in TIED_CORRECT.values() for t in texts] + \
    [("shared", t) for texts in SHARED_CORRECT.values() for t in texts]


@pytest.mark.parametrize("model,text", CORRECT_CASES, ids=[f"{m}-{t}" for m, t in CORRECT_CASES])
def test_matches_single_process_reference(launches: dict[Any, Any], refs: dict[str, dict[str, Any]], model: str,
                                          text: str) -> None:
    ref = refs[model]
    diff = compare(_result(launches, "correct", text, model), ref)
    assert diff["loss_rel"] <= TOL, f"losses {diff['losses']} vs reference {diff['reference']}"
    assert diff["param_rel"] <= TOL, f"{diff['worst_param']} differs by {diff['param_rel']:.2e} (relative)"
    assert ref["losses"][0] != ref["losses"][-1]


BLOCKS = ("weights", "gradients", "optimizer")


def _analytic(scn: Scenario, plan: Plan) -> Any:
    cluster = scn.cluster.model_copy(update={"num_nodes": 1, "gpus_per_node": plan.world_size})
    training = scn.training.model_copy(update={"stack": "torch"})
    mem = evaluate(scn.model_copy(update={"cluster": cluster, "training": training}), plan).memory
    assert mem is not None
    return mem


SHARDING_CASES = [("dense", t, b) for texts in SHARDING.values() for t in texts for b in BLOCKS] + \
    [("moe", t, b) for texts in MOE_SHARDING.values() for t in texts for b in BLOCKS]
GAPS = {("dense", *k): v for k, v in ANALYTIC_GAPS.items()} | {("moe", *k): v for k, v in MOE_GAPS.items()}


@pytest.mark.parametrize("model,text,block", [
    pytest.param(*c, marks=pytest.mark.xfail(reason=GAPS[c], strict=True)) if c in GAPS else c
    for c in SHARDING_CASES
], ids=[f"{m}-{t}-{b}" for m, t, b in SHARDING_CASES])
def test_sharded_state_bytes_match_analytic_model(launches: dict[Any, Any], scenarios: dict[str, Scenario],
                                                   model: str, text: str, block: str) -> None:
    plan, scn = _plan(text), scenarios[model]
    ranks = _result(launches, "sharding", text, model)["ranks"]
    mem = _analytic(scn, plan)
    expected = getattr(mem, f"{block}_gib") * GIB
    worst = [r for r in ranks if r["stage_ids"][0] == mem.worst_stage]
    assert worst, f"no rank holds the worst stage {mem.worst_stage}: {[r['stage_ids'] for r in ranks]}"
    key = {"weights": "param_bytes", "gradients": "grad_bytes", "optimizer": "optimizer_bytes"}[block]
    measured = [r[key] + (r["unsharded_param_bytes"] if block == "weights" else 0) for r in worst]
    if block == "optimizer" and plan.zero_stage == 1:
        # ZeroRedundancyOptimizer partitions whole parameters over dp / dp_replicate ranks (greedily): each
        # rank holds its share to within one parameter's states; the model gives the fullest rank's.
        largest = max(scn.model.vocab_size * scn.model.hidden_size, scn.model.hidden_size ** 2) * 8
        assert max(measured) == pytest.approx(expected, abs=0.5)
        assert all(abs(m - expected) <= largest for m in measured), (measured, expected)
    else:
        assert measured == [pytest.approx(expected, abs=0.5)] * len(worst), (measured, expected)


MOE_TP_CASES = [(t, b) for texts in MOE_TP_SHARDING.values() for t in texts for b in BLOCKS]


@pytest.mark.parametrize("text,block", MOE_TP_CASES, ids=[f"{t}-{b}" for t, b in MOE_TP_CASES])
def test_moe_tp_state_bytes_match_analytic_model(launches: dict[Any, Any], scenarios: dict[str, Scenario],
                                                 text: str, block: str) -> None:
    """Under TP the experts are split over ep x etp and FSDP2-sharded over edp = dp*tp / (ep*etp) as memory.py
    splits them, and the router is whole on every TP rank in both (torchtitan NoParallel)."""
    plan, scn = _plan(text), scenarios["moe"]
    ranks = _result(launches, "sharding", text, "moe")["ranks"]
    expected = getattr(_analytic(scn, plan), f"{block}_gib") * GIB
    key = {"weights": "param_bytes", "gradients": "grad_bytes", "optimizer": "optimizer_bytes"}[block]
    measured = [r[key] + (r["unsharded_param_bytes"] if block == "weights" else 0) for r in ranks]
    assert measured == [pytest.approx(expected, abs=0.5)] * len(ranks), (measured, expected)


OFFLOAD_CASES = [t for texts in SHARDING.values() for t in texts if "offload" in t]


@pytest.mark.parametrize("text", OFFLOAD_CASES)
def test_offload_keeps_the_sharded_states_in_host_memory(launches: dict[Any, Any], tiny: Scenario, text: str) -> None:
    """Under FSDP2's CPUOffloadPolicy nothing of the model states stays on the device at rest, and the host holds
    exactly what the same plan without offload holds on the device (analytic weights + gradients + optimizer)."""
    plan = _plan(text)
    ranks = _result(launches, "sharding", text)["ranks"]
    resident = _analytic(tiny, plan.model_copy(update={"optimizer_offload": "none"}))
    expected = (resident.weights_gib + resident.gradients_gib + resident.optimizer_gib) * GIB
    assert ranks, "the offload run reported no rank"
    assert [r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"] for r in ranks] == [0] * len(ranks)
    assert [r["host_state_bytes"] for r in ranks] == [pytest.approx(expected, abs=0.5)] * len(ranks)
    assert _analytic(tiny, plan).optimizer_gib == 0
