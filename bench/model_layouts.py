"""Modern MoE presets, pipeline splits and expert layouts: parameter counts against the
published totals, Llama-3-405B's pipeline splits on 1,024 H100s (Megatron stack), and the best DeepSeek-V3 layouts
the search space holds on 256 H100s. Every number is the analytic model's (stratagem.evaluators.evaluate /
evaluate_many with the default calibration); the last line is the figure: the best DeepSeek-V3 plan's tokens/s/GPU.

    .venv/bin/python bench/model_layouts.py
"""

from __future__ import annotations

import platform
import time

import numpy as np

from stratagem import __version__
from stratagem.evaluators import evaluate, evaluate_many
from stratagem.spaces import (
    MODEL_PRESETS,
    Plan,
    Scenario,
    SearchConfig,
    SearchSpace,
    cluster_preset,
    violations,
)

# Published totals / active parameters (model cards; DeepSeek-V3 tech report sec. 4.2; OpenAI gpt-oss Table 1).
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9), "qwen3-30b-a3b": (30.5e9, 3.3e9), "qwen3-235b-a22b": (235e9, 22e9),
    "mixtral-8x22b": (141e9, 39e9), "llama4-scout-17b-16e": (109e9, 17e9), "gpt-oss-120b": (116.83e9, 5.13e9),
    "gpt-oss-20b": (20.91e9, 3.61e9),
}


def main() -> None:
    for name, (total, active) in PUBLISHED.items():
        m = MODEL_PRESETS[name]
        act = m.num_active_params(not name.startswith("gpt-oss"))  # OpenAI counts active without the input embedding
        print(f"{name:22s} total {m.num_params() / 1e9:8.2f}B ({m.num_params() / total - 1:+.2%})  "
              f"active {act / 1e9:6.2f}B ({act / active - 1:+.2%})")
    s = Scenario(model=MODEL_PRESETS["llama3-405b"], cluster=cluster_preset("h100-sxm-80g", 1024, 8),
                 training={"seq_len": 8192, "global_batch_size": 1024, "stack": "megatron"})
    base = Plan(dp=8, tp=8, pp=16, zero_stage=1, sequence_parallel=True, activation_checkpointing="full")
    for label, p in [
        ("pp16 x vpp8, embedding+loss", base.model_copy(update={
            "pp_schedule": "interleaved", "virtual_stages": 8, "pp_split": "embedding_loss"})),
        ("pp16 x vpp7, layers", base.model_copy(update={"pp_schedule": "interleaved", "virtual_stages": 7})),
        ("pp16 1f1b, layers", base),
        ("pp16 1f1b, first/last 7", base.model_copy(update={"first_stage_layers": 7, "last_stage_layers": 7})),
    ]:
        assert not violations(s, p), violations(s, p)
        ev = evaluate(s, p)
        assert ev.memory is not None and ev.time is not None
        print(f"llama3-405b {label:30s} peak {ev.memory.peak_gib:5.1f} GiB  step {ev.time.step_s:6.2f} s  "
              f"bubble {ev.time.bubble_s:5.2f} s")
    cfg = SearchConfig(precision="bf16", activation_checkpointing=["full"], cp=1)
    s = Scenario(model=MODEL_PRESETS["deepseek-v3"], cluster=cluster_preset("h100-sxm-80g", 256, 8),
                 training={"seq_len": 4096, "global_batch_size": 1024, "stack": "megatron"}, search=cfg)
    space = SearchSpace(s)
    t0 = time.time()
    pc = space.enumerate()
    fig = evaluate_many(s, pc)
    elapsed = time.time() - t0
    fits = np.where(fig.peak_gib <= fig.hbm_gib - cfg.memory_margin_gib)[0]
    best = fits[np.argsort(-fig.tokens_per_s_per_gpu[fits])[:5]]
    for i in best:
        print(f"deepseek-v3 {pc.plan(int(i)).short():58s} {fig.tokens_per_s_per_gpu[i]:7.1f} tok/s/GPU  "
              f"MFU {fig.mfu[i]:.3f}  peak {fig.peak_gib[i]:5.1f} GiB")
    print(f"config: deepseek-v3 on 256x h100-sxm-80g, megatron, seq 4096, batch 1024; {len(pc)} plans "
          f"({len(fits)} fit) screened in {elapsed:.1f} s; etp {space.choices('etp')}, ep {space.choices('ep')}")
    print(f"versions: stratagem {__version__}, numpy {np.__version__}, python {platform.python_version()}")
    print(f"figure: best DeepSeek-V3 plan {pc.plan(int(best[0])).short()}: "
          f"{fig.tokens_per_s_per_gpu[best[0]]:.1f} tokens/s/GPU (analytic)")


if __name__ == "__main__":
    main()
