"""Response cache: deterministic requests only, exact replay, what is never stored, the LRU byte
bound, and the Redis store with its TTL."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from tests.support.sampling import SAMPLING_FIELDS, with_sampling
from zerolayer.config.hooks import CacheConfig, RateLimitConfig
from zerolayer.config.settings import AuthConfig
from zerolayer.hooks import CachedResponse, Chain, Completion, Principal, RequestContext
from zerolayer.hooks.cache import ENTRY_OVERHEAD, MemoryCacheStore, RedisCacheStore, cache_key

IDS = np.array([5, 17, 42, 7], dtype=np.int32)
TEXT = "héllo wörld"


def make_ctx(**kw) -> RequestContext:
    fields = dict(
        principal=Principal("anonymous"),
        model="tiny",
        prompt_ids=np.array([1, 2, 3, 4], dtype=np.int32),
        prompt_id=0,
        max_tokens=16,
        stop_ids=(),
        stop_sequences=(),
        want_text=True,
        state={},
    )
    fields.update(kw)
    return RequestContext(**with_sampling(fields))


def vary(ctx: RequestContext, field: str, value: object) -> RequestContext:
    """``ctx`` with one field (a sampling parameter too) changed."""
    if field in SAMPLING_FIELDS:
        return dataclasses.replace(
            ctx, sampling=dataclasses.replace(ctx.sampling, **{field: value})
        )
    return dataclasses.replace(ctx, **{field: value})


def cache_chain(**cache) -> Chain:
    return Chain.build(
        SimpleNamespace(
            auth=AuthConfig(),
            ratelimit=RateLimitConfig(enabled=False),
            cache=CacheConfig(**cache),
        )
    )


def serve(chain: Chain, ctx: RequestContext, finish: int = 1, ids=IDS, text=TEXT):
    """What the server does: ask the chain, else 'run the engine' and report DONE."""
    hit = chain.on_request(ctx)
    if hit is not None:
        chain.on_done(ctx, Completion(hit.finish_reason, hit.prompt_tokens, len(hit.token_ids),
                                      hit.token_ids, hit.text, True))  # fmt: skip
        return hit
    chain.on_done(ctx, Completion(finish, len(ctx.prompt_ids), len(ids), ids, text, False))
    return None


def test_greedy_hit_replays_identical_ids_and_text():
    chain = cache_chain()
    assert chain.records
    assert serve(chain, make_ctx()) is None
    hit = serve(chain, make_ctx(want_text=False))  # want_text is not part of the key
    assert isinstance(hit, CachedResponse)
    assert hit.token_ids.dtype == np.int32 and np.array_equal(hit.token_ids, IDS)
    assert hit.text == TEXT and hit.finish_reason == 1 and hit.prompt_tokens == 4
    assert not hit.token_ids.flags.writeable  # shared by every hit: nobody may change it


def test_seeded_requests_are_cached_per_seed():
    chain = cache_chain()
    assert serve(chain, make_ctx(temperature=0.8, seed=7)) is None
    assert serve(chain, make_ctx(temperature=0.8, seed=7)) is not None
    assert serve(chain, make_ctx(temperature=0.8, seed=8)) is None


def test_a_bypassing_request_is_neither_looked_up_nor_stored():
    chain = cache_chain()
    assert serve(chain, make_ctx(use_cache=False)) is None
    assert serve(chain, make_ctx()) is None  # the bypassing run stored nothing
    assert serve(chain, make_ctx()) is not None  # the normal run did
    assert serve(chain, make_ctx(use_cache=False)) is None  # and a bypass does not read it


def test_unseeded_sampling_is_never_cached():
    chain = cache_chain()
    for _ in range(3):
        ctx = make_ctx(temperature=0.7)
        assert serve(chain, ctx) is None
        assert "cache_key" not in ctx.state
    store = chain._on_request[-1].__self__.store
    assert len(store) == 0


def test_every_input_is_part_of_the_key():
    base = make_ctx(stop_ids=(2,), stop_sequences=("\n",), seed=3)
    variants = {
        "model": "other",
        "prompt_ids": np.array([1, 2, 3, 5], dtype=np.int32),
        "prompt_id": 9,
        "max_tokens": 17,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.1,  # a SAMPLING_ROW column: in the key without the cache naming it
        "seed": 4,
        "stop_ids": (3,),
        "stop_sequences": ("\n\n",),
    }
    keys = {cache_key(base)}
    for field, value in variants.items():
        keys.add(cache_key(vary(base, field, value)))
    assert len(keys) == len(variants) + 1
    assert cache_key(vary(base, "seed", None)) != cache_key(vary(base, "seed", 0))
    # Stop sequences are length-delimited: ("ab", "c") is not ("a", "bc").
    a = dataclasses.replace(base, stop_sequences=("ab", "c"))
    b = dataclasses.replace(base, stop_sequences=("a", "bc"))
    assert cache_key(a) != cache_key(b)
    assert cache_key(dataclasses.replace(base, want_text=False)) == cache_key(base)
    # A non-contiguous or int64 view of the same ids is the same prompt.
    wide = np.array([1, 0, 2, 0, 3, 0, 4, 0], dtype=np.int64)[::2]
    assert cache_key(dataclasses.replace(base, prompt_ids=wide)) == cache_key(base)


@pytest.mark.parametrize("finish", [3, -1])
def test_cancelled_or_failed_streams_are_never_stored(finish):
    chain = cache_chain()
    assert serve(chain, make_ctx(), finish=finish) is None
    assert serve(chain, make_ctx()) is None  # still a miss; this one finishes and is stored
    assert serve(chain, make_ctx()) is not None


def test_unrecorded_streams_and_replays_are_not_stored():
    chain = cache_chain()
    ctx = make_ctx()
    chain.on_request(ctx)
    chain.on_done(ctx, Completion(0, 4, 4, None, None, False))
    assert chain.on_request(make_ctx()) is None
    serve(chain, make_ctx())
    store = chain._on_request[-1].__self__.store
    before = store.bytes
    ctx = make_ctx()
    hit = chain.on_request(ctx)
    chain.on_done(ctx, Completion(hit.finish_reason, 4, 4, hit.token_ids, hit.text, True))
    assert store.bytes == before and len(store) == 1


def test_lru_byte_bound_evicts_least_recently_used():
    size = IDS.nbytes + len(TEXT.encode()) + ENTRY_OVERHEAD
    store = MemoryCacheStore(max_bytes=3 * size)
    entry = CachedResponse(IDS, TEXT, 0, 4)
    for k in (b"a", b"b", b"c"):
        store.put(k, entry)
    assert store.bytes == 3 * size
    assert store.get(b"a") is entry  # a is now the most recently used
    store.put(b"d", entry)
    assert store.get(b"b") is None  # b was the least recently used
    assert all(store.get(k) is entry for k in (b"a", b"c", b"d"))
    assert store.bytes == 3 * size <= store.max_bytes
    store.put(b"huge", CachedResponse(np.zeros(10_000, np.int32), "", 1, 1))
    assert store.get(b"huge") is None and len(store) == 3  # larger than the bound: skipped


def test_lru_bound_through_the_chain():
    size = IDS.nbytes + len(TEXT.encode()) + ENTRY_OVERHEAD
    chain = cache_chain(max_bytes=2 * size)
    for m in ("m1", "m2", "m3"):
        serve(chain, make_ctx(model=m))
    assert chain.on_request(make_ctx(model="m1")) is None
    assert chain.on_request(make_ctx(model="m3")) is not None


# ---- Redis store -----------------------------------------------------------------------------


def test_redis_cache_hit_and_ttl(redis_url):  # noqa: F811
    async def run() -> tuple[CachedResponse | None, CachedResponse | None]:
        a = cache_chain(store="redis", redis_url=redis_url, ttl_s=120)
        b = cache_chain(store="redis", redis_url=redis_url, ttl_s=120)  # another replica
        assert a.is_async
        ctx = make_ctx(seed=11, temperature=1.0)
        miss = await a.on_request_async(ctx)
        a.on_done(ctx, Completion(2, 4, len(IDS), IDS, TEXT, False))
        await a.drain()
        hit = await b.on_request_async(make_ctx(seed=11, temperature=1.0))
        other = make_ctx(temperature=0.3)
        assert await b.on_request_async(other) is None
        b.on_done(other, Completion(0, 4, 1, IDS[:1], "x", False))
        cancelled = make_ctx(max_tokens=3)
        await b.on_request_async(cancelled)
        b.on_done(cancelled, Completion(3, 4, 1, IDS[:1], "x", False))
        await b.aclose()
        await a.aclose()
        return miss, hit

    miss, hit = asyncio.run(run())
    assert miss is None
    assert np.array_equal(hit.token_ids, IDS) and hit.text == TEXT
    assert hit.finish_reason == 2 and hit.prompt_tokens == 4
    client = redis.Redis.from_url(redis_url)
    keys = client.keys("zerolayer:cache:*")
    assert len(keys) == 1  # the sampled and the cancelled streams were not stored
    assert 0 < client.ttl(keys[0]) <= 120


def test_redis_cache_errors_are_misses():
    from benchmarks._support.redis_server import RedisServer

    server = RedisServer().start()
    try:
        store = RedisCacheStore(server.url, ttl_s=60, max_bytes=1 << 20)
    finally:
        server.stop()

    async def run() -> CachedResponse | None:
        await store.put(b"k", CachedResponse(IDS, TEXT, 0, 4))
        got = await store.get(b"k")
        await store.aclose()
        return got

    assert asyncio.run(run()) is None


def test_principals_do_not_share_entries_unless_configured():
    """Issue #25 item 7: key B is never served key A's completion by default."""
    a, b = Principal("key-a"), Principal("key-b")
    chain = cache_chain()
    assert serve(chain, make_ctx(principal=a)) is None
    assert serve(chain, make_ctx(principal=b)) is None  # B's own miss, not A's entry
    assert serve(chain, make_ctx(principal=a)) is not None
    shared = cache_chain(shared_across_principals=True)
    assert serve(shared, make_ctx(principal=a)) is None
    assert serve(shared, make_ctx(principal=b)) is not None
