"""Headless Chromium driven by Playwright for Python (sync API), pointed at the system Chromium.

Used by ``scripts/gallery.py`` and the screenshot tests: pages such as MLflow's run page load
their charts lazily and need a script to run (type into a filter box, wait for images) before a
screenshot is worth taking, which ``chromium --screenshot`` cannot do.

    with Browser(width=1400, height=1000) as b:
        b.goto("http://127.0.0.1:5000/#/experiments/1/runs/<id>")
        b.wait("document.querySelectorAll('img').length > 3", timeout=60)
        b.screenshot(Path("page.png"))

No ``playwright install``: that downloads a browser build, which fails without internet. Debian's
``/usr/bin/chromium`` is launched through ``executable_path`` with ``FLAGS`` and a fresh profile
directory of its own (``tempfile.mkdtemp``), so two browsers at once (two pytest-xdist workers) never
share one; Playwright closes Chromium when the block ends, and the profile is removed.
``b.page`` is the Playwright ``Page`` for anything the helpers below do not cover.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page, Playwright

#: the flags the environment doc recommends (``--headless`` comes from ``headless=True``)
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--hide-scrollbars", "--mute-audio"]


def chromium_path() -> str | None:
    """The Chromium executable on PATH (or /usr/bin/chromium), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def unavailable(exe: str | None = None) -> str | None:
    """Why ``Browser`` (with Chromium ``exe``, or the system one) cannot run here, as a skip reason, or None
    when it can. Costs a module lookup and a PATH lookup."""
    if find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install 'trackdiag[test]'; scripts/bootstrap.sh does)"
    if (exe or chromium_path()) is None:
        return "headless Chromium is not installed (scripts/bootstrap.sh installs the Debian package 'chromium')"
    return None


class Browser:
    """One headless Chromium with one page (see the module doc). ``width``/``height``: the viewport.
    Starting one costs Playwright's driver (a node process) plus Chromium: about 1-3 s on two cores."""

    def __init__(self, width: int = 1400, height: int = 1000, exe: str | None = None) -> None:
        self.width, self.height = width, height
        why = unavailable(exe)
        if why is not None:
            raise FileNotFoundError(why)
        self.exe = exe or chromium_path()
        self.profile: str | None = None  #: this browser's own profile directory while it runs
        self._pw: Playwright | None = None
        self._context: BrowserContext | None = None
        self._page: Page | None = None

    @property
    def page(self) -> Page:
        """The Playwright ``Page`` (a ``playwright.sync_api.Page``)."""
        if self._page is None:
            raise RuntimeError("use Browser as a context manager")
        return self._page

    def __enter__(self) -> Self:
        from playwright.sync_api import sync_playwright

        self.profile = tempfile.mkdtemp(prefix="trackdiag-chromium-")
        self._pw = sync_playwright().start()
        try:
            self._context = self._pw.chromium.launch_persistent_context(
                self.profile, executable_path=self.exe, headless=True, args=FLAGS,
                viewport={"width": self.width, "height": self.height}, device_scale_factor=1)
            pages = self._context.pages
            self._page = pages[0] if pages else self._context.new_page()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._context is not None:
                self._context.close()
        finally:
            if self._pw is not None:
                self._pw.stop()
            self._context = self._page = self._pw = None
            if self.profile is not None:
                shutil.rmtree(self.profile, ignore_errors=True)

    def resize(self, width: int, height: int) -> None:
        """A new viewport size for the page."""
        self.width, self.height = width, height
        self.page.set_viewport_size({"width": width, "height": height})

    def forget(self, origin: str) -> None:
        """Clear the cookies and ``origin``'s local and session storage (what a page remembers of a visit),
        keeping the cache: a returning visitor without the last visit's settings."""
        self.page.context.clear_cookies()
        self.page.goto(origin, wait_until="load", timeout=60_000)
        self.eval("(() => { localStorage.clear(); sessionStorage.clear(); })()")
        self.page.goto("about:blank")

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited); RuntimeError if it throws."""
        from playwright.sync_api import Error

        try:
            return self.page.evaluate(expression)
        except Error as e:
            raise RuntimeError(f"script failed: {e.message}: {expression[:200]}") from e

    def goto(self, url: str, settle: float = 1.0) -> None:
        """Open ``url`` and wait for the document to load (plus ``settle`` seconds)."""
        self.page.goto(url, wait_until="load", timeout=60_000)
        time.sleep(settle)

    def wait(self, condition: str, timeout: float = 60.0, poll: float = 0.25) -> bool:
        """Poll a JavaScript condition until it is truthy (a throw counts as false); False when
        ``timeout`` passes first."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        predicate = f"() => {{ try {{ return !!({condition}); }} catch (e) {{ return false; }} }}"
        try:
            self.page.wait_for_function(predicate, polling=poll * 1000, timeout=timeout * 1000)
        except PlaywrightTimeout:
            return False
        return True

    def type(self, text: str) -> None:
        """Type ``text`` into the focused element (one input event, as a paste: React sees it)."""
        self.page.keyboard.insert_text(text)

    def press(self, key: str) -> None:
        """Press and release one key (Playwright's names: ``"Escape"``, ``"Enter"``, ``"Control+A"``)."""
        self.page.keyboard.press(key)

    def screenshot(self, path: Path, full_page: bool = False,
                   clip: tuple[float, float, float, float] | None = None) -> Path:
        """A PNG of the viewport, of the whole document with ``full_page``, or of the rectangle ``clip``
        (x, y, width, height in CSS pixels of the document; it may reach below the viewport)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if clip is not None:
            x, y, w, h = clip
            self.page.screenshot(path=str(path), full_page=True, clip={"x": x, "y": y, "width": w, "height": h})
        else:
            self.page.screenshot(path=str(path), full_page=full_page)
        return path
