"""The histogram schedule gives every run a series worth looking at: log-spaced due steps up to the
preset's ``every`` (0, 10, 20, 50, 100, 200 at ``advanced`` in a 300-step run), then every ``every``;
the heat-maps of a healthy, a NaN and an LR-explosion run differ; the per-step MLflow images are
square (what the run page's image cards show) and flag values piled up in the end bins."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import batches, make_mlp

from trackdiag import Diagnostics
from trackdiag.probes.histograms import HistogramProbe
from trackdiag.util.schedule import Every, SpreadThenEvery
from trackdiag.core.record import read_records


def test_spread_schedule_steps() -> None:
    assert [s for s in range(3001) if SpreadThenEvery(500, 10)(s)] == [0, 10, 20, 50, 100, 200, 500, 1000, 1500,
                                                                       2000, 2500, 3000]
    assert [s for s in range(301) if SpreadThenEvery(100, 5)(s)] == [0, 5, 10, 25, 50, 100, 200, 300]
    # the long-run cost is Every(n)'s plus the early steps: 200 + 5 due steps in 100k steps
    assert sum(SpreadThenEvery(500, 10)(s) for s in range(100_000)) == 200 + 5
    probe = HistogramProbe(every=500)
    probe.bind(10)
    assert probe.schedule == SpreadThenEvery(500, 10, False)  # no anomaly-window steps: too costly
    off = HistogramProbe(every=500, spread=False)
    off.bind(10)
    assert off.schedule == Every(500, False)


def _run(out: Path, digits, fault: str) -> Path:
    x, y = digits
    model = make_mlp(hidden=32, depth=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    diag = Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out),
                       probes={"landscape": {"enabled": False}})
    data = batches(x, y, 64)
    with diag:
        for step in range(120):
            xb, yb = next(data)
            if fault == "nan" and step == 60:
                xb = xb.clone()
                xb[0, 0] = float("nan")
            if fault == "lr" and step == 60:
                for g in opt.param_groups:
                    g["lr"] = 50.0
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=model(xb).detach() if step % 10 == 0 else None, batch=(xb, yb))
    return out


@pytest.mark.slow
def test_advanced_runs_get_a_series_and_faults_show_in_it(tmp_path: Path, digits) -> None:
    runs = {f: _run(tmp_path / f, digits, f) for f in ("healthy", "nan", "lr")}
    steps = {f: [r.step for r in read_records(d) if r.histograms] for f, d in runs.items()}
    assert steps["healthy"] == [0, 10, 20, 50, 100]  # a 120-step run: five columns, not one
    pictures = {f: (d / "plots" / "param_hist.png").read_bytes() for f, d in runs.items()}
    assert len(set(pictures.values())) == 3  # byte-identical across runs before
    clipped = {f: [r.tables.get("diag/param/hist_clipped", {}) for r in read_records(d) if r.histograms][-1]
               for f, d in runs.items()}
    assert not clipped["healthy"] and clipped["nan"] and clipped["lr"]  # NaN / blown-up weights leave the edges


def test_mlflow_histogram_image_is_square_and_flags_the_end_bins() -> None:
    from trackdiag.sinks.mlflow.media import HistogramRenderer

    r = HistogramRenderer()
    edges = list(np.linspace(-1.0, 1.0, 33))
    ok = r.to_array("diag/grad/hist/0", edges, list(np.exp(-np.linspace(-2, 2, 32) ** 2) * 50), 10)
    assert ok.shape == (256, 256, 3) and ok.dtype == np.uint8 and ok.std() > 5
    bad = r.to_array("diag/param/hist/0", edges, [0.0] * 31 + [1000.0], 100)
    red = (bad[..., 0] > 150) & (bad[..., 1] < 80) & (bad[..., 2] < 80)  # the "in the end bins" note
    assert red.sum() > 50 and not ((ok[..., 0] > 150) & (ok[..., 1] < 80) & (ok[..., 2] < 80)).sum() > 50


def test_mlflow_histogram_image_bars_follow_the_counts_without_matplotlib() -> None:
    """Each bin's bar is as tall as its count says (read back from the pixels, against the counts), an empty bin
    draws nothing, odd data gives no image instead of an error, and drawing imports no matplotlib (the delivery
    worker beside training drew ~36 images a run with it, ~30 ms each plus ~0.6 s to import it)."""
    from trackdiag.sinks.mlflow.hist_image import BAR, BOX, HistogramRenderer

    counts = [0.0, 10.0, 40.0, 20.0, 0.0, 5.0, 80.0, 0.0]
    edges = [float(e) for e in range(len(counts) + 1)]
    img = HistogramRenderer().to_array("diag/grad/hist/0", edges, counts, 7)
    left, top, right, bottom = BOX
    bar = (img == np.array(BAR, dtype=np.uint8)).all(axis=2)
    pad, span = 0.02 * 8, 8 * 1.04
    tall = []
    for i, c in enumerate(counts):  # the column at each bin's centre
        x = round(left + (i + 0.5 + pad) / span * (right - left))
        tall.append(int(bar[:, x].sum()))
    full = bottom - top - 1
    expected = [c / (1.05 * max(counts)) * full for c in counts]
    assert all(abs(t - e) <= 2 for t, e in zip(tall, expected)), (tall, expected)
    assert bar[:, :left].sum() == 0 and bar[:, right + 1:].sum() == 0 and bar[bottom:, :].sum() == 0

    r = HistogramRenderer()
    assert r.to_array("diag/grad/hist/0", [0.0, float("inf")], [1.0], 0) is None
    assert r.to_array("diag/grad/hist/0", [0.0, 1.0, 2.0], [1.0], 0) is None  # edges and counts disagree
    code = ("import sys; from trackdiag.sinks.mlflow.media import HistogramRenderer; "
            "a = HistogramRenderer().to_array('diag/grad/hist/0', [0.0, 1.0, 2.0], [3.0, 4.0], 5); "
            "assert a is not None and a.shape == (256, 256, 3); assert 'matplotlib' not in sys.modules, 'imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])  # this checkout's trackdiag
    assert done.returncode == 0, done.stderr[-2000:]
