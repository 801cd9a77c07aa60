"""``scripts/gallery.py``, its quick part: the planted log(0) run (in process, ~5 s) still ends in an alert
that names the module, and the picture the README shows of it is kept small and not blank."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gallery  # noqa: E402


@pytest.mark.slow
def test_nan_run_names_the_module_and_its_plot_is_kept(tmp_path: Path) -> None:
    run = gallery.nan_run(tmp_path)
    [alert] = json.loads((run / "alerts.json").read_text())
    assert alert["kind"] == "nonfinite_loss" and alert["step"] == gallery.NAN_STEP
    assert "comes out of features (LogFeatures" in alert["message"]
    png = gallery.check(gallery.keep(run / "plots" / "loss_alerts.png", tmp_path / "out" / "nan_loss_alerts.png"))
    assert 0 < png.stat().st_size < 300_000
