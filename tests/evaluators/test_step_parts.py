"""The step-time parts table (evaluators.step_parts) is the one list: the time model's columns, TimeBreakdown and
PlanFigures carry exactly its names, the terms sum to the step, and each `*_comm_s` means exposed."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from stratagem.evaluators import PlanFigures, TimeBreakdown, evaluate_many
from stratagem.evaluators.calibration import default_calibration
from stratagem.evaluators.step_parts import (
    COMM_TERMS,
    STEP_PARTS,
    TIME_KEYS,
    TIME_TERMS,
    before_overlap,
    term_seconds,
)
from stratagem.evaluators.timing import time_columns
from stratagem.spaces import Plan, Scenario, cluster_preset, model_preset
from stratagem.spaces.columns import PlanColumns

MOE = Scenario(model=model_preset("mixtral-8x7b"), cluster=cluster_preset("h200", 64),
               training={"seq_len": 4096, "global_batch_size": 512, "stack": "megatron"})
PLANS = [Plan(dp=32, tp=2, ep=8, zero_stage=1, sequence_parallel=True), Plan(dp=16, tp=2, pp=2, ep=8, zero_stage=1,
                                                                             sequence_parallel=True),
         Plan(dp=64, ep=8, zero_stage=3)]


def test_every_view_of_the_parts_declares_the_tables_names() -> None:
    assert tuple(TimeBreakdown.model_fields) == TIME_KEYS
    assert set(TIME_KEYS) <= {f.name for f in fields(PlanFigures)}
    cols = time_columns(MOE, PlanColumns.from_plans(PLANS), default_calibration("h200"))
    assert set(TIME_KEYS) <= set(cols)
    assert len({p.name for p in STEP_PARTS}) == len(STEP_PARTS)
    for p in STEP_PARTS:  # a hidden companion is a hidden row of the same group
        if p.hidden:
            h = next(q for q in STEP_PARTS if q.name == p.hidden)
            assert h.meaning == "hidden" and h.group == p.group and p.meaning == "exposed"


def test_terms_sum_to_the_step_and_the_exposed_parts_to_exposed_comm() -> None:
    figs = evaluate_many(MOE, PlanColumns.from_plans(PLANS))
    cols = {k: getattr(figs, k) for k in TIME_KEYS}
    np.testing.assert_allclose(term_seconds(cols).sum(axis=1), figs.step_s, rtol=1e-12)
    np.testing.assert_allclose(sum(cols[k] for k in COMM_TERMS), figs.exposed_comm_s, rtol=1e-12)
    assert TIME_TERMS == ("compute_s", "recompute_s", "tp_comm_s", "ep_comm_s", "cp_comm_s", "pp_comm_s", "dp_comm_s",
                          "bubble_s", "optimizer_s", "overhead_s")  # the calibration files' multiplier names
    assert np.all(figs.ep_comm_s > 0) and np.all(figs.dp_hidden_s >= 0)
    # every exposed part is at most its traffic before overlap
    for k in COMM_TERMS:
        assert np.all(cols[k] <= before_overlap(figs.__dict__, k) + 1e-15)


def test_an_evaluation_stored_before_the_split_reads_with_todays_meanings() -> None:
    old = {"compute_s": 5.0, "recompute_s": 0.0, "tp_comm_s": 0.1, "ep_comm_s": 0.3, "dp_comm_s": 0.9,
           "pp_comm_s": 0.0, "cp_comm_s": 0.0, "bubble_s": 0.0, "optimizer_s": 0.05, "exposed_comm_s": 1.0,
           "overhead_s": 0.05, "step_s": 6.1}
    tm = TimeBreakdown.model_validate(old)
    assert tm.dp_comm_s == pytest.approx(0.6) and tm.dp_hidden_s == pytest.approx(0.3)
    assert float(before_overlap(tm.model_dump(), "dp_comm_s")) == pytest.approx(0.9)
    assert TimeBreakdown.model_validate(tm.model_dump()) == tm  # today's records pass unchanged
