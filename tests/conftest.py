"""Shared fixtures: real data (scikit-learn's bundled digits) and small real models."""
from __future__ import annotations

import os
import sys
import tempfile

# One intra-op thread per test process and per process it starts (Hydra apps, README commands, workers
# inherit the environment): the suite runs one test per core (pytest-xdist), so torch's default of one
# OpenMP thread per core only makes threads spin against each other and the other worker's test (the
# example app's 2 ms step took 50-150 ms on the 2-core VM while another test ran). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Bytecode written as modules are first imported, here and in every process the suite starts: scripts/bootstrap.sh
# compiles only what trackdiag[all] brings (scripts/byte_compile.py), so where PYTHONDONTWRITEBYTECODE is set (this
# sandbox, CI) each process would compile the test-only packages (transformers, Ray, Lightning, ...) in memory again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

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


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    """One real ``mlflow server`` (SQLite store, ``tests/_mlflow_util.MlflowServer``) for the modules of the
    ``mlflow_server`` group, which only need one running: their runs are told apart by experiment or run tag. Each
    start is ~10-16 CPU-s on 2 cores; four modules started one each (issue 47). The tests that stop or restart a
    server start their own."""
    from _mlflow_util import MlflowServer
    from _procs import AFTER_GROUP

    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server"))
    AFTER_GROUP.setdefault("mlflow_server", []).append(srv.stop)  # stopped with the group's last test
    try:
        srv.start()
        srv.wait(180)
        yield srv
    finally:
        srv.stop()  # the whole process group, whatever happened (a second stop does nothing)


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
def _sigint_handler_restored():
    """The SIGINT handler as it was before each test: one left installed by a test (or by what it ran in-process)
    changes what a Ctrl-C does in every later test of the worker (``util/uninterrupted.py`` holds the signal only
    under Python's own handler), so the tests about Ctrl-C would depend on the order the suite ran in."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    yield
    if signal.getsignal(signal.SIGINT) is not before and before is not None:
        signal.signal(signal.SIGINT, before)


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
SHARED_FIXTURES = {"test_benchmarks", "test_compare", "test_distributed", "test_hydra_app", "test_lightning",
                   "test_mlflow_sink", "test_plots"}
#: modules that share one group: the sweeps (five tests, 25-50 s each on 2 cores) wait on PostgreSQL, MLflow and Ray
#: starting and on their jobs, so on one worker they start one PostgreSQL + MLflow server (_sweeps.server_fixture:
#: one per worker process) and leave the other worker's CPU-bound tests the cores they do not use; spread over both
#: workers they waited side by side at the start of the run (~15 % of the cores idle in its first 80 s)
GROUPED_WITH = {"test_sweep_server": "sweeps", "test_sweep_faults": "sweeps", "test_sweep_ray": "sweeps",
                # one SQLite ``mlflow server`` (the session fixture ``mlflow_server``) for the modules that need one up
                "test_view_story": "mlflow_server", "test_view_screens": "mlflow_server",
                "test_delivery_server": "mlflow_server", "test_hardening_redact": "mlflow_server"}


def group_of(module: str) -> str | None:
    """The xdist group of a test module (its own name for :data:`SHARED_FIXTURES`), or None."""
    return GROUPED_WITH.get(module) or (module if module in SHARED_FIXTURES else None)


#: the costliest tests (a node id or its prefix: a module, or a test and all its parameters) and their seconds
#: on one worker of a full run on the 2-core VM (--durations=0: a quiet run's, or a busy run's x0.4). They start
#: first, costliest first (pyproject's addopts has ``--no-loadscope-reorder``, so xdist keeps this order instead
#: of starting the groups with the most tests), so that no worker is left running a long test at the end while
#: the other idles; a module's figure is the whole module's when it is a group (one scope), each test's when not.
#: The rest follows in file order. A guess is enough: the order matters, not the figures. Left out on purpose: tests
#: that mostly wait (test_delivery_server's server 150 ms away, test_mlflow_server's outage: ~50 s of wall for ~15
#: CPU-s); first, they waited beside the README's and the sweeps' tests, which wait too, with ~40 % of a core idle
#: for ~45 s (sampled every 5 s on a cold run); in file order they run beside the in-process tests that use a core.
COSTLY: dict[str, float] = {
    "tests/test_sweep_server.py::test_parallel_jobs_one_parent_every_point_true_statuses[joblib]": 120,
    "tests/test_sweep_ray.py": 90,
    "tests/test_sweep_server.py::test_parallel_jobs_one_parent_every_point_true_statuses[submitit_local]": 70,
    "tests/test_sweep_faults.py::test_server_restarted_mid_sweep_loses_nothing": 120,
    "tests/test_sweep_faults.py::test_killed_job_is_killed_others_unaffected": 110,
    "tests/test_compare.py": 100,
    "tests/test_hydra_app.py": 90,
    # the mlflow_server group (the view, delivery and credentials modules, ~150 s on one worker): its browser work
    # uses a core, its delivery tests mostly wait (see above), so it starts after the sweeps and the README's tests,
    # beside CPU-bound ones, not first
    "tests/test_view_story.py": 30,
    "tests/test_benchmarks.py": 90,
    "tests/test_oldest_versions.py": 90,
    "tests/test_lightning.py": 80,
    "tests/test_mlflow_view.py::test_sweep_with_default_store_and_commands_that_work_when_pasted": 70,
    "tests/test_readme.py::test_every_command_and_snippet_works_as_printed[accelerate": 60,
    "tests/test_readme.py::test_every_command_and_snippet_works_as_printed[a-hydra-app]": 58,
    "tests/test_mlflow_sink.py": 45,
    "tests/test_view_screens.py": 20,
    "tests/test_sink_hub.py::test_every_write_a_ctrl_c_lets_through": 40,
    "tests/test_readme.py::test_every_command_and_snippet_works_as_printed[set-up]": 39,
    "tests/test_readme.py::test_every_command_and_snippet_works_as_printed[add-it": 38,
    "tests/test_distributed.py": 35,
    "tests/test_ctrl_c.py::test_a_second_ctrl_c": 33,
    "tests/test_delivery_busy.py": 32,
    "tests/test_rl_unflagged.py::test_pytorch_actor_critic_example": 31,
    "tests/test_optuna_hydra.py::test_optuna_sweeper_prunes_exploding_trials": 30,
    "tests/test_compile.py::test_inductor_end_to_end_at_every_preset": 20,   # a fresh machine builds Inductor's headers
    "tests/test_delivery_status.py::test_crash_sigterm_and_ctrl_c_without_with": 22,
    "tests/test_optuna_compare.py::test_cli_compare_optuna_source": 21,
    "tests/test_silent_ranks.py": 21,
    "tests/test_optuna_stop.py": 18,
}


def cost(nodeid: str) -> float:
    """The seconds :data:`COSTLY` gives ``nodeid`` (its longest matching prefix), 0 when it is not listed."""
    found = [k for k in COSTLY if nodeid.startswith(k)]
    return COSTLY[max(found, key=len)] if found else 0.0


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core. A worker more (the previous choice: waits on servers and jobs leave a core
    idle) costs more than the waits it fills: on 2 cores the healthy style matrix (93 CPU-bound tests) took 97 CPU-s
    in 59 s with 2 workers and 111-115 CPU-s in 67-69 s with 3 (alternated, twice each: every test pays for sharing
    a core), the whole suite 1,154 CPU-s in 622 s against 1,286 in 660 (issue 47)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return cores


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the node ids (``id@group``)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups: dict[str, str] = {}
    for item in items:
        group = group_of(_module_of(item))
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            groups[item.nodeid] = group
    # costliest scope first (a group is one scope: its tests stay together, in file order, even when its modules
    # are not neighbours in the collection); stable for the rest
    scope_cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        scope = groups.get(item.nodeid, item.nodeid)
        scope_cost[scope] = max(scope_cost.get(scope, 0.0), cost(item.nodeid))
        first.setdefault(scope, i)

    def order(item: pytest.Item) -> tuple[float, int]:
        scope = groups.get(item.nodeid, item.nodeid)
        return -scope_cost[scope], first[scope]

    items.sort(key=order)
    COLLECTED[:] = [item.nodeid for item in items]  # before ``-k``/``-m`` deselect (this hook runs first)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a group's last test on this worker (the next test is of another scope, or none), what the group's shared
    fixtures left running (:data:`_procs.AFTER_GROUP`) is stopped, not at the worker's exit."""
    yield
    from _procs import AFTER_GROUP

    group = group_of(_module_of(item))
    if group in AFTER_GROUP and (nextitem is None or group_of(_module_of(nextitem)) != group):
        for stop in AFTER_GROUP.pop(group):
            stop()


def _module_of(item: pytest.Item) -> str:
    return item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""


#: this session's collection in the order xdist gets it (tests/test_suite_order.py checks it)
COLLECTED: list[str] = []
#: the node ids as xdist's scheduler gets them, after every plugin's ``pytest_collection_modifyitems`` (on a worker
#: under ``--dist loadgroup``, a grouped test's id ends with ``@<group>``), those ``-k``/``-m`` deselected included
SCHEDULED: list[str] = []


def pytest_deselected(items: list[pytest.Item]) -> None:
    SCHEDULED.extend(item.nodeid for item in items)


def pytest_collection_finish(session: pytest.Session) -> None:
    SCHEDULED.extend(item.nodeid for item in session.items)


#: ``TRACKDIAG_TEST_CPU=<file>``: each test's CPU seconds (this process and the children it waited for, setup to
#: teardown), wall seconds, start time (epoch seconds) and xdist worker appended as
#: ``nodeid<TAB>cpu<TAB>wall<TAB>start<TAB>worker`` lines, for issue 47's "where the suite's CPU goes"
#: (``python scripts/test_cpu_report.py <file>`` sums them by module and draws the workers' timeline)
CPU_LOG = os.environ.get("TRACKDIAG_TEST_CPU")


def _cpu() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = sys.modules.get("_warm")  # children forked by tests/_warm.py's zygote: it waits for them, not this process
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + (warm.children_cpu if warm else 0.0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not CPU_LOG:
        yield
        return
    import time

    c0, t0, start = _cpu(), time.perf_counter(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(CPU_LOG, "a") as f:
        f.write(f"{item.nodeid}\t{_cpu() - c0:.2f}\t{time.perf_counter() - t0:.2f}\t{start:.1f}\t{worker}\n")
