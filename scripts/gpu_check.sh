#!/usr/bin/env bash
# Single-GPU check of the harness against the analytic model: a ~1.2B-parameter Llama (Llama-3.2-1B shapes,
# tied embeddings), seq 2048, global batch 4, AdamW, 5 timed steps after 2 warm-up steps, for every
# precision {bf16, fp32} x micro-batch {1, 2, 4} x recompute {none, selective, full} (18 plans, one process).
# Prints predicted vs measured peak memory (CUDA max reserved / allocated) and tokens/s, and writes
#   $OUT/scenario.yaml, $OUT/<plan>.json (harness result or OOM), $OUT/summary.json, $OUT/table.txt
# Budget: < 8 minutes on an H100/H200 (bf16 ~0.2 s/step, fp32 ~1.5 s/step, no checkpoint timing).
#
#   OUT=/tmp/gpu-check scripts/gpu_check.sh            # on a machine with one NVIDIA GPU
#   OUT=/tmp/gpu-check scripts/gpu_check.sh --dry-run  # CPU: the tiny model, 4 plans, same code path
#
# PYTHON selects the interpreter (default: .venv/bin/python if present, else python3); it needs torch with
# CUDA, pydantic, numpy and pyyaml. Results to keep go under bench/results/.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/bench/results/gpu-check}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
mkdir -p "$OUT"

if [[ "${1:-}" == "--dry-run" ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  cp "$ROOT/examples/tiny-cpu.yaml" "$OUT/scenario.yaml"
  exec timeout 300 "$PYTHON" -m stratagem.launch.sweep --scenario "$OUT/scenario.yaml" --out "$OUT" \
    --gpu cpu --steps 2 --warmup 1 \
    --plans "precision=fp32,mbs=1;precision=fp32,mbs=2,ac=selective;precision=bf16,mbs=4,ac=full;precision=bf16,mbs=1"
fi

"$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: torch is not importable by this interpreter; set PYTHON=/path/to/python")
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible (torch %s); run on a GPU machine or use --dry-run" % torch.__version__)
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB", flush=True)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true

cat > "$OUT/scenario.yaml" <<'YAML'
# Llama-3.2-1B shapes (1.24e9 parameters with tied embeddings) on one GPU (the sweep sets the cluster).
model:
  name: llama3.2-1b
  num_layers: 16
  hidden_size: 2048
  num_attention_heads: 32
  num_kv_heads: 8
  ffn_hidden_size: 8192
  vocab_size: 128256
  tied_embeddings: true
cluster:
  gpu: h100-sxm-80g
  num_nodes: 1
  gpus_per_node: 1
training:
  seq_len: 2048
  global_batch_size: 4
  optimizer: adamw
  stack: torch
YAML

timeout 470 "$PYTHON" -m stratagem.launch.sweep --scenario "$OUT/scenario.yaml" --out "$OUT" --grid \
  --gpu "${GPU_PRESET:-auto}" --steps 5 --warmup 2 | tee "$OUT/table.txt"
