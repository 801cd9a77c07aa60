"""A loopback HTTP proxy that adds a fixed delay to every request: a tracking server "far away".

Run it as its own process (tests and ``benchmarks/mlflow_delivery.py`` start it in a new process
group and kill the group)::

    python tests/_delay_proxy.py --upstream http://127.0.0.1:5000 --port 5001 --delay 0.15 [--log FILE]

Every request waits ``delay`` seconds, is forwarded to ``upstream`` (same method, path, headers,
body) and its answer is returned as is. With ``--log``, one line per request (``METHOD path``) is
appended to FILE with its arrival time, so callers can count round trips. With ``--lose-first PART``,
the first request whose path contains PART reaches upstream but its answer is replaced by a 503 (a
server whose answer timed out at a load balancer after the work was done). Only 127.0.0.1 is ever
bound or reached.
"""
from __future__ import annotations

import argparse
import http.client
import http.server
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


def make_handler(upstream: str, delay: float, log: str | None,
                 lose_first: str | None = None) -> type[http.server.BaseHTTPRequestHandler]:
    """A request handler class forwarding to ``upstream`` after ``delay`` seconds."""
    target = urllib.parse.urlsplit(upstream)
    lock = threading.Lock()
    to_lose = [lose_first] if lose_first else []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if log:
                with lock, open(log, "a", encoding="utf-8") as f:
                    f.write(f"{time.time():.3f} {self.command} {self.path}\n")
            time.sleep(delay)
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "host"}
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
            except OSError as exc:
                self.send_error(502, f"upstream: {exc}")
                return
            finally:
                conn.close()
            with lock:
                lost = bool(to_lose) and to_lose[0] in self.path
                if lost:
                    to_lose.clear()
            if lost:
                self.send_error(503, "answer lost on the way back")
                return
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _forward

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

    return Handler


class DelayProxy:
    """Starts this file as a process in its own group; ``uri`` is the proxied address."""

    def __init__(self, upstream: str, port: int, delay: float, log: Path | None = None,
                 lose_first: str | None = None) -> None:
        self.upstream, self.port, self.delay, self.log = upstream, port, delay, log
        self.lose_first = lose_first
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--upstream", self.upstream, "--port", str(self.port),
               "--delay", str(self.delay)]
        if self.log is not None:
            cmd += ["--log", str(self.log)]
        if self.lose_first:
            cmd += ["--lose-first", self.lose_first]
        self.proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/__proxy_alive__", timeout=2):
                    pass
            except urllib.error.HTTPError:
                return  # the proxy answered (upstream's 404, or 502 while upstream boots)
            except OSError:
                time.sleep(0.1)
                continue
            return
        raise TimeoutError("delay proxy did not start")

    def requests(self) -> list[str]:
        """Every request seen so far (``METHOD path``), if logging."""
        return [r for _, r in self.timed_requests()]

    def timed_requests(self) -> list[tuple[float, str]]:
        """Every request seen so far as (time.time() when it arrived, ``METHOD path``)."""
        if self.log is None or not self.log.exists():
            return []
        lines = [x.split(" ", 1) for x in self.log.read_text().splitlines() if "__proxy_alive__" not in x]
        return [(float(t), r) for t, r in lines]

    def stop(self) -> None:
        from _procs import kill_group

        kill_group(self.proc)
        self.proc = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.15)
    ap.add_argument("--log", default=None)
    ap.add_argument("--lose-first", default=None)
    args = ap.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port),
                                             make_handler(args.upstream, args.delay, args.log, args.lose_first))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
