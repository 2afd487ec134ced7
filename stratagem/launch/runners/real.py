"""The real-run evaluator: a plan trains for a few steps through Ray (launch.ray_runner) and is judged on
what it measured. The analytic prediction of the same plan is kept beside it (`Evaluation.prediction`).

Measured: tokens/s and step time (median of the timed steps), peak memory of the worst rank (CUDA: max
reserved; CPU: the peak of live tensors the harness tracks), per-rank parameter/gradient/optimizer bytes,
checkpoint save time. Derived: MFU scales the predicted MFU by measured/predicted tokens/s (same FLOPs per
token); checkpoint risk is the analytic one (a short run cannot measure a cluster's MTBF), with the
measured save time recorded in `measurements`. Time breakdown: None (only the step is measured). Zones: HBM
from the measured memory, the time zones from the prediction (sentences say which).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from stratagem.evaluators.analytic import evaluate
from stratagem.evaluators.calibration import Calibration
from stratagem.evaluators.evaluation import Evaluation, Fidelity, MemoryBreakdown, Status, Throughput
from stratagem.evaluators.zones import measured_zones
from stratagem.launch.harness.budget import StepBudget
from stratagem.spaces.plan import Plan
from stratagem.spaces.rules import violations
from stratagem.spaces.scenario import Scenario
from stratagem.units import GIB

__all__ = ["RayRunEvaluator", "measured_evaluation", "provenance", "DEFAULT_BUILD_S", "open_ray_evaluator"]

_ENV_FLAGS = ("OMP_NUM_THREADS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_IB_DISABLE", "CUDA_DEVICE_MAX_CONNECTIONS",
              "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _git_revision() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
        rev = out.stdout.strip()
        if rev:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5, check=False).stdout.strip()
            return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def provenance(result: dict[str, Any] | None, command: str, seed: int) -> dict[str, Any]:
    """Everything needed to judge whether a rerun is comparable: versions, revision, seed, hardware, env."""
    import optuna
    import ray

    import stratagem

    versions = dict((result or {}).get("versions", {}))
    return {
        "stratagem_version": stratagem.__version__,
        "git_revision": _git_revision(),
        "torch": versions.get("torch"),
        "cuda": versions.get("cuda"),
        "python": versions.get("python") or platform.python_version(),
        "ray": ray.__version__,
        "optuna": optuna.__version__,
        "seed": seed,
        "hardware": {"device": (result or {}).get("device"), "world_size": (result or {}).get("world_size"),
                     "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "env": {k: os.environ[k] for k in _ENV_FLAGS if k in os.environ},
        "command": command,
    }


def measured_evaluation(scenario: Scenario, plan: Plan, status: Status, reason: str,
                        result: dict[str, Any] | None, prediction: Evaluation,
                        prov: dict[str, Any] | None = None) -> Evaluation:
    """An Evaluation with fidelity "measured" from a harness result (or a failed run's status)."""
    if status != "ok" or result is None:
        return Evaluation(plan=plan, status=status, reason=reason, fidelity="measured", prediction=prediction,
                          provenance=prov)
    from stratagem.launch.harness.result import parse_result

    run = parse_result(result, f"the harness result of {plan.short()}")
    worst = run.worst_rank
    peak = run.peak_gib
    weights = max(r.param_bytes + r.unsharded_param_bytes for r in run.ranks) / GIB
    grads = max(r.grad_bytes for r in run.ranks) / GIB
    opt = max(r.optimizer_bytes for r in run.ranks) / GIB
    hbm = scenario.cluster.gpu.hbm_gib
    rest = max(0.0, peak - weights - grads - opt)
    memory = MemoryBreakdown(
        weights_gib=weights, gradients_gib=grads, optimizer_gib=opt, activations_gib=rest, transient_gib=0.0,
        overhead_gib=0.0, peak_gib=peak, hbm_gib=hbm, headroom_gib=hbm - peak,
        first_block_to_break=None if peak <= hbm else "activations",
        worst_stage=worst.stage_ids[0] if worst.stage_ids else 0,
    )
    tokens = run.tokens_per_s
    world = plan.world_size
    mfu = 0.0
    if prediction.throughput is not None and prediction.throughput.tokens_per_s > 0:
        mfu = prediction.throughput.mfu * tokens / prediction.throughput.tokens_per_s
    measurements = run.stored()
    zones = None
    if prediction.zones is not None and prediction.time is not None and prediction.checkpoint is not None:
        zones = measured_zones(prediction.zones, memory, prediction.time, prediction.checkpoint)
    return Evaluation(
        plan=plan, status="ok", fidelity="measured", memory=memory,
        throughput=Throughput(tokens_per_s=tokens, tokens_per_s_per_gpu=tokens / world, mfu=mfu),
        checkpoint=prediction.checkpoint, zones=zones, prediction=prediction, measurements=measurements,
        provenance=prov,
    )


DEFAULT_BUILD_S = 60.0
"""Predicted time of a run outside its steps (Ray placement, process start, model build, process group, checkpoint
timing) before this evaluator has finished a run to learn it from (the CPU demo's runs: 4-16 s build on an idle
host, several times that under load)."""


class RayRunEvaluator:
    """Judges plans by short real runs through Ray; `evaluate(scenario, plan) -> Evaluation` (measured).

    timeout_s: each run's limit (--run-timeout); None derives it per batch from the plans' predicted run time
    (search.budget.derived_timeout: a factor over build + warm-up and timed steps, with a floor). The build part
    is learned from this evaluator's own finished runs (wall time minus their steps), DEFAULT_BUILD_S before the
    first."""

    fidelity: Fidelity = "measured"

    def __init__(self, run_dir: str | Path, address: str | None = None, num_cpus: int | None = None,
                 steps: int = 6, warmup: int = 2, seed: int = 0, timeout_s: float | None = None,
                 calibration: Calibration | None = None, resource_wait_s: float = 600.0,
                 budget: StepBudget | None = None) -> None:
        # budget: timed steps from a time budget (harness/budget.py); None: `steps` fixed
        from stratagem.launch.runners.ray_runner import RayRunner

        self.runner = RayRunner(run_dir, address=address, num_cpus=num_cpus, resource_wait_s=resource_wait_s)
        self.steps, self.warmup, self.seed, self.timeout_s = steps, warmup, seed, timeout_s
        self.calibration = calibration
        self.budget = budget
        self.build_s = DEFAULT_BUILD_S
        """Predicted time of a run outside its steps: the most this evaluator's finished runs took."""
        self._learned = False

    def run_seconds(self, scenario: Scenario, plan: Plan) -> float:
        """Predicted wall time of one run: build (learned) + warm-up and timed steps at the predicted step time
        (with a step budget: the timed steps the budget would choose)."""
        pred = evaluate(scenario, plan, self.calibration)
        step = pred.time.step_s if pred.time is not None else 0.0
        steps = self.steps
        if self.budget is not None:
            from stratagem.launch.harness.budget import timed_steps

            steps = timed_steps(self.budget, step)
        return self.build_s + (steps + self.warmup) * step

    def run_timeout(self, scenario: Scenario, plans: Sequence[Plan]) -> float:
        """The limit of a batch's runs: --run-timeout, else derived from the slowest plan's predicted run time."""
        from stratagem.search.budget import derived_timeout

        if self.timeout_s is not None:
            return self.timeout_s
        return max((derived_timeout(self.run_seconds(scenario, p)) for p in plans), default=derived_timeout(0.0))

    def _learn(self, wall_s: float, result: dict[str, Any] | None) -> None:
        """Update build_s from a finished run: its wall time less its steps."""
        if not result or not wall_s:
            return
        outside = max(0.0, wall_s - sum(float(t) for t in result.get("step_times_s") or []))
        self.build_s = outside if not self._learned else max(self.build_s, outside)
        self._learned = True

    @property
    def slots(self) -> int:
        """Ranks the cluster can run at once (GPUs, or CPUs on a CPU cluster), read now."""
        return self.runner.slots

    def unsupported(self, scenario: Scenario, plan: Plan) -> str | None:
        """Why the harness cannot run `plan` (launch.support.unsupported), or None: the loop skips such plans."""
        from stratagem.launch.harness.support import unsupported

        return unsupported(scenario, plan)

    def stop(self) -> int:
        """Kill the in-flight runs' ranks now; returns how many runs were in flight."""
        return self.runner.stop()

    def _cap(self, scenario: Scenario) -> float | None:
        # On CPU workers the scenario's per-device memory is enforced by the harness's tracked peak.
        return scenario.cluster.gpu.hbm_gib if scenario.cluster.gpu.kind == "cpu" else None

    def evaluate(self, scenario: Scenario, plan: Plan, name: str | None = None) -> Evaluation:
        """Run one plan for real and return its measured Evaluation."""
        return self.evaluate_batch(scenario, [plan], names=[name] if name else None)[0]

    def evaluate_batch(self, scenario: Scenario, plans: Sequence[Plan],
                      names: Sequence[str] | None = None) -> list[Evaluation]:
        """Run several plans at once (as many as the cluster's free slots allow); results in order."""
        out: list[Evaluation | None] = [None] * len(plans)
        jobs = []
        for i, plan in enumerate(plans):
            broken = violations(scenario, plan)
            if broken:
                out[i] = Evaluation(plan=plan, status="infeasible", reason="; ".join(broken), fidelity="measured")
            else:
                jobs.append((i, plan))
        results = self.runner.run_many(
            [(scenario, p, (names[i] if names else None) or _run_name(p)) for i, p in jobs],
            steps=self.steps, warmup=self.warmup, seed=self.seed,
            timeout_s=self.run_timeout(scenario, [p for _, p in jobs]), memory_cap_gib=self._cap(scenario),
            budget=self.budget)
        for (i, plan), run in zip(jobs, results, strict=True):
            if run.status == "ok":
                self._learn(run.wall_s, run.result)
            prediction = evaluate(scenario, plan, self.calibration)
            prov = provenance(run.result, run.command, self.seed)
            prov["log_dir"] = run.log_dir
            prov["wall_s"] = run.wall_s
            out[i] = measured_evaluation(scenario, plan, run.status, run.reason, run.result, prediction, prov)
        return [e for e in out if e is not None]

    def close(self) -> None:
        """Shut the evaluator's Ray runner down (and its local cluster, if it started one)."""
        self.runner.shutdown()


def _run_name(plan: Plan) -> str:
    import uuid

    return plan.short().replace(" ", "_") + "-" + uuid.uuid4().hex[:6]


@contextlib.contextmanager
def open_ray_evaluator(run_dir: Path, address: str | None, num_cpus: int | None, steps: int | None,
                       calibration: Calibration | None, timeout_s: float | None) -> Iterator[RayRunEvaluator]:
    """A RayRunEvaluator for `stratagem search --real-runs`, closed at the end; `steps` None: the timed steps
    from the harness's default time budget (StepBudget()), else that many. Ray's own start-up failures become
    one line (StratagemError); the run folders this call created are removed again when nothing was written
    under them."""
    fresh = [d for d in (run_dir, *run_dir.parents[:3]) if not d.exists()]  # created by this call
    try:
        # its predictions ('pred' beside each run) use the calibration the search starts from
        evaluator = RayRunEvaluator(run_dir, address=address, num_cpus=num_cpus, steps=steps or 6, warmup=2,
                                    calibration=calibration, timeout_s=timeout_s,
                                    budget=StepBudget.model_validate({}) if steps is None else None)
    except BaseException as e:
        _remove_empty(fresh)
        if isinstance(e, Exception) and _raised_by_ray(e):  # e.g. "node timed out during startup" on a busy host
            from stratagem.errors import StratagemError

            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StratagemError(f"--real-runs: Ray did not start ({address or 'local cluster'}): {first}; "
                                 "retry when the machine is less loaded, or join a running cluster with "
                                 "--ray-address") from None
        raise
    try:
        yield evaluator
    finally:
        evaluator.close()
        _remove_empty(fresh)  # a call that wrote nothing leaves no empty runs/ folder behind


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories this call created when no file was written under them (deepest first)."""
    import shutil

    for d in dirs:
        if d.is_dir() and not any(p.is_file() or p.is_symlink() for p in d.rglob("*")):
            shutil.rmtree(d)


def _raised_by_ray(e: BaseException) -> bool:
    """Whether the innermost frame of e's traceback is Ray's own code (Ray's start-up failures are plain
    Exceptions: the frame, not the type, says where they come from)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}ray{os.sep}" in tb.tb_frame.f_code.co_filename
