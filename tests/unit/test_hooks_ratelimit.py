"""Rate limits: GCRA arithmetic, reservation under concurrency, reconciliation, and one global
limit for several chains (daemons) sharing a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from benchmarks._support.redis_server import RedisServer
from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig
from zerolayer.hooks import (
    INTERNAL,
    INVALID_REQUEST,
    RATE_LIMITED,
    Chain,
    Completion,
    HookConfigError,
    HookError,
    Principal,
    RequestContext,
)
from zerolayer.hooks.ratelimit import MemoryRateStore, RateLimiter
from zerolayer.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_ctx(principal: Principal, prompt_len: int = 10, max_tokens: int = 20) -> RequestContext:
    return RequestContext(
        principal, "m", np.zeros(prompt_len, dtype=np.int32), 0, max_tokens,
        SamplingParams(temperature=0.7), (), (), False, {},
    )  # fmt: skip


def chain_for(store: str = "memory", url: str = "redis://127.0.0.1:1/0", **limits) -> Chain:
    return Chain.build(
        SimpleNamespace(
            auth=AuthConfig(),
            ratelimit=RateLimitConfig(store=store, redis_url=url, **limits),
            cache=CacheConfig(enabled=False),
        )
    )


def limiter(clock: FakeClock, **limits) -> RateLimiter:
    cfg = SimpleNamespace(ratelimit=RateLimitConfig(**limits))
    return RateLimiter(cfg, store=MemoryRateStore(clock))


def refused(fn, *args) -> HookError | None:
    try:
        fn(*args)
    except HookError as err:
        return err
    return None


# ---- in-process store ------------------------------------------------------------------------


def test_tokens_reserved_refused_and_refilled():
    clock = FakeClock()
    rl = limiter(clock, default_tpm=60)  # one token per second
    alice = Principal("alice")
    assert refused(rl.on_request, make_ctx(alice, 10, 50)) is None  # 60 of 60
    err = refused(rl.on_request, make_ctx(alice, 5, 5))
    assert err.code == RATE_LIMITED and err.retry_after_ms == 10_000
    assert "'alice'" in err.message and "60 tpm" in err.message
    clock.t += 9.9
    assert refused(rl.on_request, make_ctx(alice, 5, 5)).retry_after_ms == 100
    clock.t += 0.1
    assert refused(rl.on_request, make_ctx(alice, 5, 5)) is None
    # Another principal has its own bucket.
    assert refused(rl.on_request, make_ctx(Principal("bob"), 10, 50)) is None


def test_requests_per_minute():
    clock = FakeClock()
    rl = limiter(clock, default_rpm=3)
    p = Principal("p")
    for _ in range(3):
        assert refused(rl.on_request, make_ctx(p)) is None
    err = refused(rl.on_request, make_ctx(p))
    assert err.code == RATE_LIMITED and err.retry_after_ms == 20_000  # one request per 20 s


def test_principal_limits_override_defaults_and_none_is_unlimited():
    clock = FakeClock()
    rl = limiter(clock)  # no defaults
    free = Principal("free")
    for _ in range(1000):
        assert refused(rl.on_request, make_ctx(free, 100, 1000)) is None
    assert rl.store._tpm == {} and rl.store._rpm == {}  # nothing was even counted
    rl = limiter(clock, default_tpm=1_000_000)
    assert refused(rl.on_request, make_ctx(Principal("tight", tpm=40), 10, 20)) is None
    assert refused(rl.on_request, make_ctx(Principal("tight", tpm=40), 10, 20)).code == RATE_LIMITED


def test_request_larger_than_the_bucket_is_invalid_not_retryable():
    rl = limiter(FakeClock(), default_tpm=100)
    err = refused(rl.on_request, make_ctx(Principal("p"), 30, 71))
    assert err.code == INVALID_REQUEST and err.retry_after_ms == 0
    assert "101 tokens" in err.message and "at most 100" in err.message


def test_done_reconciles_to_the_real_count():
    clock = FakeClock()
    rl = limiter(clock, default_tpm=100)
    p = Principal("p")
    ctxs = [make_ctx(p, 10, 20) for _ in range(3)]  # 3 x 30 reserved = 90
    for ctx in ctxs:
        assert refused(rl.on_request, ctx) is None
    assert refused(rl.on_request, make_ctx(p, 10, 20)).code == RATE_LIMITED
    for ctx in ctxs:  # each really used 10 + 5 = 15: 45 tokens come back
        rl.on_done(ctx, Completion(0, 10, 5))
    assert refused(rl.on_request, make_ctx(p, 10, 20)) is None  # 45 + 30 = 75
    assert refused(rl.on_request, make_ctx(p, 10, 20)).code == RATE_LIMITED  # 105 > 100
    # A cancelled stream that used nothing returns all of its reservation, once.
    ctx = make_ctx(Principal("q"), 10, 90)
    assert refused(rl.on_request, ctx) is None
    rl.on_done(ctx, Completion(3, 0, 0))
    rl.on_done(ctx, Completion(3, 0, 0))
    assert refused(rl.on_request, make_ctx(Principal("q"), 10, 90)) is None
    assert refused(rl.on_request, make_ctx(Principal("q"), 1, 1)).code == RATE_LIMITED


def test_reconcile_charges_tokens_beyond_the_reservation():
    clock = FakeClock()
    rl = limiter(clock, default_tpm=100)
    p = Principal("p")
    ctx = make_ctx(p, 10, 20)
    rl.on_request(ctx)
    rl.on_done(ctx, Completion(1, 60, 20))  # a precompiled prefix made the prompt 60 tokens
    # 80 used: 21 more no longer fit (they would with the 30 reserved), 20 do.
    assert refused(rl.on_request, make_ctx(p, 10, 11)).code == RATE_LIMITED
    assert refused(rl.on_request, make_ctx(p, 10, 10)) is None


def test_concurrent_threads_never_overrun_the_token_limit():
    # LiteLLM #18730: five concurrent requests spent 6.6x a 100-token limit. Here 16 threads fire
    # 200 requests of 30 tokens at a 100-token limit: only 3 may ever be admitted.
    chain = chain_for(default_tpm=100)
    p = Principal("shared")
    admitted: list[RequestContext] = []
    lock = threading.Lock()
    start = time.monotonic()

    def fire(_: int) -> None:
        ctx = make_ctx(p, 10, 20)
        if refused(chain.on_request, ctx) is None:
            with lock:
                admitted.append(ctx)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(fire, range(200)))
    refill = (time.monotonic() - start) * 100 / 60  # what the bucket regained meanwhile
    assert len(admitted) >= 3 and 30 * len(admitted) <= 100 + refill


def test_five_concurrent_requests_on_a_100_token_limit():
    chain = chain_for(default_tpm=100)
    p = Principal("litellm-18730")

    async def one() -> bool:
        await asyncio.sleep(0)
        return refused(chain.on_request, make_ctx(p, 20, 60)) is None

    async def run() -> list[bool]:
        return await asyncio.gather(*(one() for _ in range(5)))

    assert sum(asyncio.run(run())) == 1  # 80 tokens reserved; a second 80 never fits in 100


# ---- Redis store -----------------------------------------------------------------------------


def test_redis_scripts_match_the_memory_arithmetic(redis_url):  # noqa: F811
    chain = chain_for("redis", redis_url, default_tpm=60, default_rpm=1000)
    assert chain.is_async
    p = Principal("alice")

    async def run() -> None:
        assert await chain.on_request_async(make_ctx(p, 10, 50)) is None
        with pytest.raises(HookError) as err:
            await chain.on_request_async(make_ctx(p, 5, 5))
        assert err.value.code == RATE_LIMITED
        assert 9_000 < err.value.retry_after_ms <= 10_000  # ~10 tokens at 1 token/s
        with pytest.raises(HookError) as err:
            await chain.on_request_async(make_ctx(p, 30, 31))
        assert err.value.code == INVALID_REQUEST
        await chain.aclose()

    asyncio.run(run())
    client = redis.Redis.from_url(redis_url)
    assert sorted(client.keys("zerolayer:rl:*")) == [
        b"zerolayer:rl:{alice}:rpm",
        b"zerolayer:rl:{alice}:tpm",
    ]
    assert 0 < client.pttl("zerolayer:rl:{alice}:tpm") <= 60_001


def test_two_chains_on_one_redis_hold_one_global_limit(redis_url):  # noqa: F811
    # Two chains stand in for two daemons: N = 5 requests per minute in total, not 2N.
    async def run() -> tuple[int, float]:
        a = chain_for("redis", redis_url, default_rpm=5)
        b = chain_for("redis", redis_url, default_rpm=5)
        p = Principal("tenant")
        start = time.monotonic()

        async def one(chain: Chain) -> bool:
            try:
                await chain.on_request_async(make_ctx(p))
                return True
            except HookError as err:
                assert err.code == RATE_LIMITED and err.retry_after_ms > 0
                return False

        results = await asyncio.gather(*(one(c) for c in (a, b) * 10))
        elapsed = time.monotonic() - start
        await a.aclose()
        await b.aclose()
        return sum(results), elapsed

    allowed, elapsed = asyncio.run(run())
    assert 5 <= allowed <= 5 + elapsed * 5 / 60


def test_concurrent_requests_over_redis_never_overrun_tokens(redis_url):  # noqa: F811
    async def run() -> tuple[list[RequestContext], float, list[RequestContext], float]:
        chains = [chain_for("redis", redis_url, default_tpm=100) for _ in range(2)]
        p = Principal("shared")
        start = time.monotonic()

        async def one(chain: Chain) -> RequestContext | None:
            ctx = make_ctx(p, 10, 20)
            try:
                await chain.on_request_async(ctx)
                return ctx
            except HookError:
                return None

        got = await asyncio.gather(*(one(chains[i % 2]) for i in range(100)))
        admitted = [c for c in got if c is not None]
        elapsed = time.monotonic() - start
        # Reconcile: each used 15 of its 30; the refunds make room for exactly the tokens freed.
        for ctx in admitted:
            chains[0].on_done(ctx, Completion(0, 10, 5))
        await chains[0].drain()
        after = await asyncio.gather(*(one(chains[1]) for _ in range(10)))
        total = time.monotonic() - start
        for c in chains:
            await c.aclose()
        return admitted, elapsed, [a for a in after if a is not None], total

    admitted, elapsed, after, total = asyncio.run(run())
    assert len(admitted) >= 3 and 30 * len(admitted) <= 100 + elapsed * 100 / 60
    assert len(after) >= 1  # freed tokens are usable again
    assert 15 * len(admitted) + 30 * len(after) <= 100 + total * 100 / 60  # never above the bucket


def test_noscript_reloads_the_script(redis_url):  # noqa: F811
    chain = chain_for("redis", redis_url, default_rpm=100)

    async def run() -> None:
        await chain.on_request_async(make_ctx(Principal("x")))
        redis.Redis.from_url(redis_url).script_flush()
        await chain.on_request_async(make_ctx(Principal("x")))
        await chain.aclose()

    asyncio.run(run())
    assert float(redis.Redis.from_url(redis_url).get("zerolayer:rl:{x}:rpm")) > 0


def test_unreachable_redis_stops_the_start_and_later_fails_closed():
    with pytest.raises(HookConfigError, match="ratelimit.redis_url redis://127.0.0.1:1/0"):
        chain_for("redis", "redis://127.0.0.1:1/0", default_rpm=5)
    server = RedisServer().start()
    try:
        chain = chain_for("redis", server.url, default_rpm=5)
    finally:
        server.stop()

    async def run() -> HookError:
        with pytest.raises(HookError) as err:
            await chain.on_request_async(make_ctx(Principal("x")))
        await chain.aclose()
        return err.value

    err = asyncio.run(run())
    assert err.code == INTERNAL and "rate-limit store unavailable" in err.message


def test_redis_reservation_returned_when_a_later_hook_refuses(redis_url, tmp_path):  # noqa: F811
    refuser = tmp_path / "refuse_odd.py"
    refuser.write_text(
        "from zerolayer.hooks import hook, HookError, INVALID_REQUEST\n"
        '@hook("on_request")\n'
        "def refuse_odd(ctx):\n"
        "    if ctx.max_tokens % 2:\n"
        '        raise HookError(INVALID_REQUEST, "odd")\n'
    )
    chain = Chain.build(
        SimpleNamespace(
            auth=AuthConfig(),
            hooks=HooksConfig(modules=[str(refuser)]),
            ratelimit=RateLimitConfig(store="redis", redis_url=redis_url, default_tpm=100),
            cache=CacheConfig(enabled=False),
        )
    )
    p = Principal("p")

    async def run() -> list[int]:
        codes = []
        for max_tokens in (81, 81, 81, 80, 80):  # 10 + 81 = 91 tokens held by each refused one
            try:
                await chain.on_request_async(make_ctx(p, 10, max_tokens))
                codes.append(0)
            except HookError as err:
                codes.append(err.code)
            await chain.drain()  # the refund runs as a task; let it land before the next try
        await chain.aclose()
        return codes

    assert asyncio.run(run()) == [INVALID_REQUEST] * 3 + [0, RATE_LIMITED]
