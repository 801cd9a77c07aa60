#!/usr/bin/env bash
# Create .venv (if needed) and install trackdiag with everything the example and tests use.
# CPU torch first: a torch requirement resolved by pip alone would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
# headless Chromium for the browser tests (apt-get, as root; they are skipped with a reason without it), in the
# background while pip works (a fresh machine spends ~30-60 s fetching and unpacking it; it needs no Python).
# Playwright (the test extra) drives this system Chromium (scripts/browser.py: executable_path): no
# `playwright install`, which downloads a browser build of its own and fails without internet.
APT_PID=
if ! command -v chromium >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 &
  APT_PID=$!
fi
# Nothing changed since the last install (this script, pyproject.toml, the package's files and folders): pip is
# skipped (~25 s of building and resolving); the stamp is written only once every install below succeeded.
STAMP=.venv/.trackdiag-installed
if [ -f "$STAMP" ] && [ -z "$(find scripts/bootstrap.sh pyproject.toml trackdiag -newer "$STAMP" -print -quit)" ] \
   && $VPY -c "import trackdiag" 2>/dev/null; then
  echo "bootstrap: .venv already holds this tree's trackdiag and extras (rm $STAMP to reinstall)" >&2
else
  touch "$STAMP.new"   # before: a file edited while pip runs is newer than the stamp, so the next run reinstalls
  $VPY -m pip install -q --upgrade pip >/dev/null
  # --no-compile, then compileall on every core: pip byte-compiles the ~24,000 files one after another (33 s of
  # the fresh install's 78 here; compileall -j 0: 25 s on 2 cores). Compiled either way: where
  # PYTHONDONTWRITEBYTECODE is set (this sandbox), nothing would write a .pyc on first import.
  $VPY -c "import torch" 2>/dev/null || $VPY -m pip install -q --no-compile "torch==2.13.0"
  $VPY -m pip install -q --no-compile ".[all,test,sweeps,ray,optuna,accelerate,lightning,transformers]"
  $VPY -m compileall -q -j 0 "$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 \
    || true   # a few packages ship files that are not Python 3 (test data); pip skips them the same way
  # a regular (non-editable) install of the current tree, so Hydra apps anywhere use the package as users get it;
  # setuptools' build/ is removed first: a module renamed or deleted since the last build would still be in it
  rm -rf build
  $VPY -m pip install -q --no-deps --force-reinstall .
  mv "$STAMP.new" "$STAMP"
fi
# .venv-oldest: the oldest transformers/accelerate/lightning trackdiag claims, over .venv's torch (~1 min the first time)
bash scripts/oldest_env.sh || echo "scripts/oldest_env.sh failed: tests/test_oldest_versions.py will fail until it runs" >&2
if [ -n "$APT_PID" ] && ! wait "$APT_PID"; then
  echo "bootstrap: could not apt-get install chromium (not root?): the browser tests will be skipped" >&2
fi
