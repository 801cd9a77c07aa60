"""What a user sees, in headless Chromium driven by Playwright (``scripts/browser.py``): the run report
of a NaN run, the comparison page of a sweep, and a run page served by a real ``mlflow server``
(the experiment's kind, the run's Source, the per-step histogram images).

Every page is loaded, its images are checked to have decoded (``naturalWidth``), its text is checked
for what the issue complained about, and a screenshot is checked not to be blank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import batches, make_mlp

import _warm as warm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from browser import Browser, unavailable  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
IMAGES_JS = "Array.from(document.images).map(i => [i.alt || i.src.slice(0, 80), i.naturalWidth, i.naturalHeight])"


def _nonblank(path: Path) -> None:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200, path
    rgb = (img[..., :3] * 255).astype(np.uint32)
    assert len(np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])) > 50, f"{path} looks blank"


@pytest.fixture(scope="module")
def nan_run(digits: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An advanced run of 60 steps with a NaN in the batch at step 30 (local record only)."""
    from trackdiag import Diagnostics

    out = tmp_path_factory.mktemp("nan_run")
    x, y = digits
    model = make_mlp(hidden=32, depth=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    diag = Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out))
    data = batches(x, y, 64)
    with diag:
        for step in range(60):
            xb, yb = next(data)
            if step == 30:
                xb = xb.clone()
                xb[0, 0] = float("nan")
            out_ = model(xb)
            loss = F.cross_entropy(out_, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out_, batch=(xb, yb))
    return out


def test_report_page_of_a_nan_run(nan_run: Path, tmp_path: Path) -> None:
    with Browser(1280, 1000) as b:
        b.goto((nan_run / "report.html").as_uri(), settle=0.3)
        images = {alt: (w, h) for alt, w, h in b.eval(IMAGES_JS)}
        text = b.eval("document.body.innerText")
        rows = b.eval("Array.from(document.querySelectorAll('table tr')).map(r => Array.from(r.cells).map(c => c.innerText))")
        shot = b.screenshot(tmp_path / "report.png", full_page=True)
    assert set(images) == {"loss_alerts", "grad_flow", "grad_hist", "param_hist", "memory"}, images
    assert all(w > 300 and h > 200 for w, h in images.values()), images  # every picture decoded
    loss_rows = [r for r in rows if len(r) > 5 and r[2] == "nonfinite_loss"]
    assert loss_rows and loss_rows[0][0] == "30" and loss_rows[0][5] == "none"  # threshold: none, not nan
    assert loss_rows[0][3].startswith("0 (Linear")  # a bare index names its module type
    assert loss_rows[0][7].startswith("The NaN/Inf came in with the batch")  # the data hint, not "lower the LR"
    assert text.count("the first non-finite value comes out of") == 1  # the replay's account, told once
    assert "see the nonfinite_input alert of step 30" in text
    _nonblank(shot)


def _comparison(tmp_path: Path) -> Path:
    """A local sweep: lr 1e-3 healthy, lr 1 diverging, a job that never enabled trackdiag."""
    from trackdiag.core.alert import Alert
    from trackdiag.compare import compare, write_outputs
    from trackdiag.core.record import Record
    from trackdiag.core.runinfo import RunInfo
    from trackdiag.sinks.local import LocalSink

    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for num, lr in enumerate((1e-3, 1e-2, 1.0)):
        sink = LocalSink()
        sink.open(RunInfo(name=f"train#{num}", output_dir=sweep / str(num) / "diag", level="basic", config={},
                          hparams={"optimizer": {"lr": lr}, "diag": {"level": "basic", "every": 10}},
                          group=str(sweep), job_num=num))
        bad = lr == 1.0
        alert = Alert("loss_divergence", 12, "critical", "x") if bad else None
        for step in range(0, 40, 10):
            series = [(s, 2.0 - s / 40 if not bad else 2.0 + s / 5) for s in range(step, step + 10)]
            fired = [alert] if alert and step == 10 else []
            for a in fired:
                sink.alert(a)
            sink.write(Record(step=step, series={"diag/loss": series}, alerts=fired))
        alerts = {"loss_divergence": {"count": 1, "first_step": 12, "severity": "critical", "first_where": "",
                                      "suppressed": 0}} if bad else {}
        sink.close("FINISHED", {"steps": 40, "health": "critical" if bad else "ok", "alerts": alerts})
    plain = sweep / "3" / ".hydra"
    plain.mkdir(parents=True)
    (plain / "overrides.yaml").write_text("- optimizer.lr=0.1\n")
    (plain / "config.yaml").write_text("optimizer:\n  lr: 0.1\n")
    return write_outputs(compare(sweep), tmp_path / "out")["html"]


def test_comparison_page(tmp_path: Path) -> None:
    page = _comparison(tmp_path)
    with Browser(1280, 1000) as b:
        b.goto(page.as_uri(), settle=0.3)
        images = {alt: (w, h) for alt, w, h in b.eval(IMAGES_JS)}
        text = b.eval("document.body.innerText")
        head = b.eval("Array.from(document.querySelectorAll('thead th')).map(c => c.innerText)")
        shot = b.screenshot(tmp_path / "comparison.png", full_page=True)
    assert set(images) == {"anomalies_by_param", "first_anomaly_vs_param", "loss_curves"}, images
    assert all(w > 300 and h > 200 for w, h in images.values()), images
    assert head[:4] == ["run", "status", "health", "optimizer.lr"] and not any(h.startswith("diag.") for h in head)
    assert "no trackdiag" in text and "null" not in text and "FAILED" not in text
    assert "optimizer.lr=1: 1/1 runs anomalous (loss_divergence)" in text
    _nonblank(shot)


# ---------------------------------------------------------------- a real mlflow server
SCRIPT = """
import torch
from torch import nn
import trackdiag
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local", "mlflow"], output_dir="run", every=5,
                             hparams={"optimizer": {"lr": 0.1}, "seed": 0},
                             probes={"histograms": {"every": 20}, "report": {"enabled": False}},
                             sink={"mlflow": {"tracking_uri": URI, "experiment": "view", "run_name": "screens"}})
with diag:
    for _ in range(30):
        x = torch.randn(16, 8)
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,)))
        loss.backward(); opt.step(); opt.zero_grad(); diag.step(loss)
"""


@pytest.fixture(scope="module")
def served_run(mlflow_server: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """(server URI, experiment id, run id) of a run delivered to a real ``mlflow server``."""
    uri = mlflow_server.uri
    root = tmp_path_factory.mktemp("served")
    (root / "train_view.py").write_text(SCRIPT.replace("URI", repr(uri)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    proc = warm.run([sys.executable, "train_view.py"], cwd=root, env=env, capture_output=True, text=True,
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/get-by-name?experiment_name=view",
                                timeout=10) as r:
        exp = json.load(r)["experiment"]
    body = json.dumps({"experiment_ids": [exp["experiment_id"]]}).encode()
    req = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/search", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        [run] = json.load(r)["runs"]
    tags = {t["key"]: t["value"] for t in exp.get("tags", [])}
    assert tags.get("mlflow.experimentKind") == "custom_model_development"
    return uri, exp["experiment_id"], run["info"]["run_id"]


@pytest.mark.slow
def test_mlflow_run_page_shows_kind_source_and_images(served_run: tuple[str, str, str], tmp_path: Path) -> None:
    uri, eid, rid = served_run
    ml = "workflowType=machine_learning"  # the UI's "Model training" toggle (kept per browser)
    with Browser(1400, 1000) as b:
        b.goto(f"{uri}/#/experiments/{eid}/runs/{rid}?{ml}")
        assert b.wait("document.body.innerText.includes('train_view.py')", 60), b.eval("document.body.innerText")
        overview = b.eval("document.body.innerText")
        b.screenshot(tmp_path / "overview.png")
        b.goto(f"{uri}/#/experiments/{eid}/runs/{rid}/model-metrics?{ml}")
        box = "input[placeholder*=\"Search metric\"]"
        assert b.wait(f"!!document.querySelector('{box}')", 60)
        # typed before the charts are listed, the filter hides them all ("All charts are filtered")
        assert b.wait("document.body.innerText.includes('diag/param/hist')", 90)
        b.eval(f"document.querySelector('{box}').focus()")
        b.type("hist")
        loaded = "Array.from(document.querySelectorAll('img[src*=get-artifact]')).filter(i => i.naturalWidth > 0)"
        assert b.wait(f"{loaded}.length >= 4", 90), b.eval("document.body.innerText")[:2000]
        sizes = b.eval(f"{loaded}.map(i => [i.naturalWidth, i.naturalHeight])")
        metrics = b.eval("document.body.innerText")
        shot = b.screenshot(tmp_path / "images.png")
    assert "Source" in overview and "Finished" in overview and "trackdiag.health" in overview
    assert "Runs" in overview and "Evaluations" not in overview  # the Model training view of the experiment
    assert all(w == 256 and h == 256 for w, h in sizes), sizes  # each card shows a picture, not just text
    assert "diag/grad/hist" in metrics and "diag/param/hist" in metrics
    _nonblank(shot)
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/artifacts/list?run_id={rid}&path=images", timeout=10) as r:
        names = [Path(f["path"]).name for f in json.load(r)["files"]]
    steps = {n.split("+step+")[1].split("+")[0] for n in names if n.startswith("diag~param~hist~0+step+")}
    assert steps == {"0", "5", "10", "20"}, names  # log_image(key, step) series: a step slider with 4 marks
