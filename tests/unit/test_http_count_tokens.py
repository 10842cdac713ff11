"""Anthropic's /v1/messages/count_tokens on the HTTP door, in process: a real HttpServer on a
uvloop thread, the real request path and input processor, and a tokenizer that records the
thread each render and encode ran on. A conversation above ``offload.INLINE_BYTES`` is
templated and tokenized on the offload pool, never on the event loop's thread; a small one on
the loop (where a thread hop would cost more than the work). The e2e test
(tests/e2e/test_hostile.py) checks the count and the order of answers, which inline code
would pass too: this one checks where the work ran."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import uvloop

from tests.support.rawhttp import RawHttp
from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig, HttpConfig
from zerolayer.engine.backends.synthetic import SyntheticBackend
from zerolayer.engine.engine import Engine
from zerolayer.hooks import Chain
from zerolayer.http.door import HttpApi
from zerolayer.http.server import HttpServer
from zerolayer.ops.metrics import Metrics
from zerolayer.request_path import offload
from zerolayer.request_path.inputs import InputProcessor, request_body_bound
from zerolayer.request_path.lifecycle import RequestPath
from zerolayer.tokenizer import ByteTokenizer

MAX_CONTEXT = 4096  # a text bound of 64 KiB: room above the 16 KiB inline size


class ThreadRecordingTokenizer(ByteTokenizer):
    """The byte tokenizer, recording the thread of every render and encode."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[threading.Thread] = []

    def render_chat(self, messages, system, tools=None):  # noqa: ANN001, ANN201
        self.threads.append(threading.current_thread())
        return super().render_chat(messages, system, tools)

    def encode_prompt(self, text: str) -> np.ndarray:
        self.threads.append(threading.current_thread())
        return super().encode_prompt(text)


@pytest.fixture
def door():  # noqa: ANN201 - (port, tokenizer, the event loop's thread)
    tok = ThreadRecordingTokenizer()
    backend = SyntheticBackend(num_slots=2, vocab_size=300, max_context=MAX_CONTEXT)
    engine = Engine(
        backend, tok, lambda step: None, max_queue=8, max_step_tokens=64, prefill_chunk=16
    )
    settings = SimpleNamespace(
        hooks=HooksConfig(modules=[]),
        auth=AuthConfig(),
        ratelimit=RateLimitConfig(),
        cache=CacheConfig(enabled=False),
    )
    path = RequestPath(engine, InputProcessor(tok, backend.info), Chain.build(settings), Metrics())
    started = threading.Event()
    holder: dict = {}

    def run() -> None:
        async def main() -> None:
            api = HttpApi(path, backend.info)
            cfg = HttpConfig(enabled=True, port=0)
            srv = HttpServer(cfg, api.connection, 65536, None, request_body_bound(MAX_CONTEXT))
            await srv.start()
            holder["server"], holder["stop"] = srv, asyncio.Event()
            holder["loop"], holder["thread"] = (
                asyncio.get_running_loop(),
                threading.current_thread(),
            )
            started.set()
            await holder["stop"].wait()
            await srv.drain(1.0)

        uvloop.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)
    yield holder["server"].port, tok, holder["thread"]
    holder["loop"].call_soon_threadsafe(holder["stop"].set)
    thread.join(10)


def count(port: int, text: str) -> int:
    c = RawHttp("127.0.0.1", port)
    body = {"model": "synthetic", "messages": [{"role": "user", "content": text}]}
    c.request("POST", "/v1/messages/count_tokens", body)
    r = c.response()
    c.sock.close()
    assert r.status == 200, r.body
    return r.json()["input_tokens"]


def test_a_large_conversation_is_counted_off_the_event_loop(door) -> None:
    port, tok, loop_thread = door
    small = count(port, "x" * 10)
    assert tok.threads and all(t is loop_thread for t in tok.threads)  # inline: on the loop
    tok.threads.clear()
    large = offload.INLINE_BYTES + 4000
    assert count(port, "x" * large) == small + large - 10  # the byte tokenizer: a byte a token
    assert tok.threads, "the conversation was not templated or tokenized"
    assert all(t is not loop_thread for t in tok.threads), tok.threads
    assert all(t.name.startswith("zerolayer-tokenize") for t in tok.threads), tok.threads
