"""The canary of the hostile-client benchmarks: one client on 127.0.0.1 asking on both doors
(a streamed OpenAI chat request, a frame request through zerolayer.client.connection), its time to
first token sampled while attackers on other loopback addresses do their worst; ``in_own_process``
runs it apart from the attackers' client. Public interfaces only: sockets and the project's
client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from zerolayer.client import Client, ConnectionClosed, ServerError

HTTP_CANARY = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: canary\r\ncontent-type: application/json\r\n"
    b"connection: close\r\n%scontent-length: %d\r\n\r\n%s"
)
_BODY = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}'
DOORS = ("http", "frames")


async def http_ttft(port: int, hang_s: float, key: str = "") -> float | None:
    """Time to the first streamed event on the HTTP door, a fresh connection (None: failed);
    with ``key``, its bearer token."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), hang_s)
    except (OSError, asyncio.TimeoutError, TimeoutError):
        return None
    try:
        auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
        writer.write(HTTP_CANARY % (auth, len(_BODY), _BODY))
        seen = b""
        while b"data: {" not in seen:
            chunk = await asyncio.wait_for(reader.read(4096), hang_s)
            if not chunk:
                return None
            seen += chunk
        ttft = time.perf_counter() - t0
        while await asyncio.wait_for(reader.read(65536), hang_s):  # the rest of the stream
            pass
        return ttft if seen.startswith(b"HTTP/1.1 200") else None
    except (asyncio.TimeoutError, TimeoutError, OSError):
        return None
    finally:
        writer.close()


async def frame_ttft(endpoint: str, hang_s: float, key: str = "") -> float | None:
    """Time to the first TOKEN on the frame door, a fresh connection (None: failed); with
    ``key``, the HELLO's."""
    t0 = time.perf_counter()
    try:
        async with await Client.connect(endpoint, key or None, timeout=hang_s) as client:
            stream = await client.generate("canary", 4, cache=False)
            async for _ in stream:
                ttft = time.perf_counter() - t0
                await asyncio.wait_for(stream.collect(), hang_s)
                return ttft
    except (OSError, ServerError, ConnectionClosed, asyncio.TimeoutError, TimeoutError):
        return None
    return None


class Canary:
    """Samples both doors' TTFT every ``gap_s`` while ``run`` is awaited, into ``samples``
    and ``failed`` by door; with ``key``, as that key's client (a daemon with auth on)."""

    def __init__(self, http_port: int, endpoint: str, hang_s: float = 10.0, key: str = "") -> None:
        self.http_port = http_port
        self.endpoint = endpoint
        self.hang_s = hang_s
        self.key = key
        self.samples: dict[str, list[float]] = {d: [] for d in DOORS}
        self.failed: dict[str, int] = dict.fromkeys(DOORS, 0)

    async def run(self, go_on: Callable[[], bool], gap_s: float = 0.05) -> None:
        while go_on():
            for door, ttft in (
                ("http", await http_ttft(self.http_port, self.hang_s, self.key)),
                ("frames", await frame_ttft(self.endpoint, self.hang_s, self.key)),
            ):
                if ttft is None:
                    self.failed[door] += 1
                else:
                    self.samples[door].append(ttft)
            await asyncio.sleep(gap_s)

    async def for_seconds(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        await self.run(lambda: time.monotonic() < end)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        return {
            door: {**percentiles(self.samples[door]), "failed": self.failed[door]} for door in DOORS
        }


def percentiles(xs: list[float]) -> dict[str, float | int | None]:
    """n, p50 and p99 in ms (None without samples)."""
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    ys = sorted(xs)

    def pick(q: float) -> float:
        return round(1000 * ys[min(len(ys) - 1, int(q * len(ys)))], 2)

    return {"n": len(ys), "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


def _canary_for(http_port: int, endpoint: str, seconds: float, hang_s: float, key: str) -> dict:
    canary = Canary(http_port, endpoint, hang_s, key)
    asyncio.run(canary.for_seconds(seconds))
    return canary.summary()


def in_own_process(
    http_port: int, endpoint: str, seconds: float, hang_s: float = 10.0, key: str = ""
) -> asyncio.Future[dict]:
    """A canary running for ``seconds`` in a process of its own (the attackers' client work
    in this process must not delay it); its ``summary`` when done."""
    pool = ProcessPoolExecutor(1)
    fut = asyncio.get_running_loop().run_in_executor(
        pool, _canary_for, http_port, endpoint, seconds, hang_s, key
    )
    fut.add_done_callback(lambda _: pool.shutdown(wait=False))
    return fut
