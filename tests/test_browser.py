"""``scripts/browser.py``, the Playwright helper the screenshot tests and ``scripts/gallery.py`` use: each
helper on a small local page (values, waits, typing, keys, the three kinds of screenshot), two browsers at
once in two processes (as two pytest-xdist workers run them), and the skip reasons without Playwright or
Chromium."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import browser  # noqa: E402
from browser import Browser, unavailable  # noqa: E402

needs_browser = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

PAGE = """<!doctype html><html><head><style>body{margin:0;background:#fff} #low{position:absolute;left:0;
top:1500px;width:300px;height:100px;background:#f00}</style></head><body style="height:2000px">
<input id="box"><div id="low"></div><script>
window.keys = []; addEventListener('keydown', e => keys.push(e.key));
setTimeout(() => { window.late = 42; }, 700);
</script></body></html>"""


def _png(path: Path) -> np.ndarray:
    import matplotlib.image as mpimg

    return mpimg.imread(path)


@needs_browser
def test_helpers_on_a_local_page(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text(PAGE)
    with Browser(640, 480) as b:
        b.goto(page.as_uri(), settle=0)
        assert b.eval("1 + 2") == 3 and b.eval("Promise.resolve('done')") == "done"
        with pytest.raises(RuntimeError, match="nope"):
            b.eval("nope()")
        assert b.wait("window.late === 42", timeout=10)
        assert not b.wait("document.querySelector('#missing').value", timeout=1)  # throws: false, not an error
        b.eval("document.querySelector('#box').focus()")
        b.type("diag/alerts")
        b.press("Escape")
        assert b.eval("[document.querySelector('#box').value, keys]") == ["diag/alerts", ["Escape"]]
        assert b.page.url == page.as_uri()
        view = _png(b.screenshot(tmp_path / "view.png"))
        full = _png(b.screenshot(tmp_path / "full.png", full_page=True))
        low = _png(b.screenshot(tmp_path / "sub" / "low.png", clip=(0, 1450, 400, 200)))
    assert view.shape[:2] == (480, 640) and full.shape[:2] == (2000, 640) and low.shape[:2] == (200, 400)
    # the clip is in document coordinates, below the viewport: the red box fills its rows 50-150, columns 0-300
    assert np.allclose(low[60:140, :290, :3], [1, 0, 0]) and np.allclose(low[:40, :, :3], 1)
    assert np.allclose(full[1510:1590, :290, :3], [1, 0, 0]) and np.allclose(view[300:, :, :3], 1)


PARALLEL = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from browser import Browser
    me, other = Path(sys.argv[2]), Path(sys.argv[3])
    with Browser(320, 240) as b:
        b.goto(Path(sys.argv[4]).as_uri(), settle=0)
        me.write_text("open")
        t0 = time.monotonic()
        while not other.exists() and time.monotonic() - t0 < 120:  # both browsers open at once
            time.sleep(0.1)
        both = other.exists()
        b.eval("document.querySelector('#box').focus()")
        b.type(me.name)
        print(json.dumps({"both": both, "profile": b.profile, "value": b.eval("document.querySelector('#box').value")}))
""")


@needs_browser
def test_two_browsers_at_once_each_with_its_own_profile(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text(PAGE)
    script = tmp_path / "one.py"
    script.write_text(PARALLEL)
    a, b = tmp_path / "a", tmp_path / "b"
    procs = [subprocess.Popen([sys.executable, str(script), str(REPO / "scripts"), str(me), str(other), str(page)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for me, other in ((a, b), (b, a))]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [g["both"] for g in got] == [True, True] and [g["value"] for g in got] == ["a", "b"]
    assert got[0]["profile"] != got[1]["profile"]
    assert not any(Path(g["profile"]).exists() for g in got)  # each profile removed at exit


def test_skip_reasons_without_playwright_or_chromium(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browser, "find_spec", lambda name: None)
    assert "Playwright" in (unavailable() or "")
    with pytest.raises(FileNotFoundError, match="Playwright"):
        Browser()
    monkeypatch.setattr(browser, "find_spec", lambda name: object())
    monkeypatch.setattr(browser, "chromium_path", lambda: None)
    assert "'chromium'" in (unavailable() or "")
    with pytest.raises(FileNotFoundError, match="Chromium"):
        Browser()
