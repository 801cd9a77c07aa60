"""Issue 15, item 7: ``log_eval`` with odd values skips them with one warning, never raises."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import trackdiag
from trackdiag import DisabledDiagnostics

from _mlflow_util import tiny_model, train


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "log_eval" in r.getMessage()]


def test_odd_eval_values_are_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}})
    with caplog.at_level(logging.WARNING, logger="trackdiag"), diag:
        train(diag, model, opt, range(5))
        diag.log_eval(loss=torch.tensor(0.75), acc="high", f1=None, per_class=torch.ones(3), top1=np.float32(0.5),
                      z=torch.tensor(1 + 2j), n=np.array([7]))
        [warning] = _warnings(caplog)
        for key in ("acc='high'", "f1=None", "per_class=<Tensor of shape (3,)>", "z="):
            assert key in warning, warning
        diag.log_eval(loss="nan?")  # nothing valid: one more warning, nothing recorded, no exception
        diag.log_eval(loss=float("nan"))  # a non-finite number is data, not an odd value
        assert len(_warnings(caplog)) == 2
    evals = [r["scalars"] for r in map(json.loads, (tmp_path / "records.jsonl").read_text().splitlines())
             if any(k.startswith("diag/eval/") for k in r["scalars"])]
    assert evals[0] == {"diag/eval/loss": 0.75, "diag/eval/top1": 0.5, "diag/eval/n": 7.0}
    assert evals[1] == {"diag/eval/loss": "nan"} and len(evals) == 2


def test_disabled_session_checks_the_same_way(caplog: pytest.LogCaptureFixture) -> None:
    d = DisabledDiagnostics()
    with caplog.at_level(logging.WARNING, logger="trackdiag"):
        d.log_eval(loss=0.5, acc="high", t=torch.ones(3))
        d.log_eval(loss=torch.tensor(0.5), acc=1)
    [warning] = _warnings(caplog)
    assert "acc='high'" in warning and "t=<Tensor of shape (3,)>" in warning
