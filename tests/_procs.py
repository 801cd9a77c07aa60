"""Child processes the tests start in their own process group (servers, proxies)."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Callable

#: per xdist group (``conftest.group_of``), how to stop what its shared fixtures started (a server, PostgreSQL):
#: conftest calls them once the group's last test on this worker has ended (its tests are neighbours in the
#: collection: tests/test_suite_order.py), not when the worker exits. Left up, the sweeps' PostgreSQL and MLflow
#: server (two uvicorn workers) and the view's SQLite server used ~30 CPU-s idling through the ~8 minutes the suite
#: ran on after their groups (BSD process accounting of a whole run, issue 47)
AFTER_GROUP: dict[str, list[Callable[[], None]]] = {}


def kill_group(proc: "subprocess.Popen[Any] | None") -> None:
    """Kill ``proc``'s whole process group (it was started with ``start_new_session=True``) and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
