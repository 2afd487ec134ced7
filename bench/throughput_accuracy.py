"""How well the analytic time model predicts published throughput.

Predicts tokens/s/GPU for the nanotron playbook sweep (`playbook_sweep_calibration.json`, field tok_s_gpu) and
torchtitan's tables, and TFLOP/s/GPU for Megatron-LM's H100 table (`published_cases_calibration.json`), then
prints MAPE per source and overall, the worst 10 with the terms of their predicted step, and the nccl-tests
bus bandwidth the collective model predicts next to the measured one. The figure is printed last.

    .venv/bin/python bench/throughput_accuracy.py            # with stratagem's default calibration
    .venv/bin/python bench/throughput_accuracy.py --fit      # refit the time constants on this set, print them

Reference directory: $STRATAGEM_REFERENCE, else bench/reference (the repository's copy; see its README).

Assumptions for what the sources do not state (each one printed with the run):
  sweep       nanotron stack (fp32 grad accumulation buffers), bf16, AdamW, no recompute, SP when tp > 1, 1F1B,
              global batch = dp x mbs x gas (4 runs record gbs 256 but ran dp x mbs x gas = 4096); P2P metadata
              polled with 0.1 s sleeps when pp > 1 (nanotron nouamane/bench2 from 67c5ebb6: Calibration.p2p_poll_s,
              read from the code, not fitted). The sweep mixes runs from before and after that commit without
              recording which: the bench prints how many pp > 1 runs each version explains, and the figure over all
              points and over the subset of SUBSET_RULE.
  torchtitan  torch stack on h100-96g (Grand Teton, 500 W power cap as the source states: cluster.power_cap_w) /
              h200, FSDP2 = ZeRO-3 over dp_shard x cp, bf16 or fp8 linears (tensorwise, the torchao default),
              training.compile as each case records, global batch = dp_shard x micro-batch where not stated.
  megatron    megatron stack (distributed optimizer = ZeRO-1), micro-batch 1, SP when tp > 1, GPT (GELU 4h, MHA,
              LayerNorm, untied), bf16, no recompute, pp > 1: interleaved with 2 chunks per stage (the
              README enables overlap of DP/TP/PP traffic but states neither micro-batch nor schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from overlap_pairs import pairs_report  # noqa: E402

from stratagem.evaluators import DEFAULT_CALIBRATION, Calibration, evaluate_many  # noqa: E402
from stratagem.evaluators.comm import bus_bandwidth_gbps  # noqa: E402
from stratagem.evaluators.speed import FP8_SCALE_BYTES  # noqa: E402
from stratagem.evaluators.timing import megatron_flops_per_token  # noqa: E402
from stratagem.spaces import (  # noqa: E402
    MODEL_PRESETS,
    ClusterSpec,
    ModelSpec,
    Plan,
    Scenario,
    TrainingSpec,
    gpu_preset,
)
from stratagem.spaces.columns import PlanColumns  # noqa: E402
from stratagem.spaces.plan import Precision, Recompute  # noqa: E402
from stratagem.spaces.stacks import STACKS  # noqa: E402

TIME_FIELDS = ("matmul_efficiency", "attention_efficiency", "half_efficiency_gflop", "layer_floor_ms", "overlap",
               "step_overhead_s")
# The collective constants are fitted on the nccl-tests bus bandwidths (what they describe), not here:
COMM_FIELDS = ("link_efficiency", "collective_step_us")


def reference_dir() -> Path:
    env = os.environ.get("STRATAGEM_REFERENCE")
    path = Path(env) if env else ROOT / "bench" / "reference"
    if not (path / "published_cases_calibration.json").exists():
        sys.exit(f"reference data not found in {path}; set STRATAGEM_REFERENCE")
    return path


@dataclass(frozen=True)
class Point:
    """One measured run: the scenario and plan to predict, what was measured, and how to compare."""

    source: str
    label: str
    scenario: Scenario
    plan: Plan
    measured: float
    unit: str  # "tok/s/gpu" or "TFLOP/s/gpu"


def _cluster(gpu: str, gpus: int, power_cap_w: float = 0.0) -> ClusterSpec:
    per_node = min(8, gpus)
    return ClusterSpec(gpu=gpu_preset(gpu), num_nodes=gpus // per_node, gpus_per_node=per_node,
                       power_cap_w=power_cap_w)


def sweep_points(ref: Path) -> list[Point]:
    data = json.loads((ref / "playbook_sweep_calibration.json").read_text())
    models = {
        name: ModelSpec(name=f"nanotron-{name}", num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                        num_attention_heads=m["num_attention_heads"], num_kv_heads=m["num_kv_heads"],
                        ffn_hidden_size=m["ffn_hidden_size"], vocab_size=m["vocab_size"],
                        tied_embeddings=m["tied_embeddings"])
        for name, m in data["meta"]["models"].items()
    }
    points = []
    for r in data["runs"]:
        gbs = r["dp"] * r["mbs"] * r["gas"]
        scn = Scenario(model=models[r["model"]], cluster=_cluster("h100-sxm-80g", 8 * r["nodes"]),
                       training=TrainingSpec(seq_len=4096, global_batch_size=gbs, stack="nanotron"))
        plan = Plan(dp=r["dp"], tp=r["tp"], pp=r["pp"], zero_stage=r["zero"], micro_batch_size=r["mbs"],
                    sequence_parallel=r["tp"] > 1)
        label = (f"sweep {r['model']} {r['nodes']}n dp{r['dp']} tp{r['tp']} pp{r['pp']} z{r['zero']} "
                 f"mbs{r['mbs']} gas{r['gas']}")
        if r["gbs"] != gbs:
            CONTRADICTORY.add(label)
        points.append(Point("sweep", label, scn, plan, float(r["tok_s_gpu"]), "tok/s/gpu"))
    return points


def _model(m: dict[str, Any], gpt: bool) -> ModelSpec:
    kw: dict[str, Any] = dict(name=m["name"], num_layers=m["layers"], hidden_size=m["hidden"],
                              num_attention_heads=m["heads"], num_kv_heads=m["kv_heads"],
                              ffn_hidden_size=m["ffn"], vocab_size=m["vocab"], tied_embeddings=m["tied"])
    if gpt:
        kw.update(mlp="gelu", norm="layernorm", bias="all", position_embedding="rope")
    return ModelSpec(**kw)


def published_points(ref: Path) -> list[Point]:
    data = json.loads((ref / "published_cases_calibration.json").read_text())
    points = []
    for c in data["cases"]:
        cid, par, tr = c["id"], c.get("parallel", {}), c.get("training", {})
        if cid.startswith("tt-"):
            gpu = "h200" if "h200" in cid else "h100-96g"
            dp, cp = par["dp_shard"], par.get("cp", 1)
            mbs = tr["micro_batch"]
            gbs = tr.get("global_batch", dp * mbs)
            ac: Recompute = "full" if tr["activation_checkpointing"].startswith("full") else "selective"
            precision: Precision = "fp8" if "fp8" in tr["precision"] else "bf16"
            cap = 500.0 if "500W power cap" in json.dumps(c) else 0.0
            scn = Scenario(model=_model(c["model"], gpt=False), cluster=_cluster(gpu, par["gpus"], cap),
                           training=TrainingSpec(seq_len=tr["seq_len"], global_batch_size=gbs, stack="torch",
                                                 compile=bool(tr.get("compile", False)), precision=precision))
            plan = Plan(dp=dp, cp=cp, zero_stage=3, micro_batch_size=mbs, precision=precision,
                        activation_checkpointing=ac)
            points.append(Point("torchtitan", cid, scn, plan, float(c["measured"]["tokens_per_s_per_gpu"]),
                                "tok/s/gpu"))
        elif cid.startswith("mlm-"):
            tp, pp = par["tp"], par["pp"]
            scn = Scenario(model=_model(c["model"], gpt=True), cluster=_cluster("h100-sxm-80g", par["gpus"]),
                           training=TrainingSpec(seq_len=tr["seq_len"], global_batch_size=tr["global_batch"],
                                                 stack="megatron"))
            plan = Plan(dp=par["dp"], tp=tp, pp=pp, zero_stage=1, micro_batch_size=1, sequence_parallel=tp > 1,
                        pp_schedule="interleaved" if pp > 1 else "1f1b", virtual_stages=2 if pp > 1 else 1)
            points.append(Point("megatron", cid, scn, plan, float(c["measured"]["tflops_per_gpu"]),
                                "TFLOP/s/gpu"))
    return points


def moe_points(ref: Path) -> list[Point]:
    """Published MoE runs (published_moe_runs.json): Megatron-Core layouts on H100 (and DeepSeek-V3 on H800), each
    with its dispatcher, EP overlap, recompute, pipeline split and fp8 recipe as published; source "moe", "moe-check"
    (not fitted, but read while mechanisms were chosen: steered) or "moe-held" (steered false: the held-out set
    nobody models against). Not part of --fit."""
    path = ref / "published_moe_runs.json"
    if not path.exists():
        return []
    points = []
    for r in json.loads(path.read_text())["runs"]:
        gpus, tp, pp, cp = r["gpus"], r["tp"], r["pp"], r["cp"]
        if r["gpu"] == "h800":  # H100 silicon, NVLink cut to 400 GB/s bidirectional (200 one way), 8 x 400 Gb/s IB
            cluster = ClusterSpec(gpu={"preset": "h100-sxm-80g", "name": "h800"}, num_nodes=gpus // 8,
                                  gpus_per_node=8, intra_node_gbps=200, inter_node_gbps=50)
        else:
            cluster = _cluster(r["gpu"], gpus)
        precision: Precision = "fp8" if r["precision"] == "fp8" else "bf16"
        training = TrainingSpec(seq_len=r["seq"], global_batch_size=r["gbs"], stack="megatron", precision=precision,
                                fp8_recipe=r.get("fp8_recipe"), moe_dispatcher=r["dispatcher"],
                                ep_comm_overlap=r["a2a_overlap"],
                                activation_func_fp8_input_store=bool(r.get("activation_func_fp8_input_store")),
                                optimizer_state_dtype=r.get("optimizer_state_dtype") or "fp32",
                                grad_dtype=r.get("grad_dtype"), grad_reduce_dtype=r.get("grad_reduce_dtype"),
                                tp_comm_overlap=r.get("tp_comm_overlap"))
        scn = Scenario(model=MODEL_PRESETS[r["model"]], cluster=cluster, training=training)
        vp = r["vp"]
        plan = Plan(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=r["ep"], etp=r["etp"],
                    zero_stage=3 if r["fsdp"] else 1, micro_batch_size=r["mbs"], sequence_parallel=tp > 1,
                    precision=precision, activation_checkpointing=r["recompute"],
                    recompute_modules=tuple(r.get("recompute_modules", ())),
                    pp_schedule="interleaved" if vp > 1 else "1f1b", virtual_stages=vp,
                    pp_split=r.get("pp_split", "layers"))
        meas = r["measured"]
        tps = meas.get("tokens_per_s_per_gpu") or r["gbs"] * r["seq"] / (meas["step_s"] * gpus)
        source = "moe-held" if not r.get("steered", True) else "moe-check" if r["check"] else "moe"
        points.append(Point(source, r["id"], scn, plan, float(tps), "tok/s/gpu"))
    return points


def moe_report(points: list[Point], cal: Calibration) -> list[str]:
    """Per published MoE run: measured -> predicted tokens/s/GPU, its error and the step's EP / TP / compute shares."""
    if not points:
        return []
    pred, parts = predict(points, cal)
    err = ape(pred, points)
    lines = ["published MoE runs (measured -> predicted tok/s/GPU; step shares: compute, EP comm, TP comm, bubble):"]
    for i, p in enumerate(points):
        pt = parts[i]
        step = pt["step_s"]
        lines.append(f"  {p.source:9s} {p.label:42s} {p.measured:7,.0f} -> {pred[i]:7,.0f} ({pred[i] / p.measured - 1:+.0%})"
                     f"  [compute {pt['compute_s'] / step:.0%}, EP {pt['ep_comm_s'] / step:.0%}, "
                     f"TP {pt['tp_comm_s'] / step:.0%}, bubble {pt['bubble_s'] / step:.0%}]")
    for src in ("moe", "moe-check", "moe-held"):
        mask = np.array([p.source == src for p in points])
        if mask.any():
            lines.append(f"  {src:9s} n={mask.sum():3d}  MAPE {np.mean(err[mask]):6.1%}  median APE "
                         f"{np.median(err[mask]):6.1%}")
    pair = {p.label: pred[i] / p.measured for i, p in enumerate(points)}
    a, b = "modelzoo-qwen3-235b-ep32-pp8", "modelzoo-qwen3-235b-tp4-ep8-pp8"
    if a in pair and b in pair:
        ia = next(i for i, p in enumerate(points) if p.label == a)
        ib = next(i for i, p in enumerate(points) if p.label == b)
        lines.append(f"  cross-node EP32 / intra-node TP4 x EP8 speed: measured {points[ia].measured / points[ib].measured:.2f}x, "
                     f"predicted {pred[ia] / pred[ib]:.2f}x")
    return lines


# The sweep's software (not fitted): nanotron's benchmark branch polls pipeline P2P metadata with 0.1 s sleeps from
# commit 67c5ebb6 on (Calibration.p2p_poll_s). Which runs used that code is not recorded (see SUBSET_RULE).
SWEEP_P2P_POLL_S = 0.1


def source_calibration(source: str, cal: Calibration, sweep_poll_s: float = SWEEP_P2P_POLL_S) -> Calibration:
    """The calibration a source's points are predicted with: the fitted constants + that source's stated software."""
    return cal.model_copy(update={"p2p_poll_s": sweep_poll_s}) if source == "sweep" else cal


def predict(points: list[Point], cal: Calibration,
            sweep_poll_s: float = SWEEP_P2P_POLL_S) -> tuple[np.ndarray, list[dict[str, float]]]:
    """Predicted value of every point (same unit as measured) and its step breakdown."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, p in enumerate(points):
        groups[(p.source, p.scenario.model_dump_json())].append(i)
    pred = np.zeros(len(points))
    parts: list[dict[str, float]] = [{} for _ in points]
    for (source, _), idx in groups.items():
        scn = points[idx[0]].scenario
        cols = evaluate_many(scn, PlanColumns.from_plans([points[i].plan for i in idx]),
                             source_calibration(source, cal, sweep_poll_s))
        for j, i in enumerate(idx):
            p = points[i]
            if p.unit == "TFLOP/s/gpu":
                m = scn.model
                flops = megatron_flops_per_token(m.num_layers, m.hidden_size, scn.training.seq_len, m.vocab_size)
                pred[i] = flops * cols.tokens_per_s_per_gpu[j] / 1e12
            else:
                pred[i] = cols.tokens_per_s_per_gpu[j]
            parts[i] = {k: float(getattr(cols, k)[j]) for k in ("compute_s", "recompute_s", "tp_comm_s", "ep_comm_s",
                                                                "pp_comm_s",
                                                      "cp_comm_s", "bubble_s", "exposed_comm_s", "optimizer_s",
                                                      "overhead_s", "step_s")}
    return pred, parts


def ape(pred: np.ndarray, points: list[Point]) -> np.ndarray:
    meas = np.array([p.measured for p in points])
    out: np.ndarray = np.abs(pred - meas) / meas
    return out


def nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: np.ndarray, iters: int) -> np.ndarray:
    """Minimise f from x0 (Nelder & Mead 1965, standard coefficients 1, 2, 0.5, 0.5)."""
    simplex = [x0] + [x0 + np.eye(len(x0))[i] * step[i] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        centroid = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        xr = centroid + (centroid - worst)
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - worst)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (worst - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best] + [best + 0.5 * (x - best) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    winner: np.ndarray = simplex[int(np.argmin(values))]
    return winner


# Fitted in log space so every constant stays positive; efficiencies are clipped to their bounds.
def _decode(x: np.ndarray) -> Calibration:
    v: dict[str, Any] = dict(zip(TIME_FIELDS, np.exp(x[: len(TIME_FIELDS)]), strict=True))
    for k in ("matmul_efficiency", "attention_efficiency", "overlap"):
        v[k] = min(v[k], 1.0)
    return START.model_copy(update=v)


START = DEFAULT_CALIBRATION


def fit(points: list[Point], start: Calibration, iters: int) -> Calibration:
    x0 = np.log(np.array([max(getattr(start, k), 1e-3) for k in TIME_FIELDS]))

    meas = np.array([p.measured for p in points])
    sources = [np.array([p.source == s for p in points]) for s in sorted({p.source for p in points})]

    def loss(x: np.ndarray) -> float:
        # |log(pred / measured)| capped at log 2 (a run more than 2x off, e.g. a failing node, weighs no more
        # than any other miss), averaged per source, then over sources (each source counts the same).
        pred, _ = predict(points, _decode(x))
        r = np.minimum(np.abs(np.log(pred / meas)), np.log(2.0))
        return float(np.mean([r[s].mean() for s in sources]))

    return _decode(nelder_mead(loss, x0, np.full(len(x0), 0.3), iters))


def nccl_report(ref: Path, cal: Calibration) -> list[str]:
    data = json.loads((ref / "published_cases_calibration.json").read_text())
    lines = ["nccl-tests busbw, 256 MB, H100 8/node (measured -> predicted GB/s):"]
    by_kind: dict[str, list[str]] = defaultdict(list)
    for c in data["cases"]:
        if c["kind"] != "collective_bandwidth":
            continue
        kind = c["id"].split("-")[1]
        n, nodes = c["parallel"]["gpus"], c["parallel"]["nodes"]
        cluster = ClusterSpec(gpu=gpu_preset("h100-sxm-80g"), num_nodes=nodes, gpus_per_node=8)
        pred = bus_bandwidth_gbps(cluster, cal, kind, n, c["training"]["message_bytes"])
        by_kind[kind].append(f"{nodes}n {c['measured']['busbw_GBps']:.0f}->{pred:.0f}")
    for kind, row in by_kind.items():
        lines.append(f"  {kind:15s} " + ", ".join(row))
    return lines


SUBSET_RULE = (
    "all points except the sweep's runs with pp > 1: the sweep ran two versions of nanotron's pipeline P2P code "
    "(nouamane/bench2 before 67c5ebb6: no polling; from it on: 0.1 s sleep polls per metadata message, "
    "Calibration.p2p_poll_s) and does not record which run used which, so no single model of those runs is right "
    "(the line above counts the runs each version explains); and the 4 sweep runs whose stated global batch "
    "(gbs 256) contradicts dp x mbs x gas (4096)"
)


def in_subset(p: Point) -> bool:
    """The documented subset (SUBSET_RULE): a rule on stated configuration, never on the error."""
    if p.source != "sweep":
        return True
    return p.plan.pp == 1 and p.label not in CONTRADICTORY


CONTRADICTORY: set[str] = set()  # labels of sweep runs whose recorded gbs != dp x mbs x gas (filled by sweep_points)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Spearman 1904): Pearson correlation of the ranks, ties given their mean rank."""
    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties: mean rank
            tied = v == value
            r[tied] = r[tied].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def ranking_report(points: list[Point], pred: np.ndarray, top: int = 5) -> tuple[list[str], float, int, int]:
    """Per (model, nodes) group of the sweep: Spearman of predicted vs measured tokens/s/GPU, whether the measured
    best run is in the predicted top `top`, and MAPE. Returns the lines, the median Spearman, hits and groups."""
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, p in enumerate(points):
        if p.source == "sweep":
            groups[(p.label.split()[1], p.scenario.cluster.num_nodes)].append(i)
    lines, rhos, hits = [], [], 0
    for (model, nodes), idx in sorted(groups.items(), key=lambda kv: (float(kv[0][0][:-1]), kv[0][1])):
        meas = np.array([points[i].measured for i in idx])
        pr = pred[idx]
        rho = spearman(pr, meas)
        best = int(np.argmax(meas))
        in_top = best in set(np.argsort(-pr)[:top].tolist())
        hits += in_top
        rhos.append(rho)
        mape = float(np.mean(np.abs(pr - meas) / meas))
        lines.append(f"  {model:3s} {nodes:3d} nodes  n={len(idx):3d}  Spearman {rho:+.2f}  measured best in "
                     f"predicted top {top}: {'yes' if in_top else 'no '}  MAPE {mape:6.1%}")
    return lines, float(np.nanmedian(rhos)), hits, len(groups)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true", help="refit the time constants on this set and print them")
    ap.add_argument("--iters", type=int, default=400, help="Nelder-Mead iterations with --fit")
    ap.add_argument("--worst", type=int, default=10)
    args = ap.parse_args()
    ref = reference_dir()
    points = sweep_points(ref) + published_points(ref)
    cal = fit(points, DEFAULT_CALIBRATION, args.iters) if args.fit else DEFAULT_CALIBRATION
    pred, parts = predict(points, cal)
    err = ape(pred, points)
    print(f"reference: {ref}")
    print("calibration: " + ", ".join(f"{k}={getattr(cal, k):.4g}" for k in TIME_FIELDS + COMM_FIELDS))
    print("stack speed terms (spaces/stacks.py): " + ", ".join(
        f"{r.name} kernels {r.kernel_efficiency:g} compile x{r.compile_gain:g}" for r in STACKS.values())
        + "; fp8: datasheet fp8/bf16 peak with the small-GEMM term, scale bytes "
        + ", ".join(f"{k} {v:.3g}" for k, v in FP8_SCALE_BYTES.items())
        + ", routed experts in fp8 on " + ", ".join(r.name for r in STACKS.values() if r.fp8_routed_experts))
    for line in nccl_report(ref, cal):
        print(line)
    print(f"\nworst {args.worst} (measured -> predicted; predicted step terms as % of step):")
    for i in np.argsort(-err)[: args.worst]:
        p, pt = points[i], parts[i]
        step = pt["step_s"]
        terms = ", ".join(f"{k[:-2]} {pt[k] / step:.0%}" for k in ("compute_s", "exposed_comm_s", "tp_comm_s",
                                                                  "pp_comm_s", "bubble_s", "overhead_s"))
        print(f"  {err[i]:7.0%}  {p.label}: {p.measured:,.0f} -> {pred[i]:,.0f} {p.unit}  [{terms}]")
    sources = sorted({p.source for p in points})
    print("\nper source:")
    for s in sources:
        mask = np.array([p.source == s for p in points])
        print(f"  {s:11s} n={mask.sum():4d}  MAPE {np.mean(err[mask]):6.1%}  median APE {np.median(err[mask]):6.1%}")
    # How the error splits by regime (which terms dominate the misses).
    regimes: dict[str, Callable[[Point], bool]] = {
        "one node": lambda p: p.scenario.cluster.num_nodes == 1,
        "tp > gpus/node": lambda p: p.plan.tp > p.scenario.cluster.gpus_per_node,
        "pp > 1 across nodes": lambda p: p.plan.pp > 1 and p.scenario.cluster.num_nodes > 1,
        "no pp, tp <= node": lambda p: p.plan.pp == 1 and p.plan.tp <= p.scenario.cluster.gpus_per_node,
        "  of which <= 16 nodes": lambda p: (p.plan.pp == 1 and p.plan.tp <= p.scenario.cluster.gpus_per_node
                                            and p.scenario.cluster.num_nodes <= 16),
        "64 nodes": lambda p: p.scenario.cluster.num_nodes == 64,
    }
    print("sweep by regime:")
    for name, pick in regimes.items():
        mask = np.array([p.source == "sweep" and pick(p) for p in points])
        if mask.any():
            print(f"  {name:22s} n={mask.sum():4d}  MAPE {np.mean(err[mask]):6.1%}  "
                  f"median APE {np.median(err[mask]):6.1%}")
    published = np.array([p.source != "sweep" for p in points])
    print(f"published cases (torchtitan + Megatron) n={published.sum()}: MAPE {np.mean(err[published]):.1%}")

    # Evidence for the two P2P code versions in the sweep's pipeline runs: how many runs each hypothesis explains.
    piped = np.array([p.source == "sweep" and p.plan.pp > 1 for p in points])
    pred_nopoll, _ = predict(points, cal, sweep_poll_s=0.0)
    err_nopoll = ape(pred_nopoll, points)
    near_poll, near_nopoll = piped & (err <= 0.35), piped & (err_nopoll <= 0.35)
    print(f"sweep pp > 1 (n={piped.sum()}): within 35% with P2P polling {near_poll.sum()}, without "
          f"{near_nopoll.sum()}, either {(near_poll | near_nopoll).sum()}; MAPE with polling "
          f"{np.mean(err[piped]):.1%}, without {np.mean(err_nopoll[piped]):.1%}")
    print()
    for line in moe_report(moe_points(ref), cal):
        print(line)
    rank_lines, rho_median, hits, n_groups = ranking_report(points, pred)
    print("\nranking per (model, nodes) group of the sweep (predicted vs measured tokens/s/GPU):")
    for line in rank_lines:
        print(line)
    subset = np.array([in_subset(p) for p in points])
    print("\npublished with/without pairs (bench/overlap_pairs.py; measured -> predicted):")
    print("\n".join(pairs_report(cal)))
    print(f"\nsubset rule: {SUBSET_RULE}")
    print(f"\npython {platform.python_version()}, numpy {np.__version__}")
    print(f"MAPE over the subset ({subset.sum()} points): {np.mean(err[subset]):.1%} "
          f"(median APE {np.median(err[subset]):.1%})")
    print(f"MAPE over all {len(points)} points: {np.mean(err):.1%} (median APE {np.median(err):.1%})")
    print(f"ranking over {n_groups} sweep groups: median Spearman {rho_median:+.2f}, measured best in predicted "
          f"top 5 in {hits} of {n_groups}")


if __name__ == "__main__":
    main()
