#!/usr/bin/env bash
# GPU check in one offline call: install stratagem from a wheelhouse into a temp dir, run `stratagem calibrate` on
# this node's GPUs (single-GPU runs across micro-batch, recompute and precision; node runs across dp/zero/tp when
# there are 2+ GPUs; the model sized to the GPU), and write everything under $OUT within 8 minutes:
#   calibration.yaml (fitted constants, provenance, every run with its residuals), calibration-runs/*.json (one
#   per run), table.txt (predicted vs measured before and after the fit), scenario.yaml, nvidia-smi.txt,
#   install.log.
#
# On a machine that has only python3 + torch (>= 2.11) and no network:
#   here:  make wheelhouse-calibrate PY=3.12    # -> wheelhouse-calibrate-py3.12/ (~20 MB); carry it with the checkout
#   there: OUT=/tmp/gpu-check WHEELHOUSE=wheelhouse-calibrate-py3.12 bash scripts/gpu_check.sh
# CPU dry path (cpu ranks, the tiny model, the same code; WHEELHOUSE optional):
#   OUT=/tmp/gpu-check bash scripts/gpu_check.sh --dry-run
#
# WHEELHOUSE unset: no install; this checkout runs on PYTHON's own packages (PYTHONPATH). PYTHON: an interpreter
# with torch (default: .venv/bin/python if present, else python3). GPU_PRESET overrides the detected preset;
# BUDGET_MINUTES (default 5) bounds the runs, the whole call is cut at 470 s (DRY: 300 s).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/bench/results/gpu-check}"
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"

"$PYTHON" -c "import torch" 2>/dev/null || { echo "gpu_check: torch is not importable by $PYTHON; set PYTHON" >&2; exit 1; }

# 1. Install: stratagem without its dependencies, then the calibrate path's modules this interpreter lacks, all
#    from the wheelhouse, into $TMP/site (pip when there is one; else the wheels are unzipped: they are plain zips).
if [[ -n "${WHEELHOUSE:-}" ]]; then
  WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
  missing=()
  for spec in pydantic:pydantic typer:typer rich:rich yaml:pyyaml numpy:numpy; do
    "$PYTHON" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec#*:}")
  done
  echo "gpu_check: installing stratagem ${missing[*]:+and ${missing[*]} }from $WHEELHOUSE" >&2
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    {
      "$PYTHON" -m pip install --no-index --find-links "$WHEELHOUSE" --target "$TMP/site" --no-deps stratagem
      if [[ ${#missing[@]} -gt 0 ]]; then
        "$PYTHON" -m pip install --no-index --find-links "$WHEELHOUSE" --target "$TMP/site" "${missing[@]}"
      fi
    } > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log" >&2; exit 1; }
  else
    for whl in "$WHEELHOUSE"/*.whl; do
      case "$(basename "$whl")" in numpy-*) continue ;; esac  # numpy must stay the one torch was built with
      "$PYTHON" -m zipfile -e "$whl" "$TMP/site"
    done
    echo "no pip: unzipped $(ls "$WHEELHOUSE" | wc -l) wheels" > "$OUT/install.log"
  fi
  export PYTHONPATH="$TMP/site"
  cd "$TMP"  # import the installed package, not this checkout
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import stratagem, sys; print(f'gpu_check: stratagem {stratagem.__version__} from {stratagem.__file__}', file=sys.stderr)"

# 2. The scenario: this node's GPU preset (the model is sized by calibrate itself; this one is a placeholder).
if [[ $DRY == 1 ]]; then
  PRESET=cpu; GPUS=2; LIMIT=300; EXTRA=(--steps 2 --warmup 1 --budget-minutes 3)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
  "$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device visible (torch {torch.__version__}); run on a GPU machine or use --dry-run")
print(f"gpu_check: torch {torch.__version__}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB", file=sys.stderr, flush=True)
PY
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true
  PRESET="${GPU_PRESET:-$("$PYTHON" -c "from stratagem.launch.sweep import detect_gpu; print(detect_gpu())")}"
  GPUS="$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")"
  LIMIT=470; EXTRA=(--budget-minutes "${BUDGET_MINUTES:-5}")
fi
cat > "$OUT/scenario.yaml" <<YAML
# Written by scripts/gpu_check.sh: this node ($GPUS x $PRESET). stratagem calibrate sizes its own model.
model: {name: placeholder, num_layers: 4, hidden_size: 64, num_attention_heads: 4, num_kv_heads: 2,
        ffn_hidden_size: 128, vocab_size: 256}
cluster: {gpu: $PRESET, num_nodes: 1, gpus_per_node: $GPUS}
YAML

# 3. Calibrate.
timeout "$LIMIT" "$PYTHON" -m stratagem.cli calibrate "$OUT/scenario.yaml" --gpus "$GPUS" \
  -o "$OUT/calibration.yaml" "${EXTRA[@]}" | tee "$OUT/table.txt"
