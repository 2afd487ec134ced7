"""A plan's groups and derived sizes (spaces/groups.py): one definition each, the same for one Plan (the harness,
the canonical form, the advice) and for PlanColumns (the model)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import numpy as np
import pytest

from stratagem.spaces import Plan, PlanColumns, Scenario, SearchSpace, cluster_preset, model_preset
from stratagem.spaces.groups import (
    dp_shard,
    expert_data_parallel,
    micro_batches,
    shard_group,
    uses_fsdp,
)

ROOT = Path(__file__).resolve().parents[2]

DERIVED = {
    "dp_shard": r"\bdp\s*//?\s*\w*\.?dp_replicate\b",
    "shard_group": r"\bdp\s*\*\s*\w*\.?cp\s*//?\s*\w*\.?dp_replicate\b",
    "expert_data_parallel": r"\btp\s*\*\s*\w*\.?dp\s*\*\s*\w*\.?cp\s*//?\s*\(|\bdp\s*\*\s*\w*\.?cp\s*\*\s*\w*\.?tp\s*//?\s*\(",
    "uses_fsdp": r"\bdp\s*\*\s*\w*\.?cp\s*>\s*1\)?\s*(&|and)\s*\(?\w*\.?zero_stage\s*>=\s*2",
    "micro_batches": r"global_batch_size\s*//?\s*\(\s*\w*\.?dp\s*\*\s*\w*\.?micro_batch_size",
    "sp_divisor": r"np\.where\s*\(\s*[\w.]*sequence_parallel\s*>\s*0\s*,\s*[\w.]*tp\s*,\s*1\.0\s*\)",
    "usable_gib": r"hbm_gib\s*-\s*[\w.]*memory_margin_gib",
}
"""Each derived size's formula, as code spells it."""


def _code_lines(path: Path) -> dict[int, str]:
    """Line -> its code without strings and comments (a formula in a docstring cites, it does not derive)."""
    out: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT) and tok.type != getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.setdefault(tok.start[0], []).append(tok.string)
    return {n: re.sub(r"\s*\.\s*", ".", " ".join(parts)) for n, parts in out.items()}


CODE = {p: _code_lines(p) for p in sorted((ROOT / "stratagem").rglob("*.py"))}


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_each_derived_size_is_defined_once(name: str) -> None:
    pattern = re.compile(DERIVED[name])
    found = [f"{p.relative_to(ROOT)}:{n}: {code}" for p, lines in CODE.items() for n, code in lines.items()
             if pattern.search(code)]
    assert [f for f in found if f.startswith("stratagem/spaces/groups.py")], f"{name}: the pattern finds no definition"
    assert [f for f in found if not f.startswith("stratagem/spaces/groups.py")] == [], (
        f"{name} derived outside spaces/groups.py:\n" + "\n".join(found))


def test_one_plan_and_the_columns_agree() -> None:
    scn = Scenario(model=model_preset("mixtral-8x7b"), cluster=cluster_preset("h200", 64),
                   training={"seq_len": 4096, "global_batch_size": 512})
    pc = SearchSpace(scn).enumerate()
    idx = np.random.default_rng(0).choice(len(pc), size=200, replace=False)
    for i in idx:
        plan = pc.plan(int(i))
        one = PlanColumns.from_plans([plan])
        for f in (dp_shard, shard_group, expert_data_parallel, uses_fsdp):
            assert f(plan) == f(one)[0], (f.__name__, plan.short())
        assert micro_batches(plan, 512) == micro_batches(one, 512)[0]
    assert shard_group(Plan(dp=8, cp=2, dp_replicate=4)) == 4 and dp_shard(Plan(dp=8, dp_replicate=4)) == 2
    assert expert_data_parallel(Plan(tp=4, dp=2, ep=8)) == 1
    assert uses_fsdp(Plan(dp=2, zero_stage=2)) and not uses_fsdp(Plan(dp=1, zero_stage=3))
