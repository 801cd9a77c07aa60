"""Regenerate the README gallery, ``docs/gallery/*.png``, from real runs.

    .venv/bin/python scripts/gallery.py [--out docs/gallery] [--no-browser] [--keep DIR]

What it trains (seeded; 40 s to 2 min on two CPU cores, depending on what else runs), in a temporary directory:

- **healthy**: the example Hydra app, ``examples/train.py +diag=advanced``;
- **explosion**: the same with ``fault=lr_explode`` (the learning rate jumps to 50 at step 100);
- **nan**: the example app's data and MLP behind a named ``features`` module that takes ``log(x + eps)``
  of the pixels; at step 60 its ``eps`` is set to 0, so ``log(0) = -inf`` of the blank pixels reaches the loss;
- **sweep**: ``examples/train.py -m +diag=basic optimizer.lr=...`` (four jobs), then
  ``trackdiag compare SWEEP --out`` for the comparison page and its plots.

With headless Chromium (Playwright, ``scripts/browser.py``) it also screenshots ``report.html``, ``comparison.html``
and an MLflow run page: a real ``mlflow server`` on 127.0.0.1 (a free port, its own process group, its store in the
temporary directory, killed with its group at the end) to which the explosion run delivers (tests/_mlflow_util.py).
Without Chromium or Playwright one line says so and the matplotlib PNGs are still written. Nothing reaches the network.
Every PNG is at most 1200 px wide (screenshots are downscaled) and under ~300 KB (a 256-colour palette if needed).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts"), str(REPO / "tests"), str(REPO / "examples")]

from browser import Browser, unavailable  # noqa: E402

EXPERIMENT = "gallery"
SWEEP_LRS = "0.001,0.03,0.3,1.0"
NAN_STEP, NAN_STEPS = 60, 100


# ---------------------------------------------------------------- runs
def _env() -> dict[str, str]:
    """The children's environment: this checkout's trackdiag first, W&B off, no stray MLflow store."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env.update(WANDB_MODE="disabled", PYTHONHASHSEED="0")
    return env


def _sh(args: list[str], cwd: Path, log: Path) -> None:
    """Run a child process, its output to ``log``; raise with the log's tail when it fails."""
    with open(log, "wb") as f:
        proc = subprocess.run(args, cwd=cwd, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=900)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(args[:4])} ... failed ({proc.returncode}):\n{tail}")


def example_run(root: Path, name: str, overrides: list[str], server_uri: str | None) -> Path:
    """One job of the example Hydra app in ``root/name``; its local record (the ``diag`` dir)."""
    sink = ([f"diag.sink.mlflow.tracking_uri={server_uri}", f"diag.sink.mlflow.experiment={EXPERIMENT}",
             f"diag.sink.mlflow.run_name={name}"] if server_uri else ["diag/sink=local"])
    _sh([sys.executable, str(REPO / "examples" / "train.py"), "+diag=advanced", *sink, *overrides,
         f"hydra.run.dir={root / name}"], root, root / f"{name}.log")
    return root / name / "diag"


def nan_run(root: Path) -> Path:
    """The example app's data and MLP behind a ``features`` module whose log loses its eps at NAN_STEP."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch import nn
    from train import build_model, load_data

    from trackdiag import Diagnostics

    class LogFeatures(nn.Module):
        """log-scaled pixel intensities; ``eps`` keeps the blank pixels (0) finite."""

        def __init__(self, eps: float = 1e-2) -> None:
            super().__init__()
            self.eps = eps

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x + self.eps)

    cfg = OmegaConf.create({"seed": 0, "model": {"depth": 2, "hidden": 64, "activation": "relu"},
                            "optimizer": {"name": "adam", "lr": 1e-3}, "steps": NAN_STEPS,
                            "fault": f"features.eps=0 at step {NAN_STEP}"})
    torch.manual_seed(cfg.seed)
    xtr, ytr, xva, yva = load_data(cfg.seed)
    model = nn.Sequential(OrderedDict(features=LogFeatures(), mlp=build_model(cfg)))
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optimizer.lr)
    out = root / "nan" / "diag"
    diag = Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out), run_name="nan-log0",
                       hparams=OmegaConf.to_container(cfg))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    with diag:
        for step in range(cfg.steps):
            if step == NAN_STEP:
                model.features.eps = 0.0  # the planted fault: log(0) = -inf for every blank pixel
            idx = torch.randint(0, len(xtr), (64,), generator=gen)
            x, y = xtr[idx], ytr[idx]
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
            if (step + 1) % 20 == 0:
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xva), yva).item())
    return out


def sweep_run(root: Path) -> Path:
    """Four jobs of the example app, one learning rate each, then ``trackdiag compare --out``."""
    sweep = root / "sweep"
    _sh([sys.executable, str(REPO / "examples" / "train.py"), "-m", "+diag=basic", "diag/sink=local", "steps=200",
         f"optimizer.lr={SWEEP_LRS}", f"hydra.sweep.dir={sweep}"], root, root / "sweep.log")
    out = root / "compare"
    _sh([sys.executable, "-m", "trackdiag", "compare", str(sweep), "--out", str(out)], root, root / "compare.log")
    return out


# ---------------------------------------------------------------- pictures
def keep(src: Path, dest: Path, max_width: int = 1200, budget: int = 300_000) -> Path:
    """``src`` as a PNG at ``dest``, at most ``max_width`` px wide; stored with a 256-colour palette only
    when the full-colour file would be larger than ``budget`` bytes."""
    from PIL import Image

    img = Image.open(src).convert("RGB")
    if img.width > max_width:
        img = img.resize((max_width, round(img.height * max_width / img.width)), Image.Resampling.LANCZOS)
    dest.parent.mkdir(parents=True, exist_ok=True)
    img.save(dest, optimize=True)
    if dest.stat().st_size > budget:
        img.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(dest, optimize=True)
    return dest


def check(path: Path) -> Path:
    """Raise when a picture looks blank (a page that did not render, a plot with nothing drawn)."""
    from PIL import Image

    img = Image.open(path).convert("RGB")
    if img.width < 300 or img.height < 150 or len(img.getcolors(1 << 24)) < 50:
        raise RuntimeError(f"{path} looks blank ({img.width}x{img.height})")
    return path


def span(b: Browser, first: str, last: str, pad: int = 12) -> tuple[float, float, float, float]:
    """The document rectangle (x, y, width, height) from the top of element ``first`` to the bottom of
    element ``last`` (JavaScript expressions that give elements), the page's full width."""
    top, bottom = b.eval(f"[({first}).getBoundingClientRect().top + scrollY, "
                         f"({last}).getBoundingClientRect().bottom + scrollY]")
    return 0.0, max(0.0, top - pad), float(b.width), bottom - top + 2 * pad


def _h2(text: str) -> str:
    """JavaScript: the first <h2> whose text starts with ``text``."""
    return f"Array.from(document.querySelectorAll('h2')).find(h => h.innerText.startsWith({text!r}))"


def page_shots(shots: Path, healthy: Path, nan: Path, compare_dir: Path) -> dict[str, Path]:
    """report.html of the healthy run (top), the NaN run's alert table, comparison.html (table and risk)."""
    out: dict[str, Path] = {}
    with Browser(1000, 900) as b:
        b.goto((healthy / "report.html").as_uri(), settle=0.3)
        out["healthy_report"] = b.screenshot(shots / "healthy_report.png",
                                             clip=span(b, "document.querySelector('h1')", "document.images[0]"))
        b.goto((nan / "report.html").as_uri(), settle=0.3)
        if "comes out of features" not in b.eval("document.body.innerText"):
            raise RuntimeError("the NaN run's report does not name the module the NaN came out of")
        out["nan_alert"] = b.screenshot(shots / "nan_alert.png",
                                        clip=span(b, _h2("alerts ("), f"{_h2('alerts (')}.nextElementSibling"))
        b.goto((compare_dir / "comparison.html").as_uri(), settle=0.3)
        out["sweep_comparison"] = b.screenshot(shots / "sweep_comparison.png",
                                               clip=span(b, "document.querySelector('h1')", "document.images[0]"))
    return out


def mlflow_shots(shots: Path, uri: str, run_name: str) -> dict[str, Path]:
    """The run page of ``run_name`` on the server: its Overview (tags: health, first step of each alert)
    and its Artifacts tab previewing ``plots/grad_flow.png``."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    eid = client.get_experiment_by_name(EXPERIMENT).experiment_id
    [run] = client.search_runs([eid], filter_string=f"attributes.run_name = '{run_name}'")
    page = f"{uri}/#/experiments/{eid}/runs/{run.info.run_id}"
    view = "?workflowType=machine_learning"  # the UI's "Model training" view
    close_assistant = ("document.body.innerText.includes('MLflow Assistant') && "
                       "document.querySelector('button[aria-label=Close]')?.click()")
    out: dict[str, Path] = {}
    with Browser(1400, 860) as b:
        for name, tab, ready in (
                ("mlflow_run_overview", "", "document.body.innerText.includes('trackdiag.health')"),
                ("mlflow_run_artifacts", "/artifacts/plots/grad_flow.png",
                 ("document.body.innerText.includes('plots/grad_flow.png') && "  # the preview: a blob: URL
                  "Array.from(document.images).some(i => i.src.startsWith('blob:') && i.naturalWidth > 300)"))):
            b.goto(page + tab + view)
            if not b.wait(ready, 90):
                raise RuntimeError(f"MLflow's run page did not show {name}: {b.eval('document.body.innerText')[:500]}")
            b.eval(close_assistant)
            time.sleep(1.0)
            out[name] = b.screenshot(shots / f"{name}.png")
    return out


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "gallery", help="where the PNGs go (docs/gallery)")
    ap.add_argument("--no-browser", action="store_true", help="only the matplotlib PNGs (no Chromium, no server)")
    ap.add_argument("--keep", type=Path, default=None, help="train in this dir and keep the runs (default: a temp dir)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    why = "--no-browser" if args.no_browser else unavailable()
    browser = why is None
    if not browser:
        print(f"gallery: {why}: skipping the report, comparison and MLflow screenshots; matplotlib PNGs only")
    with tempfile.TemporaryDirectory(prefix="trackdiag-gallery-") as tmp:
        root = args.keep.resolve() if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        server = None
        if browser:
            from _mlflow_util import MlflowServer  # tests/_mlflow_util.py: own process group, killed whole

            (root / "server").mkdir(exist_ok=True)
            server = MlflowServer(root / "server")
            server.start()  # it boots while the in-process run trains
        try:
            print("gallery: training (nan, sweep, healthy, explosion) in", root, flush=True)
            nan = nan_run(root)
            compare_dir = sweep_run(root)
            uri = None
            if server is not None:
                server.wait(180)
                uri = server.uri
            healthy = example_run(root, "healthy", [], None)
            explosion = example_run(root, "explosion", ["fault=lr_explode"], uri)
            print(f"gallery: runs done in {time.monotonic() - t0:.0f} s", flush=True)
            shots = root / "shots"
            pictures = {"healthy_grad_hist": healthy / "plots" / "grad_hist.png",
                        "nan_loss_alerts": nan / "plots" / "loss_alerts.png",
                        "explosion_loss_alerts": explosion / "plots" / "loss_alerts.png",
                        "sweep_loss_curves": compare_dir / "loss_curves.png"}
            if browser and uri is not None:
                pictures.update(page_shots(shots, healthy, nan, compare_dir))
                pictures.update(mlflow_shots(shots, uri, "explosion"))
            written = [check(keep(src, args.out / f"{name}.png")) for name, src in pictures.items()]
        finally:
            if server is not None:
                server.stop()
    total = 0
    for path in written:
        size = path.stat().st_size
        total += size
        print(f"  {path.relative_to(REPO) if path.is_relative_to(REPO) else path}  {size / 1024:.0f} KiB")
    print(f"gallery: wrote {len(written)} PNGs ({total / 1024:.0f} KiB) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
