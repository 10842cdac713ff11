"""Scripted fake servers for the bench tests: a frame server and an SSE (HTTP/1.1) server that
send each request's chunks at scripted times of a manual clock shared with the client.

The server sets ``clock.now`` to the request's arrival time plus the chunk's offset before
writing the chunk, then pauses a few real milliseconds so the client reads that chunk alone: the
client stamps it with exactly the scripted time, so measured metrics equal hand-computed ones.
"""

from __future__ import annotations

import asyncio
import json

from zerolayer.frames import protocol as p

REAL_GAP_S = 0.01  # real time between chunks, for the client to read each one on its own

# A script: ([(offset s, tokens, text), ...], done offset s). One per request, used in turn.
Script = tuple[list[tuple[float, int, str]], float]


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeFrameServer:
    def __init__(self, clock: ManualClock, scripts: list[Script]) -> None:
        self.clock, self.scripts, self.served = clock, scripts, 0
        self.requests: list[tuple[int, bytes]] = []  # (flags, payload)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader, writer) -> None:
        decoder = p.FrameDecoder("server", 1 << 20)
        while data := await reader.read(65536):
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                ftype, flags, sid, payload = frame
                if ftype == p.FrameType.HELLO:
                    writer.write(p.encode_welcome(1 << 20, 64, 300, 257, 1024, "fake"))
                elif ftype == p.FrameType.REQUEST:
                    self.requests.append((flags, bytes(payload)))
                    await self._play(writer, sid)
        writer.close()

    async def _play(self, writer, sid: int) -> None:
        chunks, done_at = self.scripts[self.served % len(self.scripts)]
        self.served += 1
        base = self.clock.now
        for offset, k, _ in chunks:
            self.clock.now = base + offset
            writer.write(p.encode_token(sid, list(range(97, 97 + k))))
            await writer.drain()
            await asyncio.sleep(REAL_GAP_S)
        self.clock.now = base + done_at
        n = sum(k for _, k, _ in chunks)
        writer.write(p.encode_done(sid, p.Done(1, 0, 7, n, 0, 0, 0)))
        await writer.drain()
        await asyncio.sleep(REAL_GAP_S)

    async def close(self) -> None:
        self.server.close()


def _sse(data: dict | str, event: str | None = None) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def _chunked(piece: bytes) -> bytes:
    return f"{len(piece):x}\r\n".encode() + piece + b"\r\n"


# How OpenAI-compatible servers end a stream and treat its connection (``FakeSseServer.style``):
STYLES = (
    "vllm",  # finish_reason chunk, usage chunk, [DONE]; the connection is kept (and us)
    "llamacpp",  # as vllm, then the server closes the connection without saying so
    "transformers",  # finish_reason chunk, no usage, no [DONE]: the body just ends
    "open-after-finish",  # finish_reason chunk, no [DONE], and the body stays open for a while
    "stale-keepalive",  # as vllm, but a kept connection is closed when the next request comes
)


class FakeSseServer:
    """OpenAI chat (tokens per event told by logprobs) or Anthropic (told only by the final
    usage) streaming, HTTP/1.1 keep-alive with chunked bodies; GET /v1/models names one model.
    ``style`` picks how a stream ends (STYLES)."""

    def __init__(
        self,
        clock: ManualClock,
        scripts: list[Script],
        protocol: str,
        refuse: int = 0,
        style: str = "vllm",
    ) -> None:
        assert style in STYLES
        self.clock, self.scripts, self.protocol, self.served = clock, scripts, protocol, 0
        self.refuse = refuse  # answer the first POST with this status (and a JSON error body)
        self.style = style
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each POST's headers (names lower-cased)
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _conn(self, reader, writer) -> None:
        self.connections += 1
        streams = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.style == "stale-keepalive" and streams:
                    writer.close()  # what an idle timeout racing the client's next request does
                    return
                lines = head.decode().split("\r\n")
                method, path = lines[0].split()[:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/v1/models":
                    out = json.dumps({"data": [{"id": "fake-model"}]}).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(out)}\r\n\r\n".encode()
                        + out
                    )
                    continue
                self.bodies.append(json.loads(body))
                self.headers.append(headers)
                if self.refuse and len(self.bodies) == 1:
                    out = b'{"error": {"message": "slow down"}}'
                    writer.write(
                        f"HTTP/1.1 {self.refuse} Too Many Requests\r\n".encode()
                        + f"Content-Length: {len(out)}\r\n\r\n".encode()
                        + out
                    )
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                )
                await self._play(writer)
                streams += 1
                if self.style == "open-after-finish":
                    await asyncio.sleep(3.0)  # longer than the client's grace after a finish
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if self.style == "llamacpp":
                    writer.close()  # with no "Connection: close": the client finds out later
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _play(self, writer) -> None:
        chunks, done_at = self.scripts[self.served % len(self.scripts)]
        self.served += 1
        base = self.clock.now
        n = sum(k for _, k, _ in chunks)
        if self.protocol == "anthropic":
            start = {"type": "message_start", "message": {"usage": {"input_tokens": 7}}}
            writer.write(_chunked(_sse(start, "message_start")))
        for offset, k, text in chunks:
            self.clock.now = base + offset
            if self.protocol == "anthropic":
                event = {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": text},
                }
                writer.write(_chunked(_sse(event, "content_block_delta")))
            elif self.protocol == "openai-completions":
                choice = {"index": 0, "text": text, "logprobs": {"tokens": ["x"] * k}}
                writer.write(_chunked(_sse({"choices": [choice]})))
            else:
                logprobs = {"content": [{"token": "x", "logprob": 0.0}] * k}
                choice = {"index": 0, "delta": {"content": text}, "logprobs": logprobs}
                writer.write(_chunked(_sse({"choices": [choice]})))
            await writer.drain()
            await asyncio.sleep(REAL_GAP_S)
        self.clock.now = base + done_at
        if self.protocol == "anthropic":
            end = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}}
            end["usage"] = {"output_tokens": n}
            writer.write(_chunked(_sse(end, "message_delta")))
            writer.write(_chunked(_sse({"type": "message_stop"}, "message_stop")))
        else:
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            if self.style in ("vllm", "llamacpp"):
                writer.write(_chunked(_sse(last) + _sse({"choices": [], "usage": usage})))
                writer.write(_chunked(_sse("[DONE]")))
            else:
                writer.write(_chunked(_sse(last)))
        await writer.drain()

    async def close(self) -> None:
        self.server.close()
