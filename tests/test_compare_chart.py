"""The sweep comparison's "anomalous runs per value" chart counts each run once (a run that crashed
after an alert is anomalous, not anomalous *and* failed: it used to draw 3 of 2 runs, a bar past the
axis), and a float override keeps its point (``lr=1.0`` reads ``1.0``). Real local records."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from trackdiag.core.alert import Alert  # noqa: E402
from trackdiag.compare import compare  # noqa: E402
from trackdiag.compare.plots import _anomalies_by_param, format_value  # noqa: E402
from trackdiag.core.record import Record  # noqa: E402
from trackdiag.core.runinfo import RunInfo  # noqa: E402
from trackdiag.sinks.local import LocalSink  # noqa: E402

#: (lr, status, alert) per job: at lr 1.0 one run crashed after an alert, one crashed with none, one is fine
JOBS = [(1.0, "FAILED", True), (1.0, "FAILED", False), (1.0, "FINISHED", False), (0.1, "FINISHED", False),
        (0.1, "FINISHED", True)]


def _sweep(root: Path) -> Path:
    sweep = root / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for num, (lr, status, alerted) in enumerate(JOBS):
        sink = LocalSink()
        sink.open(RunInfo(name=f"train#{num}", output_dir=sweep / str(num) / "diag", level="basic", config={},
                          hparams={"optimizer": {"lr": lr}}, group=str(sweep), job_num=num))
        alert = Alert("loss_divergence", 12, "critical", "x") if alerted else None
        for step in (0, 10, 20):
            fired = [alert] if alert and step == 10 else []
            for a in fired:
                sink.alert(a)
            sink.write(Record(step=step, series={"diag/loss": [(s, 2.0 - s / 40) for s in range(step, step + 10)]},
                              alerts=fired))
        alerts = {"loss_divergence": {"count": 1, "first_step": 12, "severity": "critical", "first_where": "",
                                      "suppressed": 0}} if alerted else {}
        sink.close(status, {"steps": 30, "health": "critical" if alerted else "ok", "alerts": alerts})
    return sweep


def test_each_run_is_counted_once_and_floats_keep_their_point(tmp_path: Path) -> None:
    comparison = compare(_sweep(tmp_path))
    [risk] = comparison.risks
    fig = _anomalies_by_param([risk], [r for r in comparison.runs if r.diagnosed])
    [ax] = fig.axes
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["0.1", "1.0"], ticks
    stacks = {x: 0.0 for x in range(len(ticks))}
    outline = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        if bar.get_width() > 0.7:  # the outline: every run with this value
            outline[x] = bar.get_height()
        else:
            stacks[x] += bar.get_height()
    assert outline == {0: 2.0, 1: 3.0}, outline
    assert stacks == {0: 1.0, 1: 2.0}, stacks  # lr 1.0: 1 anomalous (crashed after its alert) + 1 failed, no alert
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["1/2", "1/3"], labels
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "failed, no alert before" in legend, legend
    assert format_value(1e-05) == "1e-05" and format_value(100.0) == "100.0" and format_value(3) == "3"
