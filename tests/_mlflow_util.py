"""Helpers for the MLflow sink tests: a tiny training loop, local-record readers, a real server."""
from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _procs import kill_group
from trackdiag.core.record import read_records


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train(diag: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: range, nan_step: int | None = None) -> None:
    """``len(steps)`` optimizer steps on random data; a NaN in the input at ``nan_step``."""
    gen = torch.Generator().manual_seed(steps.start + 1)
    for step in steps:
        x = torch.randn(16, 8, generator=gen)
        if step == nan_step:
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,), generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        diag.step(loss)


def local_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric point of a local record: key -> [(step, value), ...] sorted by step."""
    out: dict[str, list[tuple[int, float]]] = {}
    for rec in read_records(run_dir):
        for k, s, v in rec.points():
            out.setdefault(k, []).append((s, v))
    return {k: sorted(v) for k, v in out.items()}


def history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def same_points(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """Equal step by step; NaN equals NaN; MLflow stores +-inf as +-1.8e308."""
    def norm(v: float) -> float:
        return math.copysign(1.7976931348623157e308, v) if math.isinf(v) else v
    return len(a) == len(b) and all(
        sa == sb and (norm(va) == norm(vb) or (math.isnan(va) and math.isnan(vb))) for (sa, va), (sb, vb) in zip(a, b))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 in its own process group (it forks workers): ``stop`` kills the group.

    The one server harness of the suite: a SQLite store under ``root`` by default, or ``store_uri`` (the
    PostgreSQL-backed server of the sweep tests, :class:`_postgres.PgMlflowServer`); artifacts go to
    ``root/server_artifacts``, proxied by the server when ``serve_artifacts``. Job execution is off (it
    halves start-up: ~10 s instead of ~20 s on 2 cores).
    """

    def __init__(self, root: Path, port: int | None = None, *, store_uri: str | None = None, workers: int = 1,
                 serve_artifacts: bool = False) -> None:
        self.root, self.port = root, port or free_port()
        self.store_uri = store_uri or f"sqlite:///{root / 'server.db'}"
        self.workers, self.serve_artifacts = workers, serve_artifacts
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Any = None
        self.log_path = root / "mlflow-server.log"
        root.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)
        from trackdiag.sinks.mlflow.new_store import seed

        seed(self.store_uri)  # a new SQLite store as the sink makes one (a restart finds it: untouched)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.store_uri,
             *(["--serve-artifacts"] if self.serve_artifacts else []),
             "--artifacts-destination", str(self.root / "server_artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", str(self.workers)],
            cwd=self.root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait(self, timeout: float = 180.0) -> float:
        """Seconds until ``/health`` answers (~10 s on a quiet 2-core machine, over a minute on a busy one);
        raises if the server exits or ``timeout`` passes."""
        t0 = time.monotonic()
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited ({self.proc.returncode}): {self.log_tail()}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"mlflow server not healthy after {timeout}s: {self.log_tail()}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """Kill the server's whole process group."""
        kill_group(self.proc)
        self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


def ready_store(dest_dir: Path, name: str = "mlflow.db") -> str:
    """A real, empty SQLite MLflow store at ``dest_dir/name`` (its URI), made as the MLflow sink makes a new one:
    a copy of the template MLflow migrated once (:mod:`trackdiag.sinks.mlflow.new_store`)."""
    from trackdiag.sinks.mlflow.new_store import seed

    dest_dir.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{dest_dir / name}"
    assert seed(uri), f"could not make {uri}"
    return uri
