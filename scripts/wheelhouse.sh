#!/usr/bin/env bash
# Wheels for an offline install of stratagem on a machine that already has torch: every dependency in
# pyproject.toml except torch (and their dependencies), for one Python version on x86_64 Linux, plus
# stratagem's own wheel. Needs network here; the target needs none.
#
#   scripts/wheelhouse.sh [--calibrate] [--python-version 3.12] [--dest DIR]
#   make wheelhouse PY=3.12                 # everything except torch -> wheelhouse-py3.12/
#   make wheelhouse-calibrate PY=3.12       # only what `stratagem calibrate` imports -> wheelhouse-calibrate-py3.12/
#
# --calibrate keeps the dependencies the calibrate path imports (pydantic, typer, rich, pyyaml, numpy and what
# they need; no Ray, Optuna or plotly): a few MB, small enough to carry to a GPU box (scripts/gpu_check.sh).
# On the offline machine:
#   pip install --no-index --find-links DIR stratagem                          # full wheelhouse
#   pip install --no-index --find-links DIR --no-deps stratagem && \
#     pip install --no-index --find-links DIR pydantic typer rich pyyaml numpy  # calibrate wheelhouse
#
# PYTHON selects the interpreter that runs pip here (default: .venv/bin/python if present, else python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYV=3.12
DEST=""
ONLY_CALIBRATE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --calibrate) ONLY_CALIBRATE=1; shift ;;
    --python-version) PYV="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    *) echo "wheelhouse.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
  esac
done
if [[ ! "$PYV" =~ ^3\.[0-9]+$ ]]; then
  echo "wheelhouse.sh: --python-version ($PYV): give major.minor, e.g. 3.12" >&2; exit 2
fi
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if [[ -z "$DEST" ]]; then
  if [[ $ONLY_CALIBRATE == 1 ]]; then DEST="$ROOT/wheelhouse-calibrate-py$PYV"; else DEST="$ROOT/wheelhouse-py$PYV"; fi
fi
mkdir -p "$DEST"

# The requirements: pyproject's dependencies without torch (--calibrate: the calibrate path's imports only).
mapfile -t REQS < <("$PYTHON" - "$ROOT/pyproject.toml" "$ONLY_CALIBRATE" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
calibrate = {"pydantic", "typer", "rich", "pyyaml", "numpy"}
for d in deps:
    name = re.split(r"[<>=!~; \[]", d, maxsplit=1)[0].lower()
    if name == "torch" or (sys.argv[2] == "1" and name not in calibrate):
        continue
    print(d)
PY
)
ABI="cp${PYV/./}"
echo "wheelhouse: ${#REQS[@]} requirements for Python $PYV ($ABI, manylinux x86_64) -> $DEST" >&2
"$PYTHON" -m pip download --quiet --dest "$DEST" --only-binary=:all: --python-version "$PYV" \
  --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform linux_x86_64 --platform any \
  "${REQS[@]}"
# stratagem itself (pure Python): built from this checkout.
rm -f "$DEST"/stratagem-*.whl
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" "$ROOT"
rm -rf "$ROOT/build"
echo "wheelhouse: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST" >&2
