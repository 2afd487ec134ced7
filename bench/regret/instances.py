"""Benchmark instances: tables of measured outcomes (every candidate's outcome known) and the truth a method is
judged against.

A plan's outcome is a distribution (stratagem.evaluators.table: one sample per real run). A method DECIDES on
what its runs show: each run draws one sample with the method's own seeded generator (an OOM draw of a plan that
usually runs is an OOM to the method). It is JUDGED on the plan's median sample (what the user would get): the
true best is the highest median, and a plan counts as the best when its median is within the table's measured
noise of it (OutcomeTable.within_noise, epsilon by stratagem.evaluators.table.EPSILON_RULE; 0 for tables of
single measurements such as the published sweep, where only the best plan itself counts).

Each instance's plans are named by their canonical plan in the instance's scenario (spaces/canonical.py: the one
Plan for the job a plan builds): a table row measured as `dp2 pp2 z3` on torch (the harness keeps parameters
gathered with pp: ZeRO-2's job) or as 1f1b with one micro-batch (gpipe's job) is that job, and the loop stores
and excludes its runs by the canonical plan's key (search.records.plan_key). Two rows naming one job would keep
the first (none does in these tables; counted as `duplicate`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from stratagem.evaluators.table import OutcomeTable, TableOutcome
from stratagem.spaces import Plan, format_plan, parse_plan, violations
from stratagem.spaces.canonical import canonical_plan

__all__ = ["Instance", "Truth", "Runner", "sweep_instances", "table_instance", "canonical_table"]


class Instance:
    """One benchmark instance: its table and where it came from (sweep group or measured table)."""

    def __init__(self, table: OutcomeTable, model: str = "", nodes: int = 0) -> None:
        self.table = table
        self.model = model
        """The sweep group's model size ('' for a measured table)."""
        self.nodes = nodes
        """The sweep group's node count (0 for a measured table)."""

    @property
    def name(self) -> str:
        """The table's name."""
        return self.table.name


def sweep_instances(path: Path) -> tuple[list[Instance], dict[str, int]]:
    """One instance per (model, nodes) group of a playbook-format sweep; counts of runs left out."""
    data = json.loads(path.read_text())
    meta = data["meta"]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    dropped = {"contradictory_batch": 0, "duplicate": 0, "invalid": 0}
    for r in data["runs"]:
        if r["dp"] * r["mbs"] * r["gas"] != r["gbs"]:
            dropped["contradictory_batch"] += 1
            continue
        groups[(r["model"], int(r["nodes"]))].append(r)
    out = []
    for (model, nodes), runs in sorted(groups.items(), key=lambda kv: (float(kv[0][0].rstrip("B")), kv[0][1])):
        m = meta["models"][model]
        scenario = {
            "model": {"name": f"nanotron-{model}", **{k: m[k] for k in (
                "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "tied_embeddings")}},
            "cluster": {"gpu": "h100-sxm-80g", "num_nodes": nodes, "gpus_per_node": 8},
            # meta["training"]: seq 4096, bf16, AdamW, no recompute, SP when tp > 1, 1F1B; gbs = dp*mbs*gas (256).
            "training": {"seq_len": 4096, "global_batch_size": runs[0]["gbs"], "optimizer": "adamw",
                         "stack": "nanotron"},
            "search": {"precision": "bf16", "activation_checkpointing": "none", "pp_schedule": "1f1b",
                       "cross_node_tp": "allow"},
        }
        table = OutcomeTable(name=f"{model} x {nodes} nodes", scenario=scenario, runs=[],
                             meta={"source": meta.get("source", str(path))})
        scn = table.load_scenario()
        outcomes: dict[str, TableOutcome] = {}
        for r in runs:
            plan = Plan(dp=r["dp"], tp=r["tp"], pp=r["pp"], zero_stage=r["zero"], micro_batch_size=r["mbs"],
                        sequence_parallel=r["tp"] > 1)
            if violations(scn, plan):
                dropped["invalid"] += 1
                continue
            key = format_plan(canonical_plan(scn, plan))
            if key in outcomes:  # the same plan measured twice: a tabular benchmark keeps one outcome, the first
                dropped["duplicate"] += 1
                continue
            outcomes[key] = TableOutcome.single(plan=key, status="ok", tokens_per_s_per_gpu=float(r["tok_s_gpu"]),
                                                peak_gib=float(r["mem_gb"]))
        if len(outcomes) >= 2:
            out.append(Instance(table.model_copy(update={"runs": list(outcomes.values())}), model, nodes))
    return out, dropped


def canonical_table(table: OutcomeTable) -> tuple[OutcomeTable, int]:
    """`table` with each row named by its canonical plan (module docstring); rows naming a job already seen are
    left out (the first kept). Returns the table and how many rows were left out."""
    scn = table.load_scenario()
    rows: dict[str, TableOutcome] = {}
    for r in table.runs:
        key = format_plan(canonical_plan(scn, parse_plan(r.plan)))
        rows.setdefault(key, r.model_copy(update={"plan": key}))
    return table.model_copy(update={"runs": list(rows.values())}), len(table.runs) - len(rows)


def table_instance(table: OutcomeTable) -> Instance:
    """A measured table as one instance, its plans canonical (module docstring)."""
    return Instance(canonical_table(table)[0])


class Truth:
    """What a method is judged against: each candidate's median value (tokens/s/GPU, 0 for a median run that
    failed), the best of them and the noise tolerance epsilon."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.table = instance.table
        self.scenario = self.table.load_scenario()
        self.plans = self.table.plans()
        self.keys = [format_plan(p) for p in self.plans]
        self.outcomes = self.table.outcomes()
        self.value = {k: o.value for k, o in self.outcomes.items()}
        """Plan key -> the median sample's value (what the user gets)."""
        self.best = max(self.value.values())
        self.epsilon = self.table.noise_epsilon()
        """Relative tolerance within which a plan counts as the best (the table's measured noise)."""
        self.noisy = any(len(o.samples) > 1 for o in self.outcomes.values())
        """Whether any plan has more than one sample (a method's draws then depend on its seed)."""
        # OutcomeTable.within_noise's rule, computed once: median >= best median x (1 - epsilon)
        self.best_keys = {k for k, v in self.value.items() if self.best > 0 and v >= self.best * (1 - self.epsilon)}
        """Plans that count as the best."""

    def is_best(self, key: str) -> bool:
        """Whether the plan's median is within the measured noise of the best median (OutcomeTable.within_noise)."""
        return key in self.best_keys

    def failed_median(self, key: str) -> bool:
        """Whether the plan's median run failed (OOM or crash)."""
        return self.value[key] <= 0


class Runner:
    """A method's real runs on one instance: each run of a plan draws one of its samples (seeded); records the
    order, what each run showed, and what the method would recommend after each run."""

    def __init__(self, truth: Truth, rng: np.random.Generator) -> None:
        self.truth = truth
        self.rng = rng
        self.order: list[str] = []
        """Plan key per run, in order (a plan may be run again)."""
        self.seen: list[float] = []
        """What each run showed: the drawn sample's value (0 for a failed run)."""
        self.oom: list[bool] = []
        """Whether each run's drawn sample failed."""
        self.candidate: list[bool] = []
        """Whether each run may be recommended (False for a procedure's profiling run, which it never picks)."""
        self.last_peak: float | None = None
        """Peak memory (GiB) of the last run's drawn sample (None when it failed)."""

    def run(self, key: str, candidate: bool = True) -> float:
        """Spend one run on `key`; the drawn sample's value."""
        out = self.truth.outcomes[key]
        sample = out.samples[int(self.rng.integers(len(out.samples)))] if len(out.samples) > 1 else out.samples[0]
        self.order.append(key)
        self.seen.append(sample.value)
        self.oom.append(sample.status != "ok")
        self.candidate.append(candidate)
        self.last_peak = sample.peak_gib if sample.status == "ok" else None
        return sample.value

    def promote(self, key: str) -> None:
        """Let the runs of `key` be recommended (a profiling run whose setting a later step would run as is)."""
        self.candidate = [c or k == key for k, c in zip(self.order, self.candidate, strict=True)]

    def record(self, key: str, value: float) -> None:
        """A run spent elsewhere (the loop's evaluator): its plan and the value it showed."""
        self.order.append(key)
        self.seen.append(value)
        self.oom.append(value <= 0)
        self.candidate.append(True)

    def ran(self, key: str) -> bool:
        """Whether `key` has been run."""
        return key in self.order

    def observed(self, key: str) -> float:
        """The mean of what the runs of `key` showed (0 if never run)."""
        xs = [v for k, v in zip(self.order, self.seen, strict=True) if k == key]
        return float(np.mean(xs)) if xs else 0.0
