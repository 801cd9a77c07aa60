#!/usr/bin/env bash
# Make .venv-oldest: .venv with the OLDEST framework versions trackdiag claims to support
# (transformers 4.49.0, accelerate 1.0.0, lightning 2.1.4), for tests/test_oldest_versions.py.
#
# Cheap on purpose: .venv-oldest has no torch, mlflow or numpy of its own. A .pth file puts .venv's
# site-packages after its own, so only the three frameworks are installed here (plus what their old
# versions pin: tokenizers and huggingface-hub for transformers 4.49, setuptools < 81 for lightning
# 2.1's pkg_resources), with --no-deps: nothing can pull another torch (a --dry-run of the same
# requirements with their dependencies, against .venv, is checked first and must not name torch).
# Idempotent: an .venv-oldest with the right versions is kept (~1 min to make; checked from the installed
# packages' metadata, 0.1 s: importing the three frameworks to read their versions cost 8 s of CPU per bootstrap).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "run scripts/bootstrap.sh first" >&2; exit 2; }
PINS=(transformers==4.49.0 "setuptools<81" "tokenizers>=0.21,<0.22" "huggingface-hub>=0.26,<1.0" accelerate==1.0.0 lightning==2.1.4)
OPY=.venv-oldest/bin/python
check='from importlib.metadata import version as v; raise SystemExit(tuple(map(v, ("transformers", "accelerate", "lightning"))) != ("4.49.0", "1.0.0", "2.1.4"))'
if [ -x "$OPY" ] && "$OPY" -c "$check" 2>/dev/null; then
  exit 0
fi
rm -rf .venv-oldest
.venv/bin/python -m venv --without-pip .venv-oldest
OWN=$("$OPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
BASE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$BASE" > "$OWN/_trackdiag_base_venv.pth"   # .venv's packages, after this venv's own
# what pip would install with dependencies, resolved against .venv (where torch 2.13.0+cpu is): no torch
plan=$(.venv/bin/python -m pip install --dry-run --report - -q "${PINS[@]}" 2>/dev/null \
       | .venv/bin/python -c 'import json, sys; print(" ".join(i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in json.load(sys.stdin)["install"]))')
case " $plan " in *" torch=="*|*" nvidia-"*) echo "refusing: the old frameworks would pull another torch: $plan" >&2; exit 3;; esac
.venv/bin/python -m pip install -q --no-compile --no-deps --target "$OWN" "${PINS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m compileall -q -j 0 "$OWN" >/dev/null 2>&1 || true   # --no-compile above: on every core
"$OPY" -c "$check"   # importing them is tests/test_oldest_versions.py's (~8 CPU-s here, beside the byte-compiling)
echo ".venv-oldest: transformers 4.49.0, accelerate 1.0.0, lightning 2.1.4 over .venv's torch $("$OPY" -c 'from importlib.metadata import version; print(version("torch"))')"
