"""The frame-protocol target: N connections carrying a run's streams, recording chunk times.

Each connection is an ``asyncio.BufferedProtocol`` around the sans-IO ``FrameDecoder``: received
bytes land in the decoder's buffer, and every frame of one read gets the same arrival time (read
once per read, not per frame). A TOKEN frame appends (time, n_ids) to its request's record; no
token ids, text or objects are kept, so the client stays cheap next to the server it measures.
Requests bypass the response cache (option bit 3) unless ``use_cache``; DONE's cache bit 0 marks
an answer that came from it anyway. Every connection starts with HELLO (the API key, or empty)
and waits for WELCOME, which names the model and its vocabulary (random token-id prompts stay
below it).

The frame protocol has no "ignore EOS" option: ``max_tokens`` and stop conditions are all a
REQUEST can say, so an EOS ends a stream early and the report counts it under finish_reasons.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl as ssl_module
from collections.abc import Callable, Iterator
from typing import Any, cast

from zerolayer.client.bench.endpoint import Endpoint
from zerolayer.client.bench.stats import RequestRecord
from zerolayer.client.bench.workload import WorkItem
from zerolayer.codes import FINISH_LABELS, ErrorCode, FrameType
from zerolayer.frames import protocol as p

_TOKEN, _DONE, _ERROR = int(FrameType.TOKEN), int(FrameType.DONE), int(FrameType.ERROR)
_WELCOME, _PING = int(FrameType.WELCOME), int(FrameType.PING)
_CODES = {int(c): c.name for c in ErrorCode}


def _error_kind(code: int) -> str:
    return _CODES.get(code, f"code_{code}")


class TargetError(Exception):
    """The target could not be reached or refused the run before any request (one line)."""


class _Conn(asyncio.BufferedProtocol):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._decoder = p.FrameDecoder("client", p.U32_MAX)
        self.streams: dict[int, tuple[RequestRecord, asyncio.Future[None]]] = {}
        self.ids = itertools.count(1)
        self.welcome: asyncio.Future[p.Welcome] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.lost: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.advance(nbytes)
        now = self._clock()
        try:
            while (frame := self._decoder.next_frame()) is not None:
                self._on_frame(now, *frame)
        except p.ProtocolError as exc:
            self._fail_all("protocol_error", str(exc))
            assert self.transport is not None
            self.transport.close()

    def _on_frame(self, now: float, ftype: int, _flags: int, sid: int, payload: memoryview) -> None:
        if ftype == _TOKEN:
            n = p.TOKEN_HEAD.unpack_from(payload)[0]
            entry = self.streams.get(sid)
            if entry is not None and n:
                entry[0].chunk_t.append(now)
                entry[0].chunk_k.append(n)
        elif ftype == _DONE:
            entry = self.streams.pop(sid, None)
            if entry is not None:
                rec, fut = entry
                done = p.parse_done(payload)
                rec.t_end = now
                rec.prompt_tokens = done.prompt_tokens
                rec.finish = FINISH_LABELS.get(done.finish_reason, str(done.finish_reason))
                rec.cached = bool(done.cache & p.CACHE_RESPONSE)
                if not fut.done():
                    fut.set_result(None)
        elif ftype == _ERROR:
            code, _, message = p.parse_error(payload)
            if sid == 0:
                if not self.welcome.done():
                    self.welcome.set_exception(TargetError(f"{_error_kind(code)}: {message}"))
                self._fail_all(_error_kind(code), message)
            elif (entry := self.streams.pop(sid, None)) is not None:
                entry[0].t_end = now
                entry[0].error = _error_kind(code)
                entry[0].message = message
                if not entry[1].done():
                    entry[1].set_result(None)
        elif ftype == _WELCOME:
            if not self.welcome.done():
                self.welcome.set_result(p.parse_welcome(payload))
        elif ftype == _PING:
            assert self.transport is not None
            self.transport.write(p.encode_pong(bytes(payload)))

    def _fail_all(self, kind: str, message: str) -> None:
        self.lost = f"{kind}: {message}"
        now = self._clock()
        for rec, fut in self.streams.values():
            rec.t_end = now
            rec.error = kind
            rec.message = message
            if not fut.done():
                fut.set_result(None)
        self.streams.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.welcome.done():
            self.welcome.set_exception(TargetError("the server closed the connection"))
        self._fail_all("connection_closed", str(exc or "closed by the server"))


class FrameTarget:
    """Sends WorkItems as REQUEST frames over ``connections`` connections, round robin."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ssl: ssl_module.SSLContext | None = None,
        connections: int = 1,
        api_key: str = "",
        text_deltas: bool = True,
        request_format: str = "auto",
        use_cache: bool = False,
        version: int = p.VERSION,
        clock: Callable[[], float],
    ) -> None:
        """``version``: the protocol version the HELLO asks for (a daemon of an older release
        speaks 1 only; this one speaks 1 and 2, and a run's requests use no version-2 field)."""
        self.endpoint = endpoint
        self._version = version
        self._cache = use_cache
        self._ssl = ssl
        self._n = max(1, connections)
        self._api_key = api_key
        self._text = text_deltas
        self._format = request_format
        self._clock = clock
        self._conns: list[_Conn] = []
        self._next: Iterator[_Conn] = itertools.cycle(())
        self.welcome: p.Welcome | None = None

    async def open(self, timeout: float = 10.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        hello = p.encode_hello(self._api_key, self._version)
        for _ in range(self._n):
            try:
                transport, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: _Conn(self._clock),
                        self.endpoint.host,
                        self.endpoint.port,
                        ssl=self._ssl,
                    ),
                    timeout,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                raise TargetError(f"cannot connect to {self.endpoint}: {exc}") from None
            transport.write(hello)  # the same transport conn holds
            self._conns.append(conn)
            try:
                self.welcome = await asyncio.wait_for(asyncio.shield(conn.welcome), timeout)
            except asyncio.TimeoutError:
                raise TargetError(f"{self.endpoint} sent no WELCOME within {timeout:g} s") from None
        self._next = itertools.cycle(self._conns)
        w = self.welcome
        assert w is not None
        return {"model_id": w.model, "vocab_size": w.vocab_size, "max_context": w.max_context}

    def encode(self, stream: int, item: WorkItem) -> bytes:
        as_json = self._format == "json" or (
            self._format == "auto" and (item.messages is not None or item.system is not None)
        )
        if not as_json:
            if item.messages is not None or item.system is not None:
                raise ValueError("binary requests carry no messages or system text: use json")
            prompt = item.prompt_ids if item.prompt_ids is not None else (item.prompt or "")
            return p.encode_request(
                stream,
                prompt,
                item.max_tokens,
                prompt_id=item.prompt_id,
                text_deltas=self._text,
                cache=self._cache,
            )
        request: dict[str, Any] = {"max_tokens": item.max_tokens}
        if not self._cache:
            request["cache"] = False
        if item.messages is not None:
            request["messages"] = item.messages
        elif item.prompt_ids is not None:
            raise ValueError("JSON requests carry text, not token ids: use binary")
        else:
            request["prompt"] = item.prompt or ""
        if item.system is not None:
            request["system"] = item.system
        if item.prompt_id:
            request["prompt_id"] = item.prompt_id
        return p.encode_json_request(stream, request)

    async def request(self, item: WorkItem, rec: RequestRecord) -> None:
        """Send ``item`` and return when its stream ends; ``rec`` holds what happened."""
        conn = next(self._next)
        if conn.lost is not None:
            rec.t_send = rec.t_end = self._clock()
            rec.error, rec.message = "connection_closed", conn.lost
            return
        sid = next(conn.ids)
        frame = self.encode(sid, item)
        fut = asyncio.get_running_loop().create_future()
        conn.streams[sid] = (rec, fut)
        rec.t_send = self._clock()
        assert conn.transport is not None  # open() connected every connection
        conn.transport.write(frame)
        try:
            await fut
        finally:
            if conn.streams.pop(sid, None) is not None and conn.lost is None:
                conn.transport.write(p.encode_cancel(sid))  # timed out or cancelled

    async def close(self) -> None:
        for conn in self._conns:
            if conn.transport is not None:
                conn.transport.close()
        await asyncio.sleep(0)
