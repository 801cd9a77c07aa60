"""Launching the ranks of a gloo test on loopback (tests/test_distributed.py, tests/test_silent_ranks.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import _warm as warm
from _procs import kill_group

FORK = Path(__file__).with_name("_fork_ranks.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(worker: Path, scenario: str, out: Path, world: int, timeout: float, **env: str) -> None:
    """Run ``worker`` as ranks 0..world-1 of ``scenario`` (``_fork_ranks.py``: one start-up, one fork per
    rank); every process is gone when this returns; a failing rank fails the test with every rank's log."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **env}
    proc = warm.popen([sys.executable, str(FORK), str(worker), str(world), scenario, str(out)], env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_group(proc)
        log = proc.communicate()[0]
        pytest.fail(f"ranks of {scenario!r} still running after {timeout} s:\n{log[-6000:]}")
    finally:
        kill_group(proc)  # ranks a crashed launcher left behind
    if proc.returncode:
        pytest.fail(f"a rank of {scenario!r} failed:\n{log[-6000:]}")
