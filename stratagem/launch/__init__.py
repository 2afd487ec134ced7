"""launch: a plan becomes a job. Four parts, each its own package or module:

    harness/    the training harness (torch): model, parallelize, pipeline, train, memory, checkpoint
    runners/    where it runs: local gloo ranks, a Ray cluster, the real-run evaluator, node calibration
    trace/      the harness's step on fake tensors at full size (the traced fidelity)
    export/     a plan as a torchrun / torchtitan / Megatron-LM / DeepSpeed job
    reproduce   a stored measured trial rerun and compared

Each name has one address, its module's (the packages re-export nothing): importing a package imports nothing
heavy, and torch or ray load with the module that needs them, so `stratagem.launch.export` and the analytic path
stay free of torch.

    from stratagem.launch.harness.run import run_harness
    result = run_harness("examples/tiny-cpu.yaml", "dp=1", steps=5, out="result.json")
"""
