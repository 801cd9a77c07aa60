"""The MLflow run's Description (``mlflow.note.content``) on a real SQLite store: what it says, that
it links the run's own page, and that a description a user wrote on their own run is left alone.
(What the run page shows of it, in a browser: tests/test_view_story.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.sinks.mlflow.note import RUN_HREF, _one_line, run_note  # noqa: E402

from _mlflow_util import ready_store, tiny_model, train  # noqa: E402

NOTE = "mlflow.note.content"


def _session(tmp_path: Path, store: str, name: str) -> trackdiag.Diagnostics:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=5, sinks=["mlflow"], output_dir=str(tmp_path / name),
                                 sink={"mlflow": {"tracking_uri": store, "experiment": "note", "delivery": "thread"}})
    with diag:
        train(diag, model, opt, range(20), nan_step=7)
    return diag


def test_description_tells_health_and_each_alert(tmp_path: Path) -> None:
    store = ready_store(tmp_path)
    diag = _session(tmp_path, store, "own")
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("note").experiment_id])
    note = run.data.tags[NOTE]
    first = {a.kind: a for a in reversed(diag.alerts)}
    assert note.startswith(f"**trackdiag: health CRITICAL** · run FINISHED after 20 steps · {len(first)} alert kind")
    assert RUN_HREF not in note and "report.html" not in note  # basic draws no report: nothing to link
    for kind, alert in first.items():
        line = next(x for x in note.splitlines() if x.startswith(f"- **{kind.replace('_', chr(92) + '_')}**"))
        assert f"({alert.severity}) at step {alert.step}" in line
        assert "*Hint:* " in line and line.count("\n") == 0


def test_a_users_own_description_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ready_store(tmp_path)
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("note")
    try:
        with mlflow.start_run() as mine:
            mlflow.set_tag(NOTE, "my ablation: no warm-up")
            _session(tmp_path, store, "joined")
        with mlflow.start_run() as bare:
            _session(tmp_path, store, "joined-bare")
    finally:
        mlflow.set_tracking_uri("")
    client = MlflowClient(store)
    assert client.get_run(mine.info.run_id).data.tags[NOTE] == "my ablation: no warm-up"
    assert client.get_run(bare.info.run_id).data.tags[NOTE].startswith("**trackdiag: health CRITICAL**")


def test_note_text_is_markdown_safe_and_bounded() -> None:
    assert _one_line("clip_grad_norm_ of x < 1\n[see] *this*", 200) == "clip\\_grad\\_norm\\_ of x &lt; 1 \\[see\\] \\*this\\*"
    kinds = {f"kind_{i}": {"count": 1, "severity": "warning",
                           "first": {"step": i, "message": "m" * 300, "hint": "h" * 400, "where": "layer"}}
             for i in range(40)}
    note = run_note("warning", "FINISHED", 100, kinds, "files/report.html")
    assert len(note) <= 7000 and f"[report.html]({RUN_HREF}/artifacts/files/report.html?workflowType=machine_learning)" in note
    assert note.count("\n- **kind") <= 12 and ("more kinds" in note or "the rest in alerts.json" in note)
