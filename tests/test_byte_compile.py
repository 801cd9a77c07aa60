"""scripts/byte_compile.py: bootstrap byte-compiles what ``trackdiag[all]`` brings, not the test-only packages."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import _warm as warm

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("byte_compile", REPO / "scripts" / "byte_compile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_closure_is_trackdiag_all_and_what_it_needs_not_the_test_extras() -> None:
    bc = _script()
    reqs = bc.requirements(REPO / "pyproject.toml", {"all"})
    assert {r.name for r in reqs} >= {"torch", "hydra-core", "mlflow", "wandb", "matplotlib", "rich", "psutil"}
    assert "trackdiag" not in {r.name for r in reqs}  # trackdiag[wandb,plots,rich] inside ``all``: expanded
    names = bc.closure(reqs)
    # MLflow's own store and server stack, torch's sympy: needed by every run, reached only through requirements
    assert {"torch", "sympy", "mlflow", "mlflow-skinny", "sqlalchemy", "alembic", "hydra-core", "omegaconf",
            "wandb", "matplotlib", "numpy"} <= names
    assert not {"transformers", "ray", "lightning", "optuna", "pytest", "playwright"} & names  # compiled lazily


def test_every_module_a_session_imports_is_among_the_files_it_compiles() -> None:
    """The modules a training process with trackdiag imports (torch, Hydra, MLflow's client and SQLite store,
    matplotlib) that live in site-packages, save a handful, are files the script compiles."""
    bc = _script()
    files = set(bc.python_files(bc.closure(bc.requirements(REPO / "pyproject.toml", {"all"}))))
    code = ("import sys, torch, hydra.main, mlflow.tracking, mlflow.store.tracking.sqlalchemy_store, "
            "matplotlib.pyplot; print('\\n'.join(m.__file__ for m in list(sys.modules.values()) "
            "if (getattr(m, '__file__', None) or '').endswith('.py')))")
    out = warm.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    site = [f for f in out if "site-packages" in f and "/trackdiag/" not in f]
    missing = [f for f in site if f not in files]
    assert len(site) > 2000 and len(missing) <= 0.01 * len(site), missing[:20]
