"""The MLflow run page a user opens first, in headless Chromium with a fresh profile each time
(Playwright: ``scripts/browser.py``): the example app with an exploding learning rate, delivered to a real
``mlflow server``, opened through the link trackdiag prints at the end.

- the link opens the run itself in the UI's "Model training" view (a fresh browser otherwise
  starts in the GenAI view, whatever the experiment's tag says);
- the top of Overview (its Description) says the health, then each alert kind with its step,
  ``where`` and hint; its ``report.html`` link opens the report in the Artifacts tab;
- the chart of an alert count spans the loss's steps (it used to start at the first alert).

Screenshots are written to the test's tmp dir and checked not to be blank."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import _warm as warm

pytest.importorskip("mlflow")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from browser import Browser, unavailable  # noqa: E402
from test_view_screens import _nonblank  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")]
HEALTH = "Array.from(document.querySelectorAll('strong')).find(e => e.innerText.startsWith('trackdiag: health'))"


@pytest.fixture(scope="module")
def story(mlflow_server: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The example app (``+diag=advanced fault=lr_explode``, 200 steps) against a real server:
    ``{"url": the link it printed, "uri": the server, "run_dir": its local record}``."""
    root = tmp_path_factory.mktemp("story")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_TRACKING_URI"] = mlflow_server.uri
    proc = warm.run([sys.executable, str(REPO / "examples" / "train.py"), "+diag=advanced", "fault=lr_explode",
                     "fault_step=100", "steps=200", f"hydra.run.dir={root / 'job'}"], cwd=root, env=env,
                    capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    links = re.findall(r"^trackdiag: MLflow run FINISHED, health critical: (\S+)$", proc.stderr, re.M)
    assert len(links) == 1, proc.stderr[-3000:]
    assert "View run" not in proc.stdout + proc.stderr  # MLflow's own link (GenAI view) is not printed
    return {"url": links[0], "uri": mlflow_server.uri, "run_dir": str(root / "job" / "diag")}


def test_printed_link_opens_the_run_with_its_story_on_top(story: dict[str, str], tmp_path: Path) -> None:
    """A fresh profile, a 1920-wide window: the run's page in the Model training view, the health
    and the first alert with its hint at the top of Overview, above the "Show more" fold."""
    alerts = json.loads((Path(story["run_dir"]) / "alerts.json").read_text())
    with Browser(1920, 1080) as b:
        b.goto(story["url"])
        assert b.wait(f"!!({HEALTH})", 90), b.eval("document.body.innerText")[:2000]
        time.sleep(1.0)
        text = b.eval("document.body.innerText")
        health = b.eval(f"({HEALTH}).getBoundingClientRect().toJSON()")
        first = b.eval(f"(() => {{ const li = ({HEALTH}).closest('div').querySelector('li'); "
                       "return li && [li.innerText, li.querySelector('em').getBoundingClientRect().bottom] })()")
        fold = b.eval("Array.from(document.querySelectorAll('button, span, a')).find(e => e.innerText === 'Show more')"
                      "?.getBoundingClientRect().top")
        shot = b.screenshot(tmp_path / "run_overview.png")
    assert "Runs" in text and "Evaluations" not in text and "Evaluation runs" not in text  # Model training view
    assert text.index("Description") < text.index("About this run")
    assert health["top"] < 250, health  # the first lines of the Overview
    assert "trackdiag: health CRITICAL · run FINISHED after 200 steps" in text
    rank = {"critical": 0, "warning": 1, "info": 2}
    worst = min(alerts, key=lambda a: (rank[a["severity"]], a["step"]))  # listed first: most severe, earliest
    assert first is not None and first[0].startswith(f"{worst['kind']} ({worst['severity']}) at step {worst['step']}"), first
    assert f"Hint: {worst['hint'][:40]}" in first[0], first
    assert fold is None or first[1] <= fold, (first, fold)  # the hint shows before "Show more"
    for kind in {a["kind"] for a in alerts}:  # every kind, with its first step
        step = min(a["step"] for a in alerts if a["kind"] == kind)
        assert re.search(rf"{kind} \((info|warning|critical)\) at step {step}\b", text), kind
    _nonblank(shot)


@pytest.fixture(scope="module")
def _returning() -> Iterator[Browser]:
    with Browser(1400, 1000) as b:
        yield b


@pytest.fixture
def browser(_returning: Browser, story: dict[str, str]) -> Browser:
    """The browser of the tests after the first visit: one Chromium and profile for them all, so MLflow's
    scripts are compiled once (a fresh profile pays ~6 CPU-s per MLflow page on 2 cores, a warm one ~1: issue
    47); each test starts with the server's cookies and storage cleared, at 1400 x 1000."""
    _returning.forget(story["uri"] + "/health")
    _returning.resize(1400, 1000)
    return _returning


def test_report_link_opens_the_report(story: dict[str, str], browser: Browser, tmp_path: Path) -> None:
    b = browser
    b.goto(story["url"])
    assert b.wait("!!Array.from(document.querySelectorAll('a')).find(a => a.innerText === 'report.html')", 90)
    href = b.eval("Array.from(document.querySelectorAll('a')).find(a => a.innerText === 'report.html').getAttribute('href')")
    b.goto(story["uri"] + "/" + href)
    shown = b.wait("document.body.innerText.includes('files/report.html') && "
                   "Array.from(document.querySelectorAll('iframe')).some(f => f.getBoundingClientRect().height > 300)", 90)
    text = b.eval("document.body.innerText")
    shot = b.screenshot(tmp_path / "report_preview.png")
    assert href.startswith("#/experiments/") and href.endswith("/artifacts/files/report.html?workflowType=machine_learning")
    assert shown, text[:2000]
    assert "Evaluations" not in text
    _nonblank(shot)


def _chart_extents(b: Browser) -> dict[str, list[float]]:
    """Per plotted metric (named by its legend, ``(diag/...)``): [first x, last x, axis from, axis to]."""
    return dict(b.eval("""Array.from(document.querySelectorAll('.js-plotly-plot')).map(p => {
        let card = p, key = null;
        for (let i = 0; i < 12 && card && !key; i++) {
            card = card.parentElement; const m = card && card.innerText.match(/\\((diag\\/[^)]+)\\)/); key = m && m[1]; }
        const xs = (p.data || []).flatMap(d => Array.from(d.x || []));
        return [key, [Math.min(...xs), Math.max(...xs), ...p._fullLayout.xaxis.range]]; })"""))


def test_alert_chart_shares_the_loss_step_range(story: dict[str, str], browser: Browser, tmp_path: Path) -> None:
    kind = json.loads((Path(story["run_dir"]) / "alerts.json").read_text())[0]["kind"]  # the incident's alert
    base, _, route = story["url"].partition("#")
    page, _, query = route.partition("?")
    box = "input[placeholder*=\"Search metric\"]"
    b = browser
    b.goto(f"{base}#{page}/model-metrics?{query}")
    assert b.wait(f"!!document.querySelector('{box}')", 60)
    assert b.wait("document.body.innerText.includes('diag/alerts')", 90), b.eval("document.body.innerText")[:2000]
    b.eval(f"document.querySelector('{box}').focus()")
    b.type(f"diag/alerts/{kind}|diag/loss$")  # the filter is a regular expression
    assert b.wait("document.querySelectorAll('.js-plotly-plot').length === 2", 60)
    time.sleep(1.0)
    charts = _chart_extents(b)
    shot = b.screenshot(tmp_path / "alert_chart.png")
    loss, alert = charts["diag/loss"], charts[f"diag/alerts/{kind}"]
    assert loss[:2] == [0, 199] and alert[:2] == loss[:2], charts  # the same steps, first to last
    assert alert[2] <= loss[2] and alert[3] >= loss[3], charts  # its axis shows the whole run too
    _nonblank(shot)


def test_report_opens_with_health_and_status_in_mlflow_too(story: dict[str, str]) -> None:
    """report.html is drawn while the run closes; its first line carries the final health and status,
    locally and in the copy MLflow holds (uploaded after the local record stamped it)."""
    import urllib.request

    from mlflow import MlflowClient

    local = (Path(story["run_dir"]) / "report.html").read_text(encoding="utf-8")
    run_id = story["url"].split("/runs/")[1].split("?")[0]
    with urllib.request.urlopen(f"{story['uri']}/get-artifact?path=files/report.html&run_uuid={run_id}", timeout=30) as r:
        served = r.read().decode("utf-8")
    for page in (local, served):
        head = page[page.index("<h1>"):page.index("<table>")]
        assert 'health <b class="critical">CRITICAL</b> · run <b>FINISHED</b>' in head, head
    assert MlflowClient(story["uri"]).get_run(run_id).data.tags["trackdiag.health"] == "critical"


def test_runs_table_shows_health_from_the_tag_the_readme_names(story: dict[str, str], browser: Browser,
                                                               tmp_path: Path) -> None:
    """README: in the runs table, *Columns* -> *Tags* -> ``trackdiag.health`` adds the health."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "*Columns* → *Tags* → `trackdiag.health`" in readme
    base, _, route = story["url"].partition("#")
    experiment = route.split("/runs/")[0]
    b = browser
    b.resize(1600, 1000)
    b.goto(f"{base}#{experiment}?workflowType=machine_learning")
    assert b.wait("Array.from(document.querySelectorAll('button')).some(x => x.innerText.trim() === 'Columns')", 90)
    assert b.wait("document.body.innerText.includes('lr_explode')", 60)
    b.eval("Array.from(document.querySelectorAll('button')).find(x => x.innerText.trim() === 'Columns').click()")
    assert b.wait("document.body.innerText.includes('Tags (')", 30), b.eval("document.body.innerText")[:2000]
    menu = b.eval("document.body.innerText")
    b.eval("Array.from(document.querySelectorAll('*')).filter(e => e.children.length === 0 && "
           "e.innerText === 'trackdiag.health').pop().click()")
    b.press("Escape")
    shown = b.wait("Array.from(document.querySelectorAll('[role=columnheader], th')).some(h => "
                   "h.innerText.includes('trackdiag.health')) && document.body.innerText.includes('critical')", 30)
    shot = b.screenshot(tmp_path / "runs_table.png")
    assert "Tags (" in menu and "trackdiag.health" in menu
    assert shown
    _nonblank(shot)
