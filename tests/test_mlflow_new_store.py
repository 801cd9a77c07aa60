"""A new SQLite store is a copy of an empty template, not MLflow's migrations replayed (trackdiag.sinks.mlflow.new_store).

Real MLflow, real SQLite files, a real training session through the MLflow worker. The reference is MLflow's own
store: a store MLflow made and one seeded from the template hold the same schema and rows (but the ``Default``
experiment's creation time), and MLflow opens the seeded one without migrating it. A store that exists is never
touched; processes racing to make one leave one intact store; a damaged template is replaced, not copied.
"""
from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.sinks.mlflow import new_store  # noqa: E402
from trackdiag.sinks.mlflow.ops import sanitize_key  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

from _mlflow_util import history, local_points, same_points, tiny_model, train  # noqa: E402

MIGRATING = "Creating initial MLflow database tables"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own: the template is made here, once."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "trackdiag"


def _dump(db: Path) -> list[str]:
    """The database as SQL statements, sorted, each table's columns and constraints sorted too (the order
    in which MLflow's migrations write a table's constraints varies from one process to the next), the
    ``Default`` experiment's two timestamps masked."""
    con = sqlite3.connect(db)
    try:
        lines = list(con.iterdump())
    finally:
        con.close()
    return sorted(line.split("VALUES(0,'Default',")[0] + "<Default>" if "VALUES(0,'Default'," in line else
                  "\n".join(sorted(part.strip().rstrip(",") for part in line.split("\n"))) if line.startswith("CREATE TABLE")
                  else line for line in lines)


def _uri(db: Path) -> str:
    return f"sqlite:///{db}"


def test_seeded_store_is_the_store_mlflow_makes_without_migrating(tmp_path: Path, cache: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    made = tmp_path / "made" / "mlflow.db"
    made.parent.mkdir()
    with caplog.at_level(logging.INFO, logger="mlflow.store.db.utils"):
        MlflowClient(_uri(made)).search_experiments()  # MLflow alone: its migrations
    assert MIGRATING in caplog.text

    seeded = tmp_path / "seeded" / "mlflow.db"
    seeded.parent.mkdir()
    assert new_store.seed(_uri(seeded))  # the first time: the template is made (by MLflow), then copied
    assert [p.name for p in cache.iterdir()] == [p.name for p in cache.glob("mlflow-*.db")] != []
    again = tmp_path / "again" / "mlflow.db"
    again.parent.mkdir()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlflow.store.db.utils"):
        assert new_store.seed(_uri(again))
        for db in (seeded, again):
            exps = MlflowClient(_uri(db)).search_experiments()
            assert [e.name for e in exps] == ["Default"]
            assert exps[0].artifact_location == MlflowClient(_uri(made)).get_experiment("0").artifact_location
    assert MIGRATING not in caplog.text  # opened as an up-to-date store: no table made, no migration run
    # the same schema, indexes, Alembic revision and rows as the store MLflow made
    assert _dump(seeded) == _dump(again) == _dump(made)
    assert not new_store.seed(_uri(seeded))  # it exists now


def test_the_file_is_the_one_mlflow_opens(tmp_path: Path) -> None:
    """The store's path as SQLAlchemy reads the URI (``%20`` a space, a ``?query`` not part of it), and a '#' or
    '%' in a directory's name kept: the seeded file is the one MLflow then opens, not a stray one beside it."""
    for odd, uri in [(tmp_path / "a b", f"sqlite:///{tmp_path}/a%20b/mlflow.db"),
                     (tmp_path / "q", f"sqlite:///{tmp_path}/q/mlflow.db?timeout=20"),
                     (tmp_path / "my #1 100%", _uri(tmp_path / "my #1 100%" / "mlflow.db"))]:
        odd.mkdir()
        assert new_store.seed(uri), uri
        assert sorted(p.name for p in odd.iterdir()) == ["mlflow.db"]
        before = (odd / "mlflow.db").read_bytes()
        assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]
        assert (odd / "mlflow.db").read_bytes() != before  # MLflow wrote its Default experiment into this file
        assert sorted(p.name for p in odd.iterdir()) == ["mlflow.db"]


def test_an_existing_store_is_never_touched(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    client = MlflowClient(_uri(db))
    run = client.create_run(client.create_experiment("mine"))
    client.log_metric(run.info.run_id, "loss", 0.5)
    before = db.read_bytes()
    assert not new_store.seed(_uri(db))
    assert db.read_bytes() == before
    empty = tmp_path / "empty.db"
    empty.touch()  # a file, even an empty one, is somebody's
    assert not new_store.seed(_uri(empty)) and empty.read_bytes() == b""


@pytest.mark.parametrize("uri", ["sqlite:///relative.db", "sqlite:///:memory:", "sqlite:////no/such/dir/mlflow.db",
                                 "postgresql://u@127.0.0.1/db", "http://127.0.0.1:5000", "file:///tmp/mlruns",
                                 "sqlite://"])
def test_what_it_leaves_to_mlflow(uri: str) -> None:
    assert not new_store.seed(uri)


def test_racing_processes_make_one_intact_store(tmp_path: Path) -> None:
    """Two processes seed the same new store at once (the template made by the first of them to finish): one
    store, MLflow opens it, and exactly one process made it."""
    db = tmp_path / "race" / "mlflow.db"
    db.parent.mkdir()
    code = ("import sys; from trackdiag.sinks.mlflow.new_store import seed; "
            f"print(seed({_uri(db)!r}))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(outs) == ["False", "True"], outs
    assert sorted(p.name for p in db.parent.iterdir()) == ["mlflow.db"]  # no temporary file left
    assert [e.name for e in MlflowClient(_uri(db)).search_experiments()] == ["Default"]


def test_a_damaged_template_is_not_copied_and_is_made_again(tmp_path: Path, cache: Path) -> None:
    first = tmp_path / "first.db"
    assert new_store.seed(_uri(first))
    (template,) = cache.glob("mlflow-*.db")
    template.write_bytes(template.read_bytes()[: 8192])  # truncated: not an intact database
    second = tmp_path / "second.db"
    assert not new_store.seed(_uri(second)) and not second.exists()  # left to MLflow
    assert not template.exists()
    third = tmp_path / "third.db"
    assert new_store.seed(_uri(third)) and template.exists()  # made again
    assert _dump(third) == _dump(first)


def test_a_training_session_on_a_new_default_store_delivers_every_point(tmp_path: Path) -> None:
    """The README's way: the MLflow sink on a new SQLite store, through the worker process; the store was
    seeded (the template exists) and holds every point of the local record."""
    db = tmp_path / "mlflow.db"
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / "run"),
                                 probes={"report": {"enabled": False}},
                                 sink={"mlflow": {"tracking_uri": _uri(db), "experiment": "seeded"}})
    with diag:
        train(diag, model, opt, range(20))
    run_id = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink)).run_id
    assert list((tmp_path / "cache" / "trackdiag").glob("mlflow-*.db"))
    client = MlflowClient(_uri(db))
    local = local_points(tmp_path / "run")
    assert local
    for key, pts in local.items():
        assert same_points(history(client, run_id, sanitize_key(key)), pts), key
    assert client.get_run(run_id).info.status == "FINISHED"
