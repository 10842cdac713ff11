"""Client library: an asyncio client (one connection, many concurrent streams) and a sync wrapper.

    async with await Client.connect("tcp://127.0.0.1:7070") as client:
        stream = await client.generate("hello", max_tokens=32, text=True)
        async for event in stream:
            print(event.text, end="")
        print(stream.result.finish_reason)

Errors arrive as typed exceptions: one ``ServerError`` subclass per protocol ErrorCode
(``RateLimitedError``, ``OverloadedError``, ...) carrying ``code`` and ``retry_after_ms``;
``EndpointError`` when the endpoint cannot be reached, says nothing within the deadline, or
answers in another protocol (HTTP, TLS), named. Built on the same sans-IO codec as the server.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
import ssl as _ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from zerolayer.codes import FINISH_LABELS, ErrorCode, FrameType
from zerolayer.frames import protocol as p
from zerolayer.frames.wrong_door import sniff
from zerolayer.ops.tls import client_context

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11; annotations only

DEFAULT_ENDPOINT = "tcp://127.0.0.1:7070"
DEFAULT_TIMEOUT_S = 10.0  # connect, and HELLO until WELCOME

_T = TypeVar("_T")


class ServerError(Exception):
    """An ERROR frame. ``code`` is the protocol ErrorCode (an int the client does not know
    stays an int); ``stream`` 0 means the connection."""

    code: ErrorCode | int = ErrorCode.INTERNAL

    def __init__(self, code: int, message: str, retry_after_ms: int = 0, stream: int = 0) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"code {code}"
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.stream = stream


class ConnectionClosed(Exception):
    """The connection ended before the stream did."""


class EndpointError(ConnectionError):
    """The endpoint is unreachable, silent past the deadline, or not a frame-protocol server;
    the message names the endpoint and what answered."""


# One class per ErrorCode, written out so grep, IDEs and type checkers find each of them.
class MalformedFrameError(ServerError):
    code = ErrorCode.MALFORMED_FRAME


class FrameTooLargeError(ServerError):
    code = ErrorCode.FRAME_TOO_LARGE


class UnsupportedVersionError(ServerError):
    code = ErrorCode.UNSUPPORTED_VERSION


class UnauthenticatedError(ServerError):
    code = ErrorCode.UNAUTHENTICATED


class RateLimitedError(ServerError):
    code = ErrorCode.RATE_LIMITED


class OverloadedError(ServerError):
    code = ErrorCode.OVERLOADED


class InvalidRequestError(ServerError):
    code = ErrorCode.INVALID_REQUEST


class PromptTooLongError(ServerError):
    code = ErrorCode.PROMPT_TOO_LONG


class UnknownPromptError(ServerError):
    code = ErrorCode.UNKNOWN_PROMPT


class StreamInUseError(ServerError):
    code = ErrorCode.STREAM_IN_USE


class TooManyStreamsError(ServerError):
    code = ErrorCode.TOO_MANY_STREAMS


class IdleTimeoutError(ServerError):
    code = ErrorCode.IDLE_TIMEOUT


class ShuttingDownError(ServerError):
    code = ErrorCode.SHUTTING_DOWN


class SlowConsumerError(ServerError):
    code = ErrorCode.SLOW_CONSUMER


class InternalError(ServerError):
    code = ErrorCode.INTERNAL


ERRORS: dict[int, type[ServerError]] = {
    cls.code.value: cls
    for cls in (
        MalformedFrameError,
        FrameTooLargeError,
        UnsupportedVersionError,
        UnauthenticatedError,
        RateLimitedError,
        OverloadedError,
        InvalidRequestError,
        PromptTooLongError,
        UnknownPromptError,
        StreamInUseError,
        TooManyStreamsError,
        IdleTimeoutError,
        ShuttingDownError,
        SlowConsumerError,
        InternalError,
    )
}


def _foreign(endpoint: str, data: bytes) -> EndpointError | None:
    """An EndpointError when a server's first bytes are HTTP or TLS rather than frames."""
    kind = sniff(data)
    if kind == "http":
        status = data.split(b"\r\n", 1)[0].decode("latin-1")[:80]
        return EndpointError(
            f"{endpoint} answered in HTTP ({status!r}), not the ZeroLayer frame protocol: "
            "is it an HTTP or metrics port? Give the frame port (default 7070)"
        )
    if kind == "tls":
        return EndpointError(
            f"{endpoint} answered with TLS, not the plain frame protocol: the port expects TLS"
        )
    return None


def make_error(code: int, message: str, retry_after_ms: int = 0, stream: int = 0) -> ServerError:
    return ERRORS.get(code, ServerError)(code, message, retry_after_ms, stream)


@dataclass(slots=True)
class TokenEvent:
    ids: list[int]
    text: str


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's logprob and its most likely alternatives (id, logprob),
    descending: of the distribution the server sampled from (docs/protocol.md, LOGPROBS)."""

    id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class Result:
    """A finished stream: everything it streamed plus the DONE fields. ``finish_reason`` is the
    name ("eos", "max_tokens", "stop", "cancelled": the CLI's and the metrics' labels),
    ``finish_code`` the wire value (codes.FinishReason)."""

    finish_reason: str
    finish_code: int
    cache: int
    prompt_tokens: int
    completion_tokens: int
    queue_us: int
    ttft_us: int
    total_us: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per id, when asked


class Stream:
    """One request's output: iterate TokenEvents; ``result`` is set when DONE arrives."""

    def __init__(self, client: Client, stream_id: int) -> None:
        self._client = client
        self.stream_id = stream_id
        self._queue: asyncio.Queue[TokenEvent | Result | BaseException] = asyncio.Queue()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.result: Result | None = None
        self.ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []  # filled as LOGPROBS frames arrive
        self._last_ids: list[int] = []  # the ids of the last TOKEN frame (LOGPROBS follows it)

    def _push(self, item: TokenEvent | Result | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        while True:
            item = await self._queue.get()
            if isinstance(item, TokenEvent):
                self.ids.extend(item.ids)
                self.text_parts.append(item.text)
                yield item
            elif isinstance(item, Result):
                item.ids = self.ids
                item.text = "".join(self.text_parts)
                item.logprobs = self.logprobs
                self.result = item
                return
            else:
                raise item

    async def collect(self) -> Result:
        """Consume the stream and return its Result (raises ServerError on ERROR)."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def cancel(self) -> None:
        await self._client._send(p.encode_cancel(self.stream_id))


class Client:
    """One connection to a ZeroLayer daemon carrying many concurrent streams."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        endpoint: str = DEFAULT_ENDPOINT,
    ) -> None:
        self.endpoint = endpoint
        self._reader = reader
        self._writer = writer
        self._decoder = p.FrameDecoder("client", 2**32 - 1)
        self._streams: dict[int, Stream] = {}
        self._next_id = 1
        self._pongs: asyncio.Queue[bytes] = asyncio.Queue()
        self._welcome: asyncio.Future[p.Welcome] = asyncio.get_running_loop().create_future()
        self.goaway: tuple[int, str] | None = None
        self.closed_error: BaseException | None = None
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        endpoint: str = DEFAULT_ENDPOINT,
        api_key: str | bytes | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        ssl: _ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> Client:
        """Open a connection; with ``api_key`` (b"" when auth is off) send HELLO and wait for
        WELCOME, which proves the endpoint speaks the frame protocol. ``timeout`` bounds the
        connect and the wait for WELCOME each; EndpointError says what went wrong.

        ``tls://HOST:PORT`` connects with TLS: ``ssl`` is the client context (see
        zerolayer.ops.tls.client_context for a CA, a client certificate and its key; default: the
        system CAs); the server's certificate must name ``server_hostname`` (default HOST). A
        failed handshake is an EndpointError whose ``__cause__`` is the ssl error."""
        url = urlparse(endpoint if "://" in endpoint else f"tcp://{endpoint}")
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("tcp", "tls") or not url.hostname or not port:
            raise ValueError(
                f"endpoint must look like tcp://HOST:PORT or tls://HOST:PORT, got {endpoint!r}"
            )
        tls: dict[str, Any] = {}
        if url.scheme == "tls":
            tls = {
                "ssl": ssl or client_context(),
                "server_hostname": server_hostname or url.hostname,
            }
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(url.hostname, port, **tls), timeout
            )
        except asyncio.TimeoutError:
            raise EndpointError(f"{endpoint}: no TCP connection within {timeout:g} s") from None
        except _ssl.SSLError as exc:  # before OSError: its subclass
            raise EndpointError(f"TLS handshake with {endpoint} failed: {exc}") from exc
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise EndpointError(f"cannot connect to {endpoint}: {reason}") from exc
        client = cls(reader, writer, endpoint)
        if api_key is not None:
            try:
                await client.hello(api_key, timeout=timeout)
            except BaseException:
                await client.close()
                raise
        return client

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def hello(
        self, api_key: str | bytes = b"", *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> p.Welcome:
        """Send HELLO; return the WELCOME, or raise EndpointError when none comes in time."""
        await self._send(p.encode_hello(api_key))
        try:
            return await asyncio.wait_for(asyncio.shield(self._welcome), timeout)
        except asyncio.TimeoutError:
            raise EndpointError(
                f"{self.endpoint} accepted the connection but sent no WELCOME within "
                f"{timeout:g} s: not a ZeroLayer frame port (an HTTP server, such as the "
                "metrics port, waits silently for a request line), or a daemon still starting"
            ) from None
        except ConnectionClosed as exc:
            raise EndpointError(
                f"{self.endpoint} closed the connection before WELCOME: {exc}"
            ) from exc

    async def ping(self, data: bytes = b"") -> bytes:
        await self._send(p.encode_ping(data))
        return await self._pongs.get()

    def _new_stream(self) -> Stream:
        while self._next_id in self._streams:
            self._next_id = self._next_id % (2**32 - 1) + 1
        stream = Stream(self, self._next_id)
        self._next_id = self._next_id % (2**32 - 1) + 1
        self._streams[stream.stream_id] = stream
        return stream

    async def generate(
        self,
        prompt: str | list[int] | np.ndarray,
        max_tokens: int,
        *,
        text: bool = True,
        **options: Unpack[p.RequestOptions],
    ) -> Stream:
        """Send a binary REQUEST; a str prompt goes as UTF-8 text, a list as token ids.
        ``options`` are the codec's (``protocol.RequestOptions``: temperature, top_p, top_k,
        seed, prompt_id, stop_ids, cache, logprobs, top_logprobs, the penalties, min_tokens,
        logit_bias). ``cache=False`` bypasses the server's response cache (a fresh run of the
        model). ``logprobs`` (with ``top_logprobs`` alternatives) fills ``Result.logprobs``; it
        and the logits processing fields need protocol version 2 (``hello``, the default)."""
        return await self._start(
            lambda sid: p.encode_request(sid, prompt, max_tokens, text_deltas=text, **options)
        )

    async def generate_json(self, request: dict[str, Any]) -> Stream:
        """Send a JSON REQUEST (chat ``messages`` or raw ``prompt``); text deltas always on."""
        return await self._start(lambda sid: p.encode_json_request(sid, request))

    async def _start(self, encode: Callable[[int], bytes]) -> Stream:
        """A new stream whose REQUEST is ``encode(stream_id)``, sent. When encoding raises (a
        value the codec cannot write), no stream stays registered."""
        if self.closed_error is not None:
            raise ConnectionClosed(str(self.closed_error))
        stream = self._new_stream()
        try:
            frame = encode(stream.stream_id)
        except BaseException:
            del self._streams[stream.stream_id]
            raise
        await self._send(frame)
        return stream

    async def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (for tests of the server's error handling)."""
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._reader_task.cancel()
        with contextlib.suppress(BaseException):
            await self._reader_task

    async def _read_loop(self) -> None:
        err: BaseException = ConnectionClosed("connection closed by the server")
        first = True
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    break
                if first:
                    first = False
                    foreign = _foreign(self.endpoint, data)
                    if foreign is not None:
                        err = foreign
                        break
                self._decoder.feed(data)
                while (frame := self._decoder.next_frame()) is not None:
                    conn_err = self._on_frame(*frame)
                    if conn_err is not None:
                        err = conn_err
        except (ConnectionError, p.ProtocolError) as exc:
            err = ConnectionClosed(str(exc))
        finally:
            self.closed_error = err
            for stream in self._streams.values():
                stream._push(err)
            self._streams.clear()
            if not self._welcome.done():
                self._welcome.set_exception(err)
                self._welcome.exception()  # mark retrieved
            if isinstance(err, EndpointError):
                self._writer.close()

    def _on_frame(
        self, ftype: int, flags: int, sid: int, payload: memoryview
    ) -> BaseException | None:
        if ftype == FrameType.TOKEN:
            stream = self._streams.get(sid)
            if stream is not None:
                ids, text = p.parse_token(payload)
                stream._last_ids = ids.tolist()
                stream._push(TokenEvent(stream._last_ids, stream._decoder.decode(text)))
        elif ftype == FrameType.LOGPROBS:
            stream = self._streams.get(sid)
            if stream is not None:  # for the ids of the TOKEN frame just before it
                token, top_ids, top = p.parse_logprobs(payload)
                last = stream._last_ids[-len(token) :] if len(token) else []
                for j, (tid, lp) in enumerate(zip(last, token.tolist(), strict=True)):
                    pairs = list(zip(top_ids[j].tolist(), top[j].tolist(), strict=True))
                    stream.logprobs.append(TokenLogprob(tid, lp, pairs))
        elif ftype == FrameType.DONE:
            stream = self._streams.pop(sid, None)
            if stream is not None:
                d = p.parse_done(payload)
                tail = stream._decoder.decode(b"", final=True)
                if tail:
                    stream._push(TokenEvent([], tail))
                stream._push(
                    Result(
                        FINISH_LABELS.get(d.finish_reason, str(d.finish_reason)),
                        d.finish_reason,
                        d.cache,
                        d.prompt_tokens,
                        d.completion_tokens,
                        d.queue_us,
                        d.ttft_us,
                        d.total_us,
                    )
                )
        elif ftype == FrameType.ERROR:
            code, retry, message = p.parse_error(payload)
            exc = make_error(code, message, retry, sid)
            if sid == 0:
                if not self._welcome.done():
                    self._welcome.set_exception(exc)
                    self._welcome.exception()
                return exc
            stream = self._streams.pop(sid, None)
            if stream is not None:
                stream._push(exc)
        elif ftype == FrameType.PING:
            self._writer.write(p.encode_pong(bytes(payload)))
        elif ftype == FrameType.PONG:
            self._pongs.put_nowait(bytes(payload))
        elif ftype == FrameType.WELCOME:
            if not self._welcome.done():
                self._welcome.set_result(p.parse_welcome(payload))
        elif ftype == FrameType.GOAWAY:
            self.goaway = p.parse_goaway(payload)
        return None


class SyncClient:
    """The blocking equivalent of Client, with its own event loop (scripts, notebooks):
    ``SyncClient.connect(...)`` (or the constructor) takes ``Client.connect``'s arguments, and
    there is a method per Client method.

    ``generate`` / ``generate_json`` wait for the whole answer and return its Result (ids, text,
    DONE fields); ``stream`` / ``stream_json`` yield TokenEvents as they arrive, the Result being
    the generator's return value (``.result`` of the last stream, too). Leaving a ``stream``
    early cancels the request on the server."""

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        api_key: str | bytes | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        ssl: _ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                Client.connect(
                    endpoint, api_key, timeout=timeout, ssl=ssl, server_hostname=server_hostname
                )
            )
        except BaseException:
            self._loop.close()
            raise
        self.result: Result | None = None  # of the last stream

    @classmethod
    def connect(
        cls,
        endpoint: str = DEFAULT_ENDPOINT,
        api_key: str | bytes | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        ssl: _ssl.SSLContext | None = None,
        server_hostname: str | None = None,
    ) -> SyncClient:
        """Client.connect, blocking: ``with SyncClient.connect(...) as client:`` reads as the
        async ``async with await Client.connect(...) as client:`` does (same arguments as the
        constructor, which it calls)."""
        return cls(endpoint, api_key, timeout=timeout, ssl=ssl, server_hostname=server_hostname)

    @property
    def endpoint(self) -> str:
        return self._client.endpoint

    @property
    def goaway(self) -> tuple[int, str] | None:
        return self._client.goaway

    def _run(self, awaitable: Awaitable[_T]) -> _T:
        return self._loop.run_until_complete(awaitable)

    def hello(
        self, api_key: str | bytes = b"", *, timeout: float | None = DEFAULT_TIMEOUT_S
    ) -> p.Welcome:
        return self._run(self._client.hello(api_key, timeout=timeout))

    def ping(self, data: bytes = b"") -> bytes:
        return self._run(self._client.ping(data))

    def generate(
        self,
        prompt: str | list[int] | np.ndarray,
        max_tokens: int,
        *,
        text: bool = True,
        **options: Unpack[p.RequestOptions],
    ) -> Result:
        """Client.generate (same arguments), waited for: the Result with ids and text."""
        started = self._client.generate(prompt, max_tokens, text=text, **options)
        return self._run(self._collect(started))

    def generate_json(self, request: dict[str, Any]) -> Result:
        """Client.generate_json, waited for: the Result with ids and text."""
        return self._run(self._collect(self._client.generate_json(request)))

    def stream(
        self,
        prompt: str | list[int] | np.ndarray,
        max_tokens: int,
        *,
        text: bool = True,
        **options: Unpack[p.RequestOptions],
    ) -> Generator[TokenEvent, None, Result | None]:
        """Yield TokenEvents of Client.generate as they arrive."""
        started = self._client.generate(prompt, max_tokens, text=text, **options)
        return self._events(self._run(started))

    def stream_json(self, request: dict[str, Any]) -> Generator[TokenEvent, None, Result | None]:
        """Yield TokenEvents of Client.generate_json as they arrive."""
        return self._events(self._run(self._client.generate_json(request)))

    def send_raw(self, data: bytes) -> None:
        self._run(self._client.send_raw(data))

    @staticmethod
    async def _collect(started: Awaitable[Stream]) -> Result:
        stream = await started
        return await stream.collect()

    def _events(self, stream: Stream) -> Generator[TokenEvent, None, Result | None]:
        iterator = stream.__aiter__()
        finished = False
        try:
            while True:
                try:
                    event = self._run(iterator.__anext__())
                except StopAsyncIteration:
                    finished = True
                    self.result = stream.result
                    return stream.result
                except (ServerError, ConnectionClosed):
                    finished = True  # the stream ended in an ERROR: nothing to cancel
                    raise
                yield event
        finally:
            if not finished and self._client.closed_error is None and not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self._run(stream.cancel())  # left early: free its slot on the server

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
