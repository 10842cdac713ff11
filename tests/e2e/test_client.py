"""The client library and `zerolayer generate` against a real daemon."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from benchmarks._support.daemon import ROOT
from zerolayer import client as zc
from zerolayer.frames.protocol import ErrorCode

# One daemon for this module and the other of the same config (tests/conftest.py).
SHARED = {"ENGINE__SYNTHETIC_STEP_MS": "1", "ENGINE__MAX_CONTEXT": "65536"}


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon(SHARED)


def test_async_streams_events_and_result(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            welcome = await client.hello()
            assert welcome.model == "synthetic" and welcome.max_streams == 256
            stream = await client.generate("hello", max_tokens=25)
            events = [e async for e in stream]
            result = stream.result
            assert result.finish_reason == "max_tokens"
            assert result.completion_tokens == 25 == sum(len(e.ids) for e in events)
            assert result.text == "".join(e.text for e in events) and len(result.text) == 25
            assert await client.ping(b"p") == b"p"

    asyncio.run(main())


def test_many_concurrent_streams_and_typed_errors(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            streams = [await client.generate(f"p{i}", max_tokens=10 + i) for i in range(60)]
            results = await asyncio.gather(*(s.collect() for s in streams))
            assert [r.completion_tokens for r in results] == [10 + i for i in range(60)]
            bad = await client.generate([1, 2, 10**8], max_tokens=5)
            with pytest.raises(zc.InvalidRequestError) as exc:
                await bad.collect()
            assert exc.value.code == ErrorCode.INVALID_REQUEST
            unknown = await client.generate("x", max_tokens=5, prompt_id=99)
            with pytest.raises(zc.UnknownPromptError):
                await unknown.collect()
            # The connection is still fine.
            assert (
                await (await client.generate("ok", max_tokens=3)).collect()
            ).completion_tokens == 3

    asyncio.run(main())


def test_cancel_and_chat(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            stream = await client.generate("long", max_tokens=50000)
            async for _ in stream:
                await stream.cancel()
                break
            result = await stream.collect()
            assert result.finish_reason == "cancelled"
            chat = await client.generate_json(
                {
                    "max_tokens": 7,
                    "messages": [{"role": "user", "content": "hi"}],
                    "seed": 3,
                    "temperature": 0.8,
                }
            )
            r = await chat.collect()
            assert r.completion_tokens == 7 and len(r.text) == 7

    asyncio.run(main())


def test_connection_error_raises_for_open_streams(daemon):
    async def main():
        client = await zc.Client.connect(daemon.endpoint)
        stream = await client.generate("x", max_tokens=50000)
        await client.send_raw(bytes(4) + b"\x55" + bytes(7))  # unknown frame type
        with pytest.raises(zc.MalformedFrameError):
            await stream.collect()
        await client.close()

    asyncio.run(main())


def test_sync_client(daemon):
    with zc.SyncClient.connect(daemon.endpoint) as client:  # as Client.connect reads
        r = client.generate("sync", max_tokens=9)
        assert r.completion_tokens == 9 and len(r.text) == 9
        assert (r.finish_reason, r.finish_code) == ("max_tokens", 1)
        events = list(client.stream("sync", max_tokens=9))
        assert "".join(e.text for e in events) == r.text


def test_cli_generate_prints_streamed_text(daemon):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerolayer.cli.main",
            "generate",
            "--endpoint",
            daemon.endpoint,
            "--max-tokens",
            "32",
            "-v",
            "hello",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.rstrip("\n")) == 32
    assert "finish_reason=max_tokens" in proc.stderr and "completion_tokens=32" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerolayer.cli.main",
            "generate",
            "--endpoint",
            "tcp://127.0.0.1:1",
            "hi",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr == "zerolayer: cannot connect to tcp://127.0.0.1:1: Connection refused\n"
