"""The HTTP/1.1 listener: one asyncio.Protocol per connection on the daemon's uvloop loop,
requests parsed by httptools (llhttp), answered by the connection's ``handle`` (the door,
gateway/zerolayer/http/door.py, subclasses HttpConnection).

Owns what is HTTP and nothing else: keep-alive, pipelined requests answered one at a time in
order, bounded bodies (``http.max_body_bytes`` → 413 and close, checked against Content-Length
before the body is read), header and body timeouts (``http.header_timeout_s``,
``http.body_timeout_s`` → 408 and close, or a silent close of an idle keep-alive connection),
``Expect: 100-continue``, chunked streaming responses, and bytes that are not HTTP (400 and
close). Output goes into one write buffer per connection and leaves with one ``transport.write``
per ``flush`` (the door flushes once per engine delivery); a streamed response's bytes since
the last flush form one HTTP chunk, its size patched in place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from email.utils import formatdate
from ssl import SSLContext
from typing import cast

import httptools

from zerolayer.codes import ErrorCode
from zerolayer.config.settings import HttpConfig
from zerolayer.http.errors import OPENAI, REASONS, HttpError, error_body, status_for
from zerolayer.ops.escape import client_text
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.sockets import SocketTuning, apply_socket_options, out_of_descriptors
from zerolayer.ops.tls import TlsListener

log = logging.getLogger("zerolayer.http")

MAX_HEAD_BYTES = 65536  # request line + headers; beyond it 431 and close
MAX_PIPELINED = 32  # requests read ahead of the one being answered before reading pauses
# Headers the door reads; others are not kept.
WANTED_HEADERS = frozenset(
    {
        b"content-type",
        b"content-length",
        b"authorization",
        b"x-api-key",
        b"expect",
        b"anthropic-version",
        b"cache-control",
        b"origin",
        b"access-control-request-method",
        b"access-control-request-headers",
    }
)
_CREDENTIALS = (b"x-api-key", b"authorization")
_CHUNK_HOLE = b"00000000\r\n"  # a chunk's size line, patched at flush (leading zeros are valid)
_CHUNK_HOLE_LEN = len(_CHUNK_HOLE)
RETRY_AFTER_S = 1  # the Retry-After of a connection or body refused for capacity
# The answer when building the proper one failed: fixed bytes that cannot fail.
_LAST_BODY = b'{"error":{"message":"internal server error","type":"server_error"}}'
_LAST_RESORT = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_LAST_BODY), _LAST_BODY)
)


class Incoming:
    """One parsed request. ``api`` picks the error shape (set by the router)."""

    __slots__ = (
        "method",
        "path",
        "headers",
        "body",
        "keep_alive",
        "t_recv",
        "api",
        "state",
        "held",
        "repeated",
    )

    def __init__(self, t_recv: float) -> None:
        self.method = b""
        self.path = b""
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.keep_alive = True
        self.t_recv = t_recv
        self.api = OPENAI
        self.state: object = None  # the door's per-request object
        self.held = 0  # body bytes counted in HttpServer.body_bytes for this request
        # Credential headers after the first of their name: every credential is checked
        self.repeated: list[tuple[bytes, bytes]] = []

    def credential_headers(self) -> list[tuple[bytes, bytes]]:
        """Each ``x-api-key`` and ``authorization`` header, a repeated one included."""
        found = [(n, v) for n in _CREDENTIALS if (v := self.headers.get(n)) is not None]
        return found + self.repeated


class HttpServer:
    """The listener and its connections; lives on the event loop. ``make_connection(server)``
    builds the protocol of each accepted connection (an HttpConnection subclass)."""

    def __init__(
        self,
        cfg: HttpConfig,
        make_connection: Callable[[HttpServer], HttpConnection],
        write_buffer_limit: int,
        metrics: Metrics | None = None,
        max_body_bytes: int = 0,
    ) -> None:
        """``max_body_bytes``: the body limit when ``cfg.max_body_bytes`` is 0 (the daemon
        derives it from the context)."""
        self.cfg = cfg
        self.max_body_bytes = cfg.max_body_bytes or max_body_bytes
        assert self.max_body_bytes > 0, "http.max_body_bytes = 0 needs the derived limit"
        self.make_connection = make_connection
        self.metrics = metrics
        self.write_buffer_limit = write_buffer_limit
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self.date = formatdate(usegmt=True).encode()
        self._server: asyncio.Server | TlsListener | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self.socket_options: SocketTuning | None = None  # ServerConfig, if any
        self._ids = 0
        self.per_ip: collections.Counter[str] = collections.Counter()
        self.body_bytes = 0  # request-body bytes held by all connections (reserved or read)

    async def start(self, sock: socket.socket | None = None, ssl: SSLContext | None = None) -> None:
        """Listen (on ``sock`` when given); with ``ssl`` every connection speaks TLS only."""
        loop = asyncio.get_running_loop()
        if ssl is not None:  # the daemon always passes its bound socket
            assert sock is not None, "a TLS listener needs its bound socket"
            self._server = TlsListener(sock, lambda: self.make_connection(self), ssl, "HTTP")
        elif sock is None:
            self._server = await loop.create_server(
                lambda: self.make_connection(self), self.cfg.host, self.cfg.port,
                reuse_address=True,
            )  # fmt: skip
        else:
            self._server = await loop.create_server(lambda: self.make_connection(self), sock=sock)
        self._sweeper = loop.create_task(self._sweep())

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]  # (host, port[, ...])
        return port

    async def _sweep(self) -> None:
        interval = min(1.0, self.cfg.header_timeout_s / 4, self.cfg.body_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.date = formatdate(usegmt=True).encode()
            now = time.monotonic()
            for conn in list(self.connections):
                if conn.deadline and now > conn.deadline:
                    conn.timed_out()

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def drain(self, timeout: float) -> None:
        """Stop accepting; close idle connections now, the others once their response ends
        (each closes after it: ``connection: close``); at ``timeout`` the responses still
        running are ended (``abort_active``) and every connection closes."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close_after = True
            if conn.active is None:
                conn.close()
        if self.connections:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("http drain deadline passed; ending %d", len(self.connections))
        for conn in list(self.connections):
            if conn.active is not None:
                conn.abort_active()
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    def admit(self, conn: HttpConnection, sock: object) -> str:
        """Count a new connection in; returns why it must be refused ("" = admitted)."""
        self.connections.add(conn)
        self.per_ip[conn.peer_ip] += 1
        cfg = self.cfg
        if out_of_descriptors(sock, "HTTP"):
            return "the server is out of connection capacity"
        if cfg.max_connections_per_ip and self.per_ip[conn.peer_ip] > cfg.max_connections_per_ip:
            return f"too many connections from {conn.peer_ip}"
        if len(self.connections) > cfg.max_connections:
            return "too many connections"
        return ""

    def hold_body(self, conn: HttpConnection, n: int) -> bool:
        """Count ``n`` more request-body bytes held by ``conn``; False (nothing counted) when
        that would pass ``http.max_body_bytes_in_flight``."""
        limit = self.cfg.max_body_bytes_in_flight
        if limit and n > 0 and self.body_bytes + n > limit:
            return False
        self.body_bytes += n
        conn.held += n
        return True

    def release_body(self, conn: HttpConnection, n: int) -> None:
        n = min(n, conn.held)
        self.body_bytes -= n
        conn.held -= n

    def gone(self, conn: HttpConnection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.per_ip[conn.peer_ip] -= 1
            if self.per_ip[conn.peer_ip] <= 0:
                del self.per_ip[conn.peer_ip]
        self.release_body(conn, conn.held)
        if not self.connections:
            self._idle.set()


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order, one write per flush.

    Subclasses answer by overriding ``handle`` (and ``disconnected``, ``slow_stream``,
    ``abort_active`` for a response that is still running)."""

    api_label = "openai"  # the api label of errors counted before a request is routed

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.cfg = server.cfg
        self.conn_id = server.next_id()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Incoming] = deque()  # complete requests waiting for their turn
        self.active: Incoming | None = None  # the request being answered
        self.cur: Incoming | None = None  # the request being parsed
        self.closing = False
        self.paused = False
        self.slow = False  # the transport holds more than write_buffer_limit
        self.deadline = 0.0  # monotonic time of the current timeout; 0 = none
        self.head_bytes = 0
        self.header_name = b""
        self.out = bytearray()
        self.streaming = False  # a streamed response is open
        self.chunked = False
        self.chunk_at = -1  # offset of the open chunk's size line in ``out``; -1 = none
        self.close_after = False  # close once the active response ends
        self.extra_head = b""  # header lines for every response to the active request (CORS)
        self.dirty = False  # in the door's list of connections to flush
        self.peer_ip = "?"
        self.held = 0  # request-body bytes this connection holds (HttpServer.body_bytes)
        self.in_head = True  # the bytes arriving are a request line / headers
        self.head_fed = 0  # bytes fed to the parser since the current head began

    # ------------------------------------------------------------------ transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport is a Transport (BaseProtocol's signature says Base).
        self.transport = stream = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer_ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        sock = transport.get_extra_info("socket")
        refusal = self.server.admit(self, sock)
        if refusal:
            self._refuse_connection(refusal)
            return
        if self.server.socket_options is not None and sock is not None:
            apply_socket_options(sock, self.server.socket_options)
        stream.set_write_buffer_limits(high=self.server.write_buffer_limit)
        self.deadline = time.monotonic() + self.cfg.header_timeout_s

    def _refuse_connection(self, reason: str) -> None:
        """503 with Retry-After before reading anything, then close."""
        self.closing = self.close_after = True
        self.active = Incoming(time.perf_counter())
        self.respond_error(
            HttpError(503, reason, retry_after_ms=RETRY_AFTER_S * 1000, close=True), advance=False
        )
        self.active = None
        self.close()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self._feed(memoryview(data))
        except httptools.HttpParserUpgrade:
            if self.cur is None:  # the request is complete: answered as HTTP/1.1, then close
                self.closing = self.close_after = True
                if self.active is None and not self.queue:
                    self.close()
            else:
                self._fail(HttpError(400, "protocol upgrades are not supported", close=True))
        except httptools.HttpParserCallbackError:
            log.exception("internal error parsing a request")
            self._fail(HttpError(500, "internal server error", close=True))
        except httptools.HttpParserError as exc:
            self._fail(
                HttpError(
                    400,
                    client_text(f"malformed HTTP request: {exc}"),
                    close=True,
                    error=ErrorCode.MALFORMED_FRAME,
                )
            )
        except Exception:  # the guard: whatever failed, the client gets an answer or a close
            log.exception("internal error reading a request")
            self._last_resort()
            return
        self.flush()

    def _feed(self, data: memoryview) -> None:
        """Feed the parser; bytes of a request head are counted as they arrive, so a head
        over MAX_HEAD_BYTES is refused before the parser accumulates more of it."""
        while data and not self.closing:
            if not self.in_head:
                self.parser.feed_data(data)
                return
            room = MAX_HEAD_BYTES + 1 - self.head_fed
            piece, data = data[:room], data[room:]
            self.head_fed += len(piece)
            self.parser.feed_data(piece)
            if self.in_head and self.head_fed > MAX_HEAD_BYTES and not self.closing:
                self._fail(HttpError(431, "request headers too large", close=True))
                return

    def _last_resort(self) -> None:
        """An answer that cannot fail, then close: for an error on the error path itself."""
        self.closing = self.close_after = True
        self.out.clear()
        self.queue.clear()
        self.streaming = False
        if self.transport is not None:
            self.transport.write(_LAST_RESORT)
            self.transport.close()

    def eof_received(self) -> bool:
        # The client half-closed: answer what it sent (pipelined requests), then close.
        self.close_after = True
        if self.active is None and not self.queue:
            self.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.transport = None
        active, self.active = self.active, None
        self.queue.clear()
        try:
            if active is not None:
                self.disconnected(active)
        finally:
            self.server.gone(self)

    # ------------------------------------------------------------------ what subclasses answer

    def handle(self, request: Incoming) -> None:
        """Answer ``request``: now (``respond``) or later (``start_stream`` ... ``end_stream``,
        or ``respond`` with ``advance=False`` and ``advance()`` once done)."""
        raise HttpError(404, "no such endpoint")

    def api_of(self, path: bytes) -> str:
        """The API whose error shape a request to ``path`` gets."""
        return OPENAI

    def disconnected(self, request: Incoming) -> None:
        """The client went away while ``request`` was being answered."""

    def slow_stream(self, request: Incoming) -> None:
        """The client stopped reading ``request``'s stream (the connection closes after it)."""

    def abort_active(self) -> None:
        """The drain deadline passed while the active request was being answered."""

    def pause_writing(self) -> None:
        # The kernel stopped taking our bytes and the transport holds more than the limit.
        self.slow = True
        if self.active is not None and self.streaming:
            self.close_after = True
            self.slow_stream(self.active)

    def resume_writing(self) -> None:
        self.slow = False

    # ------------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self.cur = Incoming(time.perf_counter())
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        assert self.cur is not None
        self.cur.path += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        name = name.lower()
        cur = self.cur
        if name in WANTED_HEADERS and cur is not None:
            if name in _CREDENTIALS and name in cur.headers:
                cur.repeated.append((name, value))  # not overwritten: each one is checked
                return
            cur.headers[name] = value

    def on_headers_complete(self) -> None:
        cur = self.cur
        assert cur is not None
        cur.method = self.parser.get_method()
        cur.path = cur.path.split(b"?", 1)[0]
        cur.keep_alive = self.parser.should_keep_alive()
        cur.api = self.api_of(cur.path)  # the shape of any error, even before routing
        self.in_head = False
        if self.head_bytes > MAX_HEAD_BYTES:
            self._refuse_unread(HttpError(431, "request headers too large", close=True))
            return
        length = cur.headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.server.max_body_bytes:
            self._refuse_unread(self._too_large())
            return
        if length.isdigit():
            if not self.server.hold_body(self, int(length)):
                self._refuse_unread(self._no_room())
                return
            cur.held = int(length)
        if self.active is None:
            self.deadline = time.monotonic() + self.cfg.body_timeout_s
        if cur.headers.get(b"expect", b"").lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        cur = self.cur
        if cur is None:
            return
        if len(cur.body) + len(body) > self.server.max_body_bytes:
            self._refuse_unread(self._too_large())
            return
        if b"content-length" not in cur.headers:  # a chunked body: counted as it arrives
            if not self.server.hold_body(self, len(body)):
                self._refuse_unread(self._no_room())
                return
            cur.held += len(body)
        cur.body += body

    def _no_room(self) -> HttpError:
        limit = self.cfg.max_body_bytes_in_flight
        return HttpError(
            503,
            f"the server holds {limit} bytes of request bodies; retry later",
            retry_after_ms=RETRY_AFTER_S * 1000,
            close=True,
        )

    def _too_large(self) -> HttpError:
        limit = self.server.max_body_bytes
        return HttpError(413, f"request body exceeds http.max_body_bytes ({limit})", close=True)

    def on_message_complete(self) -> None:
        cur, self.cur = self.cur, None
        self.in_head = True
        self.head_fed = 0
        if cur is None or self.closing:
            return
        self.queue.append(cur)
        if len(self.queue) >= MAX_PIPELINED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        if self.active is None:
            self._next()

    def _refuse_unread(self, err: HttpError) -> None:
        """A request we will not read to its end: answered after those before it, then close."""
        cur, self.cur = self.cur, None
        self.closing = True  # parse nothing more
        self.close_after = True
        if cur is None:
            cur = Incoming(time.perf_counter())
        cur.state = err
        self.queue.append(cur)
        if self.active is None:
            self._next()

    # ------------------------------------------------------------------ answering, in order

    def _next(self) -> None:
        """Answer the queued requests in order until one stays open (a stream, hooks)."""
        while self.active is None and self.queue:
            request = self.queue.popleft()
            self.active = request
            self.deadline = 0.0
            if isinstance(request.state, HttpError):
                self._release(request)
                self._answer_error(request.state)
                continue
            try:
                try:
                    self.handle(request)
                finally:  # the body is parsed (or refused): it no longer counts as in flight
                    self._release(request)
            except HttpError as err:
                self._answer_error(err)
            except Exception:
                log.exception("internal error answering %r", request.path)
                self._answer_error(HttpError(500, "internal server error"))
        if self.active is None:
            if self.close_after:
                self.flush()
                self.close()
                return
            if self.paused and self.transport is not None and not self.closing:
                self.paused = False
                self.transport.resume_reading()
            self.deadline = time.monotonic() + (
                self.cfg.body_timeout_s
                if self.cur is not None and self.cur.method
                else self.cfg.header_timeout_s
            )

    def _release(self, request: Incoming) -> None:
        self.server.release_body(self, request.held)
        request.held = 0
        request.body = bytearray()

    def _answer_error(self, err: HttpError) -> None:
        """``respond_error``, guarded: if even that fails, the fixed 500 and close."""
        try:
            self.respond_error(err)
        except Exception:
            log.exception("internal error answering with an error")
            self._last_resort()
            self.active = None

    def _head(self, status: int, content_type: bytes, length: int, extra: bytes) -> None:
        request = self.active
        keep = (
            request is not None
            and request.keep_alive
            and not self.close_after
            and not self.server.draining
        )
        if not keep:
            self.close_after = True
        out = self.out
        out += b"HTTP/1.1 %d %s\r\ndate: %s\r\ncontent-type: %s\r\n" % (
            status,
            REASONS.get(status, b"Unknown"),
            self.server.date,
            content_type,
        )
        if length >= 0:
            out += b"content-length: %d\r\n" % length
        elif self.chunked:
            out += b"transfer-encoding: chunked\r\n"
        if not keep:
            out += b"connection: close\r\n"
        out += extra
        out += self.extra_head
        out += b"\r\n"

    def respond(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        extra: bytes = b"",
        advance: bool = True,
    ) -> None:
        """A whole response to the active request. With ``advance`` the next request is
        answered at once; else the caller calls ``advance()`` when it is done with this one."""
        self._head(status, content_type, len(body), extra)
        self.out += body
        if advance:
            self.advance()

    def respond_error(self, err: HttpError, advance: bool = True, counted: bool = False) -> None:
        """``err`` in the active request's API shape, as a whole response; counted in the
        request error metrics unless the caller (the request path) already did."""
        api = self.active.api if self.active is not None else OPENAI
        if not counted and self.server.metrics is not None:
            self.server.metrics.request_error(err.error, api)
        if err.close:
            self.close_after = True
        extra = b""
        if err.retry_after_ms:
            extra += b"retry-after: %d\r\n" % max(1, -(-err.retry_after_ms // 1000))
            extra += b"retry-after-ms: %d\r\n" % err.retry_after_ms
        if err.allow:
            extra += b"allow: %s\r\n" % err.allow.encode()
        self.respond(
            status_for(api, err.status), error_body(api, err), extra=extra, advance=advance
        )

    def start_stream(self, content_type: bytes = b"text/event-stream", extra: bytes = b"") -> None:
        """Open a streamed response: write events into ``out``; ``end_stream`` ends it."""
        self.chunked = self.parser.get_http_version() == "1.1"
        if not self.chunked:  # HTTP/1.0: the body ends when the connection does
            self.close_after = True
        self._head(200, content_type, -1, b"cache-control: no-cache\r\n" + extra)
        self.streaming = True
        if self.chunked:
            self.chunk_at = len(self.out)
            self.out += _CHUNK_HOLE

    def end_stream(self, advance: bool = True) -> None:
        """The last bytes of the streamed response are in ``out``: close it."""
        if self.chunked:
            self._close_chunk()
            self.out += b"0\r\n\r\n"
        self.streaming = False
        self.chunked = False
        if advance:
            self.advance()

    def advance(self) -> None:
        """The active request is answered: go on with the next one."""
        self.active = None
        if not self.closing or self.close_after:
            self._next()

    def _close_chunk(self) -> None:
        at = self.chunk_at
        if at < 0:
            return
        self.chunk_at = -1
        size = len(self.out) - at - _CHUNK_HOLE_LEN
        if size == 0:
            del self.out[at:]
        else:
            self.out[at : at + 8] = b"%08x" % size
            self.out += b"\r\n"

    def flush(self) -> None:
        """Write what is buffered: one ``transport.write``."""
        self.dirty = False
        chunked = self.streaming and self.chunked
        if chunked:
            self._close_chunk()
        if self.out:
            if self.transport is not None:
                data, self.out = self.out, bytearray()  # the transport may keep what it can't send
                self.transport.write(data)
            else:
                self.out.clear()
        if chunked:  # the next bytes of the stream open a new chunk
            self.chunk_at = 0
            self.out += _CHUNK_HOLE

    def timed_out(self) -> None:
        self.deadline = 0.0
        if self.active is not None:
            return
        if self.cur is None:  # idle between requests: nothing to answer
            self.close()
            return
        self._refuse_unread(HttpError(408, "request not received in time", close=True))
        self.flush()

    def _fail(self, err: HttpError) -> None:
        if self.active is None and not self.queue:
            request, self.cur = self.cur, None
            self.closing = True
            self.close_after = True
            self.active = request if request is not None else Incoming(time.perf_counter())
            self.respond_error(err)
        else:  # answer the requests before it first
            self._refuse_unread(err)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            if self.out:
                data, self.out = self.out, bytearray()
                self.transport.write(data)
            self.transport.close()
