#!/usr/bin/env bash
# The suite's whole CPU, daemons included: runs the README's test command (without the bootstrap) in a cgroup v1
# `cpuacct` group of its own (as root), so the servers, Ray, PostgreSQL, Chromium, submitit jobs and MLflow workers
# that outlive or escape pytest's process tree are counted too (`time` counts only the children pytest waited for:
# ~20 % of the suite's CPU is not among them). Also writes each test's CPU, wall, start and worker to
# $OUT/tests.tsv (tests/conftest.py) and prints the per-minute timeline (scripts/test_cpu_report.py).
# CENSUS=1 also writes one line per Python process of .venv to $OUT/census.tsv (scripts/census_site.py, installed as a
# .pth file for this run only) and sums them by kind. ACCT=1 (implies CENSUS=1) also turns on the kernel's process
# accounting into $OUT/pacct: every process that ends, killed or not, Python or not, with its CPU
# (scripts/acct_report.py: by kind, the orphans, by the test that started them).
#   bash scripts/suite_cpu.sh [OUT_DIR] [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/trackdiag-suite-cpu}; shift || true
mkdir -p "$OUT"; rm -f "$OUT/tests.tsv"
CG=/sys/fs/cgroup/cpuacct/trackdiag-suite-$$
mkdir "$CG" 2>/dev/null || { echo "suite_cpu: cannot make a cpuacct cgroup (not root, or no cgroup v1 cpuacct)" >&2; exit 2; }
PTH=""
[ "${ACCT:-0}" = 1 ] && CENSUS=1
if [ "${CENSUS:-0}" = 1 ]; then
  SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp scripts/census_site.py "$SITE/_trackdiag_census.py"; PTH="$SITE/_trackdiag_census.pth"
  echo "import _trackdiag_census" > "$PTH"; rm -f "$OUT/census.tsv"; export TRACKDIAG_CENSUS="$OUT/census.tsv"
fi
ACCT_ON() { python3 -c "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).acct($1) != 0)"; }
if [ "${ACCT:-0}" = 1 ]; then
  : > "$OUT/pacct"; rm -f "$OUT/starts.tsv"; export TRACKDIAG_CENSUS_START="$OUT/starts.tsv"
  ACCT_ON "b'$OUT/pacct'" || { echo "suite_cpu: process accounting needs root and CONFIG_BSD_PROCESS_ACCT" >&2; exit 2; }
fi
trap 'rmdir "$CG" 2>/dev/null || true; [ -z "$PTH" ] || rm -f "$PTH" "${PTH%.pth}.py"; [ "${ACCT:-0}" != 1 ] || ACCT_ON None' EXIT
t0=$(date +%s.%N)
rc=0
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$CG" env TRACKDIAG_TEST_CPU="$OUT/tests.tsv" \
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@" > "$OUT/pytest.txt" 2>&1 || rc=$?
t1=$(date +%s.%N)
sleep 2   # daemons killed at the end of the last tests
tail -3 "$OUT/pytest.txt"
.venv/bin/python scripts/test_cpu_report.py "$OUT/tests.tsv" 10 > "$OUT/report.txt"
head -1 "$OUT/report.txt"
python3 -c "import sys; cpu, wall = int(sys.argv[1]) / 1e9, float(sys.argv[3]) - float(sys.argv[2]); cores = int(sys.argv[4]); print(f'whole suite: {cpu:.0f} CPU-s in {wall:.0f} s on {cores} cores ({cpu / wall / cores:.0%} of them)')" \
  "$(cat "$CG/cpuacct.usage")" "$t0" "$t1" "$(nproc)"
echo "per test, per module, per minute: $OUT/report.txt"
if [ "${ACCT:-0}" = 1 ]; then
  ACCT_ON None
  .venv/bin/python scripts/acct_report.py "$OUT" > "$OUT/acct.txt"; head -1 "$OUT/acct.txt"
  echo "every process, by kind, orphans, by test: $OUT/acct.txt"
fi
if [ -n "$PTH" ] && [ -f "$OUT/census.tsv" ]; then
  awk -F'\t' '{k = ($6 ~ /mlflow.worker/) ? "MLflow sink workers" : ($1 == "-" && $6 == "-c") ? "xdist workers" : "other Python processes";
    c[k] += $2; n[k]++} END {for (k in c) printf "census: %-22s %4d processes %7.1f CPU-s\n", k, n[k], c[k]}' "$OUT/census.tsv"
fi
exit $rc
