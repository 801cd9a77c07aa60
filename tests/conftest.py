"""Shared fixtures: real data (scikit-learn's bundled digits) and small real models."""
from __future__ import annotations

import os
import tempfile

# One intra-op thread per test process and per process it starts (Hydra apps, README commands, workers
# inherit the environment): the suite runs one test per core (pytest-xdist), so torch's default of one
# OpenMP thread per core only makes threads spin against each other and the other worker's test (the
# example app's 2 ms step took 50-150 ms on the 2-core VM while another test ran). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # in case a plugin imported torch first

os.environ.setdefault("WANDB_MODE", "offline")  # tests never reach the internet
os.environ.setdefault("WANDB_SILENT", "true")
# A test that leaves the MLflow store at its default writes into a throwaway store, never into the repo.
os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp(prefix='trackdiag-tests-')}/mlflow.db")


@pytest.fixture(scope="session")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits: 1797 8x8 images as float features in [0, 1], labels 0-9."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long)


#: probe overrides for tests that don't exercise end-of-run artifacts (the report costs ~2 s at close)
LEAN_PROBES = {"report": {"enabled": False}}


def make_mlp(hidden: int = 32, depth: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int = 64, seed: int = 1):
    """An endless stream of random mini-batches."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(x), (batch_size,), generator=gen)
        yield x[idx], y[idx]


@pytest.fixture(autouse=True)
def _close_sessions_left_open():
    """A test that leaves a session open (it would be closed at exit) keeps torch's global hooks installed
    for every later test: close it when the test ends, as the interpreter's exit would."""
    yield
    from trackdiag.capture.optimizers import DISPATCH

    for session in list(DISPATCH._listeners):  # every session not closed yet, opened or not
        if not getattr(session, "_closed", True):
            try:
                session.close("FINISHED")
            except Exception:  # noqa: BLE001 - a test's leftover must not fail the next test
                pass


#: modules whose module-scoped fixtures start something costly (a tracking server, PostgreSQL, a training
#: run, a browser story): their tests go to one xdist worker (``--dist loadgroup``) so it starts once
SHARED_FIXTURES = {"test_benchmarks", "test_compare", "test_delivery_server", "test_distributed", "test_hydra_app",
                   "test_lightning", "test_mlflow_sink", "test_plots", "test_sweep_faults", "test_sweep_server",
                   "test_view_screens", "test_view_story"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        if module in SHARED_FIXTURES:
            item.add_marker(pytest.mark.xdist_group(module))
