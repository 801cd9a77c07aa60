"""Where MLflow data goes: tracking URIs, artifact locations, server health, and file locks.

Cheap helpers with no MLflow import, shared by the sink (training process), the delivery worker,
``trackdiag sync`` and the background delivery of leftover spools.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import IO, Iterator

from trackdiag.sinks.mlflow.ops import sanitize_key


@contextlib.contextmanager
def sweep_lock(group: Path) -> Iterator[None]:
    """An exclusive lock shared by the jobs of one sweep (POSIX ``flock``; no-op elsewhere)."""
    try:
        import fcntl

        group.mkdir(parents=True, exist_ok=True)
        f = open(group / ".trackdiag_mlflow.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_tracking_uri(cwd: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<cwd>/mlflow.db`` (never MLflow's cwd-relative
    guess); a relative SQLite path is made absolute against ``cwd`` (Hydra may chdir into the job dir)."""
    return absolute_sqlite(os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db", cwd)


def absolute_sqlite(uri: str, cwd: Path) -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////<cwd>/rel.db``; any other URI unchanged."""
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if not path or path.startswith("/") or path == ":memory:" or Path(path).is_absolute():
        return uri
    return f"sqlite:///{(Path(cwd) / path).resolve()}"


def default_artifact_location(tracking_uri: str, cwd: Path, experiment: str) -> str | None:
    """``<db dir>/mlartifacts/<experiment>`` for SQLite stores (``<cwd>/mlartifacts/...`` for other
    databases), so MLflow never falls back to ``./mlruns``; None for servers and file stores."""
    if tracking_uri.startswith(("http:", "https:", "databricks", "file:", "/")) or "://" not in tracking_uri:
        return None
    base = Path(cwd)
    if tracking_uri.startswith("sqlite:///") and tracking_uri != "sqlite:///:memory:":
        base = Path(tracking_uri[len("sqlite:///"):]).parent
    return (base.resolve() / "mlartifacts" / sanitize_key(experiment).replace("/", "_")).as_uri()


def is_remote(tracking_uri: str) -> bool:
    """Whether the store is reached over HTTP (a tracking server, Databricks), where MLflow's client
    retries requests whose answer was lost."""
    return tracking_uri.startswith(("http://", "https://", "databricks"))


def health_url(tracking_uri: str) -> str | None:
    """``<server>/health`` for an http(s) tracking URI, else None (local stores need no probe)."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/") + "/health"
    return None


def healthy(url: str | None, timeout: float = 2.0) -> bool:
    """One GET without retries: is the tracking server answering? True for local stores."""
    if url is None:
        return True
    try:
        import requests

        return requests.get(url, timeout=timeout).status_code == 200
    except Exception:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (for spool ownership checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def try_lock(path: Path) -> IO[str] | None:
    """Take an exclusive, non-blocking ``flock`` on ``path`` (created if needed). Returns the open
    file (keep it open to hold the lock; closing it releases), or None if another process holds
    it. Where ``fcntl`` is missing, always succeeds."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a", encoding="utf-8")
    except OSError:
        return None
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:
        return f
    except OSError:
        f.close()
        return None
    return f


def ui_command(uri: str) -> str:
    """How to open the MLflow UI on ``uri``: ``open <url>`` for servers, else a command that works
    when pasted into a shell with no venv active (this interpreter's ``-m mlflow ui``)."""
    if uri.startswith(("http:", "https:")):
        return f"open {uri}"
    if "://" not in uri:
        return f"tracking URI {uri}"
    return f"{shlex.quote(sys.executable)} -m mlflow ui --backend-store-uri {shlex.quote(uri)}"


def option_problems(positive: dict[str, float], max_histogram_images: int, delivery: str) -> list[str]:
    """The MLflow sink's option problems (``ConfigError`` lines): values that must be > 0, the image
    cap (>= 0) and the delivery mode."""
    problems = [f"diag.sink.mlflow.{k}: must be > 0, got {v!r}" for k, v in positive.items() if v <= 0]
    if max_histogram_images < 0:
        problems.append(f"diag.sink.mlflow.max_histogram_images: must be >= 0, got {max_histogram_images!r}")
    if delivery not in ("process", "thread"):
        problems.append(f"diag.sink.mlflow.delivery: {delivery!r} is not one of process, thread")
    return problems
