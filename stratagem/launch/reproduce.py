"""Reproduce a stored measured trial: rerun it through Ray with the same harness, plan and seed (or read a
result file from a run made elsewhere, e.g. the exported torchrun command) and compare with what was recorded.

The comparison is data first (`Reproduction`), then printed by the CLI. A metric is flagged when it moved
more than the noise the original run showed: for step time and tokens/s, 3 x the relative standard deviation
of the original timed steps (at least 2%); for peak memory 1% or the allocation granularity, whichever is
larger (2 MiB CUDA blocks; 64 KiB of small buffers on CPU);
losses must agree to 1e-5 relative (same seed, same data, same arithmetic).
The environment is compared first: a different device kind/name or world size, or a different torch
major.minor makes the comparison meaningless and is reported as such (the CLI exits 3).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.errors import StratagemError

if TYPE_CHECKING:
    import optuna

__all__ = ["Comparison", "Reproduction", "environment_differences", "compare_results", "reproduce_trial"]

GIB = float(2**30)


@dataclass(frozen=True)
class Comparison:
    """One metric, recorded vs now."""

    metric: str
    recorded: float
    now: float
    threshold: float
    """Relative difference allowed (the original run's noise)."""
    floor: float = 0.0
    """Absolute difference always allowed (the measurement's granularity), in the metric's unit."""

    @property
    def rel_diff(self) -> float:
        return (self.now - self.recorded) / self.recorded if self.recorded else float("inf")

    @property
    def flagged(self) -> bool:
        return abs(self.now - self.recorded) > max(self.threshold * abs(self.recorded), self.floor)


@dataclass(frozen=True)
class Reproduction:
    """The outcome of reproducing one trial."""

    trial: int
    plan: str
    environment: list[str]
    """Differences that make the comparison meaningless (empty when comparable)."""
    rows: list[Comparison] = field(default_factory=list)
    losses_match: bool | None = None
    """Same loss trajectory (to 1e-5 relative), None when not comparable."""
    log_dir: str = ""

    @property
    def reproduced(self) -> bool:
        return not self.environment and not any(r.flagged for r in self.rows) and self.losses_match is not False


def _peak(result: dict[str, Any]) -> float:
    return float(max(r.get("peak_reserved_bytes", r["peak_bytes"]) for r in result["ranks"])) / GIB


def _memory_granularity(result: dict[str, Any]) -> float:
    """GiB: CUDA's caching allocator reserves 2 MiB blocks; on CPU the tracked live bytes of a step move by
    a few small buffers (gloo work tensors, Python-side scratch) between runs: 64 KiB."""
    return (2.0 if "cuda" in str(result.get("device", "")).lower() or result.get("ranks", [{}])[0].get(
        "peak_reserved_bytes") else 1 / 16) / 1024


def _major_minor(version: str | None) -> str:
    return ".".join((version or "?").split("+")[0].split(".")[:2])


def environment_differences(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two harness results' environments in a way that voids the comparison."""
    out = []
    if recorded.get("device") != now.get("device"):
        out.append(f"device: recorded {recorded.get('device')!r}, now {now.get('device')!r}")
    if recorded.get("world_size") != now.get("world_size"):
        out.append(f"world size: recorded {recorded.get('world_size')}, now {now.get('world_size')}")
    rv, nv = recorded.get("versions", {}).get("torch"), now.get("versions", {}).get("torch")
    if _major_minor(rv) != _major_minor(nv):
        out.append(f"torch: recorded {rv}, now {nv}")
    return out


def compare_results(recorded: dict[str, Any], now: dict[str, Any]) -> tuple[list[Comparison], bool]:
    """Rows for tokens/s, step time and peak memory, and whether the losses match."""
    timed = recorded.get("step_times_s", [])[recorded.get("warmup", 0):] or [recorded["step_s"]]
    spread = statistics.pstdev(timed) / statistics.median(timed) if len(timed) > 1 else 0.0
    time_noise = max(0.02, 3.0 * spread)
    rows = [
        Comparison("tokens/s", float(recorded["tokens_per_s"]), float(now["tokens_per_s"]), time_noise),
        Comparison("step time (s)", float(recorded["step_s"]), float(now["step_s"]), time_noise),
        Comparison("peak memory (GiB)", _peak(recorded), _peak(now), 0.01, _memory_granularity(recorded)),
    ]
    a, b = recorded.get("losses", []), now.get("losses", [])
    match = len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b, strict=True))
    return rows, match


def _recorded_result(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    from stratagem.search.records import TrialKey, trial_fidelity

    ev = trial.user_attrs.get(TrialKey.EVALUATION) or {}
    result = ev.get("measurements")
    if trial_fidelity(trial) != "measured" or not result:
        raise StratagemError(f"--trial {trial.number}: an analytic trial has no run to reproduce; pick a measured "
                             "trial (stratagem search ... --real-runs K records them)")
    return dict(result)


def reproduce_trial(study: optuna.Study, number: int, result_file: str | Path | None = None,
                    run_dir: str | Path | None = None, address: str | None = None) -> Reproduction:
    """Rerun trial `number` through Ray (or read `result_file`) and compare with what was recorded."""
    from stratagem.search.records import study_scenario, trial_plan
    from stratagem.spaces.plan import format_plan

    found = [t for t in study.get_trials(deepcopy=False) if t.number == number]
    if not found:
        raise StratagemError(f"--trial ({number}): no such trial in study {study.study_name!r}")
    trial = found[0]
    recorded = _recorded_result(trial)
    plan = trial_plan(trial)
    if result_file is not None:
        try:
            now = json.loads(Path(result_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StratagemError(f"--result ({result_file}): cannot read a harness result: {e}") from None
        log_dir = str(Path(result_file).parent)
    else:
        from stratagem.launch.ray_runner import RayRunner

        scenario = study_scenario(study)
        runner = RayRunner(run_dir or Path("runs") / study.study_name / "reproduce", address=address,
                           num_cpus=max(plan.world_size, 1) if address is None else None)
        try:
            cap = scenario.cluster.gpu.hbm_gib if scenario.cluster.gpu.kind == "cpu" else None
            run = runner.run(scenario, plan, steps=int(recorded.get("steps", 6)),
                             warmup=int(recorded.get("warmup", 2)), seed=int(recorded.get("seed", 0)),
                             memory_cap_gib=cap, name=f"reproduce-trial{number}")
        finally:
            runner.shutdown()
        if run.status != "ok" or run.result is None:
            raise StratagemError(f"reproduce: the rerun ended {run.status}: {run.reason.splitlines()[0]} "
                                 f"(logs in {run.log_dir})")
        now, log_dir = run.result, run.log_dir
    env = environment_differences(recorded, now)
    if env:
        return Reproduction(number, format_plan(plan), env, log_dir=log_dir)
    rows, match = compare_results(recorded, now)
    return Reproduction(number, format_plan(plan), [], rows, match, log_dir)
