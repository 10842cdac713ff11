"""The HTTP target: OpenAI chat, OpenAI completions and Anthropic messages APIs, streamed as SSE.

A small asyncio HTTP/1.1 client with keep-alive (a pool of idle connections reused across
requests; one request in flight per connection, as HTTP/1.1 has it), chunked and content-length
bodies, and an SSE parser. Each SSE event is stamped with the arrival time of the bytes that
completed it. An event carrying text is a chunk; how many tokens it carried is known exactly when
the server sends per-token logprobs, and otherwise taken as one; when the stream's final usage
reports a different completion-token count, the difference is spread over the chunks in
proportion to their text length (so ITL stays per token even when a server batches tokens).

Servers differ in how a stream ends and what happens to its connection, and the target accepts
each: OpenAI streams end at ``[DONE]`` (vLLM, us) or, without it, at the end of the body after a
chunk with a ``finish_reason`` (transformers serve); a body still open ``FINISH_GRACE_S`` after
that chunk is taken as ended too (the connection is then closed, not reused). A kept connection
the server has closed meanwhile (llama.cpp's server closes after each stream) is replaced by a
new one, once, when it fails before any byte of the response: that is not the request failing.

``read_head``, ``read_body`` and ``error_message`` are also how ``zerolayer chat`` reads an HTTP
endpoint's answers (gateway/zerolayer/client/chat.py).

Requests carry ``Cache-Control: no-cache`` unless ``use_cache`` (our server then neither reads
nor writes its response cache); a reply with ``x-zerolayer-cache: hit`` was a cache hit anyway.
"""

from __future__ import annotations

import asyncio
import json
import ssl as ssl_module
from collections.abc import AsyncGenerator, Callable
from typing import Any

from zerolayer.client.bench.endpoint import Endpoint
from zerolayer.client.bench.frames import TargetError
from zerolayer.client.bench.stats import RequestRecord
from zerolayer.client.bench.workload import WorkItem

FINISH_GRACE_S = 1.0  # after a finish_reason without [DONE]: how long to wait for more


class StreamEnded(Exception):
    """The body ended before the protocol's final event."""


def error_message(body: bytes) -> str:
    """The message of an error body (OpenAI's and Anthropic's shapes), else its start."""
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
        if isinstance(message, str):
            return message
        if isinstance(err, str):
            return err
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace").strip()


def _messages(item: WorkItem) -> list[dict[str, Any]]:
    if item.messages is not None:
        return item.messages
    return [{"role": "user", "content": item.prompt or ""}]


def build_body(protocol: str, item: WorkItem, model: str, ignore_eos: bool) -> dict[str, Any]:
    """The JSON body of one streamed request in ``protocol``."""
    if item.prompt_ids is not None and protocol != "openai-completions":
        raise ValueError(
            "token-id prompts go to tcp:// or --protocol openai-completions, not " + protocol
        )
    if protocol == "anthropic":
        body: dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "stream": True}
        body["messages"] = _messages(item)
        if item.system is not None:
            body["system"] = item.system
        return body
    body = {
        "model": model,
        "max_tokens": item.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; other servers ignore or refuse it
    if protocol == "openai-chat":
        system = [{"role": "system", "content": item.system}] if item.system is not None else []
        body["messages"] = system + _messages(item)
    elif item.prompt_ids is not None:
        body["prompt"] = item.prompt_ids  # OpenAI's completions take a prompt as token ids
    else:
        text = (
            item.prompt
            if item.prompt is not None
            else "\n".join(m["content"] for m in _messages(item))
        )
        body["prompt"] = (item.system + "\n" if item.system else "") + text
    return body


class SseState:
    """Reads one protocol's events into a RequestRecord: chunks, usage, finish, errors."""

    def __init__(self, protocol: str, rec: RequestRecord) -> None:
        self.protocol = protocol
        self.rec = rec
        self.text_lens: list[int] = []
        self.completion_tokens: int | None = None
        self.finished = False  # the protocol's final event ([DONE], message_stop) came
        self.finish_seen = False  # a choice carried a finish_reason

    def on_event(self, now: float, event: str, data: str) -> None:
        if self.protocol == "anthropic":
            self._anthropic(now, event, data)
        elif data.strip() == "[DONE]":
            self.finished = True
        else:
            self._openai(now, data)

    def _chunk(self, now: float, text: str, k: int = 1) -> None:
        self.rec.chunk_t.append(now)
        self.rec.chunk_k.append(k)
        self.text_lens.append(len(text))

    def _openai(self, now: float, data: str) -> None:
        obj = json.loads(data)
        if "error" in obj:
            self.rec.error = "stream_error"
            self.rec.message = error_message(data.encode())
            self.finished = True
            return
        usage = obj.get("usage")
        if usage:
            self.rec.prompt_tokens = usage.get("prompt_tokens") or self.rec.prompt_tokens
            self.completion_tokens = usage.get("completion_tokens")
        for choice in obj.get("choices") or ():
            text = (
                choice.get("text")
                if "text" in choice
                else (choice.get("delta") or {}).get("content")
            )
            if text:
                # per-token logprobs: chat's "content" list, completions' "tokens" list
                logprobs = choice.get("logprobs") or {}
                per_token = logprobs.get("content") or logprobs.get("tokens")
                self._chunk(now, text, len(per_token) if per_token else 1)
            if choice.get("finish_reason"):
                self.rec.finish = choice["finish_reason"]
                self.finish_seen = True

    def _anthropic(self, now: float, event: str, data: str) -> None:
        obj = json.loads(data)
        kind = obj.get("type", event)
        if kind == "message_start":
            usage = (obj.get("message") or {}).get("usage") or {}
            self.rec.prompt_tokens = usage.get("input_tokens", 0)
        elif kind == "content_block_delta":
            text = (obj.get("delta") or {}).get("text")
            if text:
                self._chunk(now, text)
        elif kind == "message_delta":
            self.completion_tokens = (obj.get("usage") or {}).get("output_tokens")
            self.rec.finish = (obj.get("delta") or {}).get("stop_reason") or self.rec.finish
        elif kind == "message_stop":
            self.finished = True
        elif kind == "error":
            self.rec.error = "stream_error"
            self.rec.message = error_message(data.encode())
            self.finished = True

    def settle(self) -> None:
        """Spread a usage count that differs from the chunk count over the chunks by text
        length (largest remainder), each chunk keeping at least one token."""
        k = self.rec.chunk_k
        n, have = self.completion_tokens, sum(k)
        if n is None or n <= have or not k:
            return
        extra = n - have
        total = sum(self.text_lens) or len(k)
        weights = self.text_lens if sum(self.text_lens) else [1] * len(k)
        shares = [extra * w / total for w in weights]
        add = [int(s) for s in shares]
        order = sorted(range(len(k)), key=lambda i: shares[i] - add[i], reverse=True)
        for i in order[: extra - sum(add)]:
            add[i] += 1
        self.rec.chunk_k = [a + b for a, b in zip(k, add, strict=True)]


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readuntil(b"\r\n")
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise StreamEnded(f"not an HTTP/1.x response: {status_line[:60]!r}")
    headers = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_body(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncGenerator[bytes, None]:
    """The response body as it arrives (chunked, content-length or until close)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        left = int(headers["content-length"])
        while left:
            data = await reader.read(min(left, 65536))
            if not data:
                raise StreamEnded("body shorter than its content-length")
            left -= len(data)
            yield data
    else:
        while data := await reader.read(65536):
            yield data


class HttpTarget:
    """Sends WorkItems as streamed HTTP requests; keeps finished connections for reuse."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        ssl: ssl_module.SSLContext | None = None,
        api_key: str = "",
        model: str | None = None,
        ignore_eos: bool = False,
        use_cache: bool = False,
        clock: Callable[[], float],
    ) -> None:
        self.endpoint = endpoint
        self._use_cache = use_cache
        self._api_key = api_key
        self.model = model
        self._ignore_eos = ignore_eos
        self._clock = clock
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        if ssl is None and endpoint.tls:
            ssl = ssl_module.create_default_context()
        self._ssl = ssl

    def _headers(self, method: str, path: str, body: bytes) -> bytes:
        e = self.endpoint
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {e.host}:{e.port}",
            "Accept: text/event-stream" if body else "Accept: application/json",
            "Connection: keep-alive",
        ]
        if body:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
            if not self._use_cache:
                lines.append("Cache-Control: no-cache")
        if self._api_key:
            if e.protocol == "anthropic":
                lines.append(f"x-api-key: {self._api_key}")
            else:
                lines.append(f"Authorization: Bearer {self._api_key}")
        if e.protocol == "anthropic":
            lines.append("anthropic-version: 2023-06-01")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection and whether it was kept from an earlier request."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_connection(
            self.endpoint.host, self.endpoint.port, ssl=self._ssl, limit=1 << 20
        )
        return reader, writer, False

    async def _send(
        self, head: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
        """Send a request and read its response head; a kept connection that the server has
        closed (no byte of a response) is replaced by a new one, once."""
        reader, writer, kept = await self._connect()
        try:
            writer.write(head)
            status, headers = await read_head(reader)
        except (OSError, asyncio.IncompleteReadError) as exc:
            writer.close()
            if not kept or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                raise
            reader, writer, _ = await self._connect_new()
            writer.write(head)
            status, headers = await read_head(reader)
        return reader, writer, status, headers

    async def _connect_new(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        for _, writer in self._idle:  # kept alongside the dead one: likely closed too
            writer.close()
        self._idle.clear()
        return await self._connect()

    async def open(self, timeout: float = 10.0) -> dict[str, Any]:
        """Check the server answers; without ``model``, take the first of GET /v1/models."""
        if self.model is None:
            path = self.endpoint.path.rsplit("/v1/", 1)[0] + "/v1/models"
            try:
                status, body = await asyncio.wait_for(self._get(path), timeout)
            except (OSError, asyncio.TimeoutError, StreamEnded) as exc:
                raise TargetError(f"cannot reach {self.endpoint}: {exc}") from None
            models = json.loads(body).get("data") if status == 200 else None
            if not models:
                raise TargetError(f"GET {path} answered {status} with no model: pass --model")
            self.model = models[0]["id"]
        return {"model_id": self.model}

    async def _get(self, path: str) -> tuple[int, bytes]:
        reader, writer, status, headers = await self._send(self._headers("GET", path, b""))
        body = b"".join([piece async for piece in read_body(reader, headers)])
        self._release(reader, writer, headers)
        return status, body

    def _release(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]
    ) -> None:
        if headers.get("connection", "").lower() == "close" or reader.at_eof():
            writer.close()
        else:
            self._idle.append((reader, writer))

    async def request(self, item: WorkItem, rec: RequestRecord) -> None:
        assert self.model is not None
        body = json.dumps(build_body(self.endpoint.protocol, item, self.model, self._ignore_eos))
        head = self._headers("POST", self.endpoint.path, body.encode())
        state = SseState(self.endpoint.protocol, rec)
        rec.t_send = self._clock()
        try:
            reader, writer, status, headers = await self._send(head)
        except (OSError, asyncio.IncompleteReadError, StreamEnded, ValueError) as exc:
            rec.t_end, rec.error = self._clock(), "connect_error"
            rec.message = str(exc) or type(exc).__name__
            return
        try:
            rec.cached = headers.get("x-zerolayer-cache", "").lower() == "hit"
            if status != 200:
                answer = b"".join([piece async for piece in read_body(reader, headers)])
                rec.error = f"http_{status}"
                rec.message = error_message(answer)
                self._release(reader, writer, headers)
                return
            complete = await self._read_events(reader, headers, state)
            if not (state.finished or state.finish_seen) and rec.error is None:
                rec.error = "connection_closed"
                rec.message = "the stream ended without its final event"
            state.settle()
            if complete:
                self._release(reader, writer, headers)
            else:
                writer.close()
        except (OSError, asyncio.IncompleteReadError, StreamEnded, ValueError) as exc:
            writer.close()
            if rec.error is None and state.finish_seen:
                state.settle()  # the answer was whole; only the body's ending was lost
            elif rec.error is None:
                rec.error = "connection_closed"
                rec.message = str(exc) or type(exc).__name__
        except asyncio.CancelledError:
            writer.close()
            raise
        finally:
            if not rec.t_end:
                rec.t_end = self._clock()

    async def _read_events(
        self, reader: asyncio.StreamReader, headers: dict[str, str], state: SseState
    ) -> bool:
        """Feed the body's SSE events to ``state``; False when it stopped reading early (a body
        still open ``FINISH_GRACE_S`` after a finish_reason): the connection is not reusable."""
        pending = b""
        event = ""
        data: list[str] = []  # the current event's data lines
        pieces = aiter(read_body(reader, headers))
        while not state.finished:
            try:
                if state.finish_seen:
                    piece = await asyncio.wait_for(anext(pieces), FINISH_GRACE_S)
                else:
                    piece = await anext(pieces)
            except StopAsyncIteration:
                return True
            except asyncio.TimeoutError:
                return False
            now = self._clock()
            pending += piece
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.rstrip(b"\r").decode("utf-8", "replace")
                if not line:
                    if data:
                        state.on_event(now, event, "\n".join(data))
                        if state.finished or state.finish_seen:
                            state.rec.t_end = now
                    event, data = "", []
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif line.startswith("event:"):
                    event = line[6:].strip()
        async for _ in pieces:  # the rest of the body after [DONE] / message_stop (the ending)
            pass
        return True

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()
