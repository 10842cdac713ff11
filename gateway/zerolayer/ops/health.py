"""The metrics and health HTTP endpoint, served from its own thread, never from the event loop.

GET /metrics (Prometheus text), /healthz and /readyz: 200 "ok", or 503 with the reason in the
body (zerolayer.ops.readiness decides: "starting: loading model", "engine not stepping",
"draining", a store unreachable). GET /prompts lists the precompiled system prompts as JSON once
the daemon sets ``HttpServerHandle.prompts``. The daemon starts this server before loading the
model, so probes get answers during start-up. A slow scraper costs a thread of its own, so a
scrape never stalls token delivery on the event loop.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from zerolayer.ops.metrics import CONTENT_TYPE_LATEST, Metrics
from zerolayer.ops.readiness import Health

__all__ = ["HttpServerHandle", "start_http_server"]

log = logging.getLogger("zerolayer.ops.http")


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # an in-flight scrape never holds up shutdown
    allow_reuse_address = True
    metrics: Metrics
    health: Health
    prompts: Callable[[], list[dict[str, Any]]] | None


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive for scrapers that reuse connections

    def do_GET(self) -> None:  # noqa: N802 - name fixed by BaseHTTPRequestHandler
        self._serve(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(send_body=False)

    def _serve(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, self.server.metrics.render(), CONTENT_TYPE_LATEST, send_body)
        elif path == "/healthz":
            self._reply(*_probe(self.server.health.live()), send_body=send_body)
        elif path == "/readyz":
            self._reply(*_probe(self.server.health.ready()), send_body=send_body)
        elif path == "/prompts" and self.server.prompts is not None:
            try:
                body = json.dumps({"prompts": self.server.prompts()}).encode()
            except Exception:
                log.exception("listing prompts failed")
                self._reply(500, b"internal error\n", "text/plain; charset=utf-8", send_body)
                return
            self._reply(200, body, "application/json", send_body)
        else:
            self._reply(404, b"not found\n", "text/plain; charset=utf-8", send_body)

    def _reply(self, status: int, body: bytes, content_type: str, send_body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        # Scrapes every few seconds would flood the journal; errors still go through log_error.
        pass

    def log_error(self, format: str, *args: object) -> None:  # noqa: A002
        log.debug("http: " + format, *args)


def _probe(reason: str | None) -> tuple[int, bytes, str]:
    if reason is None:
        return 200, b"ok\n", "text/plain; charset=utf-8"
    return 503, (reason + "\n").encode(), "text/plain; charset=utf-8"


class HttpServerHandle:
    """A running metrics/health server. ``port`` is the bound port (useful with port 0)."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host = str(server.server_address[0])
        self.port: int = server.server_address[1]

    @property
    def prompts(self) -> Callable[[], list[dict[str, Any]]] | None:
        return self._server.prompts

    @prompts.setter
    def prompts(self, describe: Callable[[], list[dict[str, Any]]] | None) -> None:
        """Serve GET /prompts from ``describe`` (set once the prompts are compiled)."""
        self._server.prompts = describe

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def start_http_server(
    host: str,
    port: int,
    metrics: Metrics,
    health: Health,
    prompts: Callable[[], list[dict[str, Any]]] | None = None,
) -> HttpServerHandle:
    """Bind ``host:port`` and serve /metrics, /healthz and /readyz (and /prompts when
    ``prompts`` is given: it returns the JSON-ready list) on a daemon thread. Binding errors
    (address in use) propagate as OSError."""
    server_cls = _Server6 if ":" in host else _Server
    server = server_cls((host, port), _Handler)
    server.metrics = metrics
    server.health = health
    server.prompts = prompts
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.1},  # bounds how long close() waits for the loop
        name="zerolayer-metrics-http",
        daemon=True,
    )
    thread.start()
    handle = HttpServerHandle(server, thread)
    log.info("metrics and health on http://%s:%d", host, handle.port)
    return handle
