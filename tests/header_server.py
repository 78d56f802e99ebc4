"""A loopback HTTP server (http.server in a thread) serving model files the ways download hosts do and do not, for
the header-fetching tests (tests/test_header_fetch.py, tests/comfyui/test_header_route.py and the browser test).

Paths: /files/<rel> honours one byte range (206 + Content-Range), /norange/<rel> answers 200 with the whole file
whatever the Range header (and stops when the client hangs up), /redirect/<rel> answers 302 with a relative Location
to /files/<rel>, /away/<rel> a 302 to the same file on another host name (localhost), /loop/<rel> redirects to
itself, /tofile/<rel> to file:///<rel>, /stall/<rel> answers nothing until the server stops, /hf/<repo>/resolve/<rev>/<path> stands in for a Hugging
Face endpoint (HF_ENDPOINT): a 302 to /files/<basename of path> on localhost, as the Hub sends to its CDN. Every
request is logged (path, Range, Authorization, User-Agent, Host) and the body bytes sent per path are counted.
"""
from __future__ import annotations

import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
CHUNK = 64 << 10


class HeaderServer:
    """Serves the files under `root` (see the module doc) on 127.0.0.1; `with HeaderServer(root) as s: s.url(...)`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.log: list[dict[str, Any]] = []
        self.sent: Counter = Counter()  # body bytes written per path
        self.release = threading.Event()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802
                server._handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "HeaderServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, kind: str, rel: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/{kind}/{rel}"

    def requests(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.log if kind is None or r["path"].startswith(f"/{kind}/")]

    # ------------------------------------------------------------------------------------------------ handling
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(h.path).path)
        with self.lock:
            self.log.append({"path": path, "range": h.headers.get("Range"), "auth": h.headers.get("Authorization"),
                             "agent": h.headers.get("User-Agent", ""), "host": h.headers.get("Host")})
        kind, _, rel = path.lstrip("/").partition("/")
        if kind == "stall":
            self.release.wait(60)
            return
        if kind in ("redirect", "away", "loop", "tofile"):
            target = {"redirect": f"/files/{rel}", "away": self.url("files", rel, host="localhost"),
                      "loop": f"/loop/{rel}", "tofile": f"file:///{rel}"}[kind]
            return self._redirect(h, target)
        if kind == "hf":
            return self._redirect(h, self.url("files", rel.rsplit("/", 1)[-1], host="localhost"))
        file = (self.root / rel).resolve()
        if kind not in ("files", "norange") or not file.is_file() or self.root.resolve() not in file.parents:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        size = file.stat().st_size
        match = _RANGE.match(h.headers.get("Range", "")) if kind == "files" else None
        if match is None:
            h.send_response(200)
            h.send_header("Content-Length", str(size))
            h.end_headers()
            return self._send(h, path, file, 0, size)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start >= size:
            h.send_response(416)
            h.send_header("Content-Range", f"bytes */{size}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.send_header("Content-Length", str(end - start + 1))
        h.end_headers()
        self._send(h, path, file, start, end + 1)

    def _redirect(self, h: BaseHTTPRequestHandler, target: str) -> None:
        h.send_response(302)
        h.send_header("Location", target)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _send(self, h: BaseHTTPRequestHandler, path: str, file: Path, start: int, end: int) -> None:
        """Bytes [start, end) of the file, until the client hangs up (a sparse terabyte is never read through)."""
        deadline = time.monotonic() + 30
        try:
            with open(file, "rb") as f:
                f.seek(start)
                pos = start
                while pos < end and time.monotonic() < deadline:
                    chunk = f.read(min(CHUNK, end - pos))
                    if not chunk:
                        break
                    h.wfile.write(chunk)
                    pos += len(chunk)
                    with self.lock:
                        self.sent[path] += len(chunk)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            pass
