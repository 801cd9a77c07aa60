"""``trackdiag sync`` does not trust the spool: given one made by someone else it uploads only files
inside the run dir it was given (symlinks followed), checks every op, prints the target store, and
with ``--tracking-uri`` delivers to that store only (never the store or artifact location the spool
names). The background delivery of leftover spools applies the same checks. Real SQLite stores."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from trackdiag.cli import main as cli_main  # noqa: E402

from _mlflow_util import ready_store  # noqa: E402


def _all_files(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= _all_files(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def _crafted_spool(tmp_path: Path, store: str, name: str = "theirs") -> tuple[Path, Path, Path]:
    """A run dir whose spool someone else wrote: it names ``store``, an artifact location of its own,
    and asks for secrets outside the run dir (directly, through a symlink, inside a dir)."""
    home = tmp_path / f"home-{name}"
    home.mkdir()
    secret = home / ".netrc"
    secret.write_text("machine example.com login me password hunter2\n")
    run_dir = tmp_path / "runs" / name
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots" / "ok.json").write_text('{"fine": true}')
    (run_dir / "plots" / "innocent.txt").symlink_to(secret)
    (run_dir / "sneaky").mkdir()
    (run_dir / "sneaky" / "link").symlink_to(secret)
    elsewhere = tmp_path / f"elsewhere_artifacts-{name}"
    spool = run_dir / "mlflow_spool"
    spool.mkdir()
    spec = {"experiment": "crafted", "run_name": "crafted", "artifact_location": elsewhere.as_uri(),
            "attach_run_id": None, "group": None, "start_ms": 1, "source": "/x/train.py"}
    (spool / "meta.json").write_text(json.dumps({"version": 1, "pid": 0, "state": {
        "tracking_uri": store, "run_id": None, "spec": spec}}))
    ops: list[Any] = [
        {"op": "open", "spec": spec},
        {"op": "tags", "items": [["trackdiag.level", "basic"]]},
        {"op": "points", "records": [[0, 1000, {"diag/loss": 1.5}, {}], [1, 1001, {"diag/loss": 1.25}, {}]]},
        {"op": "artifact", "path": str(secret), "dir": None},
        {"op": "artifact", "path": "/etc/passwd", "dir": "etc"},
        {"op": "artifact", "path": str(run_dir / "plots" / "innocent.txt"), "dir": "plots"},
        {"op": "artifact", "path": str(run_dir / "sneaky"), "dir": None},
        {"op": "artifact", "path": str(run_dir / "plots" / "ok.json"), "dir": "../../outside"},
        {"op": "artifact", "path": str(run_dir / "plots" / "ok.json"), "dir": "plots"},
        {"op": "_parent", "eid": "0", "group": "/"},
        {"op": "points", "records": [[2, 1002, {"diag/loss": "rm -rf"}, {}]]},
        {"op": "end", "status": "FINISHED", "ts": 2000},
    ]
    (spool / "seg-000000000000.jsonl").write_text("".join(json.dumps(op) + "\n" for op in ops))
    return run_dir, secret, elsewhere


def test_sync_uploads_only_run_dir_files_and_only_to_the_given_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    named, mine = tmp_path / "named.db", tmp_path / "mine.db"
    ready_store(tmp_path, "mine.db")
    run_dir, secret, elsewhere = _crafted_spool(tmp_path, f"sqlite:///{named}")
    rc = cli_main(["sync", str(run_dir), "--tracking-uri", f"sqlite:///{mine}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"delivering to sqlite:///{mine}" in out  # the target store, printed before anything is sent
    assert out.count("  refused:") == 5 and "2 more refused" in out, out
    assert not named.exists() and not elsewhere.exists()  # neither the named store nor its artifact location
    client = MlflowClient(f"sqlite:///{mine}")
    [run] = client.search_runs([client.get_experiment_by_name("crafted").experiment_id])
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "diag/loss")] == [(0, 1.5), (1, 1.25)]
    files = _all_files(client, run.info.run_id)
    assert files == {"plots/ok.json"}, files
    assert "hunter2" not in "".join(p.read_text(errors="ignore") for p in tmp_path.rglob("mlartifacts/**/*") if p.is_file())
    rejected = [json.loads(x) for x in (run_dir / "mlflow_spool" / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 7 and all(r["error"].startswith("refused: ") for r in rejected)
    assert secret.read_text().startswith("machine")  # untouched


def test_sync_without_tracking_uri_uses_the_named_store_and_still_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    named = tmp_path / "named.db"
    ready_store(tmp_path, "named.db")
    run_dir, _, _ = _crafted_spool(tmp_path, f"sqlite:///{named}")
    cli_main(["sync", str(run_dir)])
    assert f"delivering to sqlite:///{named}" in capsys.readouterr().out
    client = MlflowClient(f"sqlite:///{named}")
    [run] = client.search_runs([client.get_experiment_by_name("crafted").experiment_id])
    assert _all_files(client, run.info.run_id) == {"plots/ok.json"}


def test_background_delivery_applies_the_same_checks_and_only_to_its_own_store(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from trackdiag.sinks.mlflow.leftovers import deliver, output_root

    monkeypatch.chdir(tmp_path)
    mine, other = ready_store(tmp_path, "mine.db"), f"sqlite:///{tmp_path / 'other.db'}"
    _crafted_spool(tmp_path, mine)
    other_dir, _, _ = _crafted_spool(tmp_path, other, "other")  # a spool for another store, same root
    root = output_root(tmp_path / "runs" / "me", tmp_path)
    assert root == tmp_path / "runs"
    lines = deliver(root, mine, exclude=set())
    assert len(lines) == 1 and "7 refused" in lines[0], lines
    client = MlflowClient(mine)
    [run] = client.search_runs([client.get_experiment_by_name("crafted").experiment_id])
    assert _all_files(client, run.info.run_id) == {"plots/ok.json"} and run.info.status == "FINISHED"
    assert not (tmp_path / "other.db").exists()  # never delivered to a store other than the session's
    assert list(other_dir.rglob("seg-*.jsonl"))


def test_op_checks(tmp_path: Path) -> None:
    from trackdiag.sinks.mlflow.check import check_op

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "a.png").write_bytes(b"x")
    assert check_op({"op": "artifact", "path": str(run_dir / "a.png"), "dir": "plots"}, run_dir) is None
    assert "outside" in check_op({"op": "artifact", "path": str(run_dir / ".." / "x"), "dir": None}, run_dir)
    assert "outside" in check_op({"op": "artifact", "path": "a.png", "dir": None}, run_dir)  # relative: refused
    assert check_op({"op": "end", "status": "DONE"}, run_dir)
    assert check_op({"op": "params", "items": [["k", "v"]] * 101}, run_dir)
    assert check_op({"op": "open", "spec": {"experiment": "e", "group": "/elsewhere"}}, run_dir)
    assert check_op({"op": "open", "spec": {"experiment": "e", "group": str(tmp_path)}}, run_dir) is None
    assert check_op({"op": "image", "title": "h", "edges": [0, 1], "counts": [2], "step": 0, "ts": 1}, run_dir) is None
    assert check_op({"op": "image", "title": "h", "edges": ["x"], "counts": [2], "step": 0, "ts": 1}, run_dir)
