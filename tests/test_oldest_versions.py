"""The oldest framework versions trackdiag claims (README, docs/development.md): transformers 4.49.0,
accelerate 1.0.0 and lightning 2.1.4, in ``.venv-oldest`` (``scripts/oldest_env.sh``, run by
``scripts/bootstrap.sh``: .venv with only those three swapped in, same torch). The newest ones are
what .venv has, where the whole suite runs; here the integration tests run again under the oldest.

Two tests are left out there, for what the old versions do differently (docs/development.md says so):
- transformers 4.49: the first optimizer step's ``diag/grad/global_norm`` is the post-clip norm (4.49
  hands callbacks no optimizer at ``on_train_begin``; adopted at its first step, it re-indexes the
  parameters and the norm measured during that backward pass is read again after clipping);
- lightning 2.1: on CPU, ``16-mixed`` uses CUDA's ``GradScaler``, which disables itself without CUDA,
  so there is no loss scale to log."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLDEST = REPO / ".venv-oldest" / "bin" / "python"
VERSIONS = {"transformers": "4.49.0", "accelerate": "1.0.0", "lightning": "2.1.4"}
LEFT_OUT = ["test_grad_norm_and_loss_equal_the_trainers_own_per_step_logs", "test_16_mixed_scaler_passed_and_norm_unscaled"]


@pytest.mark.slow
def test_integrations_under_the_oldest_versions(tmp_path: Path) -> None:
    assert OLDEST.exists(), "no .venv-oldest: run `bash scripts/oldest_env.sh` (scripts/bootstrap.sh runs it)"
    check = subprocess.run(["bash", str(REPO / "scripts" / "oldest_env.sh")], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr[-2000:]  # present and at the right versions: a no-op
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["-q", "-o", "addopts=", "-p", "no:cacheprovider", "-m", "not slow", "-W", "ignore::DeprecationWarning",
            "-k", " and ".join(f"not {name}" for name in LEFT_OUT), f"--basetemp={tmp_path / 'pytest'}",
            "tests/test_hf_trainer.py", "tests/test_lightning.py", "tests/test_wrapped_optimizers.py"]
    # one interpreter says the versions it imports, then runs the tests (a second one importing the three
    # frameworks only to print their versions cost ~6 CPU-s)
    code = ("import json, sys, torch, transformers, accelerate, lightning; print(json.dumps({m.__name__: m.__version__ "
            "for m in (torch, transformers, accelerate, lightning)}), flush=True); import pytest; "
            f"sys.exit(pytest.main({args!r}))")
    done = subprocess.run([str(OLDEST), "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    versions = json.loads(done.stdout.splitlines()[0]) if done.stdout.startswith("{") else {}
    assert {k: versions.get(k) for k in VERSIONS} == VERSIONS, (versions, done.stderr[-2000:])
    import torch

    assert versions["torch"] == torch.__version__  # the same torch as .venv: nothing pulled another one
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    last = [line for line in done.stdout.splitlines() if " passed" in line][-1]
    assert int(last.split(" passed")[0].split()[-1]) >= 20 and "failed" not in last, tail
