"""Built-in hook: the response cache for deterministic requests.

Only greedy (temperature 0) or seeded requests are cached: for them the same inputs give the same
stream. The key is a BLAKE2b digest of the model and every input that shapes the stream: prompt
ids (after the chat template), prompt_id, max_tokens, the sampling parameters (every column of
zerolayer.sampling_params.SAMPLING_ROW, as the engine's rows hold them), stop ids and stop
sequences, and the principal's name unless ``cache.shared_across_principals`` (so by
default one API key is never served another's completion). ``want_text`` is not part of it:
the text is always stored and the server drops it when the client did not ask for it.

A request that asks to bypass the cache (``ctx.use_cache`` False: REQUEST option bit 3, JSON
``"cache": false``, HTTP ``Cache-Control: no-cache`` or ``no-store``) is neither looked up nor
stored. Entries are written at DONE, only for streams that finished normally (eos, max_tokens,
stop) and were not themselves served from the cache; cancelled or failed streams are never stored.
Stores: ``MemoryCacheStore`` (LRU, bounded in bytes) and ``RedisCacheStore`` (async, with a TTL,
for replicas sharing one Redis).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from zerolayer.config.hooks import CacheConfig
from zerolayer.hooks.registry import hook
from zerolayer.hooks.types import CachedResponse, HookConfigError
from zerolayer.sampling_params import sampling_rows

log = logging.getLogger("zerolayer.hooks.cache")

STATE_KEY = "cache_key"  # ctx.state[STATE_KEY] = digest, set by on_request for on_done
ENTRY_OVERHEAD = 256  # bytes counted per entry beyond ids and text: key, objects, dict slot
_CACHEABLE = (0, 1, 2)  # eos, max_tokens, stop
# prompt_id, max_tokens, n_prompt, n_stop_ids, n_stop_sequences, model name length; the sampling
# parameters follow as their SAMPLING_ROW record (every per-row field, a new one included).
_HEADER = struct.Struct("<IIIIII")
_BLOB = struct.Struct("<BxxxII")  # Redis value header: finish_reason, prompt_tokens, n_ids


def cache_key(ctx: Any, scope: str = "") -> bytes:
    """The 20-byte digest identifying a request's stream within ``scope`` ("" = shared)."""
    ids = ctx.prompt_ids
    if ids.dtype != np.int32 or not ids.flags.c_contiguous:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
    model = ctx.model.encode()
    h = hashlib.blake2b(digest_size=20, person=b"zl-cache-v2")
    h.update(
        _HEADER.pack(
            ctx.prompt_id,
            ctx.max_tokens,
            len(ids),
            len(ctx.stop_ids),
            len(ctx.stop_sequences),
            len(model),
        )
    )
    h.update(sampling_rows((ctx.sampling,)).tobytes())
    h.update(model)
    if scope:
        raw_scope = scope.encode("utf-8", "backslashreplace")
        h.update(b"\x00scope" + len(raw_scope).to_bytes(4, "little") + raw_scope)
    h.update(ids)
    if ctx.stop_ids:
        h.update(np.asarray(ctx.stop_ids, dtype=np.int32).tobytes())
    for seq in ctx.stop_sequences:
        raw = seq.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


class MemoryCacheStore:
    """LRU over an OrderedDict, evicting the least recently used entries past ``max_bytes``.
    Entry size = ids bytes + UTF-8 text bytes + ENTRY_OVERHEAD."""

    is_async = False

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, tuple[CachedResponse, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> CachedResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: bytes, response: CachedResponse) -> None:
        size = response.token_ids.nbytes + len(response.text.encode()) + ENTRY_OVERHEAD
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (response, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    def close(self) -> None:
        self._entries.clear()
        self.bytes = 0


class RedisCacheStore:
    """Entries under ``zerolayer:cache:<hex digest>`` with a TTL; the value is a 12-byte header
    (finish_reason, prompt_tokens, n_ids), the int32 ids, then the UTF-8 text. Redis errors are
    logged (at most once a minute) and count as misses: the cache never fails a request."""

    is_async = True

    def __init__(self, url: str, ttl_s: int, max_bytes: int) -> None:
        from redis.exceptions import RedisError

        from zerolayer.hooks import redis_scripts

        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        probe = redis_scripts.sync_client(url)
        try:
            probe.ping()
        except RedisError as exc:
            raise HookConfigError(f"cache.redis_url {url}: {exc}") from exc
        finally:
            probe.close()
        self._client = redis_scripts.async_client(url)
        self._last_warning = float("-inf")

    @staticmethod
    def redis_key(key: bytes) -> str:
        return "zerolayer:cache:" + key.hex()

    def _warn(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning("response cache %s failed (treated as a miss): %s", what, exc)

    async def get(self, key: bytes) -> CachedResponse | None:
        try:
            blob = await self._client.get(self.redis_key(key))
        except Exception as exc:
            self._warn("read", exc)
            return None
        if blob is None:
            return None
        finish, prompt_tokens, n = _BLOB.unpack_from(blob)
        ids = np.frombuffer(blob, dtype=np.int32, count=n, offset=_BLOB.size)
        text = blob[_BLOB.size + 4 * n :].decode()
        return CachedResponse(ids, text, finish, prompt_tokens)

    async def put(self, key: bytes, response: CachedResponse) -> None:
        ids = response.token_ids
        blob = b"".join(
            (
                _BLOB.pack(response.finish_reason, response.prompt_tokens, len(ids)),
                ids.tobytes(),
                response.text.encode(),
            )
        )
        if len(blob) > self.max_bytes:
            return
        try:
            await self._client.set(self.redis_key(key), blob, ex=self.ttl_s)
        except Exception as exc:
            self._warn("write", exc)

    async def aclose(self) -> None:
        await self._client.aclose()


@hook
class ResponseCache:
    """Active when ``cache.enabled`` (default). Asks the server to record streams."""

    records = True

    # Closing, bound per instance to the store's own (sync or async).
    close: Callable[[], None]
    aclose: Callable[[], Awaitable[None]]
    # The store as each implementation uses it (the same object as ``store``).
    _memory: MemoryCacheStore
    _redis: RedisCacheStore

    def __init__(self, settings: Any, store: MemoryCacheStore | RedisCacheStore | None = None):
        cfg = getattr(settings, "cache", None) or CacheConfig()
        self.enabled = cfg.enabled
        self.shared = cfg.shared_across_principals
        if not self.enabled:
            return
        if store is None:
            if cfg.store == "redis":
                store = RedisCacheStore(cfg.redis_url, cfg.ttl_s, cfg.max_bytes)
            else:
                store = MemoryCacheStore(cfg.max_bytes)
        self.store = store
        if isinstance(store, RedisCacheStore):
            self._redis = store
            # The async stages shadow the sync methods on this instance (the chain tells them
            # apart by inspect.iscoroutinefunction); mypy cannot type a per-instance override.
            # The ignores below (two): with a Redis store the hook is async, its methods swapped
            # once here for their coroutine forms (Chain awaits them: is_async).
            self.on_request = self._on_request_async  # type: ignore[method-assign,assignment]
            self.on_done = self._on_done_async  # type: ignore[method-assign,assignment]
            self.aclose = store.aclose
        else:
            self._memory = store
            self.close = store.close

    def _key(self, ctx: Any) -> bytes | None:
        if not ctx.use_cache:
            return None  # the client asked for a fresh answer: no lookup, and no store at DONE
        if not ctx.sampling.deterministic:
            return None  # sampled without a seed: a new answer each time, never cached
        key = cache_key(ctx, "" if self.shared else ctx.principal.name)
        ctx.state[STATE_KEY] = key
        return key

    @staticmethod
    def _entry(ctx: Any, result: Any) -> tuple[bytes, CachedResponse] | None:
        key = ctx.state.get(STATE_KEY)
        if (
            key is None
            or result.from_cache
            or result.finish_reason not in _CACHEABLE
            or result.token_ids is None
            or result.text is None
        ):
            return None
        ids = np.array(result.token_ids, dtype=np.int32)  # our own copy, shared by every hit
        ids.flags.writeable = False
        return key, CachedResponse(ids, result.text, result.finish_reason, result.prompt_tokens)

    def on_request(self, ctx: Any) -> CachedResponse | None:
        key = self._key(ctx)
        return None if key is None else self._memory.get(key)

    def on_done(self, ctx: Any, result: Any) -> None:
        entry = self._entry(ctx, result)
        if entry is not None:
            self._memory.put(*entry)

    async def _on_request_async(self, ctx: Any) -> CachedResponse | None:
        key = self._key(ctx)
        return None if key is None else await self._redis.get(key)

    async def _on_done_async(self, ctx: Any, result: Any) -> None:
        entry = self._entry(ctx, result)
        if entry is not None:
            await self._redis.put(*entry)
