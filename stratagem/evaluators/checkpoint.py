"""Checkpoint cost and failure exposure: state size, save/stall/load time, job MTBF, interval, goodput loss.

Sources:
  [Young]  Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9):
           tau = sqrt(2 C M).
  [Daly]   Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
           FGCS 22(3), eq. 37: tau = sqrt(2CM) [1 + sqrt(C/2M)/3 + (C/2M)/9] - C for C < 2M, else M.
           Published optima (R = 10 min, C = 5 min): M = 24 h -> 117 min, 6 h -> 57 min, 15 min -> 9.1 min.
  Expected lost fraction of wall time: C/tau (checkpoint stalls) + (tau/2 + lag + R)/M (on each failure half an
  interval of work, the save still in flight, and the restart are lost) [Young sec. 2, Daly sec. 3].
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stratagem.evaluators.memory import training_optimizer_bytes
from stratagem.evaluators.timing import rank_params
from stratagem.spaces.columns import PlanColumns
from stratagem.spaces.groups import shard_group
from stratagem.spaces.scenario import Scenario
from stratagem.spaces.stacks import StackRecord, stack_record
from stratagem.units import GIB

__all__ = ["CHECKPOINT_KEYS", "STAGING_BYTES_S", "young_interval", "daly_interval", "failure_floor",
           "checkpoint_columns"]

Array = NDArray[np.float64]
GB = 1e9

CHECKPOINT_KEYS: tuple[str, ...] = (
    "state_gib", "shard_gib", "save_s", "stall_s", "load_s", "job_mtbf_h", "interval_s", "goodput_loss",
)
# Async save stages each rank's shard from device to pinned host memory: PCIe Gen4 x16 ~25 GB/s one way
# (a GPU of kind "cpu" copies in memory at its own memory bandwidth).
STAGING_BYTES_S = 25e9


def young_interval(cost: Array | float, mtbf: Array | float) -> Array:
    """[Young] optimum compute time between checkpoints: sqrt(2 C M)."""
    c, m = np.asarray(cost, dtype=np.float64), np.asarray(mtbf, dtype=np.float64)
    return np.sqrt(2.0 * c * m)


def daly_interval(cost: Array | float, mtbf: Array | float) -> Array:
    """[Daly] eq. 37 optimum compute time between checkpoints (same unit as the inputs)."""
    c, m = np.asarray(cost, dtype=np.float64), np.asarray(mtbf, dtype=np.float64)
    x = c / (2.0 * m)
    tau = np.sqrt(2.0 * c * m) * (1.0 + np.sqrt(x) / 3.0 + x / 9.0) - c
    return np.where(c < 2.0 * m, tau, m)


def failure_floor(stall_s: float, lag_s: float, restart_s: float, mtbf_s: float) -> float:
    """The least goodput loss any checkpoint interval can reach: stall/tau + tau/(2M) is smallest at
    tau = sqrt(2 stall M) [Young], leaving sqrt(2 stall / M) + (lag + restart) / M."""
    return float(np.sqrt(2.0 * stall_s / mtbf_s) + (lag_s + restart_s) / mtbf_s)


def weights_sharded_from(rec: StackRecord) -> int:
    """The ZeRO stage from which the stack keeps its weights sharded at rest, so a checkpoint writes a shard: its
    record's weights term that exists at every stage (torch: FSDP2's fully_shard keeps sharded parameters from
    ZeRO-2 on, whatever reshard_after_forward, and DCP writes each rank's shard; the others from ZeRO-3)."""
    return min(t.sharded_from for t in rec.states if t.block == "weights" and t.exists_from == 0
               and t.exists_until >= 3)


def checkpoint_columns(scn: Scenario, pc: PlanColumns) -> dict[str, Array]:
    """CHECKPOINT_KEYS for every plan (times in seconds, sizes in GiB, MTBF in hours)."""
    m, tr, cl = scn.model, scn.training, scn.cluster
    policy = tr.checkpoint
    n = len(pc)
    fp32 = pc.fp32
    # Saved per parameter: the weights as the stack keeps them (torch: the fp32 params are the master copy;
    # others: bf16 weights + the master the optimizer keeps: Megatron's / DeepSpeed's fp32 copy, TE FusedAdam's
    # 16-bit remainders, none for torch Adam on bf16 parameters: the record's master terms) + optimizer states.
    opt = training_optimizer_bytes(scn)
    rec = stack_record(tr.stack)
    no_master = not rec.master_weights
    master = sum(t.bytes_per_param for t in rec.states_for(tr.optimizer_state_dtype) if t.master)
    weight_b = np.where(fp32 | no_master, 4.0, 2.0)
    master_b = np.where(fp32 | no_master, 0.0, master)
    state = m.num_params() * (weight_b + master_b + opt)

    # Largest per-rank write: its share of weights (replicas deduplicated: written once per dp group) and of
    # the optimizer (sharded over dp x cp from ZeRO-1 on).
    dense, expert = rank_params(scn, pc)
    shard_n = shard_group(pc)
    z = pc.zero_stage
    held = dense + expert
    weights_sharded = z >= weights_sharded_from(stack_record(tr.stack))
    shard = held * (weight_b / np.where(weights_sharded, shard_n, 1.0) + (master_b + opt) / np.where(z >= 1, shard_n, 1.0))

    write_bw = min(cl.storage_write_gbps, cl.node_storage_gbps * cl.num_nodes) * GB
    read_bw = min(cl.storage_read_gbps, cl.node_storage_gbps * cl.num_nodes) * GB
    save = state / write_bw
    load = state / read_bw
    staging = STAGING_BYTES_S if cl.gpu.kind == "gpu" else cl.gpu.hbm_tbps * 1e12
    stall = save if policy.mode == "blocking" else shard / staging
    lag = np.where(policy.mode == "async", save - stall, 0.0)

    mtbf_h = cl.node_mtbf_hours / cl.num_nodes
    mtbf = mtbf_h * 3600.0
    if policy.interval_minutes is not None:
        interval = np.full(n, policy.interval_minutes * 60.0)
    else:
        # async: a save may not start before the previous one is written (its lag) plus the Daly interval of
        # compute after it, so the interval never falls below what the storage sustains
        interval = daly_interval(stall, mtbf) + lag
    restart = policy.restart_minutes * 60.0 + load
    loss = np.minimum(1.0, stall / interval + (interval / 2.0 + lag + restart) / mtbf)
    return {
        "state_gib": state / GIB, "shard_gib": shard / GIB, "save_s": save, "stall_s": stall, "load_s": load,
        "job_mtbf_h": np.full(n, mtbf_h), "interval_s": interval, "goodput_loss": loss,
    }
