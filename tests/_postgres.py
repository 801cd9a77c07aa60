"""A real PostgreSQL and a real ``mlflow server`` on it, for the shared-server tests and benchmark.

:class:`Postgres` runs PostgreSQL's own server (Debian's ``/usr/lib/postgresql/<v>/bin``, not on
PATH) from a fresh data dir in a temporary directory, on a loopback port, with its socket in that
dir; ``initdb`` refuses to run as root, so as root (CI) every PostgreSQL command runs as the
``postgres`` system user (``runuser -u postgres --``) on a data dir that user owns.
:func:`skip_reason` says why it cannot run here (no binaries, root without a ``postgres`` user).

:class:`PgMlflowServer` is ``mlflow server --backend-store-uri postgresql://... --serve-artifacts``
on another loopback port, in its own process group (it forks workers), killed whole by ``stop``.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from _mlflow_util import MlflowServer, free_port

PG_ROOT = Path("/usr/lib/postgresql")


def pg_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb`` and ``pg_ctl``, or None."""
    if not PG_ROOT.is_dir():
        return None
    found = [d / "bin" for d in PG_ROOT.iterdir()
             if (d / "bin" / "initdb").exists() and (d / "bin" / "pg_ctl").exists()]
    return max(found, key=lambda p: float(p.parent.name) if p.parent.name.replace(".", "").isdigit() else 0.0) \
        if found else None


def skip_reason() -> str | None:
    """Why a PostgreSQL server cannot be started here, or None."""
    if pg_bin() is None:
        return f"PostgreSQL server binaries not found under {PG_ROOT}/<version>/bin (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' system user to run initdb as"
        if shutil.which("runuser") is None:
            return "running as root and runuser is missing"
    try:
        import psycopg  # noqa: F401  (MLflow opens postgresql:// stores with psycopg 3)
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    return None


class Postgres:
    """One PostgreSQL cluster in a temp dir (``start``/``stop``); ``uri(db)`` for SQLAlchemy/MLflow."""

    def __init__(self, port: int | None = None) -> None:
        self.bin = pg_bin()
        if self.bin is None:
            raise RuntimeError(skip_reason() or "no PostgreSQL")
        self.port = port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="trackdiag-pg-"))  # /tmp: readable by the postgres user
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self._as_root = os.geteuid() == 0

    def _cmd(self, tool: str, *args: str) -> list[str]:
        cmd = [str(self.bin / tool), *args]  # type: ignore[operator]
        return ["runuser", "-u", "postgres", "--", *cmd] if self._as_root else cmd

    def start(self, timeout: float = 120.0) -> None:
        """initdb (trust auth on loopback, no fsync: a throwaway cluster) and ``pg_ctl start -w``."""
        if self._as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        subprocess.run(self._cmd("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                                 "--no-sync", "--no-instructions"),
                       check=True, capture_output=True, timeout=timeout)
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                                 "-t", str(int(timeout)), "start"),
                       check=True, capture_output=True, timeout=timeout + 10)

    def create_db(self, name: str) -> str:
        """``CREATE DATABASE name``; returns its ``postgresql://`` URI."""
        import psycopg

        with psycopg.connect(self.uri("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.uri(name)

    def uri(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        """``pg_ctl stop -m immediate``, then the temp dir is removed."""
        if self.data.exists():
            subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"),
                           capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


class PgMlflowServer(MlflowServer):
    """``mlflow server`` with a PostgreSQL backend store and proxied artifacts (``--serve-artifacts``),
    in its own process group. ``uri`` is its ``http://127.0.0.1:<port>``. Two workers: each costs ~2 s of CPU
    to start (12 s for four, 8 for two), and two serve the suite's 16-job sweeps (benchmarks/sweep_server.py
    measures four)."""

    def __init__(self, root: Path, store_uri: str, port: int | None = None, workers: int = 2) -> None:
        super().__init__(root, port, store_uri=store_uri, workers=workers, serve_artifacts=True)