"""What the framework tests (Lightning, Hugging Face Trainer) share."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def fluent_mlflow_state_reset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The frameworks set MLflow's fluent tracking URI and active experiment (process globals, plus
    ``MLFLOW_EXPERIMENT_ID`` in the environment): leave neither to the tests that follow. The
    experiments they create get ``./mlruns`` as artifact root: run in the test's directory."""
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # put back as it was at teardown
    monkeypatch.chdir(tmp_path)
    yield
    if "mlflow" in sys.modules:
        sys.modules["mlflow"].set_tracking_uri(None)
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is not None and hasattr(fluent, "_active_experiment_id"):
            fluent._active_experiment_id = None
