"""Headless Chromium driven through the DevTools protocol, with the standard library only.

Used by ``scripts/gallery.py`` and the screenshot tests: pages such as MLflow's run page load
their charts lazily and need a script to run (type into a filter box, wait for images) before a
screenshot is worth taking, which ``chromium --screenshot`` cannot do.

    with Browser(width=1400, height=1000) as b:
        b.goto("http://127.0.0.1:5000/#/experiments/1/runs/<id>")
        b.wait("document.querySelectorAll('img').length > 3", timeout=60)
        b.screenshot(Path("page.png"))

Chromium runs with a throwaway profile, ``--remote-debugging-port=0`` (the port is read back from
the profile's ``DevToolsActivePort``), on loopback only; it is killed with its process group at exit.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio"]


def chromium_path() -> str | None:
    """The Chromium executable on PATH (or /usr/bin/chromium), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


class _WebSocket:
    """The client side of RFC 6455, just enough for DevTools: masked text frames out, text frames in."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        rest = url.removeprefix("ws://")
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.partition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools refused the websocket: {head[:200]!r}")
        self._buf = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def send(self, text: str) -> None:
        data = text.encode()
        mask = os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                bytes([0x80 | 127]) + struct.pack(">Q", n))
        body = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(head + mask + body)

    def recv(self) -> str:
        parts: list[bytes] = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the websocket")
            if opcode in (0x9, 0xA):  # ping / pong: nothing to do for DevTools
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Browser:
    """One headless Chromium with one page (see the module doc). ``width``/``height``: the viewport."""

    def __init__(self, width: int = 1400, height: int = 1000, exe: str | None = None) -> None:
        self.width, self.height = width, height
        self.exe = exe or chromium_path()
        if self.exe is None:
            raise FileNotFoundError("headless Chromium is not installed (Debian package 'chromium')")
        self._profile = tempfile.mkdtemp(prefix="trackdiag-chromium-")
        self._proc: subprocess.Popen[bytes] | None = None
        self._ws: _WebSocket | None = None
        self._id = 0

    def __enter__(self) -> "Browser":
        self._proc = subprocess.Popen([self.exe, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-port=0",
                                       "--remote-debugging-address=127.0.0.1", f"--window-size={self.width},{self.height}",
                                       "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        port_file = Path(self._profile) / "DevToolsActivePort"
        t0 = time.monotonic()
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() - t0 > 30 or self._proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        self._ws = _WebSocket(pages[0]["webSocketDebuggerUrl"])
        self.call("Page.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ws is not None:
            self._ws.close()
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events received meanwhile are dropped)."""
        if self._ws is None:
            raise RuntimeError("use Browser as a context manager")
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"script failed: {res['exceptionDetails'].get('text')}: {expression[:200]}")
        return res.get("result", {}).get("value")

    def goto(self, url: str, settle: float = 1.0) -> None:
        """Open ``url`` and wait for the document to load (plus ``settle`` seconds)."""
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", timeout=60)
        time.sleep(settle)

    def wait(self, condition: str, timeout: float = 60.0, poll: float = 0.5) -> bool:
        """Poll a JavaScript condition until it is truthy; False when ``timeout`` passes first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if self.eval(condition):
                    return True
            except RuntimeError:
                pass
            time.sleep(poll)
        return False

    def type(self, text: str) -> None:
        """Type ``text`` into the focused element (as a user would: React sees input events)."""
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path, full_page: bool = False,
                   clip: tuple[float, float, float, float] | None = None) -> Path:
        """A PNG of the viewport, of the whole document with ``full_page``, or of the rectangle ``clip``
        (x, y, width, height in CSS pixels of the document; it may reach below the viewport)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            h = int(self.eval("Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)") or self.height)
            clip = (0, 0, self.width, h)
        if clip is not None:
            x, y, w, h = clip
            params.update(clip={"x": x, "y": y, "width": w, "height": h, "scale": 1}, captureBeyondViewport=True)
        data = self.call("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
