"""The training harness: one plan trains for a few steps on torch (FSDP2, DTensor TP, pipelining, DCP).

Modules: `run` (the entry point) and `cli` (its command line, `python -m stratagem.launch.harness`), `model` and `moe` (the seeded
transformer), `parallelize` (with `tensor_parallel`), `expert_grid`, `pipeline` and `context` (the plan applied to it; `expert_grid`: where
MoE experts live and which ranks shard them; `context`: context parallelism),
`train` (the job and its step),
`memtrack` (per-rank memory), `checkpoint` (DCP timing, no shared filesystem assumed), `budget` (how many steps a run times), `support` (what it can run, torch-free), `result`
(its result file, torch-free), `verify` (plans against the single-process reference).
Import names from their modules (the package re-exports nothing): importing it imports no torch.
"""
