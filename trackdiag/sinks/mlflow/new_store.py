"""A new SQLite store made as a copy of an empty one, not by replaying MLflow's schema migrations.

MLflow makes the tables of every new SQLite store by creating its first schema and then running each
of its ~60 Alembic migrations (~0.85 s of CPU here, 2-3 s on a busy machine); the default store is a
new ``mlflow.db`` in each new working directory, and every test of a training loop has one of its own.
The first time, :func:`seed` has MLflow do exactly that into an empty template under the user's cache
(``$XDG_CACHE_HOME/trackdiag`` or ``~/.cache/trackdiag``, one per MLflow and SQLAlchemy version and schema revision); after
that, a store that does not exist yet starts as a copy of it (~0.04 s: MLflow then only adds its
``Default`` experiment, as it does to a store it has just migrated). The copy is checked before it
takes the store's name (SQLite's ``quick_check`` and the schema revision MLflow expects), and it takes
it with a hard link, which fails if the store appeared meanwhile: a store that exists, or that
another process is making, is never touched. Anything unusual (no cache directory, a file system
without hard links, an MLflow whose private helpers moved) leaves the store to MLflow, as before.
"""
from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from urllib.request import pathname2url

log = logging.getLogger("trackdiag")


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of an absolute ``sqlite:////path`` URI as SQLAlchemy (so MLflow) reads it (``%20`` is a
    space, a ``?query`` is not part of it), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    from sqlalchemy.engine import make_url

    path = make_url(tracking_uri).database
    return Path(path) if path and Path(path).is_absolute() else None


def seed(tracking_uri: str) -> bool:
    """Make the store of ``tracking_uri`` from the template when it is a SQLite file that does not exist
    yet and whose directory does; True when this call made it."""
    path = sqlite_file(tracking_uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        template, revision = _template()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.new")
        try:
            shutil.copyfile(template, tmp)
            if _revision(tmp) != revision:
                template.unlink(missing_ok=True)  # damaged: the next session makes it again
                return False
            os.link(tmp, path)  # atomic, and never over a store that appeared meanwhile
            return True
        finally:
            tmp.unlink(missing_ok=True)
    except FileExistsError:
        return False
    except Exception as exc:  # MLflow makes the store itself, as it always did
        log.debug("trackdiag: new MLflow store %s left to MLflow: %s", path, exc)
        return False


def _revision(db: Path) -> str | None:
    """The Alembic revision of an intact SQLite database, else None."""
    con = sqlite3.connect(f"file:{pathname2url(str(db))}?mode=ro", uri=True)  # '#', '?', '%' in a path kept
    try:
        if con.execute("PRAGMA quick_check").fetchone() != ("ok",):
            return None
        row = con.execute("SELECT version_num FROM alembic_version").fetchone()
        return row[0] if row else None
    except sqlite3.Error:
        return None
    finally:
        con.close()


def _template() -> tuple[Path, str]:
    """(the empty template store for this MLflow and SQLAlchemy, the schema revision it holds), made
    first if needed (by MLflow itself, in a file of its own, then renamed into place)."""
    import mlflow
    import sqlalchemy
    from mlflow.store.db import utils

    revision = utils._get_latest_schema_revision()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trackdiag"
    template = cache / f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}-{revision}.db"
    if template.exists():
        return template, revision
    cache.mkdir(parents=True, exist_ok=True)
    tmp = template.with_name(f".{template.name}.{os.getpid()}.{threading.get_ident()}.new")
    try:
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")
        try:
            utils._initialize_tables(engine)
            utils._verify_schema(engine)
        finally:
            engine.dispose()
        if _revision(tmp) != revision:
            raise RuntimeError(f"the template's schema is not MLflow's {revision}")
        os.replace(tmp, template)
    finally:
        tmp.unlink(missing_ok=True)
    return template, revision
