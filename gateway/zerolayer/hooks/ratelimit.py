"""Built-in hook: per-principal requests-per-minute and tokens-per-minute limits.

A request reserves ``len(prompt_ids) + max_tokens`` tokens (and one request) at admission, before
it reaches the engine, and the reservation is reconciled to ``prompt_tokens + completion_tokens``
at DONE. Concurrent requests therefore can never spend more than the bucket holds: the check and
the reservation are one atomic step (a lock in-process, one Lua script in Redis).

Buckets are GCRA (a token bucket of capacity = the per-minute limit, refilled continuously).
Two stores share one interface (``reserve``, ``adjust``): ``MemoryRateStore`` for one daemon and
``RedisRateStore`` for replicas sharing a Redis; the Redis one is async (awaited on the event
loop, never blocking it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from zerolayer.config.hooks import RateLimitConfig
from zerolayer.hooks.registry import hook
from zerolayer.hooks.types import (
    INTERNAL,
    INVALID_REQUEST,
    RATE_LIMITED,
    HookConfigError,
    HookError,
)

log = logging.getLogger("zerolayer.hooks.ratelimit")

WINDOW_US = 60_000_000.0
STATE_KEY = "ratelimit"  # ctx.state[STATE_KEY] = (name, tpm, reserved tokens)
_PRUNE_AT = 4096


class MemoryRateStore:
    """In-process GCRA buckets; thread-safe, the same arithmetic as redis_scripts.RESERVE."""

    is_async = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._rpm: dict[str, float] = {}  # name -> TAT, microseconds on self._clock
        self._tpm: dict[str, float] = {}

    def reserve(self, name: str, rpm: int, tpm: int, tokens: int) -> int:
        """Take one request and ``tokens`` tokens (a limit of 0 = none). Returns 0 when
        admitted, else the milliseconds until the same call would be admitted."""
        now = self._clock() * 1e6
        with self._lock:
            wait = 0.0
            new_r = new_t = 0.0
            if rpm:
                tat = self._rpm.get(name, now)
                new_r = (tat if tat > now else now) + WINDOW_US / rpm
                wait = new_r - now - WINDOW_US
            if tpm:
                tat = self._tpm.get(name, now)
                new_t = (tat if tat > now else now) + tokens * WINDOW_US / tpm
                wait = max(wait, new_t - now - WINDOW_US)
            if wait > 0:
                return math.ceil(wait / 1000)
            if rpm:
                self._rpm[name] = new_r
            if tpm:
                self._tpm[name] = new_t
            if len(self._tpm) + len(self._rpm) > _PRUNE_AT:
                self._prune(now)
            return 0

    def adjust(self, name: str, tpm: int, tokens: int) -> None:
        """Give ``tokens`` back to the token bucket (negative: charge them)."""
        now = self._clock() * 1e6
        with self._lock:
            tat = self._tpm.get(name, now)
            tat = (tat if tat > now else now) - tokens * WINDOW_US / tpm
            if tat <= now:
                self._tpm.pop(name, None)
            else:
                self._tpm[name] = tat

    def _prune(self, now: float) -> None:
        # Full buckets carry no information; drop them so unbounded principal names stay bounded.
        for table in (self._rpm, self._tpm):
            for name in [n for n, tat in table.items() if tat <= now]:
                del table[name]

    def close(self) -> None:
        """Nothing to release."""


class RedisRateStore:
    """Buckets in Redis under ``zerolayer:rl:{name}:rpm|tpm`` (the braces are a Redis Cluster
    hash tag: both keys of one principal live on one shard, as one script needs)."""

    is_async = True

    def __init__(self, url: str) -> None:
        from redis.exceptions import RedisError

        from zerolayer.hooks import redis_scripts

        self._reserve = redis_scripts.LuaScript(redis_scripts.RESERVE)
        self._adjust = redis_scripts.LuaScript(redis_scripts.ADJUST)
        probe = redis_scripts.sync_client(url)
        try:
            # Fail the start, not the first request, when Redis is unreachable; loading also
            # compiles the scripts once.
            self._reserve.load(probe)
            self._adjust.load(probe)
        except RedisError as exc:
            raise HookConfigError(f"ratelimit.redis_url {url}: {exc}") from exc
        finally:
            probe.close()
        self._client = redis_scripts.async_client(url)

    async def reserve(self, name: str, rpm: int, tpm: int, tokens: int) -> int:
        prefix = f"zerolayer:rl:{{{name}}}"
        keys = (prefix + ":rpm", prefix + ":tpm")
        ok, wait = await self._reserve(self._client, keys, rpm, tpm, tokens)
        return 0 if ok else max(1, int(wait))

    async def adjust(self, name: str, tpm: int, tokens: int) -> None:
        await self._adjust(self._client, (f"zerolayer:rl:{{{name}}}:tpm",), tpm, tokens)

    async def aclose(self) -> None:
        await self._client.aclose()


@hook
class RateLimiter:
    """Active when ``ratelimit.enabled`` (default). Effective limits: the principal's own,
    else ``ratelimit.default_rpm``/``default_tpm``; None everywhere = not limited."""

    # Closing, bound per instance to the store's own (sync or async).
    close: Callable[[], None]
    aclose: Callable[[], Awaitable[None]]
    # The store as each implementation uses it (the same object as ``store``).
    _memory: MemoryRateStore
    _redis: RedisRateStore

    def __init__(self, settings: Any, store: MemoryRateStore | RedisRateStore | None = None):
        cfg = getattr(settings, "ratelimit", None) or RateLimitConfig()
        self.enabled = cfg.enabled
        self._default_rpm = cfg.default_rpm
        self._default_tpm = cfg.default_tpm
        if not self.enabled:
            return
        if store is None:
            store = RedisRateStore(cfg.redis_url) if cfg.store == "redis" else MemoryRateStore()
        self.store = store
        if isinstance(store, RedisRateStore):
            self._redis = store
            # The async stages shadow the sync methods on this instance (the chain tells them
            # apart by inspect.iscoroutinefunction); mypy cannot type a per-instance override.
            # The ignores below (three): with a Redis store the hook is async, its methods
            # swapped once here for their coroutine forms (Chain awaits them: is_async).
            self.on_request = self._on_request_async  # type: ignore[method-assign,assignment]
            self.on_refused = self._on_refused_async  # type: ignore[method-assign,assignment]
            self.on_done = self._on_done_async  # type: ignore[method-assign,assignment]
            self.aclose = store.aclose
        else:
            self._memory = store
            self.close = store.close

    def apply_settings(self, settings: Any) -> tuple[str, ...]:
        """SIGHUP: the default limits change live (the store does not: a restart)."""
        cfg = settings.ratelimit
        self._default_rpm = cfg.default_rpm
        self._default_tpm = cfg.default_tpm
        return ("ratelimit.default_rpm", "ratelimit.default_tpm")

    def _admission(self, ctx: Any) -> tuple[str, int, int, int] | None:
        p = ctx.principal
        rpm = p.rpm if p.rpm is not None else self._default_rpm
        tpm = p.tpm if p.tpm is not None else self._default_tpm
        if rpm is None and tpm is None:
            return None
        tokens = len(ctx.prompt_ids) + ctx.max_tokens
        if tpm is not None and tokens > tpm:
            # No wait would ever admit it, so RATE_LIMITED (retryable) would be a lie.
            raise HookError(
                INVALID_REQUEST,
                f"request needs {tokens} tokens (prompt {len(ctx.prompt_ids)} + max_tokens "
                f"{ctx.max_tokens}) but {p.name!r} may use at most {tpm} tokens per minute; "
                "lower max_tokens or shorten the prompt",
            )
        return p.name, rpm or 0, tpm or 0, tokens

    @staticmethod
    def _refusal(name: str, rpm: int, tpm: int, wait_ms: int) -> HookError:
        limits = ", ".join(f"{v} {k}" for k, v in (("rpm", rpm), ("tpm", tpm)) if v)
        message = f"rate limit of {name!r} reached ({limits}); retry in {wait_ms} ms"
        return HookError(RATE_LIMITED, message, wait_ms)

    # ---- in-process store: plain calls ----

    def on_request(self, ctx: Any) -> None:
        adm = self._admission(ctx)
        if adm is None:
            return
        name, rpm, tpm, tokens = adm
        wait = self._memory.reserve(name, rpm, tpm, tokens)
        if wait:
            raise self._refusal(name, rpm, tpm, wait)
        if tpm:
            ctx.state[STATE_KEY] = (name, tpm, tokens)

    def on_refused(self, ctx: Any, error: HookError) -> None:
        # A later hook refused: give the tokens back (the request itself still counts).
        held = ctx.state.pop(STATE_KEY, None)
        if held is not None:
            self._memory.adjust(held[0], held[1], held[2])

    def on_done(self, ctx: Any, result: Any) -> None:
        held = ctx.state.pop(STATE_KEY, None)
        if held is not None:
            unused = held[2] - (result.prompt_tokens + result.completion_tokens)
            if unused:
                self._memory.adjust(held[0], held[1], unused)

    # ---- Redis store: awaited ----

    async def _on_request_async(self, ctx: Any) -> None:
        adm = self._admission(ctx)
        if adm is None:
            return
        name, rpm, tpm, tokens = adm
        try:
            wait = await self._redis.reserve(name, rpm, tpm, tokens)
        except Exception as exc:
            # Fail closed: a limit that silently stops limiting is worse than a refused request.
            log.warning("rate-limit store unavailable: %s", exc)
            raise HookError(INTERNAL, f"rate-limit store unavailable: {exc}") from exc
        if wait:
            raise self._refusal(name, rpm, tpm, wait)
        if tpm:
            ctx.state[STATE_KEY] = (name, tpm, tokens)

    async def _on_refused_async(self, ctx: Any, error: HookError) -> None:
        held = ctx.state.pop(STATE_KEY, None)
        if held is not None:
            await self._redis.adjust(held[0], held[1], held[2])

    async def _on_done_async(self, ctx: Any, result: Any) -> None:
        held = ctx.state.pop(STATE_KEY, None)
        if held is not None:
            unused = held[2] - (result.prompt_tokens + result.completion_tokens)
            if unused:
                await self._redis.adjust(held[0], held[1], unused)
