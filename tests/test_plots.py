"""Pictures and the run report: a short real training at extreme-like settings writes every image,
the HTML report, the model summary and the environment report, and lists them as artifacts; each
image is a real, non-blank PNG; the report opens in headless Chromium without console errors."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import batches, make_mlp

from trackdiag import Diagnostics
from trackdiag.plots.environment import environment_report
from trackdiag.plots.gradflow import classify, plot_grad_flow
from trackdiag.plots.memory import MemorySnapshot
from trackdiag.plots.summary import model_summary
from trackdiag.core.record import Histogram, Record
from trackdiag.core.record import read_records

PNG = b"\x89PNG\r\n\x1a\n"
IMAGES = ("loss_alerts", "grad_flow", "grad_hist", "param_hist", "memory")


@pytest.fixture(scope="module")
def run_dir(digits, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    x, y = digits
    model = make_mlp(hidden=32, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diag = Diagnostics(model, opt, level="extreme", every=2, anomaly_window=0, output_dir=str(out),
                       probes={"histograms": {"every": 4, "bins": 32},
                               "landscape": {"every": 20, "steps": 5, "dims": 2}},
                       rules={"grad_explosion": {"threshold": 0.15}})  # low on purpose: alerts to draw
    data = batches(x, y, 64)
    with diag:
        for _ in range(30):
            xb, yb = next(data)
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss.detach(), batch=(xb, yb))
    return out


def _check_png(path: Path) -> None:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG, path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, path
    assert float(img.std()) > 0.01, f"{path} is blank"
    rgb = (img[..., :3] * 255).astype(np.uint32)
    colours = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    assert len(colours) >= 8, f"{path}: only {len(colours)} colours"


def test_training_writes_report_images_and_artifacts(run_dir: Path) -> None:
    records = list(read_records(run_dir))
    final = records[-1]
    for name in IMAGES:
        path = run_dir / "plots" / f"{name}.png"
        assert str(path.resolve()) in final.artifacts, name
        _check_png(path)
    for name in ("report.html", "environment.json", "model_summary.json"):
        assert str((run_dir / name).resolve()) in final.artifacts
    assert final.scalars["diag/model/params_total"] == 64 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert final.scalars["diag/model/flops_per_step"] > 0
    shots = sorted((run_dir / "landscape").glob("*.png"))
    assert [p.stem for p in shots] == ["step_0000000", "step_0000020"]
    for p in shots:
        _check_png(p)
    landscape_rec = next(r for r in records if r.step == 20 and "diag/landscape/center_loss" in r.scalars)
    assert str(shots[-1]) in landscape_rec.artifacts
    assert any(r.alerts for r in records)
    hist = [r for r in records if r.histograms]
    assert [r.step for r in hist] == [0, 2, 4, 8, 12, 16, 20, 24, 28]  # spread: 2 = every x 1 before the first 4
    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(IMAGES) + 1  # + the landscape
    assert "grad_explosion" in page and "environment" in page
    assert 'src="http' not in page and 'href="http' not in page and "<script" not in page  # self-contained


def test_gradflow_flags_vanishing_and_exploding(tmp_path: Path) -> None:
    kinds = classify(np.array([1.0, 1e-9, 1.0, 500.0, np.nan]), np.array([2.0, 1e-9, 2.0, 900.0, np.nan]),
                     vanishing=1e-7, exploding=100.0, relative=1e3)
    assert kinds == ["", "vanishing", "", "exploding", "nonfinite"]
    recs = [Record(step=s, tables={"diag/D/grad/norm": {"a.0": 1.0, "a.1": 1e-9, "b": 300.0}},
                   scalars={"diag/D/grad/norm/a": 1.0, "diag/D/grad/norm/b": 300.0}) for s in range(3)]
    _check_png(plot_grad_flow(recs, tmp_path / "flow.png"))
    assert plot_grad_flow([Record(step=0)], tmp_path / "none.png") is None


def test_model_summary_and_environment() -> None:
    model = make_mlp(hidden=8, depth=1)
    model.train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    s = model_summary(model, (torch.randn(5, 64), torch.zeros(5)))
    assert s["params_total"] == s["params_trainable"] == 64 * 8 + 8 + 8 * 10 + 10
    assert s["flops_forward"] == 2 * 5 * (64 * 8 + 8 * 10)  # two matmuls
    assert s["flops_per_step"] == 3 * s["flops_forward"]
    rows = {r["name"]: r for r in s["modules"]}
    assert rows["(root)"]["input"] == [5, 64] and rows["(root)"]["output"] == [5, 10]
    assert rows["0"]["output"] == [5, 8] and rows["2"]["params"] == 8 * 10 + 10
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    env = environment_report()
    assert env["torch"] == torch.__version__ and "numpy" in env["packages"] and env["devices"]


def test_package_versions_are_importlib_metadata_s(tmp_path: Path, monkeypatch) -> None:
    """The versions read from the ``.dist-info`` folder names equal ``importlib.metadata.version``'s, names
    not installed are left out, and a package known only by an ``.egg-info`` folder is asked of
    ``importlib.metadata`` (which finds it there)."""
    from importlib import metadata

    from trackdiag.plots.environment import PACKAGES, package_versions

    expected = {}
    for name in PACKAGES:
        try:
            expected[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    assert package_versions() == expected and {"numpy", "mlflow", "trackdiag"} <= set(expected)
    egg = tmp_path / "Old_Pkg.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: old-pkg\nVersion: 0.3.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert package_versions(("old.pkg", "not-installed-anywhere", "numpy")) == {"old.pkg": "0.3.1",
                                                                                 "numpy": expected["numpy"]}


def test_memory_limit_is_physical_ram_or_the_cgroup_limit() -> None:
    """``memory_limit_bytes`` (now without importing psutil) against psutil's total and the cgroup's own file."""
    import psutil

    from trackdiag.probes.memory import memory_limit_bytes

    total = psutil.virtual_memory().total
    limits = []
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            limits.append(int(text))
            break
    assert memory_limit_bytes() == float(limits[0] if limits else total)


def test_model_summary_of_a_model_with_a_torchscript_part_leaves_no_hook(tmp_path: Path) -> None:
    """A ScriptModule takes no Python forward hook: the summary skips its shapes (the others are
    there), leaves no hook on any module (one left behind made the user's ``torch.save(model)`` of such a
    model without its TorchScript part fail: "Can't pickle local object 'model_summary.<locals>...'"), and
    the report probe is not switched off."""
    from torch import nn

    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(6, 8), nn.ReLU())), nn.Linear(8, 3))
    s = model_summary(model, (torch.randn(4, 6), torch.zeros(4)))
    rows = {r["name"]: r for r in s["modules"]}
    assert rows["(root)"]["output"] == [4, 3] and rows["1"]["input"] == [4, 8] and rows["0"]["output"] is None
    assert not any(m._forward_hooks for m in model.modules() if not isinstance(m, torch.jit.ScriptModule))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path)) as diag:
        for _ in range(3):
            x, y = torch.randn(4, 6), torch.randint(3, (4,))
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            diag.step(loss, batch=(x, y))
            assert not any(m._forward_hooks for m in model.modules() if not isinstance(m, torch.jit.ScriptModule))
    assert "report" not in diag.summary()["disabled_probes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_memory_snapshot_is_a_noop_without_cuda(tmp_path: Path) -> None:
    snap = MemorySnapshot(tmp_path / "snap.pickle", steps=2)
    assert not snap.start() and snap.step() is None and snap.stop() is None
    assert not (tmp_path / "snap.pickle").exists()


# ---------------------------------------------------------------- headless Chromium (Playwright: scripts/browser.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from browser import Browser, unavailable  # noqa: E402

needs_browser = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
_TRAP = ("<script>window.__errs=[];addEventListener('error',function(e){__errs.push(String(e.message||"
         "(e.target&&(e.target.src||e.target.href))||'error'))},true);addEventListener('unhandledrejection',"
         "function(){__errs.push('rejection')});addEventListener('load',function(){document.body.setAttribute("
         "'data-errors',__errs.length?__errs.join('|'):'none')});</script>")


def _page_errors(b: Browser, page: Path, scratch: Path) -> list[str]:
    """Console messages, uncaught script errors and error events (failed resources) of ``page`` in ``b``
    (a copy with an error trap, written next to the images the page refers to, if any, is loaded)."""
    trapped = scratch / (page.stem + ".trap.html")
    trapped.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + _TRAP, 1), encoding="utf-8")
    seen: list[str] = []
    b.page.on("console", lambda m: seen.append(f"CONSOLE {m.type}: {m.text}"))
    b.page.on("pageerror", lambda e: seen.append(f"Uncaught {e}"))
    b.goto(trapped.as_uri(), settle=0)
    assert b.wait("document.body.hasAttribute('data-errors')", 60), f"page did not finish loading: {seen}"
    trapped_errors = b.eval("document.body.getAttribute('data-errors')")
    return seen + ([] if trapped_errors == "none" else [trapped_errors])


@needs_browser
def test_error_detection_works(tmp_path: Path) -> None:
    bad = tmp_path / "bad.html"
    bad.write_text('<!doctype html><html><head></head><body><img src="missing.png"><script>nope();</script></body></html>')
    with Browser(1280, 1000) as b:
        errors = _page_errors(b, bad, tmp_path)
    assert any("nope" in e for e in errors) and any("missing.png" in e for e in errors), errors


@needs_browser
def test_report_opens_without_console_errors_and_renders(run_dir: Path, tmp_path: Path) -> None:
    with Browser(1280, 2000) as b:
        assert _page_errors(b, run_dir / "report.html", tmp_path) == []  # self-contained: loads nothing
        b.goto((run_dir / "report.html").as_uri(), settle=0.3)
        shot = b.screenshot(tmp_path / "report.png")
    assert shot.exists()
    _check_png(shot)


def _histogram_records(groups: int, scale: float, symlog: bool) -> list[Record]:
    """Histogram records of ``groups`` layer groups at six steps, values spread over ~``scale`` (symmetric
    log-spaced edges when ``symlog``), one group with values clamped into its end bin from step 50."""
    rng = np.random.default_rng(0)
    if symlog:
        mags = scale * np.logspace(-8, 0, 17)
        edges = np.concatenate([-mags[::-1], [0.0], mags]).tolist()
    else:
        edges = np.linspace(-scale, scale, 33).tolist()
    records = []
    for step in (0, 10, 20, 50, 100, 200):
        hists, table = {}, {}
        for g in range(groups):
            counts = rng.integers(0, 500, len(edges) - 1).astype(float)
            hists[f"diag/grad/hist/blocks.{g}.attention.q_proj"] = Histogram(edges=edges, counts=counts.tolist())
            if g == 0 and step >= 50:
                table[f"blocks.{g}.attention.q_proj"] = 0.2 * counts.sum()
        records.append(Record(step=step, histograms=hists, tables={"diag/grad/hist_clipped": table}))
    return records


@pytest.mark.parametrize("groups,scale,symlog", [(1, 1e-3, False), (3, 0.02, False), (5, 7.5e-4, False),
                                                 (12, 3e-3, True), (3, 150.0, True)])
def test_histogram_picture_keeps_every_label_inside_and_apart(groups: int, scale: float, symlog: bool) -> None:
    """The histogram picture places its panels with fixed margins (not constrained layout, which cost as much as
    the drawing): every text of it is inside the picture, no panel's tick labels, title or axis label overlaps
    another panel or the colour bar, and the panels keep the picture's width."""
    from trackdiag.plots.histograms import histogram_figure

    fig = histogram_figure(_histogram_records(groups, scale, symlog), "grad")
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    whole = fig.bbox
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_label() != "<colorbar>"][:groups]
    bar = next(ax for ax in fig.axes if ax not in panels and ax.get_visible())
    texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
             if t.get_visible() and t.get_text()]
    for t in texts:
        box = t.get_window_extent(renderer)
        assert whole.x0 - 1 <= box.x0 and box.x1 <= whole.x1 + 1 and whole.y0 - 1 <= box.y0 and box.y1 <= whole.y1 + 1, \
            (t.get_text(), box, whole)
    title = fig._suptitle.get_window_extent(renderer)
    for ax in panels:
        own = ax.get_tightbbox(renderer)
        assert not own.overlaps(title), ax.get_title()
        for other in [*panels, bar]:
            if other is not ax:
                assert not own.overlaps(other.get_window_extent(renderer)), (ax.get_title(), other.get_title())
    assert sum(ax.get_window_extent(renderer).width for ax in panels[:3]) > 0.6 * whole.width
