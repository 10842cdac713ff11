"""Shared pytest fixtures. Helpers live in tests/support, and those benchmarks share with tests
(the daemon launcher, redis-server, certificates, fuzz inputs, the soak) in benchmarks/_support;
unit tests in tests/unit run without starting a daemon, tests/e2e start real daemon processes
(and redis-server) on loopback."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._support.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the test session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's redis-server, flushed before the test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted once per session into a fresh cache (the daemon tests
    pass its model.data_dir, so their daemons reuse it)."""
    from gateway.models.bundled import smollm2_gguf
    from gateway.models.gguf_import import ensure_converted

    return ensure_converted(smollm2_gguf(), str(tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="session")
def smollm2_reference():
    """``reference(ids, max_new_tokens)``: transformers' greedy ids for a prompt, from its model
    loaded once from the same GGUF file; each answer computed once per session."""
    from functools import cache

    from tests.support.smollm2 import reference_greedy, reference_model

    model = reference_model()

    @cache
    def greedy(ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        return reference_greedy(model, list(ids), max_new_tokens)

    return lambda ids, max_new_tokens: greedy(tuple(ids), max_new_tokens)
