"""Single-process checks of the harness pieces: model, init, data, stage split, plan checks, memory meters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from stratagem.errors import StratagemError
from stratagem.evaluators.memory import _layer_elements, op_layer_elements, recomputed_layers
from stratagem.launch.harness.memtrack import LiveBytes
from stratagem.launch.harness.model import build_model, materialize, named_parameters, synthetic_batch
from stratagem.launch.harness.parallelize import apply_ac, check_applicable
from stratagem.launch.harness.parallelize import recomputed_layers as harness_recomputed_layers
from stratagem.launch.harness.pipeline import build_stage_model, check_microbatches, chunk_layers, rank_chunks
from stratagem.launch.harness.run import validate_plan
from stratagem.spaces import ModelSpec, Scenario, load_scenario, parse_plan
from stratagem.spaces.columns import PlanColumns

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny() -> Scenario:
    return load_scenario(ROOT / "examples" / "tiny-cpu.yaml")


def test_parameter_count_matches_spec(tiny: Scenario) -> None:
    model = build_model(tiny.model)
    assert sum(p.numel() for p in model.parameters()) == tiny.model.num_params()
    moe = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml").model
    assert sum(p.numel() for p in build_model(moe).parameters()) == moe.num_params()
    tied = build_model(tiny.model.model_copy(update={"tied_embeddings": True}))
    assert sum(p.numel() for p in tied.parameters()) == tied.spec.num_params()


def test_meta_init_is_seeded_and_plan_independent(tiny: Scenario) -> None:
    a, b, c = (build_model(tiny.model) for _ in range(3))
    for m, seed in ((a, 0), (b, 0), (c, 1)):
        materialize([m], torch.device("cpu"), seed)
    pa, pb, pc = (dict(named_parameters([m])) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.attention.wq.weight"], pc["layers.0.attention.wq.weight"])
    # A pipeline stage built separately gets the same values for the layers it keeps.
    stage = build_stage_model(tiny.model, parse_plan("pp=2"), 1)
    materialize([stage], torch.device("cpu"), 0)
    for name, p in named_parameters([stage]):
        assert torch.equal(p, pa[name]), name
    assert stage.tok_embeddings is None and stage.output is not None
    assert sorted(stage.layers.keys()) == ["2", "3"]


def test_synthetic_batch_is_deterministic_and_learnable(tiny: Scenario) -> None:
    x0, y0 = synthetic_batch(tiny.model, tiny.training, seed=0, step=3)
    x1, y1 = synthetic_batch(tiny.model, tiny.training, seed=0, step=3)
    x2, _ = synthetic_batch(tiny.model, tiny.training, seed=0, step=4)
    assert x0.shape == (tiny.training.global_batch_size, tiny.training.seq_len)
    assert torch.equal(x0, x1) and torch.equal(y0, y1) and not torch.equal(x0, x2)
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one
    # Half the next tokens follow a fixed successor table: some bigram repeats far above chance.
    pairs = torch.stack([x0.flatten(), y0.flatten()], 1)
    _, counts = torch.unique(pairs, dim=0, return_counts=True)
    assert counts.max() >= 3


@pytest.mark.parametrize("layers,chunks,expected", [
    (4, 2, [[0, 1], [2, 3]]), (5, 2, [[0, 1, 2], [3, 4]]), (4, 4, [[0], [1], [2], [3]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
])
def test_chunk_layers(layers: int, chunks: int, expected: list[list[int]]) -> None:
    assert chunk_layers(layers, chunks) == expected


def test_rank_chunks_loop_placement() -> None:
    assert rank_chunks(parse_plan("pp=2,schedule=interleaved,v=2"), 1) == [1, 3]
    assert rank_chunks(parse_plan("pp=4"), 2) == [2]


def test_validate_plan_uses_launched_world(tiny: Scenario) -> None:
    validate_plan(tiny, parse_plan("dp=1"), 1)  # the 1-rank reference, whatever the cluster (4 GPUs)
    validate_plan(tiny, parse_plan("dp=2,tp=2"), 4)
    with pytest.raises(StratagemError, match=r"must equal the 2 rank\(s\) the harness was launched with"):
        validate_plan(tiny, parse_plan("dp=4"), 2)
    with pytest.raises(StratagemError, match=r"tp \(8\) must divide num_attention_heads"):
        validate_plan(tiny, parse_plan("tp=8"), 8)


@pytest.mark.parametrize("plan,field", [
    ("pp=2,cp=2,schedule=zero_bubble", "plan.cp"),
    ("dp=2,zero=1,offload=cpu", "plan.optimizer_offload"), ("precision=fp8", "plan.precision"),
])
def test_unapplicable_plans_name_the_field(tiny: Scenario, plan: str, field: str) -> None:
    with pytest.raises(StratagemError, match=field.replace(".", r"\.")):
        check_applicable(parse_plan(plan), tiny.model, torch.device("cpu"))


def test_unsupported_models_name_the_field(tiny: Scenario) -> None:
    with pytest.raises(StratagemError, match=r"model\.moe\.capacity_factor"):
        build_model(ModelSpec(**{**tiny.model.model_dump(), "moe": {"num_experts": 2, "top_k": 1,
                                                                      "expert_ffn_hidden_size": 64,
                                                                      "capacity_factor": 1.25}}))
    with pytest.raises(StratagemError, match=r"model\.mlp/norm"):
        build_model(tiny.model.model_copy(update={"mlp": "gelu"}))
    with pytest.raises(StratagemError, match=r"model\.qk_norm"):
        build_model(tiny.model.model_copy(update={"qk_norm": True}))


def test_live_bytes_counts_storages_until_freed() -> None:
    x = torch.ones(1000)
    with LiveBytes([x]) as meter:
        assert meter.current == 4000
        y = x * 2  # +4000
        z = y.view(10, 100)  # a view: no new storage
        assert meter.current == 8000
        del y, z
        w = x + 1
        assert meter.current == 8000 and meter.peak == 8000
        w.untyped_storage().resize_(0)  # FSDP2 frees unsharded parameters this way
        assert meter.current == 4000
    assert meter.peak == 8000


def _block_retained_bytes(spec: ModelSpec, mode: str, b: int, s: int) -> int:
    """Bytes a block's forward leaves alive for backward (its output included), measured."""
    model = build_model(spec)
    apply_ac(model, mode)
    materialize([model], torch.device("cpu"), 0)
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)  # [b, s, h]
    with LiveBytes([x, *model.parameters()]) as meter:
        before = meter.current
        out = model.layers["1"](x)
        retained = meter.current - before
    del out
    return retained


def test_recompute_keeps_what_the_analytic_model_counts(tiny: Scenario) -> None:
    """selective drops exactly silu(g) and silu(g) * u (2 sbf); full keeps exactly the layer input (sbh,
    measured as the block's output, which is the next layer's input); no recompute keeps the analytic terms
    plus what this CPU build adds (torch's composite rms_norm keeps x * rstd: sbh per norm; rstd and the
    attention log-sum-exp: sb(2 + a); rotary cos/sin tables: 4 s d/2)."""
    spec, b, s = tiny.model, 2, tiny.training.seq_len
    measured = {mode: _block_retained_bytes(spec, mode, b, s) for mode in ("none", "selective", "full")}
    pc = PlanColumns.from_plans([parse_plan("precision=fp32")])
    none, selective, full = (float(v[0]) * 4 for v in _layer_elements(tiny, pc, np.float64(s), np.float64(b)))
    assert measured["none"] - measured["selective"] == none - selective == 2 * s * b * spec.ffn_hidden_size * 4
    assert measured["full"] == full == s * b * spec.hidden_size * 4
    cpu_extras = (2 * s * b * spec.hidden_size + s * b * (2 + spec.num_attention_heads)
                  + 4 * s * spec.dim_head // 2) * 4
    assert measured["none"] == none + cpu_extras


def test_moe_selective_recompute_keeps_what_the_analytic_model_counts() -> None:
    """In an MoE layer selective recompute drops silu(g) and silu(g) * u of every routed copy (2 k s b f_e) and
    of the shared experts: memory_activations.layer_elements' none - selective for an MoE layer (ep = 1: no
    load imbalance)."""
    from stratagem.evaluators.memory_activations import layer_elements

    scn = load_scenario(ROOT / "examples" / "tiny-moe-cpu.yaml")
    moe = scn.model.moe
    assert moe is not None
    shared = scn.model.model_copy(update={"moe": moe.model_copy(update={"shared_experts": 1, "shared_ffn": 32})})
    b, s = 2, scn.training.seq_len
    pc = PlanColumns.from_plans([parse_plan("precision=fp32")])
    for spec in (scn.model, shared):
        assert spec.is_moe_layer(1)
        dropped = _block_retained_bytes(spec, "none", b, s) - _block_retained_bytes(spec, "selective", b, s)
        none, selective, _ = layer_elements(scn.model_copy(update={"model": spec}), pc, float(s), float(b))
        assert dropped == (none[0] - selective[0]) * 4
        assert spec.moe is not None
        assert dropped == 2 * s * b * (moe.top_k * moe.expert_ffn_hidden_size + spec.moe.shared_experts
                                       * spec.moe.shared_ffn) * 4


def test_op_recompute_keeps_what_the_analytic_model_counts(tiny: Scenario) -> None:
    """torchtitan's op-level policy keeps wq, wv, w1, w2 outputs, the attention output and the layer output
    (op_layer_elements); on CPU the flash kernel's log-sum-exp (sb a, fp32) is kept with its output."""
    spec, b, s = tiny.model, 2, tiny.training.seq_len
    measured = _block_retained_bytes(spec, "op", b, s)
    pc = PlanColumns.from_plans([parse_plan("precision=fp32,ac=op")])
    op = float(op_layer_elements(tiny, pc, np.float64(s), np.float64(b))[0]) * 4
    assert op == s * b * (2 * spec.hidden_size + 2 * spec.q_size + spec.kv_size + spec.ffn_hidden_size) * 4
    assert measured == op + s * b * spec.num_attention_heads * 4


@pytest.mark.parametrize("example", ["tiny-cpu", "tiny-moe-cpu"])
def test_recompute_gradients_equal_no_recompute(example: str) -> None:
    """op, full and selective recompute re-run the same computation (MoE routing and balance loss included)."""
    scn = load_scenario(ROOT / "examples" / f"{example}.yaml")
    grads = {}
    for mode in ("none", "op", "full", "selective"):
        model = build_model(scn.model)
        apply_ac(model, mode)
        materialize([model], torch.device("cpu"), 0)
        x, _ = synthetic_batch(scn.model, scn.training, 0, 0)
        model(x).float().pow(2).mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in named_parameters([model]) if p.grad is not None}
    assert len(grads["none"]) == len(list(model.parameters()))
    for mode in ("op", "full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            assert torch.equal(grads[mode][name], g), (mode, name)


@pytest.mark.parametrize("mode", ["full", "op", "selective"])
def test_partial_recompute_wraps_the_first_layers_of_each_chunk(tiny: Scenario, mode: str) -> None:
    model = build_model(tiny.model)
    apply_ac(model, mode, recompute_layers=3)
    wrapped = ["_checkpoint_wrapped_module" in "".join(n for n, _ in block.named_modules())
               for block in model.layers.values()]
    assert wrapped == [True, True, True, False]
    assert harness_recomputed_layers(model, 0) == ["0", "1", "2", "3"]
    stage = build_stage_model(tiny.model, parse_plan("pp=2,schedule=interleaved,v=2,dp=1"), 1)
    assert harness_recomputed_layers(stage, 5) == list(stage.layers.keys())


def test_partial_recompute_in_the_analytic_model(tiny: Scenario) -> None:
    """recompute_layers N per chunk: N layers at the mode's size, the rest at no recompute's."""
    pc = PlanColumns.from_plans([parse_plan(t) for t in (
        "ac=full,recompute_layers=1", "ac=full,recompute_layers=9", "ac=full", "pp=2,v=2,schedule=interleaved,"
        "ac=full,recompute_layers=1")])
    layers = np.array([4.0, 4.0, 4.0, 2.0])
    assert recomputed_layers(pc, layers).tolist() == [1.0, 4.0, 4.0, 2.0]
    acts = [evaluate_plan(tiny, f"dp=4,precision=fp32,ac=full,recompute_layers={n}") for n in (1, 2, 3, 4)]
    none = evaluate_plan(tiny, "dp=4,precision=fp32")
    assert evaluate_plan(tiny, "dp=4,precision=fp32,ac=full") == acts[-1]  # 0 means every layer
    saved = np.array([none - a for a in acts])  # each recomputed layer saves the same
    assert saved[0] > 0 and np.allclose(saved, saved[0] * np.arange(1, 5))


def evaluate_plan(scn: Scenario, text: str) -> float:
    from stratagem import evaluate

    mem = evaluate(scn, parse_plan(text)).memory
    assert mem is not None
    return float(mem.activations_gib)


@pytest.mark.parametrize("plan,microbatches,ok", [
    ("pp=2,schedule=1f1b", 1, False), ("pp=2,schedule=1f1b", 2, True), ("pp=2,schedule=gpipe", 1, True),
    ("pp=2,schedule=zero_bubble", 5, False), ("pp=2,schedule=zero_bubble", 3, True),
    ("pp=2,schedule=interleaved,v=2", 4, True),
])
def test_schedule_microbatch_limits_are_named(plan: str, microbatches: int, ok: bool) -> None:
    if ok:
        check_microbatches(parse_plan(plan), microbatches)
    else:
        with pytest.raises(StratagemError, match=r"^plan\.micro_batch_size \(1\): the"):
            check_microbatches(parse_plan(plan), microbatches)
