"""The HTTP front end end to end with the official openai and anthropic SDKs against real
daemons (synthetic backend): both APIs streamed and not, stop sequences, usage, the shared
hooks (keys, one rate-limit budget across ports, response cache, registered prompts), errors
as each SDK's own exception type, and a disconnect freeing its slot."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import anthropic
import openai
import pytest

from benchmarks._support.daemon import Daemon
from benchmarks._support.metrics import scrape, value
from tests.support import rawclient as rc
from zerolayer.hooks.keys import add_key

MODEL = "synthetic"
USER = [{"role": "user", "content": "Tell me something."}]
# Sampling fields the anthropic SDK no longer has parameters for; the Messages API takes them.
GREEDY = {"temperature": 0}


def oai(d: Daemon, key: str = "none", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url + "/v1", api_key=key, max_retries=0, **kw)


def ant(d: Daemon, key: str = "none", **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.http_url, api_key=key, max_retries=0, **kw)


@pytest.fixture(scope="module")
def daemon():
    with Daemon({"ENGINE__MAX_CONTEXT": "512"}) as d:
        yield d


def test_openai_chat_streamed_and_not(daemon):
    c = oai(daemon)
    full = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, seed=5)
    text = full.choices[0].message.content
    assert len(text) == 24  # the synthetic model: one letter or space per token, never EOS
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 24
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=24,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # Without include_usage, no usage chunk; the same seed gives the same text.
    chunks = list(
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, seed=5, stream=True)
    )
    assert all(ch.choices for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    # No max_tokens: the rest of the context (max_context 512; the synthetic model never ends).
    rest = c.chat.completions.create(model=MODEL, messages=USER)
    assert rest.usage.prompt_tokens + rest.usage.completion_tokens == 512
    assert rest.choices[0].finish_reason == "length"
    greedy = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0)
    again = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=24, temperature=0)
    assert greedy.choices[0].message.content == again.choices[0].message.content


def test_64_streams_each_get_20_alternatives_in_descending_order_for_every_token(daemon):
    """Issue #40 item 3 on the HTTP door, at benchmarks/logprobs_cost.py's scale: 64 streamed
    chat completions with top_logprobs 20 at once (more than the engine's rows: some wait);
    every token has one logprobs entry of 20 alternatives in descending order, and a greedy
    stream's entries are the whole answer's."""

    async def main() -> list[list]:
        c = openai.AsyncOpenAI(base_url=daemon.http_url + "/v1", api_key="none", max_retries=0)

        async def one(i: int) -> list:
            chunks = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"s{i}"}], max_tokens=16,
                temperature=0, logprobs=True, top_logprobs=20, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            return [ch async for ch in chunks]

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await c.close()

    streams = asyncio.run(main())
    for chunks in streams:
        assert chunks[-1].usage.completion_tokens == 16
        entries = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                   for t in ch.choices[0].logprobs.content]  # fmt: skip
        assert len(entries) == 16
        for t in entries:
            values = [alt.logprob for alt in t.top_logprobs]
            assert len(values) == 20 and values == sorted(values, reverse=True)
    whole = oai(daemon).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "s0"}], max_tokens=16, temperature=0,
        logprobs=True, top_logprobs=20,
    )  # fmt: skip
    streamed = [t for ch in streams[0] if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]  # fmt: skip
    assert whole.choices[0].logprobs.content == streamed


def test_stop_sequences_in_both_apis(daemon):
    c = oai(daemon)
    text = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, seed=9)
    text = text.choices[0].message.content
    stop = text[20:23]
    cut = text.index(stop)
    got = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=40, seed=9, stop=stop)
    assert got.choices[0].message.content == text[:cut]
    assert got.choices[0].finish_reason == "stop"
    streamed = c.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=40, seed=9, stop=[stop, "\x00never"], stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == text[:cut]
    # Anthropic: the same cut, reported as stop_sequence.
    a = ant(daemon)
    greedy = a.messages.create(model=MODEL, max_tokens=40, messages=USER, extra_body=GREEDY)
    text = greedy.content[0].text
    stop = text[15:18]
    cut = text.index(stop)
    msg = a.messages.create(
        model=MODEL, max_tokens=40, messages=USER, stop_sequences=[stop], extra_body=GREEDY
    )
    assert msg.content[0].text == text[:cut]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.usage.output_tokens < 40
    # Several stop strings: the one that matched is named, streamed or not. Sampled without a seed,
    # so the response cache never answers (the synthetic backend's text ignores temperature).
    sampled = {"temperature": 0.8}
    text = a.messages.create(model=MODEL, max_tokens=40, messages=USER, extra_body=sampled)
    text = text.content[0].text
    stop = text[12:15]
    cut = text.index(stop)
    stops = ["\x00never", stop, "\x01never"]
    msg = a.messages.create(
        model=MODEL, max_tokens=41, messages=USER, stop_sequences=stops, extra_body=sampled
    )
    assert msg.content[0].text == text[:cut]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    with a.messages.stream(
        model=MODEL, max_tokens=42, messages=USER, stop_sequences=stops, extra_body=sampled
    ) as events:
        msg = events.get_final_message()
    assert msg.content[0].text == text[:cut]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)


def test_anthropic_messages_streamed_and_not(daemon):
    a = ant(daemon)
    system = [{"type": "text", "text": "Be brief."}]
    msg = a.messages.create(
        model=MODEL, max_tokens=16, system=system, messages=USER, extra_body=GREEDY
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 16
    assert len(msg.content[0].text) == 16
    with a.messages.stream(
        model=MODEL, max_tokens=16, system=system, messages=USER, extra_body=GREEDY
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.usage.input_tokens == msg.usage.input_tokens
    assert final.usage.output_tokens == 16
    assert events[:3] == ["message_start", "content_block_start", "ping"] or events[:2] == [
        "message_start",
        "content_block_start",
    ]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in events or "text" in events
    count = a.messages.count_tokens(model=MODEL, system=system, messages=USER)
    assert count.input_tokens == msg.usage.input_tokens
    # Any anthropic-version is accepted.
    other = ant(daemon, default_headers={"anthropic-version": "2099-01-01"})
    assert other.messages.create(model=MODEL, max_tokens=2, messages=USER).usage.output_tokens == 2


def test_completions_models_and_not_found(daemon):
    c = oai(daemon)
    done = c.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0)
    assert len(done.choices[0].text) == 5 and done.usage.prompt_tokens == 4  # BOS + 3 bytes
    ids = c.completions.create(model=MODEL, prompt=[97, 98, 99], max_tokens=5, temperature=0)
    assert ids.usage.prompt_tokens == 3  # token ids are the prompt as given
    chunks = list(c.completions.create(model=MODEL, prompt="abc", max_tokens=5, stream=True))
    assert sum(len(ch.choices[0].text) for ch in chunks) == 5
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in ant(daemon).models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="gpt-4", messages=USER, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError):
        ant(daemon).messages.create(model="claude-x", max_tokens=2, messages=USER)


def test_invalid_requests_are_bad_request_errors_naming_the_field(daemon):
    c, a = oai(daemon), ant(daemon)
    cases = [  # the agent fields' refusals: tests/e2e/test_http_agents.py
        (dict(n=0), "n"),
        (dict(temperature=3), "temperature"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, **extra)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:  # PROMPT_TOO_LONG: a 400 too
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=600)
    assert info.value.body["code"] == "prompt_too_long"
    with pytest.raises(anthropic.BadRequestError) as info:
        a.messages.create(model=MODEL, max_tokens=2, messages=USER, extra_body={"top_k": -3})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        a.messages.create(
            model=MODEL, max_tokens=2, messages=[*USER, {"role": "assistant", "content": "Sure"}]
        )


def test_disconnect_mid_stream_frees_the_slot_and_metrics_count_by_api():
    with Daemon({"ENGINE__SYNTHETIC_STEP_MS": "2", "ENGINE__MAX_CONTEXT": "100000"}) as d:
        before = scrape(d.metrics_url)
        body = json.dumps(
            {"model": MODEL, "messages": USER, "max_tokens": 90000, "stream": True}
        ).encode()
        sock = socket.create_connection(("127.0.0.1", d.http_port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert b"data: " in sock.recv(65536)

        def running() -> float:
            return value(scrape(d.metrics_url), "zerolayer_num_requests_running")

        deadline = time.monotonic() + 10
        while running() != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running() == 1
        sock.close()
        deadline = time.monotonic() + 10
        while running() != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running() == 0
        # The gone client's stream ends cancelled; finished requests count under their api.
        oai(d).chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        ant(d).messages.create(model=MODEL, messages=USER, max_tokens=4)
        after = scrape(d.metrics_url)

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        success = "zerolayer_request_success_total"
        assert delta(success, finished_reason="max_tokens", api="openai") == 1
        assert delta(success, finished_reason="max_tokens", api="anthropic") == 1
        assert delta(success, finished_reason="max_tokens", api="frames") == 0
        assert delta("zerolayer_generation_tokens_total", api="anthropic") == 4
        # #25 item 8: the stream its client abandoned counts as cancelled, and the tokens it
        # was sent before (at least the one chunk read above) count as generated.
        assert delta(success, finished_reason="cancelled", api="openai") == 1
        assert delta("zerolayer_generation_tokens_total", api="openai") > 3


def test_keys_and_one_rate_limit_budget_across_ports(tmp_path):
    keys = tmp_path / "keys.toml"
    key = add_key(keys, "tenant", rpm=3)
    other = add_key(keys, "other")
    env = {"AUTH__ENABLED": "true", "AUTH__KEYS_FILE": str(keys), "CACHE__ENABLED": "false"}
    with Daemon(env) as d:
        with pytest.raises(openai.AuthenticationError):
            oai(d, "zl_wrong").chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        with pytest.raises(anthropic.AuthenticationError):
            ant(d, "zl_wrong").messages.create(model=MODEL, messages=USER, max_tokens=2)
        # No key at all is refused too (the SDKs always send one: raw request).
        conn = socket.create_connection(("127.0.0.1", d.http_port))
        conn.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
        assert conn.recv(65536).startswith(b"HTTP/1.1 401 ")
        # The key's budget of 3 per minute: one frame request, then Bearer, then x-api-key...
        frames = rc.RawConnection(d.host, d.port)
        frames.send(rc.hello(key.encode()))
        assert frames.read_frame()[0] == rc.WELCOME
        frames.send(rc.request(1, b"x", 2))
        assert rc.collect(frames, {1})[1]["done"] is not None
        assert oai(d, key).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert ant(d, key).messages.create(model=MODEL, messages=USER, max_tokens=2)
        # ... and the fourth, on either API, is over it.
        with pytest.raises(openai.RateLimitError) as info:
            oai(d, key).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        with pytest.raises(anthropic.RateLimitError):
            ant(d, key).messages.create(model=MODEL, messages=USER, max_tokens=2)
        # Another key has its own budget.
        assert oai(d, other).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)


def test_every_credential_presented_is_checked(tmp_path):
    """Issue #40 item 4: an invalid credential is a 401 whichever header carries it, even beside
    a valid one; two valid keys of different principals are a 401; the same key twice is not."""
    keys = tmp_path / "keys.toml"
    key, other = add_key(keys, "tenant"), add_key(keys, "other")
    env = {"AUTH__ENABLED": "true", "AUTH__KEYS_FILE": str(keys), "CACHE__ENABLED": "false"}
    bogus = "zl_" + "x" * 43
    with Daemon(env) as d:
        refused = 0
        # openai sends Authorization: Bearer <api_key>; the extra header is x-api-key
        for bearer, x_api_key in ((bogus, key), (key, bogus), (key, other)):
            client = oai(d, bearer, default_headers={"x-api-key": x_api_key})
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
            refused += 1
        # anthropic with auth_token sends Authorization: Bearer; x-api-key as an extra header
        for bearer, x_api_key in ((key, bogus), (other, key)):
            client = anthropic.Anthropic(base_url=d.http_url, auth_token=bearer, max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                client.messages.create(
                    model=MODEL, messages=USER, max_tokens=2, extra_headers={"x-api-key": x_api_key}
                )
            refused += 1
        # a repeated x-api-key line is checked too (raw: the SDKs send a header once)
        for second in (bogus, other):
            conn = socket.create_connection(("127.0.0.1", d.http_port))
            conn.sendall(
                b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-api-key: %s\r\n"
                b"x-api-key: %s\r\ncontent-length: 2\r\n\r\n{}" % (key.encode(), second.encode())
            )
            assert conn.recv(65536).startswith(b"HTTP/1.1 401 ")
            conn.close()
            refused += 1
        assert refused == 7
        both = oai(d, key, default_headers={"x-api-key": key})
        assert both.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        ant_both = anthropic.Anthropic(base_url=d.http_url, auth_token=other, max_retries=0)
        both_headers = {"x-api-key": other}
        assert ant_both.messages.create(
            model=MODEL, messages=USER, max_tokens=2, extra_headers=both_headers
        )
        frames = rc.RawConnection(d.host, d.port)
        frames.send(rc.hello(bogus.encode()))
        assert frames.read_frame()[0] == rc.ERROR


def test_overload_is_503_and_anthropic_529():
    env = {
        "ENGINE__MAX_BATCH_SIZE": "1",
        "ENGINE__MAX_QUEUE": "1",
        "ENGINE__SYNTHETIC_STEP_MS": "5",
        "ENGINE__MAX_CONTEXT": "100000",
    }
    with Daemon(env) as d:
        # One stream holds the only slot and one waits in the queue: the next is refused.
        holders = [rc.RawConnection(d.host, d.port) for _ in range(2)]
        # One after the other: sent together, the second could find the first still queued.
        for conn, gauge in zip(holders, ("running", "waiting"), strict=True):
            conn.send(rc.request(1, b"hold " + gauge.encode(), 50000))
            deadline = time.monotonic() + 30
            name = f"zerolayer_num_requests_{gauge}"
            while value(scrape(d.metrics_url), name) != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert value(scrape(d.metrics_url), name) == 1
        with pytest.raises(openai.InternalServerError) as info:
            oai(d).chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
        assert info.value.status_code == 503
        with pytest.raises(anthropic.OverloadedError) as info:
            ant(d).messages.create(model=MODEL, messages=USER, max_tokens=2)
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"


def test_drain_deadline_is_an_in_stream_error():
    env = {
        "ENGINE__SYNTHETIC_STEP_MS": "2",
        "ENGINE__MAX_CONTEXT": "100000",
        "SERVER__DRAIN_TIMEOUT_S": "0.5",
    }
    with Daemon(env) as d:
        stream = oai(d).chat.completions.create(
            model=MODEL, messages=USER, max_tokens=90000, stream=True
        )
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as info:
            for _ in stream:
                pass
        assert "drain" in str(info.value.message)
        assert d.proc.wait(30) == 0


def test_registered_system_prompt_and_response_cache_apply(tmp_path):
    system = "You are a terse assistant."
    prompts = json.dumps([{"id": 1, "name": "terse", "text": system}])
    with Daemon({"ENGINE__MAX_CONTEXT": "512"}, raw_env={"ZEROLAYER_PROMPTS": prompts}) as d:
        before = scrape(d.metrics_url)
        c = oai(d)
        messages = [{"role": "system", "content": system}, *USER]
        first = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=1)
        by_id = c.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, seed=1, extra_body={"prompt_id": 1}
        )
        assert by_id.choices[0].message.content == first.choices[0].message.content
        a = ant(d).messages.create(
            model=MODEL, max_tokens=8, system=system, messages=USER, extra_body=GREEDY
        )
        b = ant(d).messages.create(
            model=MODEL, max_tokens=8, system=system, messages=USER, extra_body=GREEDY
        )
        assert a.content[0].text == b.content[0].text
        after = scrape(d.metrics_url)

        def delta(name):
            return value(after, name) - value(before, name)

        # Three requests ran in the engine (the fourth was answered from the response cache);
        # the prefix store was asked for each one's whole prompt (metrics in tokens) and
        # supplied the registered prompt's KV to each.
        engine_prompts = first.usage.prompt_tokens + by_id.usage.prompt_tokens
        engine_prompts += a.usage.input_tokens
        assert delta("zerolayer_prefix_cache_queries_total") == engine_prompts
        assert 0 < delta("zerolayer_prefix_cache_hits_total") < engine_prompts
        assert delta("zerolayer_response_cache_hits_total") == 1
