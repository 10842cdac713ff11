"""The client's errors: one explicit class per ErrorCode, and EndpointError naming what answered
when the endpoint is silent (the WELCOME deadline), speaks HTTP, or is not listening. The peers
here are small asyncio servers on loopback, not daemons."""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable

import pytest

import gateway.client as zc
from gateway.codes import ErrorCode


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
