"""The W&B sink, offline only: runs are read back from their ``run-<id>.wandb`` files."""
from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("wandb")

import torch  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.core.alert import Alert  # noqa: E402
from trackdiag.config.load import load_preset, merge, validate  # noqa: E402
from trackdiag.core.presets import _read  # noqa: E402
from trackdiag.core.errors import ConfigError, TrackdiagError  # noqa: E402
from trackdiag.core.record import Histogram, Record  # noqa: E402
from trackdiag.core.runinfo import RunInfo  # noqa: E402
from trackdiag.core.record import read_records  # noqa: E402
from trackdiag.sinks.wandb import WandbSink  # noqa: E402
from trackdiag.sinks.wandb_util import REDACTED, fit_histogram, redact, summary_policy, sweep_group  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from wandb_reader import LEAN, find_runs, read_run, settled_runs, offline, tiny_model as _model  # noqa: E402,F401 (offline: an autouse fixture)

import _warm as warm

REPO = Path(__file__).resolve().parents[1]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


# ---------------------------------------------------------------------------- helpers, no wandb run
def test_redact_any_depth_case_insensitive() -> None:
    cfg = {"lr": 1, "API_KEY": "x", "db": {"Password": "p", "host": "h"}, "l": [{"authToken": "t"}, 3], "secret_x": 1}
    assert redact(cfg) == {"lr": 1, "API_KEY": REDACTED, "db": {"Password": REDACTED, "host": "h"},
                           "l": [{"authToken": REDACTED}, 3], "secret_x": REDACTED}


def test_summary_policy_group_and_bins() -> None:
    assert summary_policy("diag/loss") == summary_policy("diag/eval/loss") == "min,last"
    assert summary_policy("diag/grad/global_norm") == summary_policy("diag/grad/norm/enc.layernorm") == "max,last"
    assert summary_policy("diag/opt/lr") is None and summary_policy("diag/grad/nonfinite_tensors") is None
    g = sweep_group("/a/multirun/2026-01-02/10-11-12")
    assert g.startswith("2026-01-02/10-11-12-") and g != sweep_group("/b/multirun/2026-01-02/10-11-12")
    counts, edges = fit_histogram(list(range(1025)), [1.0] * 1024)  # type: ignore[misc]
    assert len(counts) == 512 and len(edges) == 513 and sum(counts) == 1024 and edges[-1] == 1024


def test_options_validated_against_preset_and_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = merge(load_preset("basic"), _read("diag", "sink", "wandb.yaml"))
    validate(preset)  # every default in wandb.yaml is an option of WandbSink
    assert preset["sinks"] == ["local", "console", "wandb"]
    with pytest.raises(ConfigError, match="diag.sink.wandb.bogus"):
        validate(merge(preset, {"sink": {"wandb": {"bogus": 1}}}))
    with pytest.raises(TrackdiagError, match="mode"):
        WandbSink(mode="sometimes")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(TrackdiagError, match=r"pip install 'trackdiag\[wandb\]'"):
        WandbSink(mode="offline")
    WandbSink(mode="disabled")  # disabled needs no wandb at all


def test_disabled_mode_writes_nothing(tmp_path: Path) -> None:
    model, opt = _model()
    t0 = time.perf_counter()
    with trackdiag.Diagnostics(model, opt, level="basic", sinks=["wandb"], output_dir=str(tmp_path / "rec"),
                               sink={"wandb": {"mode": "disabled", "dir": str(tmp_path / "wb")}}) as d:
        for _ in range(3):
            loss = model(torch.randn(4, 4)).pow(2).mean()
            opt.zero_grad(), loss.backward(), opt.step()
            d.step(loss)
    assert time.perf_counter() - t0 < 5.0
    assert not (tmp_path / "wb").exists() and not list(tmp_path.rglob("*wandb*"))
    assert (tmp_path / "rec" / "records.jsonl").exists()


# ---------------------------------------------------------------------------- offline runs
def test_training_run_offline(tmp_path: Path) -> None:
    """Real training, level advanced, NaN planted at step 7: history equals the local record,
    alert and summary keys for nonfinite_loss, config redacted, run finished."""
    model, opt = _model()
    out = tmp_path / "rec"
    d = trackdiag.Diagnostics(
        model, opt, level="advanced", sinks=["wandb"], output_dir=str(out),
        sink={"wandb": {"mode": "offline", "dir": str(tmp_path), "project": "p", "tags": ["t1"], "settings": LEAN}},
        hparams={"lr": 0.05, "api_key": "xyz", "db": {"password": "p", "host": "h"}})
    for step in range(20):
        x = torch.randn(16, 4)
        if step == 7:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad(), loss.backward(), opt.step()
        d.step(loss)
    d.close()
    files = settled_runs(tmp_path)
    assert len(files) == 1 and files[0].parent.name.startswith("offline-run-")
    run = read_run(files[0])
    assert run.exit_code == 0 and run.run["project"] == "p" and run.run["tags"] == ["t1"]
    assert run.run["name"] == d.run.name

    local = [(s, v) for r in read_records(out) for k, s, v in r.points() if k == "diag/grad/global_norm"]
    remote = run.series("diag/grad/global_norm")
    assert [s for s, _ in remote] == [s for s, _ in local]
    assert [s for s, _ in local] == list(range(20))  # the pre-clip norm is a series: every step, at its own step
    assert all(_same(a, b) for (_, a), (_, b) in zip(remote, local))
    loss_steps = [s for s, _ in run.series("diag/loss")]
    assert loss_steps == list(range(20))  # every per-step point, at its own step, in order

    [alert] = [a for a in run.alerts if "nonfinite_loss" in a["title"]]
    assert alert["level"] == "ERROR" and "step 7" in alert["text"]
    assert dict(run.series("diag/alerts/nonfinite_loss")) == {0: 0, 6: 0, 7: 1, 19: 1}  # step-shaped, the loss's range
    assert run.summary["trackdiag/alerts/nonfinite_loss/count"] == 1
    assert run.summary["trackdiag/alerts/nonfinite_loss/first_step"] == 7
    assert run.summary["trackdiag/health"] == "critical" and run.summary["trackdiag/status"] == "FINISHED"
    assert set(run.summary["diag/grad/global_norm"]) == {"max", "last"}
    assert set(run.summary["diag/loss"]) == {"min", "last"}
    steps = {m.glob_name: m.step_metric for m in run.metrics if m.glob_name}
    assert steps == {"diag/*": "diag/step"}

    assert run.config["api_key"] == REDACTED and run.config["db"] == {"password": REDACTED, "host": "h"}
    assert run.config["lr"] == 0.05 and run.config["trackdiag"]["level"] == "advanced"
    assert "xyz" not in files[0].read_bytes().decode("latin-1")


def test_sink_histograms_images_files_and_levels(tmp_path: Path) -> None:
    """Hand-built records through the sink: native histograms (over 512 bins fitted), a PNG as an
    image, other files saved, alert levels, FAILED -> exit code 1."""
    from PIL import Image

    png, report = tmp_path / "curves.png", tmp_path / "report.html"
    Image.new("RGB", (8, 8), "red").save(png)
    report.write_text("<html></html>")
    sink = WandbSink(mode="offline", dir=str(tmp_path), name="direct", settings=LEAN, notify="warning")
    sink.open(RunInfo("r", tmp_path / "rec", "extreme", {"level": "extreme"}, {"token": "t"}))
    sink.write(Record(step=3, scalars={"diag/x": 1.0}, artifacts=[str(png), str(report), str(tmp_path / "gone.png")],
                      histograms={"diag/grad/hist/fc": Histogram([0.0, 1.0, 2.0, 4.0], [3, 5, 1]),
                                  "diag/param/hist/fc": Histogram([float(i) for i in range(701)], [1.0] * 700)}))
    for sev in ("info", "warning", "critical"):
        sink.alert(Alert(f"k_{sev}", 3, sev, "m."))
    sink.flush()
    sink.close("FAILED", {"health": "critical", "alerts": {}})
    run = read_run(settled_runs(tmp_path)[0])
    hists = dict(run.histograms())
    assert hists["diag/grad/hist/fc"]["values"] == [3, 5, 1] and hists["diag/grad/hist/fc"]["bins"] == [0, 1, 2, 4]
    assert len(hists["diag/param/hist/fc"]["values"]) == 350
    [row] = [r for r in run.history if "diag/images/curves" in r]
    assert row["diag/step"] == 3 and row["diag/images/curves"]["_type"] == "image-file"
    assert [a["level"] for a in run.alerts] == ["WARN", "ERROR"]  # info is below notify=warning
    assert run.exit_code == 1 and run.config["token"] == REDACTED
    assert (find_runs(tmp_path)[0].parent / "files" / "report.html").exists()


def test_attach_to_user_run_never_finishes_it(tmp_path: Path) -> None:
    import wandb

    user = wandb.init(project="mine", dir=str(tmp_path), mode="offline", settings=wandb.Settings(**LEAN))
    try:
        model, opt = _model()
        with trackdiag.Diagnostics(model, opt, level="basic", sinks=["wandb"], output_dir=str(tmp_path / "rec"),
                                   every=2, sink={"wandb": {"mode": "offline"}}, hparams={"lr": 0.1, "my_token": "s"}) as d:
            for step in range(6):
                loss = model(torch.randn(4, 4)).pow(2).mean()
                opt.zero_grad(), loss.backward(), opt.step()
                d.step(loss)
                d.flush()
                wandb.log({"user/loss": loss.item()}, step=step)
        assert wandb.run is user and user.summary["trackdiag/status"] == "FINISHED"
        wandb.log({"user/after": 1.0}, step=6)  # the user's run still takes data after trackdiag closed
    finally:
        user.finish()
    [f] = settled_runs(tmp_path)
    run = read_run(f)
    assert run.run["project"] == "mine" and run.config["trackdiag"]["level"] == "basic"
    assert run.config["lr"] == 0.1 and run.config["my_token"] == REDACTED
    assert [r["_step"] for r in run.history] == list(range(7))  # trackdiag never advanced the user's step
    assert any("diag/grad/global_norm" in r for r in run.history) and run.history[-1]["user/after"] == 1.0


@pytest.mark.slow
def test_hydra_multirun_gives_two_runs_in_one_group(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import hydra, torch, trackdiag

        @hydra.main(version_base=None, config_path=".", config_name="config")
        def main(cfg):
            torch.manual_seed(cfg.seed)
            model = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with trackdiag.Diagnostics.from_config(cfg.get("diag"), model=model, optimizer=opt, hparams=cfg) as d:
                for _ in range(4):
                    loss = model(torch.randn(8, 3)).pow(2).mean()
                    opt.zero_grad(); loss.backward(); opt.step()
                    d.step(loss)

        if __name__ == "__main__":
            main()
    """))
    wb = tmp_path / "wb"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the checkout's trackdiag, not a stale install
    cmd = [sys.executable, "app.py", "-m", "+diag=basic", "diag/sink=wandb", "diag.sink.wandb.mode=offline",
           f"diag.sink.wandb.dir={wb}", "diag.sink.wandb.settings={x_disable_stats:true,console:off}", "seed=0,1"]
    proc = warm.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [read_run(f) for f in find_runs(wb)]
    assert len(runs) == 2, proc.stderr[-3000:]
    assert runs[0].run["id"] != runs[1].run["id"] and all(r.exit_code == 0 for r in runs)
    assert runs[0].run["group"] == runs[1].run["group"] != ""
    assert sorted(r.config["seed"] for r in runs) == [0, 1]
    names = sorted(r.run["name"] for r in runs)
    assert "seed=0" in names[0] and names[0].endswith("#0") and "seed=1" in names[1] and names[1].endswith("#1")
