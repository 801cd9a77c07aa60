"""Child processes the tests start in their own process group (servers, proxies)."""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any


def kill_group(proc: "subprocess.Popen[Any] | None") -> None:
    """Kill ``proc``'s whole process group (it was started with ``start_new_session=True``) and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
