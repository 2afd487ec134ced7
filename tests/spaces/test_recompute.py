"""Megatron module recompute in plans, rules and the search space (spaces/recompute.py, SearchConfig.recompute_modules)."""

from __future__ import annotations

import numpy as np
import optuna
import pytest

from stratagem.errors import StratagemError
from stratagem.search.records import plan_distributions, plan_params
from stratagem.spaces import ClusterSpec, Plan, Scenario, SearchSpace, gpu_preset, parse_plan, violations


def _scn(stack: str = "megatron", **search: object) -> Scenario:
    return Scenario(model="deepseek-v3", cluster=ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=8,
                                                            gpus_per_node=8),
                    training={"stack": stack, "global_batch_size": 512, "seq_len": 4096},
                    search={"precision": "bf16", "activation_checkpointing": ["selective", "full"], **search})


def test_module_sets_are_order_free_and_round_trip() -> None:
    p = parse_plan("dp=8,activation_checkpointing=selective,recompute_modules=moe_act+layernorm+moe_act")
    assert p.recompute_modules == ("moe_act", "layernorm")
    assert parse_plan(p.short()) == p
    params = plan_params(p)
    assert params["recompute_modules"] in plan_distributions()["recompute_modules"].choices
    assert Plan(**params) == p


def test_space_adds_module_sets_to_selective_only() -> None:
    """Unset: the space is today's; listed: each set is one more selective choice, every plan valid."""
    plain = SearchSpace(_scn())
    sets = SearchSpace(_scn(recompute_modules=["", "layernorm+mla_up_proj+moe_act", "moe"]))
    assert sets.digest() != plain.digest()
    pc = sets.enumerate()
    selective = int(plain.enumerate().recompute_is("selective").sum())
    assert sets.count() == plain.count() + 2 * selective
    assert not pc.by_module[pc.recompute_is("full")].any()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(pc), 40, replace=False):
        assert not violations(sets.scenario, pc.plan(int(i)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = {sets.suggest(study.ask()).recompute_modules for _ in range(60)}
    assert ("moe",) in seen and () in seen


@pytest.mark.parametrize("stack,sets,fragment", [
    ("torch", ["layernorm"], "torch does not recompute layernorm"),
    ("megatron", ["layernorm+nope"], "use modules among"),
])
def test_space_refuses_module_sets_it_cannot_run(stack: str, sets: list[str], fragment: str) -> None:
    with pytest.raises(StratagemError, match=fragment):
        SearchSpace(_scn(stack=stack, recompute_modules=sets))
