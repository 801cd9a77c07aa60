"""Issue 15, items 3 and 6 and the file-tree check: run names stay one path component, odd
hyperparameters never cost the local record (or MLflow), an unwritable output dir falls back to a
temporary one, and nothing trackdiag writes lands outside the run's output dir and the tracker's store."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.core.runinfo import RunInfo, safe_component  # noqa: E402
from trackdiag.sinks.local import LocalSink  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

from _mlflow_util import tiny_model, train  # noqa: E402

LEAN = {"report": {"enabled": False}}


@pytest.fixture()
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cwd = <sandbox>/work/sub; temp files, W&B's own dirs and MLflow's default store inside the sandbox."""
    cwd = tmp_path / "work" / "sub"
    cwd.mkdir(parents=True)
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def _tree(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def _run(diag: Any, steps: int = 12) -> None:
    model, opt = diag.components[0].model, diag.components[0].optimizer
    with diag:
        train(diag, model, opt, range(steps))
        diag.log_eval(loss=1.0)


@pytest.mark.parametrize("name", ["../../escape", "/etc/abs-escape", "..", "a/b\\c", "x" * 400, ""])
def test_run_name_becomes_one_safe_path_component(sandbox: Path, name: str) -> None:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], run_name=name, probes=LEAN)
    _run(diag)
    out = Path(diag.summary()["output_dir"])
    assert out.parent == sandbox / "work" / "sub" / "trackdiag_runs" and (out / "run.json").is_file()
    assert out.name == diag.run.name == (safe_component(name) if name else diag.run.name) and len(out.name.encode()) <= 120
    assert "/" not in out.name and not out.name.startswith(".")
    assert sorted(p.name for p in sandbox.iterdir()) == ["tmp", "work"] and os.listdir(sandbox / "work") == ["sub"]


def test_nothing_is_written_outside_the_run_dir_and_the_tracker_stores(sandbox: Path) -> None:
    """Every sink at once, a hostile run name, odd hyperparameters: snapshot the sandbox before and after."""
    before = _tree(sandbox)
    cyclic: dict[str, Any] = {"lr": 0.1}
    cyclic["self"] = cyclic
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(
        model, opt, level="extreme", sinks=["console", "mlflow", "wandb"], run_name="../../../escape",
        hparams={"opt": cyclic, (1, 2): "tuple key", None: "none key"},
        sink={"wandb": {"mode": "offline", "settings": {"console": "off", "x_disable_stats": True}}})
    _run(diag, steps=25)  # extreme: report, plots, model summary, histograms
    out = Path(diag.summary()["output_dir"])
    from wandb_reader import settled_runs

    assert settled_runs(out)  # W&B's run files are complete (and under the run dir by default)
    cwd = sandbox / "work" / "sub"
    allowed = (out, cwd / "mlflow.db", cwd / "mlartifacts", sandbox / "wandb_home")
    new = _tree(sandbox) - before
    outside = sorted(str(p.relative_to(sandbox)) for p in new if not any(p == a or a in p.parents for a in allowed))
    assert outside == []
    assert {"run.json", "records.jsonl", "summary.json", "report.html"} <= {p.name for p in new if p.parent == out}
    assert [p for p in (sandbox / "tmp").rglob("*") if p.is_file()] == []  # W&B leaves empty staging dirs only


def test_odd_hparams_keep_the_local_record_and_mlflow(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuple and None keys, a circular reference, an unresolvable interpolation: every sink still works."""
    monkeypatch.delenv("TRACKDIAG_TEST_UNSET", raising=False)
    cyclic: dict[str, Any] = {"depth": 2}
    cyclic["parent"] = {"child": cyclic}
    user_cfg = OmegaConf.create({"lr": 0.1, "data": {"root": "${oc.env:TRACKDIAG_TEST_UNSET}", "n": "${lr}"}})
    store = f"sqlite:///{sandbox / 'store.db'}"
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(sandbox / "run"),
                                 hparams={"cfg": user_cfg, "model": cyclic, (1, 2): "t", None: "n", 3: "int key"},
                                 probes=LEAN, sink={"mlflow": {"tracking_uri": store, "experiment": "odd"}})
    _run(diag)
    run = json.loads((sandbox / "run" / "run.json").read_text())
    assert (sandbox / "run" / "summary.json").is_file() and (sandbox / "run" / "records.jsonl").stat().st_size > 0
    hp = run["hparams"]
    assert hp["(1, 2)"] == "t" and hp["None"] == "n" and hp["3"] == "int key"
    assert hp["model"]["parent"]["child"] == "<circular reference>"
    assert hp["cfg"]["data"] == {"root": "${oc.env:TRACKDIAG_TEST_UNSET}", "n": 0.1} and hp["cfg"]["lr"] == 0.1
    assert any("TRACKDIAG_TEST_UNSET" in n and "unresolvable" in n for n in run["notes"])
    assert any("circular" in n for n in run["notes"]) and run["status"] == "FINISHED"
    sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
    mlrun = MlflowClient(store).get_run(sink.run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["cfg.data.root"] == "${oc.env:TRACKDIAG_TEST_UNSET}"
    assert mlrun.data.params["model.parent.child"] == "<circular reference>" and "diag/loss" in mlrun.data.metrics


def test_from_config_with_an_unresolvable_interpolation_in_the_user_config(sandbox: Path) -> None:
    """Hydra-style: the whole user config as hparams, one value cannot resolve; the session is built."""
    cfg = OmegaConf.create({"diag": {"level": "basic", "sinks": ["local"], "output_dir": str(sandbox / "r")},
                            "token_path": "${oc.env:TRACKDIAG_TEST_UNSET_2}"})
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics.from_config(cfg.diag, model=model, optimizer=opt, hparams=cfg)
    _run(diag)
    hp = json.loads((sandbox / "r" / "run.json").read_text())["hparams"]
    assert hp["token_path"] == "${oc.env:TRACKDIAG_TEST_UNSET_2}" and hp["diag"]["level"] == "basic"


def test_unwritable_output_dir_falls_back_to_a_temporary_dir(sandbox: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = sandbox / "not_a_dir"
    blocker.write_text("a file where the output dir should be")
    model, opt = tiny_model()
    with caplog.at_level(logging.WARNING, logger="trackdiag"):
        diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], probes=LEAN,
                                     output_dir=str(blocker / "run"))
        _run(diag)
    out = Path(diag.summary()["output_dir"])
    try:
        assert out.parent == sandbox / "tmp" and {"run.json", "records.jsonl", "summary.json"} <= set(os.listdir(out))
        assert json.loads((out / "summary.json").read_text())["steps"] == 12
        [warning] = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
        assert str(blocker / "run") in warning and str(out) in warning
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_local_sink_falls_back_when_open_fails(sandbox: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The second line of defence: the dir looked writable but open() fails (here: a file in its place)."""
    blocker = sandbox / "blocked"
    blocker.write_text("x")
    run = RunInfo("r", blocker / "run", "basic", {}, {"lr": 1})
    sink = LocalSink()
    with caplog.at_level(logging.WARNING, logger="trackdiag"):
        sink.open(run)
    try:
        sink.close("FINISHED", {"steps": 0})
        assert run.output_dir.parent == sandbox / "tmp" and (run.output_dir / "run.json").is_file()
        assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    finally:
        shutil.rmtree(run.output_dir, ignore_errors=True)
