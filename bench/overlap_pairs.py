"""Published with/without pairs that isolate one overlap or schedule mechanism, predicted by the analytic model.

Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch 1963fc8, torchao eab345c, torchtitan
9dec370; Grand Teton, H100 96 GB HBM2e at the 500 W default power limit, 400 Gb/s RDMA per GPU; TPS/GPU read at
step 90; memory = the largest over ranks):
  Table 4  Llama 3.1 70B, 256 GPUs (FSDP 32, TP 8), torch.compile + Float8, local batch 16, global 512, full AC:
           2D 829 tok/s/GPU (71.9 GiB), 2D + AsyncTP 876 (67.6 GiB).
  Table 5  Llama 3.1 405B, 512 GPUs (FSDP 8, TP 8, PP 8), torch.compile + Float8 + AsyncTP, local batch 32,
           global 256, full AC: 1F1B 100 tok/s/GPU (82.5 GiB), Interleaved 1F1B 128 (72.7 GiB). torchtitan 9dec370
           splits the local batch into pipeline_parallel_degree micro-batches when none are set
           (parallelisms/pipelining_utils.py build_pipeline_schedule): 8 micro-batches of 4 sequences; looped
           schedules get 2 stages per rank (generate_split_points).
Sequence length 8192 (train_configs llama3_70b.toml / llama3_405b.toml), tensorwise float8 (torchao's default then).

    .venv/bin/python bench/overlap_pairs.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stratagem.evaluators import Calibration, evaluate_many  # noqa: E402
from stratagem.evaluators.memory import rank_memory_columns  # noqa: E402
from stratagem.spaces import MODEL_PRESETS, ClusterSpec, Plan, Scenario, TrainingSpec, gpu_preset  # noqa: E402
from stratagem.spaces.columns import PlanColumns  # noqa: E402
from stratagem.units import GIB  # noqa: E402

# (label, model, gpus, global batch, async TP, plan fields, measured tok/s/GPU, measured GiB)
PAIRS: tuple[tuple[str, tuple[tuple[str, str, int, int, bool, dict[str, object], float, float], ...]], ...] = (
    ("torchtitan 70B async TP (Table 4)", (
        ("2D", "llama3-70b", 256, 512, False, dict(dp=32, tp=8, micro_batch_size=16), 829.0, 71.9),
        ("2D + AsyncTP", "llama3-70b", 256, 512, True, dict(dp=32, tp=8, micro_batch_size=16), 876.0, 67.6))),
    ("torchtitan 405B schedules (Table 5)", (
        ("1F1B", "llama3-405b", 512, 256, True, dict(dp=8, tp=8, pp=8, micro_batch_size=4, pp_schedule="1f1b"),
         100.0, 82.5),
        ("Interleaved 1F1B", "llama3-405b", 512, 256, True,
         dict(dp=8, tp=8, pp=8, micro_batch_size=4, pp_schedule="interleaved", virtual_stages=2), 128.0, 72.7))),
)


def _case(model: str, gpus: int, gbs: int, async_tp: bool, fields: dict[str, object]) -> tuple[Scenario, Plan]:
    cluster = ClusterSpec(gpu=gpu_preset("h100-96g"), num_nodes=gpus // 8, gpus_per_node=8, power_cap_w=500.0)
    training = TrainingSpec(seq_len=8192, global_batch_size=gbs, stack="torch", compile=True, precision="fp8",
                            tp_comm_overlap=async_tp)
    plan = Plan(zero_stage=3, sequence_parallel=True, precision="fp8", activation_checkpointing="full",
                **fields)  # type: ignore[arg-type]
    return Scenario(model=MODEL_PRESETS[model], cluster=cluster, training=training), plan


def _order(first: float, second: float) -> str:
    return "same" if abs(second - first) < 0.05 else ("lower" if second < first else "higher")


def pairs_report(cal: Calibration | None = None) -> list[str]:
    """One line per run (measured -> predicted tok/s/GPU and memory: the worst rank, and rank 0) and per pair
    (measured vs predicted ratio)."""
    lines = []
    for title, runs in PAIRS:
        lines.append(f"  {title}:")
        got = []
        for label, model, gpus, gbs, atp, fields, tps, gib in runs:
            scn, plan = _case(model, gpus, gbs, atp, fields)
            f = evaluate_many(scn, [plan], cal)
            pred = float(f.tokens_per_s_per_gpu[0])
            first = float(rank_memory_columns(scn, PlanColumns.from_plans([plan]), cal or Calibration(),
                                              "first")["peak"][0]) / GIB
            got.append((tps, pred, gib, float(f.peak_gib[0]), first))
            lines.append(f"    {label:18s} {tps:6.0f} -> {pred:6.0f} tok/s/GPU ({pred / tps - 1:+.1%}); memory "
                         f"{gib:.1f} -> {float(f.peak_gib[0]):.1f} GiB (stage {int(f.worst_stage[0])}), rank 0 "
                         f"{first:.1f} GiB")
        (m0, p0, g0, w0, r0), (m1, p1, g1, w1, r1) = got
        lines.append(f"    ratio measured {m1 / m0:.3f}, predicted {p1 / p0:.3f}; memory of the second run: measured "
                     f"{_order(g0, g1)}, predicted worst rank {_order(w0, w1)}, rank 0 {_order(r0, r1)}")
    return lines


if __name__ == "__main__":
    print("published with/without pairs (measured -> predicted):")
    print("\n".join(pairs_report()))
