"""Server-side Lua for the Redis stores, and the one way we run it: EVALSHA, loaded once.

Each rate-limit check is one script call, so it is atomic across every daemon sharing the Redis:
no read-modify-write race between replicas. Times come from the Redis clock (TIME), so replicas
with skewed clocks still share one bucket. Needs Redis >= 5 (scripts replicated by effects).
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError

# GCRA over two buckets. Each key holds its theoretical arrival time (TAT, microseconds on the
# Redis clock). A cost c against a limit of L per minute moves TAT by c * 60e6 / L; it is
# admitted while the new TAT is at most one window (60 s) ahead of now, i.e. while the bucket of
# capacity L has c left. Both buckets are checked before either is written.
# KEYS: request bucket, token bucket. ARGV: rpm (0 = none), tpm (0 = none), tokens.
# Returns {1, 0} when admitted, {0, retry_after_ms} when not.
RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = 60000000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {1, tonumber(ARGV[3])}
local new = {}
local wait = 0
for i = 1, 2 do
  if limits[i] > 0 then
    local tat = tonumber(redis.call('GET', KEYS[i])) or now
    if tat < now then tat = now end
    new[i] = tat + costs[i] * window / limits[i]
    local over = new[i] - now - window
    if over > wait then wait = over end
  end
end
if wait > 0 then
  return {0, math.ceil(wait / 1000)}
end
for i = 1, 2 do
  if new[i] then
    redis.call('SET', KEYS[i], string.format('%.1f', new[i]),
               'PX', math.ceil((new[i] - now) / 1000) + 1)
  end
end
return {1, 0}
"""

# Reconcile a token bucket: give back unused tokens (ARGV[2] > 0) or charge extra (< 0).
# KEYS: token bucket. ARGV: tpm, tokens. A bucket that ends full is deleted.
ADJUST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
tat = tat - tonumber(ARGV[2]) * 60000000 / tonumber(ARGV[1])
if tat <= now then
  redis.call('DEL', KEYS[1])
  return 0
end
redis.call('SET', KEYS[1], string.format('%.1f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
return 1
"""


class LuaScript:
    """One script: SCRIPT LOAD at start-up (sync client), EVALSHA per call (async client), and a
    single reload when the server answers NOSCRIPT (a restarted or flushed Redis)."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def load(self, client: Any) -> None:
        self.sha = client.script_load(self.source)

    async def __call__(self, client: Any, keys: tuple[str, ...], *args: Any) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self.sha = await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


REDIS_TIMEOUT_S = 0.5  # socket and connect timeout of every Redis call made by the hooks


def sync_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )


def async_client(url: str) -> Any:
    import redis.asyncio

    return redis.asyncio.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
