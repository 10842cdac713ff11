"""The client's errors: one explicit class per ErrorCode, and EndpointError naming what answered
when the endpoint is silent (the WELCOME deadline), speaks HTTP, or is not listening. The peers
here are small asyncio servers on loopback, not daemons."""

from __future__ import annotations

import asyncio
import inspect
import re
import struct
from collections.abc import Awaitable, Callable

import pytest

import zerolayer.client.connection as zc
from zerolayer.codes import ErrorCode
from zerolayer.frames import protocol as p


def test_every_error_code_has_one_class_written_out_in_the_source() -> None:
    source = inspect.getsource(zc)
    assert not re.search(r"globals\(\)", source)
    assert set(zc.ERRORS) == {c.value for c in ErrorCode}
    for code in ErrorCode:
        name = "".join(part.capitalize() for part in code.name.split("_")) + "Error"
        cls = getattr(zc, name)
        assert f"class {name}(ServerError):" in source  # greppable, visible to type checkers
        assert zc.ERRORS[code.value] is cls and cls.code == code
        err = zc.make_error(code.value, "why", retry_after_ms=250, stream=3)
        assert type(err) is cls
        assert (err.code, err.retry_after_ms, err.stream, str(err)) == (
            code,
            250,
            3,
            f"{code.name}: why",
        )
    assert type(zc.make_error(999, "new")) is zc.ServerError


async def _with_peer(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    body: Callable[[str], Awaitable[None]],
) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await body(f"tcp://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_a_silent_peer_gives_no_welcome_within_the_deadline() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):  # like an HTTP server waiting for a request line
            pass
        writer.close()

    async def body(endpoint: str) -> None:
        with pytest.raises(zc.EndpointError) as info:
            await zc.Client.connect(endpoint, "", timeout=0.3)
        assert str(info.value) == (
            f"{endpoint} accepted the connection but sent no WELCOME within 0.3 s: not a "
            "ZeroLayer frame port (an HTTP server, such as the metrics port, waits silently for "
            "a request line), or a daemon still starting"
        )

    asyncio.run(_with_peer(silent, body))


def test_an_http_answer_is_named() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        writer.write(b"HTTP/1.0 400 Bad request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def body(endpoint: str) -> None:
        with pytest.raises(
            zc.EndpointError, match="answered in HTTP \\('HTTP/1.0 400 Bad request'"
        ):
            await zc.Client.connect(endpoint, "", timeout=5)
        # Without HELLO the first request gets the same error instead of hanging.
        client = await zc.Client.connect(endpoint, timeout=5)
        async with client:
            stream = await client.generate("hi", 4)
            with pytest.raises(zc.EndpointError, match="answered in HTTP"):
                await stream.collect()

    asyncio.run(_with_peer(http, body))


def test_nothing_listening_and_bad_endpoints() -> None:
    async def body() -> None:
        with pytest.raises(zc.EndpointError, match="^cannot connect to tcp://127.0.0.1:1: "):
            await zc.Client.connect("tcp://127.0.0.1:1", timeout=5)
        for bad in ("http://127.0.0.1:7070", "tcp://127.0.0.1", "tcp://h:notaport"):
            with pytest.raises(ValueError, match="endpoint must look like tcp://HOST:PORT"):
                await zc.Client.connect(bad)

    asyncio.run(body())


def test_a_request_the_codec_cannot_write_leaves_no_stream_behind() -> None:
    """``generate`` passes its options to the codec as they are; a keyword the codec does not
    know, or a value it cannot write, raises before anything is sent, and the stream it had
    taken is not left registered (once it was: a stream that never ends)."""
    received = bytearray()
    peer_done = asyncio.Event()

    async def recorder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            received.extend(data)
        writer.close()
        peer_done.set()

    async def body(endpoint: str) -> None:
        client = await zc.Client.connect(endpoint, timeout=5)
        async with client:
            with pytest.raises(TypeError, match="temprature"):
                await client.generate("hi", 4, temprature=0.5)
            with pytest.raises(struct.error):
                await client.generate("hi", 2**40)  # max_tokens is a u32 on the wire
            with pytest.raises(TypeError):
                await client.generate_json({"prompt": "hi", "max_tokens": 4, "x": object()})
            assert client._streams == {}
            stream = await client.generate("hi", 4, temperature=0.5, top_k=3, text=False)
            assert list(client._streams) == [stream.stream_id]
            expected = p.encode_request(
                stream.stream_id, "hi", 4, temperature=0.5, top_k=3, text_deltas=False
            )
        await peer_done.wait()  # the client closed: the peer has read everything
        assert bytes(received) == expected

    asyncio.run(_with_peer(recorder, body))
