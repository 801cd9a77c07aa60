"""Issue 15, item 4: ``trackdiag compare`` and ``summary`` on malformed run dirs.

Deeply nested JSON, wrong field types, list-typed job markers, malformed ``summary.json`` files,
FIFOs, oversized files, YAML alias bombs and a 30 MB hyperparameter: one clear line per skipped run
dir, never a traceback, and time linear in a field's length.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trackdiag.cli import main as cli_main
from trackdiag.compare import compare

GOOD_SUMMARY = {"steps": 3, "health": "ok", "alerts": {}}


def _run_dir(root: Path, name: str, run: Any = None, summary: Any = GOOD_SUMMARY, raw_run: str | None = None,
             raw_summary: str | None = None) -> Path:
    d = root / name / "diag"
    d.mkdir(parents=True)
    (d / "run.json").write_text(raw_run if raw_run is not None else json.dumps(
        run if run is not None else {"name": name, "status": "FINISHED", "hparams": {"lr": len(name)}}))
    if raw_summary is not None or summary is not None:
        (d / "summary.json").write_text(raw_summary if raw_summary is not None else json.dumps(summary))
    return d


def _skips(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """skipped run dir -> its one line."""
    out: dict[str, str] = {}
    for r in caplog.records:
        msg = r.getMessage()
        if msg.startswith("trackdiag compare: skipping "):
            path = msg[len("trackdiag compare: skipping "):].split(": ", 1)[0]
            assert path not in out, f"two lines for {path}"
            out[path] = msg
    return out


def test_malformed_run_dirs_are_skipped_one_line_each(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep"
    _run_dir(sweep, "good1"), _run_dir(sweep, "good22")
    bad = {
        "deep": _run_dir(sweep, "deep", raw_run='{"hparams": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "deep_ok_json": _run_dir(sweep, "deep_ok_json", run={"hparams": json.loads("[" * 200 + "]" * 200)}),
        "job_num": _run_dir(sweep, "job_num", run={"name": "x", "job_num": "seven"}),
        "run_list": _run_dir(sweep, "run_list", run=[1, 2, 3]),
        "hparams_str": _run_dir(sweep, "hparams_str", run={"hparams": "lr=0.1"}),
        "summary_list": _run_dir(sweep, "summary_list", summary=[1, 2]),
        "alerts_list": _run_dir(sweep, "alerts_list", summary={"alerts": ["grad_explosion"]}),
        "count_str": _run_dir(sweep, "count_str", summary={"alerts": {"loss_spike": {"count": "seven"}}}),
        "torn": _run_dir(sweep, "torn", raw_summary='{"steps": 3, "alerts": {'),
        "steps_dict": _run_dir(sweep, "steps_dict", summary={"steps": {"n": 3}}),
    }
    fifo = sweep / "fifo" / "diag"
    fifo.mkdir(parents=True)
    os.mkfifo(fifo / "run.json")  # reading it would block forever
    bad["fifo"] = fifo
    huge = _run_dir(sweep, "huge")
    with open(huge / "summary.json", "wb") as f:
        f.truncate(65 * 2**20)  # sparse: 65 MB on paper, over the 64 MB cap
    bad["huge"] = huge
    # a live run (no summary.json) whose records.jsonl and alerts.jsonl hold junk: still read
    live = _run_dir(sweep, "live", summary=None)
    (live / "records.jsonl").write_text('{"step": 0, "series": {"diag/loss": [[0, 1.0], ["x", 2], [1, "nan"]]}}\n'
                                        '{"step": "bad", "series": {"diag/loss": "notalist"}}\n[1]\n{torn\n')
    (live / "alerts.jsonl").write_text('{"kind": "loss_spike", "step": "seven"}\n{"kind": "loss_spike", "step": 4}\n')
    markers = sweep / ".trackdiag" / "jobs"
    markers.mkdir(parents=True)
    (markers / "0.json").write_text(json.dumps(["FAILED"]))  # a list-typed job marker
    (sweep / "multirun.yaml").write_text("hydra: {}\n")

    with caplog.at_level(logging.INFO):
        assert cli_main(["compare", str(sweep), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in out["runs"]) == ["good1", "good22", "live"]
    [lv] = [r for r in out["runs"] if r["name"] == "live"]
    assert lv["alert_counts"] == {"loss_spike": 1} and lv["first_steps"] == {"loss_spike": 4}
    assert [p for p, _ in lv["loss_curve"]] == [0, 1]
    skips = _skips(caplog)
    assert sorted(skips) == sorted(str(d.resolve()) for d in bad.values())
    for key, words in {"deep": "nested deeper", "deep_ok_json": "nested deeper", "job_num": "job_num must be an integer",
                       "run_list": "must be an object", "hparams_str": "hparams must be an object",
                       "summary_list": "summary.json", "alerts_list": "alerts", "count_str": "count must be an integer",
                       "torn": "not valid JSON", "steps_dict": "steps", "fifo": "not a regular file",
                       "huge": "over the 64 MB limit"}.items():
        assert words in skips[str(bad[key].resolve())], (key, skips[str(bad[key].resolve())])
    assert any("ignoring job marker" in r.getMessage() and "0.json" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)
    assert all(len(line) < 400 for line in skips.values())


def test_summary_command_on_malformed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {"list": "[1, 2]", "alerts_list": '{"alerts": ["x"]}', "count": '{"alerts": {"x": {"count": "seven"}}}',
             "overhead": '{"overhead": "lots"}', "torn": '{"steps": ', "deep": "[" * 50_000 + "]" * 50_000,
             "where": '{"alerts": {"x": {"count": 1, "first_where": {"a": 1}}}}'}
    for name, text in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "summary.json").write_text(text)
        assert cli_main(["summary", str(d)]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("trackdiag summary: cannot read") and "Traceback" not in err
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "summary.json").write_text(json.dumps({"steps": 5, "health": "warning", "alerts": {
        "loss_spike": {"count": 2, "first_step": 3, "suppressed": 0, "first_where": "fc1"}}}))
    assert cli_main(["summary", str(ok)]) == 0
    assert "loss_spike" in capsys.readouterr().out


def test_a_30_mb_hyperparameter_is_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """10 MB took 17 s (table) and minutes with --out before; reading cuts values early now."""
    sweep = tmp_path / "sweep"
    for i, ch in enumerate("ab"):
        _run_dir(sweep, str(i), run={"name": f"r{i}", "status": "FINISHED", "hparams": {"lr": i, "prompt": ch * 30_000_000}})
    t0 = time.perf_counter()
    assert cli_main(["compare", str(sweep), "--out", str(tmp_path / "out")]) == 0
    elapsed = time.perf_counter() - t0
    text = capsys.readouterr().out
    assert elapsed < 20, elapsed
    assert max(map(len, text.splitlines())) < 2000 and (tmp_path / "out" / "comparison.html").stat().st_size < 2**20
    c = compare(sweep)
    assert c.swept == ["lr", "prompt"] and all(len(r.hparams["prompt"]) <= 200 for r in c.runs)
    assert len({r.hparams["prompt"] for r in c.runs}) == 2  # cut values stay distinct


def test_hydra_job_files_are_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A job dir without a record whose Hydra files are hostile: a YAML alias bomb, a non-list."""
    sweep = tmp_path / "sweep"
    (sweep / "0" / ".hydra").mkdir(parents=True)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    (sweep / "0" / ".hydra" / "config.yaml").write_text(bomb)
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text(bomb)
    (sweep / "0" / ".hydra" / "hydra.yaml").write_text("hydra: [1, 2]\n")
    _run_dir(sweep, "1")
    t0 = time.perf_counter()
    c = compare(sweep)
    assert time.perf_counter() - t0 < 10
    [failed] = [r for r in c.runs if r.status == "FAILED"]
    assert failed.job_num == 0 and failed.overrides == [] and failed.hparams == {}
