"""Protocol version 2 through zerolayer.client.connection against a real daemon (synthetic backend):
logprobs collected per token, the processing block applied, a version 1 HELLO still served,
and bad #27 input refused on its own stream with the connection going on."""

from __future__ import annotations

import asyncio
import math

import pytest

from benchmarks._support.daemon import Daemon
from zerolayer import client as zc
from zerolayer.frames import protocol


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "1"}) as d:
        yield d


def test_logprobs_and_processing_through_the_client(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            welcome = await client.hello()
            assert welcome.version == 2
            result = await (
                await client.generate("hello", max_tokens=12, logprobs=True, top_logprobs=5)
            ).collect()
            assert result.finish_reason == "max_tokens"
            assert len(result.logprobs) == result.completion_tokens == 12
            for token_id, lp in zip(result.ids, result.logprobs, strict=True):
                assert lp.id == token_id and len(lp.top) == 5
                assert lp.logprob <= 0.0 and math.isfinite(lp.logprob)
                assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            plain = await (await client.generate("hello", max_tokens=12)).collect()
            assert plain.ids == result.ids and plain.logprobs == []
            biased = await (
                await client.generate("hello", max_tokens=6, logit_bias={ord("z"): 100.0})
            ).collect()
            assert biased.text == "z" * 6
            assert (await client.ping(b"v2")) == b"v2"

    asyncio.run(main())


def test_64_streams_each_get_20_alternatives_in_descending_order_for_every_token(daemon):
    """Issue #40 item 3 at the benchmark's scale (benchmarks/logprobs_cost.py): 64 streams with
    top_logprobs 20 on 8 connections (more than the engine's rows: some wait), beside 8 plain
    ones in the same steps; every token of every logprobs stream has its LOGPROBS, 20 distinct
    ids in descending order, and the plain streams get none."""

    async def main():
        clients = [await zc.Client.connect(daemon.endpoint) for _ in range(8)]
        try:
            assert [(await c.hello()).version for c in clients] == [2] * 8
            asked = [
                clients[i % 8].generate([5 + i, 6, 7], 16, text=False, logprobs=True,
                                        top_logprobs=20, cache=False)
                for i in range(64)
            ]  # fmt: skip
            plain = [clients[i].generate([5 + i, 6, 7], 16, text=False) for i in range(8)]
            streams = [await s for s in asked + plain]
            return [await s.collect() for s in streams]
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(main())
    with_lp, plain = results[:64], results[64:]
    assert [r.completion_tokens for r in results] == [16] * 72
    for result in with_lp:
        assert [lp.id for lp in result.logprobs] == result.ids
        for lp in result.logprobs:
            ids = [i for i, _ in lp.top]
            values = [v for _, v in lp.top]
            assert len(ids) == len(set(ids)) == 20
            assert values == sorted(values, reverse=True) and values[0] <= 0.0
            assert math.isfinite(lp.logprob) and lp.logprob <= values[0]
    assert [r.logprobs for r in plain] == [[]] * 8


def test_version_1_client_still_served_and_refused_the_new_fields(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            await client._send(protocol.encode_hello(b"", 1))
            assert (await asyncio.wait_for(asyncio.shield(client._welcome), 10)).version == 1
            plain = await (await client.generate("hello", max_tokens=4)).collect()
            assert plain.completion_tokens == 4
            with pytest.raises(zc.InvalidRequestError, match="logprobs"):
                await (await client.generate("hi", max_tokens=4, logprobs=True)).collect()
            assert (await (await client.generate("ok", max_tokens=2)).collect()).ids

    asyncio.run(main())


def test_bad_fields_refused_naming_them_and_the_connection_goes_on(daemon):
    async def main():
        async with await zc.Client.connect(daemon.endpoint) as client:
            await client.hello()
            running = await client.generate("long", max_tokens=40)
            for kwargs, name in (
                ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
                ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                ({"repetition_penalty": 3.0}, "repetition_penalty"),
            ):
                with pytest.raises(zc.InvalidRequestError, match=name):
                    await (await client.generate("x", max_tokens=3, **kwargs)).collect()
            n = await client.generate_json({"max_tokens": 3, "prompt": "x", "n": 3})
            with pytest.raises(zc.InvalidRequestError, match="n > 1"):
                await n.collect()
            assert (await running.collect()).completion_tokens == 40

    asyncio.run(main())
