"""Shared fixtures: real data (scikit-learn's bundled digits) and small real models."""
from __future__ import annotations

import os
import tempfile
from typing import Any

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
    from trackdiag.optimizers import DISPATCH

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
#: modules that share one group (one worker, so one process-wide fixture): both sweep modules log to the
#: process's one PostgreSQL + MLflow server (``_sweeps.server_fixture``), started once instead of once per worker
GROUP_OF = {"test_sweep_faults": "sweeps", "test_sweep_server": "sweeps"}

#: rough wall seconds of the longest work units (an xdist group, or a test id up to its parameters) on the
#: 2-core VM with both workers busy. The suite hands units out longest first (``--dist loadgroup`` follows the
#: collection order once its reorder by test count is off, see pytest_configure): a 2-minute unit that starts
#: last would stretch the run by its length while the other worker idles. Units not named here keep their order.
KNOWN_SLOW = {
    "sweeps": 290,
    "test_benchmarks": 75,
    "test_delivery_server": 70,
    "test_view_story": 55,
    "test_readme.py::test_every_command_and_snippet_works_as_printed": 45,
    "test_lightning": 40,
    "test_hydra_app": 40,
    "test_compare": 36,
    "test_mlflow_view.py::test_sweep_with_default_store_and_commands_that_work_when_pasted": 32,
    "test_mlflow_server.py::test_server_outage_loses_nothing": 27,
    "test_distributed": 27,
    "test_view_screens": 27,
    "test_oldest_versions.py::test_integrations_under_the_oldest_versions": 26,
    "test_delivery_busy.py::test_busy_machine_fresh_default_store": 25,
    "test_mlflow_sink": 19,
    "test_ctrl_c.py::test_ctrl_c_to_the_process_group": 16,
    "test_hardening_redact.py::test_hydra_app_secrets_in_config_and_overrides": 15,
    "test_flight.py::test_sigterm_mid_step_is_recorded_everywhere": 15,
    "test_hardening_redact.py::test_credentials_in_the_tracking_uri_connect_but_are_never_written": 14,
    "test_delivery_status.py::test_crash_sigterm_and_ctrl_c_without_with": 14,
    "test_delivery_status.py::test_crashed_hydra_jobs_are_failed_not_healthy": 12,
    "test_fault_zoo.py::test_memory_leak_is_caught_within_100_steps": 11,
    "test_plots": 11,
}


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: hand units out in the order sorted below
        config.option.loadscopereorder = False


def _group_of(module: str) -> str | None:
    return GROUP_OF.get(module, module) if module in SHARED_FIXTURES else None


def _group(item: pytest.Item) -> str | None:
    return _group_of(item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else "")


def _expected_seconds(item: pytest.Item, group: str | None) -> float:
    if group is not None:
        return KNOWN_SLOW.get(group, 0.0)
    name = item.nodeid.rpartition("/")[2].partition("[")[0]  # test_x.py::test_y
    return KNOWN_SLOW.get(name, 0.0)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (its hook would run first)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item: _group(item) for item in items}
    for item, group in groups.items():
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    # longest units first; a group's tests stay together in their order; ties keep the collection order
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(groups[item] or item.nodeid, i)
    order = {item: (-_expected_seconds(item, groups[item]), first_seen[groups[item] or item.nodeid], i)
             for i, item in enumerate(items)}
    items.sort(key=order.__getitem__)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: ignored where xdist is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` that groups by the table above. pytest-xdist groups by an ``@group`` suffix it
    writes into ``item._nodeid``, which pytest 9 no longer reads (``nodeid`` comes from ``item._id``): the
    ids sent to the controller had no suffix and every test of a "shared" module ran wherever it fell, its
    module fixture started on both workers. The group is read from the test's module here instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # a suffix pytest-xdist managed to write
                return nodeid.split("@")[-1]
            module = nodeid.partition("::")[0].rpartition("/")[2].removesuffix(".py")
            return _group_of(module) or nodeid

    return GroupScheduling(config, log)
