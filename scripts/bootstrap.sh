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
# Nothing changed since the last install (this script, pyproject.toml, the package's files): pip is skipped (~25 s of
# building and resolving). The stamp holds the list of those files, so a module deleted or renamed is a change; a
# file newer than the stamp is one too. Directories' times are not: the tests' bytecode (__pycache__) changes them.
# The stamp is written only once every install below succeeded.
STAMP=.venv/.trackdiag-installed
COMPILE_PID=
sources() { find scripts/bootstrap.sh pyproject.toml trackdiag -name __pycache__ -prune -o -type f "$@" -print; }
FILES=$(sources | sort)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FILES" ] && [ -z "$(sources -newer "$STAMP" | head -1)" ] \
   && $VPY -c "import trackdiag" 2>/dev/null; then
  echo "bootstrap: .venv already holds this tree's trackdiag and extras (rm $STAMP to reinstall)" >&2
else
  echo "$FILES" > "$STAMP.new"   # before: a file edited while pip runs is newer, so the next run reinstalls
  # --no-compile: pip would byte-compile all ~24,000 files one after another (33 s of the fresh install's 78 here);
  # scripts/byte_compile.py compiles the ~15,000 of trackdiag[all] and its dependencies instead, on every core,
  # beside the old-versions venv below (the fresh bootstrap 83 -> ~60 s); the tests compile the rest as they import
  # it. Compiled here because where PYTHONDONTWRITEBYTECODE is set (this sandbox) nothing writes a .pyc on import.
  # torch with pip: pip takes the CPU wheel that lies on this kind of machine (PIP_FIND_LINKS, capped by pip's
  # constraints); uv does not look there.
  $VPY -c "import torch" 2>/dev/null || $VPY -m pip install -q --no-compile "torch==2.13.0"
  EXTRAS=".[all,test,sweeps,ray,optuna,accelerate,lightning,transformers]"
  # the rest with uv (~170 packages in ~7 s on a fresh machine, where pip resolves and installs the same set in
  # ~50 s; both give the same versions), held to the torch just installed so nothing can pull another; pip when uv
  # cannot be had. uv installs without byte-compiling, as pip does with --no-compile.
  TORCH=$($VPY -c 'from importlib.metadata import version; print(version("torch"))')
  echo "torch==$TORCH" > .venv/torch-pin.txt
  if $VPY -m pip install -q --no-compile "uv>=0.5,<1" >/dev/null 2>&1 \
     && $VPY -m uv pip install -q --python $VPY -c .venv/torch-pin.txt "$EXTRAS"; then
    INSTALL=(-m uv pip install -q --python $VPY --no-deps --reinstall-package trackdiag)
  else
    echo "bootstrap: uv unavailable, installing with pip (~50 s more)" >&2
    $VPY -m pip install -q --no-compile -c .venv/torch-pin.txt "$EXTRAS"
    INSTALL=(-m pip install -q --no-compile --no-deps --force-reinstall)
  fi
  $VPY scripts/byte_compile.py &
  COMPILE_PID=$!
  # a regular (non-editable) install of the current tree, so Hydra apps anywhere use the package as users get it;
  # setuptools' build/ is removed first: a module renamed or deleted since the last build would still be in it
  rm -rf build
  $VPY "${INSTALL[@]}" .
fi
# .venv-oldest: the oldest transformers/accelerate/lightning trackdiag claims, over .venv's torch (~1 min the first time)
bash scripts/oldest_env.sh || echo "scripts/oldest_env.sh failed: tests/test_oldest_versions.py will fail until it runs" >&2
if [ -n "$COMPILE_PID" ]; then
  wait "$COMPILE_PID" || echo "bootstrap: scripts/byte_compile.py failed: Python compiles on import instead" >&2
  mv "$STAMP.new" "$STAMP"
fi
if [ -n "$APT_PID" ] && ! wait "$APT_PID"; then
  echo "bootstrap: could not apt-get install chromium (not root?): the browser tests will be skipped" >&2
fi
