"""The frame door: one uvloop listener, one BufferedProtocol per connection.

Owns the rules of docs/protocol.md that need connection state: HELLO/auth, stream ids,
per-connection stream limits, idle timeout, slow consumers, GOAWAY and the frame side of a drain
(the request path decides that it drains). Bytes arrive straight into each connection's
preallocated decoder buffer and are parsed in place; a REQUEST becomes a ``protocol.Request``
handed to the shared request path (zerolayer.request_path.lifecycle), which calls back this door's
``write_*`` methods. Engine steps reach the door through its encoder, ``TokenFrames`` (one per
engine row set): the TOKEN frames of its streams' rows, the ids of streams without text filled into
prebuilt frames with one numpy call per step. Output goes into the connection's FrameBuffer and
leaves with one ``transport.write`` per connection per delivery.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import fields
from ssl import SSLContext
from typing import cast

import numpy as np

from zerolayer.codes import FRAMES, ErrorCode, FinishReason, FrameType, Refusal, invalid
from zerolayer.config.settings import ServerConfig
from zerolayer.engine.backend import ModelInfo
from zerolayer.engine.step import NO_TOKEN, StepOutput
from zerolayer.frames import protocol as p
from zerolayer.frames import requests
from zerolayer.frames.framebuf import FrameBuffer
from zerolayer.frames.protocol import ProtocolError
from zerolayer.frames.wrong_door import SNIFF_BYTES
from zerolayer.hooks import HookError, Principal
from zerolayer.ops.metrics import Metrics
from zerolayer.ops.sockets import apply_socket_options, out_of_descriptors
from zerolayer.ops.tls import TlsListener, peer_names
from zerolayer.request_path.lifecycle import RequestPath
from zerolayer.request_path.request import Request
from zerolayer.request_path.stream import Stream

log = logging.getLogger("zerolayer.server")

_REPLAY_IDS_PER_FRAME = 256
# The sampling parameters a version 1 REQUEST can give; any other at a value other than its
# default needs version 2 (docs/protocol.md, "Versions").
_VERSION_1_SAMPLING = frozenset({"temperature", "top_p", "top_k", "seed"})
_IDLE_OUT_BYTES = 1024  # the write buffer an idle connection keeps


class Server:
    """Accepts frame connections. Lives on the event loop thread."""

    def __init__(
        self, cfg: ServerConfig, path: RequestPath, info: ModelInfo, metrics: Metrics
    ) -> None:
        self.cfg = cfg
        self.path = path
        self.metrics = metrics
        self.connections: set[Connection] = set()
        self.per_ip: collections.Counter[str] = collections.Counter()
        self.per_principal: collections.Counter[str] = collections.Counter()
        self.rx_excess = 0  # receive memory grown beyond read_buffer_bytes, all connections
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | TlsListener | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._all_closed = asyncio.Event()
        self._conn_ids = itertools.count(1)
        self._draining = False  # drain() ran
        # The WELCOME answering a HELLO of each version the server speaks (it names it).
        self.welcomes = {
            version: p.encode_welcome(
                cfg.max_frame_bytes, cfg.max_streams_per_connection, info.vocab_size,
                info.eos_token_id, info.max_context, info.name, version,
            )
            for version in p.SUPPORTED_VERSIONS
        }  # fmt: skip
        # first bytes -> the reply to a client at the wrong door (zerolayer.frames.wrong_door), or
        # None
        self.wrong_door: Callable[[bytes], bytes | None] | None = None
        self._m_bytes_out = metrics.bytes_out
        self._m_bytes_in = metrics.bytes_in

    @property
    def draining(self) -> bool:
        return self.path.draining

    # ------------------------------------------------------------------ lifecycle

    async def start(self, sock: socket.socket | None = None, ssl: SSLContext | None = None) -> None:
        """Listen on ``sock`` (or bind host:port); with ``ssl`` speak TLS only."""
        self.loop = asyncio.get_running_loop()
        if ssl is not None:  # the daemon always passes its bound socket
            assert sock is not None, "a TLS listener needs its bound socket"
            self._server = TlsListener(sock, lambda: Connection(self), ssl, "frame")
        elif sock is None:
            self._server = await self.loop.create_server(
                lambda: Connection(self),
                self.cfg.host,
                self.cfg.port,
                backlog=self.cfg.backlog,
                reuse_address=True,
                reuse_port=self.cfg.reuse_port or None,
            )
        else:
            self._server = await self.loop.create_server(
                lambda: Connection(self), sock=sock, backlog=self.cfg.backlog
            )
        self._sweeper = self.loop.create_task(self._sweep_idle())

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]  # (host, port[, ...])
        return port

    def next_conn_id(self) -> int:
        return next(self._conn_ids)

    async def drain(self) -> None:
        """The frame side of a drain (the request path drains from now on, for every door):
        stop accepting, GOAWAY everyone, finish streams in flight up to drain_timeout_s."""
        self.path.start_draining()
        if self._draining:
            return
        self._draining = True
        log.info("draining: %d connections", len(self.connections))
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway("server is draining")
        if self.connections:
            self._all_closed.clear()
            try:
                await asyncio.wait_for(self._all_closed.wait(), self.cfg.drain_timeout_s)
            except asyncio.TimeoutError:
                log.warning("drain deadline passed; ending %d connections", len(self.connections))
        for conn in list(self.connections):
            conn.end_all_streams(ErrorCode.SHUTTING_DOWN, "drain deadline passed")
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()

    def admit(self, conn: Connection, sock: object = None) -> tuple[ErrorCode, str] | None:
        """A new connection (its socket ``sock``) is counted in; returns why it must be refused,
        if it must. Near the descriptor limit every new one is refused, so the connections
        already open, the other doors and /readyz keep working. At ``max_connections`` the
        longest-idle connection (no stream, quiet for 1 s) makes room."""
        cfg = self.cfg
        self.connections.add(conn)
        self.metrics.connection_opened()
        self.per_ip[conn.peer_ip] += 1
        if out_of_descriptors(sock, "frame"):
            return ErrorCode.OVERLOADED, "the server is out of connection capacity"
        if cfg.max_connections_per_ip and self.per_ip[conn.peer_ip] > cfg.max_connections_per_ip:
            return ErrorCode.OVERLOADED, f"too many connections from {conn.peer_ip}"
        if len(self.connections) > cfg.max_connections:
            now = time.monotonic()
            idle = [c for c in self.connections if not c.streams and not c.closing]
            idle = [c for c in idle if c is not conn and now - c.last_activity >= 1.0]
            if not idle:
                return ErrorCode.OVERLOADED, "too many connections"
            oldest = min(idle, key=lambda c: c.last_activity)
            oldest.connection_error(
                ErrorCode.IDLE_TIMEOUT, "idle connection closed to make room for a new client"
            )
        return None

    def count_principal(self, conn: Connection, name: str) -> bool:
        """Count ``conn`` for principal ``name``; False when that is over the limit."""
        self.per_principal[name] += 1
        limit = self.cfg.max_connections_per_principal
        return not limit or self.per_principal[name] <= limit

    def connection_gone(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connection_closed()
            self._uncount(self.per_ip, conn.peer_ip)
            if conn.counted_principal is not None:
                self._uncount(self.per_principal, conn.counted_principal)
            self.rx_excess -= conn.rx_excess
            conn.rx_excess = 0
        if not self.connections:
            self._all_closed.set()

    def uncount_principal(self, name: str) -> None:
        self._uncount(self.per_principal, name)

    @staticmethod
    def _uncount(counter: collections.Counter[str], key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]

    async def _sweep_idle(self) -> None:
        timeout = self.cfg.idle_timeout_s
        interval = min(1.0, timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            hello_deadline = now - self.cfg.hello_timeout_s
            for conn in list(self.connections):
                if conn.principal is None and conn.opened_at < hello_deadline:
                    conn.connection_error(
                        ErrorCode.UNAUTHENTICATED,
                        f"no valid HELLO within {self.cfg.hello_timeout_s:g} s",
                    )
                elif not conn.streams and now - conn.last_activity > timeout:
                    conn.connection_error(
                        ErrorCode.IDLE_TIMEOUT, f"no frame for {timeout:g} s with no stream open"
                    )


class Connection(asyncio.BufferedProtocol):
    """One client connection: decodes frames in place; the frame door of the request path."""

    encoder: Callable[[list[Stream], list[int]], TokenFrames]  # Door.encoder (set below)

    def __init__(self, server: Server) -> None:
        self.server = server
        self.path = server.path
        cfg = server.cfg
        self.cfg = cfg
        self.conn_id = server.next_conn_id()
        self.label = str(self.conn_id)
        self.decoder = p.FrameDecoder("server", cfg.max_frame_bytes, cfg.read_buffer_bytes)
        self.streams: dict[int, Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.first_frame = True
        chain = server.path.chain
        self.principal: Principal | None = None if chain.auth_required else chain.anonymous()
        self.cert_principal: Principal | None = None  # a verified mTLS certificate's key
        self.closing = False
        self.slow = False
        self.version = 1  # the protocol version its HELLO asked for (1 without a HELLO)
        self.dirty = False
        self.last_activity = self.opened_at = time.monotonic()
        self.out = FrameBuffer(_IDLE_OUT_BYTES)
        self.peer_ip = ""
        self.counted_principal: str | None = None  # the principal this connection counts for
        self.rx_excess = 0  # receive memory beyond read_buffer_bytes (in Server.rx_excess)

    @property
    def open(self) -> bool:
        return not self.closing

    # ------------------------------------------------------------------ transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream server's transport is a Transport (BaseProtocol's signature says Base).
        self.transport = stream = cast(asyncio.Transport, transport)
        server = self.server
        peer = transport.get_extra_info("peername")
        self.peer_ip = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            apply_socket_options(sock, self.cfg)
        stream.set_write_buffer_limits(high=self.cfg.write_buffer_limit_bytes)
        refusal = server.admit(self, sock) or self._certificate(transport)
        if refusal is not None:
            self.connection_error(*refusal, retry_after_ms=1000)
        elif server.draining:
            self.goaway("server is draining")

    def _certificate(self, transport: asyncio.BaseTransport) -> tuple[ErrorCode, str] | None:
        """A verified client certificate that maps to a key stands for that key (counted like a
        HELLO's); returns a refusal when that principal has too many connections."""
        names = peer_names(transport)  # () unless TLS verified a client certificate
        principal = self.path.chain.on_certificate(names) if names else None
        if principal is None:
            return None
        self.cert_principal = self.principal = principal
        self.counted_principal = principal.name
        if not self.server.count_principal(self, principal.name):
            return ErrorCode.OVERLOADED, f"too many connections for principal {principal.name!r}"
        return None

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        if self.first_frame and not self.decoder.buffered and self.server.wrong_door is not None:
            # The connection's first bytes, at the buffer's start: HTTP or TLS gets its answer.
            reply = self.server.wrong_door(
                bytes(self.decoder.get_buffer()[: min(nbytes, SNIFF_BYTES)])
            )
            if reply is not None and self.transport is not None:
                self.transport.write(reply)
                self.close()
                return
        self.decoder.advance(nbytes)
        self.server._m_bytes_in.inc(nbytes)
        self.last_activity = time.monotonic()
        try:
            while (frame := self.decoder.next_frame()) is not None:
                self._on_frame(*frame)
                if self.closing:
                    break
        except ProtocolError as exc:
            self.connection_error(exc.code, exc.message)
        except Exception:
            log.exception("internal error handling a frame")
            self.connection_error(ErrorCode.INTERNAL, "internal server error")
        else:
            self._account_receive_memory()
        self.flush()

    def _account_receive_memory(self) -> None:
        """Give back a buffer grown for a large frame, and keep the daemon-wide total of grown
        receive buffers under max_pending_frame_bytes."""
        decoder = self.decoder
        decoder.shrink()
        excess = decoder.capacity - self.cfg.read_buffer_bytes
        if excess == self.rx_excess:
            return
        server = self.server
        server.rx_excess += excess - self.rx_excess
        self.rx_excess = excess
        limit = self.cfg.max_pending_frame_bytes
        if excess > 0 and server.rx_excess > limit:
            self.connection_error(
                ErrorCode.OVERLOADED,
                f"the server holds {limit} bytes of frames in transit; retry later",
                retry_after_ms=1000,
            )

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        for st in list(self.streams.values()):
            self.path.cancel(st)  # nothing is written: the door is closed
        self.server.connection_gone(self)

    def pause_writing(self) -> None:
        # The kernel stopped taking our bytes and the transport holds more than the limit.
        self.slow = True
        if self.streams:
            log.info("slow consumer: ending %d streams", len(self.streams))
            self.end_all_streams(ErrorCode.SLOW_CONSUMER, "client is not reading its output")

    def resume_writing(self) -> None:
        self.slow = False

    # ------------------------------------------------------------------ frames in

    def _on_frame(self, ftype: int, flags: int, stream: int, payload: memoryview) -> None:
        first = self.first_frame
        self.first_frame = False
        self.server.metrics.frames("in", ftype)
        if self.principal is None and ftype != FrameType.HELLO:
            # Auth is on and the first frame was not HELLO.
            self.connection_error(
                ErrorCode.UNAUTHENTICATED, "HELLO with a valid API key must be the first frame"
            )
            return
        if ftype == FrameType.REQUEST:
            self._on_request(stream, flags, payload)
        elif ftype == FrameType.CANCEL:
            p.check_cancel(payload)
            st = self.streams.get(stream)
            if st is not None:
                self.path.cancel(st)
        elif ftype == FrameType.PING:
            p.check_ping(payload)
            self._queue_frame(p.encode_pong(bytes(payload)), "PONG")
        elif ftype == FrameType.PONG:
            pass
        elif ftype == FrameType.HELLO:
            if not first:
                raise ProtocolError(ErrorCode.MALFORMED_FRAME, "HELLO is only allowed first")
            self._on_hello(payload)

    def _on_hello(self, payload: memoryview) -> None:
        version, key = p.parse_hello(payload)
        if version not in p.SUPPORTED_VERSIONS:
            speaks = " and ".join(map(str, p.SUPPORTED_VERSIONS))
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {version} not supported (this server speaks {speaks})",
            )
        self.version = version
        if not key and self.cert_principal is not None:  # the certificate stands for the key
            self._queue_frame(self.server.welcomes[version], "WELCOME")
            return
        try:
            # A certificate and a HELLO key must be the same key (both are credentials)
            principal = self.path.authenticate([key], self.cert_principal)
        except HookError as exc:
            self.connection_error(exc.code, exc.message, exc.retry_after_ms)
            return
        if self.counted_principal is not None:  # the certificate's principal, replaced
            self.server.uncount_principal(self.counted_principal)
        counted = principal.name
        if principal is self.path.chain.anonymous():  # no key: one bucket per address
            counted = f"{counted}@{self.peer_ip}"
        self.counted_principal = counted
        if not self.server.count_principal(self, counted):
            self.connection_error(
                ErrorCode.OVERLOADED,
                f"too many connections for principal {principal.name!r}",
                retry_after_ms=1000,
            )
            return
        self.principal = principal
        self._queue_frame(self.server.welcomes[version], "WELCOME")

    def _on_request(self, stream: int, flags: int, payload: memoryview) -> None:
        if stream in self.streams:
            raise ProtocolError(ErrorCode.STREAM_IN_USE, f"stream {stream} is already in flight")
        st = Stream(self, stream, FRAMES)
        self.streams[stream] = st
        if len(self.streams) > self.cfg.max_streams_per_connection:
            self.path.refuse(
                st,
                Refusal(
                    ErrorCode.TOO_MANY_STREAMS,
                    f"at most {self.cfg.max_streams_per_connection} streams per connection",
                ),
            )
            return
        if self.slow:
            self.path.refuse(
                st, Refusal(ErrorCode.SLOW_CONSUMER, "client is not reading its output")
            )
            return
        try:
            req = requests.parse_request(flags, payload)
            self._check_version(req)
        except Refusal as exc:
            self.path.refuse(st, exc)
            return
        assert self.principal is not None
        self.path.open(st, self.principal, req)

    def _check_version(self, req: Request) -> None:
        """The frame door's own rules on issue #27's fields (docs/protocol.md): they need
        protocol version 2 (a version 1 client could not read a LOGPROBS frame), and n > 1 is
        the HTTP door's (a frame stream is one choice)."""
        if req.n > 1:
            raise invalid(
                "n > 1 is served on the HTTP API; a frame stream is one choice "
                "(send n requests with their own seeds)",
                "n",
            )
        if self.version >= 2:
            return
        sampling = req.sampling
        for f in fields(sampling):
            if f.name not in _VERSION_1_SAMPLING and getattr(sampling, f.name) != f.default:
                raise invalid(f"{f.name} needs protocol version 2 (send HELLO version 2)", f.name)

    # ------------------------------------------------------------------ the door's writes

    def write_cached(self, st: Stream, ids: list[int], text: str) -> int:
        """The stored stream in frames of at most _REPLAY_IDS_PER_FRAME ids; the whole text
        rides on the last one."""
        data = text.encode("utf-8") if st.want_text else b""
        n = _REPLAY_IDS_PER_FRAME
        chunks = [ids[i : i + n] for i in range(0, len(ids), n)] or [[]]
        frames = 0
        for i, chunk in enumerate(chunks):
            last = data if i == len(chunks) - 1 else b""
            if chunk or last:
                self.out.token(st.key, chunk, last)
                frames += 1
        return frames

    def write_done(
        self, st: Stream, finish: FinishReason, timings: tuple[float, float, float]
    ) -> None:
        queue_s, ttft_s, total_s = timings
        self.out.done(
            st.key, int(finish), st.cache_bits, st.prompt_tokens, st.n_ids,
            int(queue_s * 1e6), int(ttft_s * 1e6), int(total_s * 1e6),
        )  # fmt: skip
        self.server.metrics.frames_out_done.inc()

    def write_error(self, st: Stream, error: Refusal) -> None:
        # The frame's message is the Refusal's, which names the field at fault (zerolayer.codes).
        if error.code == ErrorCode.UNAUTHENTICATED:  # the key was revoked by a reload
            self.connection_error(error.code, error.message)
            return
        frame = p.encode_error(st.key, error.code, error.message, error.retry_after_ms)
        self._queue_frame(frame, "ERROR")

    def stream_ended(self, st: Stream) -> None:
        if self.streams.get(st.key) is st:
            del self.streams[st.key]
        if not self.streams:
            self.last_activity = time.monotonic()
            if self.server.draining and not self.closing:
                self.flush()
                self.close()
            elif not self.dirty:  # idle: keep only a small write buffer
                self.out.shrink(_IDLE_OUT_BYTES)

    def flush(self) -> None:
        self.dirty = False
        data = self.out.take()  # taken first: write() may re-enter through pause_writing
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self.server._m_bytes_out.inc(len(data))

    # ------------------------------------------------------------------ connection-wide

    def _queue_frame(self, data: bytes, type_name: str) -> None:
        self.out.raw(data)
        self.server.metrics.frames("out", type_name)

    def end_all_streams(self, code: ErrorCode, message: str) -> None:
        """ERROR on every open stream (slow consumer, drain deadline); the connection stays."""
        for st in list(self.streams.values()):
            self.path.fail(st, Refusal(code, message))
        self.last_activity = time.monotonic()
        self.flush()

    def goaway(self, reason: str) -> None:
        self._queue_frame(p.encode_goaway(len(self.streams), reason), "GOAWAY")
        self.flush()
        if not self.streams:
            self.close()

    def connection_error(self, code: ErrorCode, message: str, retry_after_ms: int = 0) -> None:
        """ERROR on stream 0, then close; the stream-0 ERROR stands for every stream."""
        if self.closing:
            return
        self._queue_frame(p.encode_error(0, code, message, retry_after_ms), "ERROR")
        self.server.metrics.request_error(code.name)
        self.flush()
        self.close(code, message)

    def close(
        self, code: ErrorCode = ErrorCode.SHUTTING_DOWN, message: str = "connection closed"
    ) -> None:
        """Close; streams still open end with ``code`` (nothing more is written to them)."""
        if self.closing:
            return
        self.closing = True  # from here on the door writes nothing
        for st in list(self.streams.values()):
            self.path.fail(st, Refusal(code, message))
        if self.transport is not None:
            self.transport.close()
        self.server.connection_gone(self)  # counts and memory are released now, not at EOF


class TokenFrames:
    """The frame door's encoder (``Connection.encoder``) for its streams in one engine row set,
    whatever their connections.

    Streams that want no text get one-id TOKEN frames, prebuilt once (``protocol.token1_frames``)
    in one array grouped by connection: a step fills in the ids with one numpy call and hands
    each connection its span of bytes. Streams that want text get a frame per step with their id
    and text delta (or the text alone when the step produced no id)."""

    __slots__ = ("perm", "n", "frames", "spans", "text_rows", "doors", "logprobs")

    def __init__(self, streams: list[Stream], rows: list[int]) -> None:
        by_conn: dict[Connection, list[tuple[int, int]]] = {}
        self.text_rows: list[tuple[int, Stream]] = []
        self.logprobs = False  # some stream wants LOGPROBS frames (it is then a text row)
        for st, i in zip(streams, rows, strict=True):
            lp = st.seq is not None and st.seq.sampling.logprobs
            self.logprobs |= lp
            if st.want_text or lp:
                self.text_rows.append((i, st))
            else:
                # Ignored: a frame encoder's streams are on Connections (Fanout groups by encoder).
                by_conn.setdefault(st.door, []).append((i, st.key))  # type: ignore[arg-type]
        order = [i for plain in by_conn.values() for i, _ in plain]
        keys = [key for plain in by_conn.values() for _, key in plain]
        self.n = len(order)
        # The rows' ids as they are when they are the step's first rows, in order; else taken.
        self.perm = None if order == list(range(self.n)) else np.array(order, np.intp)
        self.frames = p.token1_frames(np.array(keys, np.int64))
        view = self.frames.reshape(-1).view(np.uint8).data  # its memoryview
        self.spans: list[tuple[Connection, int, int, memoryview]] = []
        start = 0
        for conn, plain in by_conn.items():
            end = start + len(plain)
            size = p.TOKEN1_FRAME_SIZE
            self.spans.append((conn, start, end, view[start * size : end * size]))
            start = end
        self.doors = [conn for conn in by_conn] + [st.door for _, st in self.text_rows]

    def write(self, step: StepOutput) -> int:
        n = 0
        if self.n:
            ids = step.tokens[: self.n] if self.perm is None else step.tokens[self.perm]
            self.frames[:, p.TOKEN1_ID] = ids
            if step.quiet and (ids == NO_TOKEN).any():  # rows that ended without a token
                for conn, start, end, _ in self.spans:
                    keep = ids[start:end] != NO_TOKEN
                    frames = self.frames[start:end][keep]
                    conn.out.append(memoryview(frames.reshape(-1).view(np.uint8)))
                    n += len(frames)
            else:
                for conn, _, _, span in self.spans:
                    conn.out.append(span)
                n = self.n
        if self.text_rows:
            tokens, text = step.tokens, step.text
            for i, st in self.text_rows:
                token = int(tokens[i])
                data = text.get(i, "").encode("utf-8")
                # The ignores here and below: a text row's door is a Connection, as above.
                out = st.door.out  # type: ignore[attr-defined]
                if token != NO_TOKEN:
                    out.token(st.key, (token,), data)
                    lp = step.logprobs.get(i) if self.logprobs else None
                    if lp is not None:  # beside the TOKEN frame of its id
                        st.door.server.metrics.frames_out_logprobs.inc()  # type: ignore[attr-defined]
                        out.raw(
                            p.encode_logprobs(
                                st.key, np.array([lp.token], np.float32), lp.top_ids[None, :],
                                lp.top[None, :],
                            )
                        )  # fmt: skip
                elif data:
                    out.token(st.key, (), data)
                else:
                    continue
                n += 1
        return n


Connection.encoder = TokenFrames
