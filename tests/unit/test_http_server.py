"""The HTTP/1.1 shell (gateway/zerolayer/http/server.py) over real loopback sockets, with a small
test App on an in-process uvloop loop: keep-alive, pipelining in order, chunked streams, body
limits, timeouts, garbage, disconnects. Responses are read with h11, a strict independent parser."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import uvloop

from tests.support.rawhttp import RawHttp
from zerolayer.config.settings import HttpConfig
from zerolayer.http.errors import HttpError
from zerolayer.http.server import HttpConnection, HttpServer, Incoming


class Seen:
    """What the test connections report."""

    def __init__(self) -> None:
        self.disconnected_paths: list[bytes] = []
        self.loop: asyncio.AbstractEventLoop | None = None


class EchoConnection(HttpConnection):
    """/echo answers the body; /stream sends N events over N loop turns; /boom raises."""

    seen: Seen

    def handle(self, request: Incoming) -> None:
        conn = self
        if request.path == b"/echo":
            conn.respond(200, bytes(request.body), b"application/octet-stream")
        elif request.path == b"/stream":
            n = int(request.body or b"3")
            conn.start_stream()
            assert self.seen.loop is not None
            self.seen.loop.call_soon(self._event, request, 0, n)
        elif request.path == b"/boom":
            raise RuntimeError("app bug")
        elif request.path == b"/refuse":
            raise HttpError(429, "slow down", retry_after_ms=1500)
        else:
            raise HttpError(404, "nope")

    def _event(self, request: Incoming, i: int, n: int) -> None:
        conn = self
        if conn.active is not request:  # the client went away
            return
        conn.flush()  # a flush with nothing new must not break the chunk framing
        conn.out += b"data: %d\n\n" % i
        if i + 1 == n:
            conn.end_stream()
        conn.flush()
        if i + 1 < n:
            assert self.seen.loop is not None
            self.seen.loop.call_later(0.001, self._event, request, i + 1, n)

    def disconnected(self, request: Incoming) -> None:
        self.seen.disconnected_paths.append(request.path)


@pytest.fixture
def server():
    app = Seen()
    cfg = HttpConfig(
        enabled=True, port=0, max_body_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5
    )
    started = threading.Event()
    holder: dict = {}

    def run() -> None:
        async def main() -> None:
            app.loop = asyncio.get_running_loop()
            EchoConnection.seen = app
            srv = HttpServer(cfg, EchoConnection, write_buffer_limit=65536)
            await srv.start()
            holder["server"], holder["stop"] = srv, asyncio.Event()
            holder["loop"] = app.loop
            started.set()
            await holder["stop"].wait()
            await srv.drain(1.0)

        uvloop.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield holder["server"], app
    holder["loop"].call_soon_threadsafe(holder["stop"].set)
    thread.join(10)


def client(server) -> RawHttp:
    return RawHttp("127.0.0.1", server[0].port)


def test_keep_alive_serves_many_requests_on_one_connection(server):
    c = client(server)
    for i in range(5):
        c.request("POST", "/echo", b"hello %d" % i, {"content-type": "text/plain"})
        r = c.response()
        assert (r.status, r.body) == (200, b"hello %d" % i)
        assert r.headers["content-length"] == str(len(r.body))
        assert "connection" not in r.headers
    c.request("POST", "/stream", b"4")
    r = c.response()
    assert r.headers["transfer-encoding"] == "chunked"
    assert r.body == b"".join(b"data: %d\n\n" % i for i in range(4))
    c.request("POST", "/echo", b"after the stream")
    assert c.response().body == b"after the stream"


def test_pipelined_requests_are_answered_in_order(server):
    c = client(server)
    req = b"POST /%s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
    c.send(
        req % (b"stream", 2, b"20")
        + req % (b"echo", 3, b"one")
        + req % (b"missing", 0, b"")
        + req % (b"echo", 3, b"two")
    )
    bodies = []
    for _ in range(4):
        c.expect_raw()
        r = c.response()
        bodies.append((r.status, r.body))
    assert bodies[0] == (200, b"".join(b"data: %d\n\n" % i for i in range(20)))
    assert bodies[1:] == [(200, b"one"), (404, bodies[2][1]), (200, b"two")]
    assert b"nope" in bodies[2][1]


def test_streamed_bytes_leave_as_one_chunk_per_flush(server):
    c = client(server)
    c.request("POST", "/stream", b"5")
    r = c.response()
    assert r.chunks == [b"data: %d\n\n" % i for i in range(5)]


def test_body_limit_is_413_and_close(server):
    # Content-Length over the limit: refused from the headers, before any body byte is sent.
    c = client(server)
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n")
    c.expect_raw()
    r = c.response()
    assert r.status == 413 and r.headers["connection"] == "close"
    assert "max_body_bytes" in r.json()["error"]["message"]
    assert c.closed()
    # A chunked body that grows past it.
    c = client(server)
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    c.send(b"800\r\n" + b"a" * 2048 + b"\r\n" + b"801\r\n" + b"a" * 2049 + b"\r\n")
    c.expect_raw()
    assert c.response().status == 413
    assert c.closed()
    # At the limit is fine, chunked or not.
    c = client(server)
    c.request("POST", "/echo", b"b" * 4096)
    assert c.response().body == b"b" * 4096


def test_garbage_is_400_and_close_and_the_server_goes_on(server):
    for junk in (
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        b"GET / HTTP/9.9\r\n\r\n",
        b"\r\n\r\n\x00\x01",
    ):
        c = client(server)
        c.send(junk)
        c.expect_raw()
        r = c.response()
        assert r.status == 400 and "malformed HTTP" in r.json()["error"]["message"]
        assert c.closed()
    c = client(server)
    c.request("POST", "/echo", b"still here")
    assert c.response().body == b"still here"


def test_slow_headers_and_bodies_time_out(server):
    c = client(server)
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # headers never finish
    c.expect_raw()
    r = c.response()
    assert r.status == 408
    assert c.closed()
    c = client(server)
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
    c.expect_raw()
    assert c.response().status == 408
    assert c.closed()
    # An idle keep-alive connection is closed without an answer.
    c = client(server)
    c.request("POST", "/echo", b"x")
    assert c.response().status == 200
    t0 = time.monotonic()
    assert c.closed()
    assert time.monotonic() - t0 < 5


def test_expect_100_continue_and_http_1_0(server):
    c = client(server)
    c.request("POST", "/echo", b"body", {"expect": "100-continue"})
    assert c.response().body == b"body"
    c = client(server)
    c.send(b"POST /stream HTTP/1.0\r\ncontent-length: 1\r\n\r\n3")
    c.expect_raw()
    r = c.response()
    assert "transfer-encoding" not in r.headers and r.headers["connection"] == "close"
    assert r.body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert c.closed()


def test_app_errors_are_answered_and_contained(server):
    c = client(server)
    c.request("POST", "/boom", b"")
    r = c.response()
    assert r.status == 500 and r.json()["error"]["type"] == "server_error"
    c.request("POST", "/refuse", b"")
    r = c.response()
    assert r.status == 429
    assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("2", "1500")
    c.request("POST", "/echo", b"ok")
    assert c.response().body == b"ok"


def test_header_block_too_large_is_431(server):
    c = client(server)
    c.send(b"POST /echo HTTP/1.1\r\nhost: x\r\n" + b"x-pad: " + b"a" * 70_000 + b"\r\n\r\n")
    c.expect_raw()
    assert c.response().status == 431
    assert c.closed()


def test_client_disconnect_mid_stream_reaches_the_app(server):
    srv, app = server
    c = client(server)
    c.request("POST", "/stream", b"100000")
    c.sock.recv(100)  # the stream has started
    c.close()
    deadline = time.monotonic() + 5
    while b"/stream" not in app.disconnected_paths and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.disconnected_paths == [b"/stream"]
    deadline = time.monotonic() + 5
    while srv.connections and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not srv.connections
