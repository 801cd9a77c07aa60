#!/usr/bin/env bash
# The whole GPU story in one go, on a machine with a CUDA GPU:
#   every CUDA test of the suite (pytest -p cuda_select -m cuda: @pytest.mark.cuda, and every test whose
#   skip reason names CUDA/GPU), then benchmarks/overhead.py --device cuda (eager, the ~111M-parameter
#   GPT under bf16 autocast included) and --device cuda --compile; one markdown report.
#
#   bash scripts/gpu_check.sh [OUTDIR]      # report: OUTDIR/gpu_report.md (default: $OUT if set, else gpu_report/)
#   bash scripts/gpu_check.sh --prepare-wheels    # HERE (online), before a run on an offline GPU box: build/gpu-wheels/
#   bash scripts/gpu_check.sh --dry-run-cpu [OUTDIR]   # plumbing check without a GPU: tiny CPU runs, exits 3
#
# No CUDA -> it stops at once with exit 2 and a report that says so: it never reports CPU numbers as GPU ones.
# Python: $PYTHON, else the first of python3 / .venv/bin/python whose torch sees CUDA (never bootstrap.sh's
# CPU-only .venv torch). What that Python lacks (trackdiag's small deps, pytest bits, Cockpit via
# scripts/bench_setup.sh) goes into /tmp/trackdiag-gpu-site with --no-deps: from build/gpu-wheels/ when
# present (offline boxes: carry it), else from the package index. trackdiag itself runs from this tree.
# GPU_WORKLOADS / GPU_COMPILE_WORKLOADS / GPU_ARMS / GPU_ROUNDS pick what the benchmarks run (GPU_ARMS: e.g.
# "basic advanced extreme extreme+logreplay"; default every arm).
# Time: every stage has a budget and the whole run a deadline (GPU_CHECK_BUDGET, default 480 s), so it ends
# well inside 10 minutes; a stage that runs out is reported as such with what it had measured.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$(date +%s)
WHEELS=${WHEELS:-build/gpu-wheels}   # offline wheelhouse (git-ignored), made by --prepare-wheels

pins() {  # the versions this checkout's .venv uses, for the wheelhouse
  local py=${PY:-.venv/bin/python}
  for pkg in "$@"; do
    v=$($py -c "from importlib.metadata import version; print(version('$pkg'))" 2>/dev/null) && echo "$pkg==$v" || echo "$pkg"
  done
}

if [ "${1:-}" = "--prepare-wheels" ]; then
  PY=${PY:-.venv/bin/python}
  mkdir -p "$WHEELS"   # under build/, which .gitignore already ignores
  # pure-Python wheels only (antlr4 4.9.3 is an sdist: pip wheel builds it): they install on any Python 3
  $PY -m pip wheel -q --no-deps -w "$WHEELS" "cockpit-for-pytorch==1.0.2" "backpack-for-pytorch==1.7.1" "unfoldNd==0.2.3" "setuptools<81" \
    $(pins json-tricks einops seaborn hydra-core omegaconf antlr4-python3-runtime pytest-timeout) || exit 1
  ls -la "$WHEELS"; du -sh "$WHEELS"
  echo "now run on the GPU box with $WHEELS carried (device tool: carry [\"$WHEELS\"]): bash scripts/gpu_check.sh"
  exit 0
fi

DRY=0
if [ "${1:-}" = "--dry-run-cpu" ]; then DRY=1; shift; fi
OUTDIR=${1:-${OUT:-gpu_report}}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/gpu_check.log
: > "$LOG"; : > "$OUTDIR/stages.tsv"
rm -f "$OUTDIR"/{pytest_cuda.xml,bench_eager.json,bench_compiled.json,gpu_report.md}
DEADLINE=$((START + ${GPU_CHECK_BUDGET:-480}))
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore WANDB_MODE=offline WANDB_SILENT=true HF_HUB_OFFLINE=1
export MLFLOW_TRACKING_URI="sqlite:///$(mktemp -d)/mlflow.db"

# ---------------------------------------------------------------- a Python whose torch sees CUDA
sees_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
PY=""
for cand in "${PYTHON:-}" python3 .venv/bin/python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if sees_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  if [ $DRY = 1 ]; then
    PY=${PYTHON:-.venv/bin/python}
  else
    {
      echo "# trackdiag GPU check: FAILED — no CUDA device"
      echo
      echo "No Python here has a torch that sees a CUDA device, so nothing was run (no CPU numbers stand in)."
      echo
      echo '```'
      for cand in "${PYTHON:-}" python3 .venv/bin/python; do
        [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
        echo "$cand: $("$cand" -c 'import torch; print("torch", torch.__version__, "cuda build", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
      done
      echo "nvidia-smi: $(nvidia-smi -L 2>&1 | head -3)"
      echo '```'
    } > "$OUTDIR/gpu_report.md"
    cat "$OUTDIR/gpu_report.md" >&2
    echo "gpu_check: FAILED: CUDA is not available (report: $OUTDIR/gpu_report.md)" >&2
    exit 2
  fi
fi
PYBIN=$(command -v "$PY"); PYBIN=$(cd "$(dirname "$PYBIN")" && pwd)/$(basename "$PYBIN")
DEVICE=cuda; [ $DRY = 1 ] && DEVICE=cpu

# ---------------------------------------------------------------- what that Python lacks
SITE=/tmp/trackdiag-gpu-site
mkdir -p "$SITE"
export PYTHONPATH="$ROOT:$ROOT/benchmarks:$SITE${PYTHONPATH:+:$PYTHONPATH}"
SRC=()
ls "$WHEELS"/*.whl >/dev/null 2>&1 && SRC=(--no-index --find-links "$WHEELS")
need=()
for pair in yaml:pyyaml numpy:numpy pytest:pytest pytest_timeout:pytest-timeout sklearn:scikit-learn matplotlib:matplotlib \
            omegaconf:omegaconf hydra:hydra-core antlr4:antlr4-python3-runtime; do
  "$PYBIN" -c "import ${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
{
  echo "== setup: python $PYBIN; installing into $SITE: ${need[*]:-(nothing missing)}"
  [ ${#need[@]} -gt 0 ] && "$PYBIN" -m pip install -q --no-deps --target "$SITE" "${SRC[@]}" "${need[@]}"
  PY=$PYBIN PIP_TARGET_DIR=$SITE WHEELS=$WHEELS bash scripts/bench_setup.sh || echo "== setup: Cockpit could not be installed: its arm will be skipped"
} >> "$LOG" 2>&1
printf 'setup\t%s\t%s\t-\n' 0 $(( $(date +%s) - START )) >> "$OUTDIR/stages.tsv"

# ---------------------------------------------------------------- environment
{
  "$PYBIN" - <<'EOF'
import platform, torch
ok = torch.cuda.is_available()
print(f"CUDA: {'yes' if ok else 'NO'}")
print(f"torch {torch.__version__} (CUDA build {torch.version.cuda}, cuDNN {torch.backends.cudnn.version() if ok else '-'}), Python {platform.python_version()}")
if ok:
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}; bf16 supported: {torch.cuda.is_bf16_supported()}")
for m in ("trackdiag", "cockpit", "backpack", "wandb", "hydra", "omegaconf", "mlflow"):
    try:
        mod = __import__(m)
        print(f"{m}: {getattr(mod, '__version__', 'importable')} ({mod.__file__})")
    except Exception as e:  # noqa: BLE001
        print(f"{m}: not importable ({type(e).__name__})")
EOF
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  echo "CPU cores: $(nproc); tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git metadata (copied tree)')"
  [ $DRY = 1 ] && echo "DRY RUN ON CPU: NOT A GPU CHECK"
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

# ---------------------------------------------------------------- stages
stage() {  # stage NAME BUDGET_S CMD...: runs with min(budget, time left before the deadline)
  local name=$1 budget=$2; shift 2
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  (( left < budget )) && budget=$left
  if (( budget < 20 )); then
    echo "== $name: skipped, no time left" | tee -a "$LOG"; printf '%s\t%s\t0\t%s\n' "$name" 124 "$budget" >> "$OUTDIR/stages.tsv"; return
  fi
  echo "== $name (budget ${budget} s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$LOG" | grep -E '^(#|[a-z_0-9]+.*(ms/step|skipped|FAILED|could not)|[0-9]+ (passed|failed)|=+ .*(passed|failed|error))' 
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" $(( $(date +%s) - t0 )) "$budget" >> "$OUTDIR/stages.tsv"
}

if [ $DRY = 1 ]; then
  E_WL=${GPU_WORKLOADS:-gpt_tiny cnn}; C_WL=${GPU_COMPILE_WORKLOADS:-gpt_tiny}; R=2; S=10
else
  E_WL=${GPU_WORKLOADS:-mlp cnn transformer scale1000 gpt}; C_WL=${GPU_COMPILE_WORKLOADS:-mlp transformer gpt}; R=${GPU_ROUNDS:-4}; S=50
fi
stage cuda-tests "${GPU_TEST_BUDGET:-170}" "$PYBIN" -m pytest -p cuda_select -m cuda tests -q -rA -p no:cacheprovider \
  --junitxml="$OUTDIR/pytest_cuda.xml" -o junit_family=xunit1
stage bench-eager "${GPU_EAGER_BUDGET:-130}" "$PYBIN" benchmarks/overhead.py --device $DEVICE --workloads $E_WL \
  --rounds $R --steps $S --warmup 10 --markdown --json "$OUTDIR/bench_eager.json" ${GPU_ARMS:+--arms $GPU_ARMS}
stage bench-compiled "${GPU_COMPILE_BUDGET:-170}" "$PYBIN" benchmarks/overhead.py --device $DEVICE --compile --workloads $C_WL \
  --rounds $R --steps $S --warmup 10 --markdown --json "$OUTDIR/bench_compiled.json"

"$PYBIN" benchmarks/gpu_report.py "$OUTDIR"
rc=$?
echo "report: $OUTDIR/gpu_report.md ($(( $(date +%s) - START )) s in all)"
[ $DRY = 1 ] && { echo "DRY RUN ON CPU: plumbing only, not a GPU check"; exit 3; }
exit $rc
