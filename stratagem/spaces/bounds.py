"""The largest (and for rates the smallest) value each numeric scenario field accepts: what a real job can
hold, with wide room above the largest published model and cluster, so that a typo (10^6 layers, a peak of
1e-300 TFLOP/s) is one line naming the bound instead of a run of minutes or figures such as 8e-26 tokens/s.

Each bound is generous on purpose (several times the largest public figure, cited beside it): the tool must
never refuse a real job, only a value no job has.
"""

from __future__ import annotations

__all__ = ["MAX_LAYERS", "MAX_HIDDEN", "MAX_HEADS", "MAX_HEAD_DIM", "MAX_FFN", "MAX_VOCAB", "MAX_POSITIONS",
           "MAX_EXPERTS", "MAX_PARAMS", "MAX_NODES", "MAX_GPUS", "MAX_GPUS_PER_NODE", "MAX_HBM_GIB", "MIN_TFLOPS",
           "MAX_TFLOPS", "MIN_TBPS", "MAX_TBPS", "MAX_LINK_GBPS", "MAX_LATENCY_US", "MIN_STORAGE_GBPS",
           "MAX_STORAGE_GBPS", "MIN_MTBF_HOURS", "MAX_MTBF_HOURS", "MAX_WATTS", "MAX_PRICE", "MAX_TOKENS",
           "MAX_MINUTES"]

# ---- model (largest published: PaLM 540B 118 layers, d 18432, ffn 73728 (Chowdhery et al. 2022, table 1);
#      MT-NLG 530B d 20480 (Smith et al. 2022); Llama 3 405B 126 layers, 128 heads (Llama 3 paper, table 3);
#      Gemma 3 vocabulary 262,144; Switch-C 2,048 experts (Fedus et al. 2021, table 9); Llama 4 Scout 10M
#      context) -----------------------------------------------------------------------------------------------
MAX_LAYERS = 2048
"""Transformer layers: 16x PaLM's 118 (the per-layer work of the model is linear in it: 10^6 took minutes)."""
MAX_HIDDEN = 1 << 18
"""Hidden size (262,144): 12x MT-NLG's 20,480."""
MAX_HEADS = 4096
"""Attention or key/value heads: 32x Llama 3 405B's 128."""
MAX_HEAD_DIM = 8192
"""Per-head dimensions (head_dim, MLA ranks' head parts): 32x the widest published head (256, Gemma)."""
MAX_FFN = 1 << 21
"""MLP, expert and MLA low-rank widths (2,097,152): 28x PaLM's 73,728."""
MAX_VOCAB = 1 << 23
"""Vocabulary (8,388,608): 32x Gemma 3's 262,144."""
MAX_POSITIONS = 1 << 30
"""Positions and attention windows: 100x Llama 4 Scout's 10M-token context."""
MAX_EXPERTS = 1 << 16
"""Experts, shared experts, top-k and routing groups (65,536): 32x Switch-C's 2,048."""
MAX_PARAMS = 10**15
"""Parameters of an encoder outside the layers: 500x the largest published dense model (about 2T)."""

# ---- cluster (largest reported: xAI Colossus 200,000 GPUs (2025); Llama 3 on 16,384 H100 in 2,048 nodes;
#      NVL72 racks of 72 GPUs in one NVLink domain; B300 288 GB HBM3e at 8 TB/s; GB300 15 PFLOP/s dense fp4) --
MAX_NODES = 1 << 17
"""Nodes in one job (131,072): 64x Llama 3's 2,048 and 5x Colossus at 8 GPUs a node."""
MAX_GPUS = 1 << 20
"""GPUs in one job (1,048,576): 5x Colossus's 200,000."""
MAX_GPUS_PER_NODE = 4096
"""GPUs in one node (one NVLink domain): 7x NVIDIA's planned NVL576 rack."""
MAX_HBM_GIB = 1 << 14
"""Device memory, GiB (16,384): 60x B300's 288 GB."""
MIN_TFLOPS = 1e-3
"""Smallest dense peak, TFLOP/s (1 GFLOP/s, a fraction of one CPU core): below it step times overflow."""
MAX_TFLOPS = 1e6
"""Largest dense peak, TFLOP/s: 65x GB300's 15,000 (fp4)."""
MIN_TBPS = 1e-4
"""Smallest memory bandwidth, TB/s (100 MB/s, a 1990s bus)."""
MAX_TBPS = 1e4
"""Largest memory bandwidth, TB/s: 1,250x B300's 8."""
MAX_LINK_GBPS = 1e6
"""Largest per-GPU link bandwidth, GB/s one direction: 1,100x NVLink 5's 900."""
MAX_LATENCY_US = 1e7
"""Largest per-hop latency, microseconds (10 s)."""
MIN_STORAGE_GBPS = 1e-4
"""Smallest checkpoint storage bandwidth, GB/s (100 KB/s)."""
MAX_STORAGE_GBPS = 1e7
"""Largest checkpoint storage bandwidth, GB/s: 1,000x the fastest published parallel file systems' 10 TB/s."""
MIN_MTBF_HOURS = 1e-3
"""Shortest node MTBF, hours (3.6 s): below it no step finishes and the checkpoint optimum underflows."""
MAX_MTBF_HOURS = 1e9
"""Longest node MTBF, hours (114,000 years)."""
MAX_WATTS = 1e6
"""Largest TDP or power cap of one device, W: 700x a B200's 1,400 W."""
MAX_PRICE = 1e6
"""Largest price, USD per GPU-hour: 100,000x on-demand H100 prices."""

# ---- training (largest reported: Qwen3 36T tokens (Qwen3 report, 2025); Llama 3 a 54-day run) -------------
MAX_TOKENS = 1e18
"""Training tokens: 27,000x Qwen3's 36T."""
MAX_MINUTES = 1e7
"""Checkpoint interval or restart time, minutes (19 years)."""
