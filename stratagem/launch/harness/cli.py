"""The training harness entry point: run one plan for a few steps and write one JSON result (rank 0).

Command line (under torchrun, or any launcher that sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK; without them it runs as a single process):

    python -m stratagem.launch.harness --scenario S.yaml --plan "dp=2,tp=2" --out result.json \
        [--steps N | --step-budget-s S [--min-steps A] [--max-steps B]] \
        [--warmup W] [--seed S] [--memory-cap-gib X] [--checkpoint-dir D | --no-checkpoint]

Exit codes of the command: 0 ok; 2 a plan or scenario error (one line); 3 OOM (a line starting "OOM:");
4 the environment failed the run, not the plan (a line starting "INFRA:": the timed checkpoint could not be
written or read, harness.checkpoint); 1 any other crash (traceback on stderr).

`cli` (what `python -m stratagem.launch.harness` runs) ends the process with os._exit (its docstring says why);
`main` returns the exit code; harness/run.py runs the plan (`run_harness`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from stratagem.errors import StratagemError
from stratagem.launch.harness.budget import DEFAULT_MAX_STEPS, DEFAULT_MIN_STEPS, StepBudget

__all__ = ["main", "cli"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m stratagem.launch.harness", description=__doc__.split("\n")[0])
    p.add_argument("--scenario", required=True, help="scenario YAML")
    p.add_argument("--plan", required=True, help='plan, e.g. "dp=2,tp=2,zero=3"')
    how_many = p.add_mutually_exclusive_group()
    how_many.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 5)")
    how_many.add_argument("--step-budget-s", type=float, default=None,
                          help="time N steps, N = clamp(budget / warm-up step time, --min-steps, --max-steps)")
    p.add_argument("--min-steps", type=int, default=DEFAULT_MIN_STEPS, help="with --step-budget-s: fewest timed steps")
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="with --step-budget-s: most timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (memory is traced in the last)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON written by rank 0")
    p.add_argument("--memory-cap-gib", type=float, default=None,
                   help="fail with OOM when the tracked peak of any rank exceeds this")
    p.add_argument("--checkpoint-dir", default=None, help="a directory on every node for the timed checkpoint (default: each node's temp dir; "
                   "a shared one is not needed); the run's folder in it is removed after")
    p.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint save/load timing")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line; returns its exit code (0 ok, 2 plan/scenario error, 3 OOM, 4 environment)."""
    import torch

    from stratagem.launch.harness.checkpoint import CheckpointEnvironmentError
    from stratagem.launch.harness.memtrack import MemoryCapExceeded
    from stratagem.launch.harness.run import run_harness

    args = _parser().parse_args(argv)
    try:
        budget = None
        if args.step_budget_s is not None:
            try:
                budget = StepBudget(budget_s=args.step_budget_s, min_steps=args.min_steps, max_steps=args.max_steps)
            except ValueError as e:
                raise StratagemError(f"--step-budget-s/--min-steps/--max-steps: {str(e).splitlines()[-1].strip()}") from None
        steps = None if budget is not None else (args.steps if args.steps is not None else 5)
        run_harness(args.scenario, args.plan, steps, args.warmup, args.seed, args.out,
                    args.memory_cap_gib, args.checkpoint_dir, not args.no_checkpoint, budget, teardown="leave")
    except StratagemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MemoryCapExceeded as e:
        print(f"OOM: {e}", file=sys.stderr)
        return 3
    except torch.cuda.OutOfMemoryError as e:
        print(f"OOM: CUDA out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
        return 3
    except CheckpointEnvironmentError as e:
        print(f"INFRA: {e}", file=sys.stderr)
        return 4
    return 0


def cli(argv: list[str] | None = None) -> NoReturn:
    """`python -m stratagem.launch.harness`: run `main`, then leave the process without interpreter teardown.

    Why: `dist.destroy_process_group()` unregisters the groups, but the ProcessGroupGloo
    objects stay alive on the C++ side (after a DTensor TP run of world 2 no Python object refers to a group,
    yet 12 `pt_gloo_runloop` and 6 `gloo_tcp_loop` threads still run: /proc/self/task). When CPython
    finalizes, any such thread that needs the GIL (a completed gloo work dropping the last reference to a
    Python-owned tensor: TensorImpl's PyObject decref takes the GIL) is ended by CPython with
    PyThread_exit_thread; the forced unwind crosses a noexcept C++ frame and std::terminate aborts the process
    ("terminate called without an active exception", SIGABRT) after the result was written (pytorch issues
    190489 and PR 179291 trace the same path: decref -> gil_scoped_acquire -> take_gil ->
    PyThread_exit_thread -> terminate). Nothing is left to run after `main` (the result is written and
    replaced atomically), so the process ends with os._exit: no finalization, no thread can race it.
    The process group is not destroyed either (run_harness teardown "leave"): 1 launch in 40 of the tp=2 case
    still died with SIGABRT while rank 1 was alive when each rank destroyed its group before os._exit (CI,
    torch 2.13; destroy_process_group shuts the gloo backends down with their threads running); each rank now
    waits at a barrier for the others and exits with the group alive. faulthandler prints every thread's Python
    stack should a rank still abort. Any exception is printed and exits 1, argparse's SystemExit keeps its code."""
    import faulthandler

    from stratagem.launch.harness.run import EXIT_FAULTS

    faulthandler.enable(all_threads=True)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: --help (0), a bad argument (2)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a crash: its traceback on stderr, exit 1 as the docstring says
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if EXIT_FAULTS:
        os.abort()
    os._exit(code)
