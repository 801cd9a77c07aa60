#!/usr/bin/env bash
# Optional benchmark peers: Cockpit (cockpit-for-pytorch) and BackPACK, into the project's .venv
# (or $PY). Run after scripts/bootstrap.sh. The core install is not touched:
#   - --no-deps for cockpit/backpack/unfoldNd: their metadata would pull torchvision (a CUDA build here,
#     which breaks under the CPU torch) and could swap torch itself; Cockpit never imports torchvision
#     (only an unused BackPACK examples module does);
#   - their real needs are named by hand: einops, json-tricks, seaborn, and setuptools<81 (Cockpit's
#     __init__ imports pkg_resources, removed from setuptools 81).
# Offline (a GPU box with no registry): put the wheels in $WHEELS (default build/gpu-wheels/) and they
# are used with --no-index (bash scripts/gpu_check.sh --prepare-wheels makes them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEELS=${WHEELS:-build/gpu-wheels}
SRC=()
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then SRC=(--no-index --find-links "$WHEELS"); fi
TARGET=()
[ -n "${PIP_TARGET_DIR:-}" ] && TARGET=(--target "$PIP_TARGET_DIR")
torch_before=$($PY -c "import torch; print(torch.__version__)")
has_vision() { PYTHONPATH=${PIP_TARGET_DIR:-}${PYTHONPATH:+:$PYTHONPATH} $PY -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torchvision') else 1)" 2>/dev/null; }
vision_before=no; has_vision && vision_before=yes
$PY -m pip install -q "${SRC[@]}" "${TARGET[@]}" --no-deps "cockpit-for-pytorch==1.0.2" "backpack-for-pytorch==1.7.1" "unfoldNd==0.2.3"
# the declared needs Cockpit and BackPACK really import (already-present ones are left alone)
need=()
$PY -c "import einops" 2>/dev/null || need+=("einops")
$PY -c "import json_tricks" 2>/dev/null || need+=("json-tricks")
$PY -c "import seaborn" 2>/dev/null || need+=("seaborn")
$PY -c "import pkg_resources" 2>/dev/null || need+=("setuptools<81")
if [ ${#need[@]} -gt 0 ]; then
  if [ ${#SRC[@]} -gt 0 ] || [ ${#TARGET[@]} -gt 0 ]; then
    $PY -m pip install -q "${SRC[@]}" "${TARGET[@]}" --no-deps "${need[@]}"
  else
    $PY -m pip install -q "${need[@]}"
  fi
fi
torch_after=$($PY -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
  echo "bench_setup: torch changed ($torch_before -> $torch_after): this must not happen" >&2; exit 1
fi
if has_vision; then
  if [ $vision_before = no ]; then echo "bench_setup: torchvision appeared: this must not happen" >&2; exit 1; fi
  echo "bench_setup: note: torchvision was already in this environment (not installed by this script)" >&2
fi
PYTHONWARNINGS=ignore $PY -c "import cockpit, backpack, torch; from importlib.metadata import version as v; print('bench_setup: cockpit-for-pytorch', v('cockpit-for-pytorch'), '+ backpack-for-pytorch', v('backpack-for-pytorch'), 'importable; torch', torch.__version__)"
