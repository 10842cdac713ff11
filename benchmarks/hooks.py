"""Hook chain cost: microseconds per request of Chain.on_request + Chain.on_done.

Variants, each run side by side in one process on the same pre-built requests:
- empty: auth off, rate limit off, cache off (the loop over empty tuples: the floor).
- built-ins, in-process stores, with a key authenticated at HELLO and limits that never refuse:
  * sampled: auth + rate limit; the cache skips the request (not deterministic)
  * greedy miss: auth + rate limit + cache key, lookup miss, store at DONE
  * greedy hit: auth + rate limit + cache key, lookup hit (served from the cache)
- Redis stores (a real redis-server on loopback, started here): rate limit + cache, awaited on
  a uvloop loop (as in the daemon) one request at a time (on_request_async, then on_done_async
  so the DONE work is counted); the empty chain through the same awaited calls is its baseline.
Prompts are PROMPT_LEN int32 ids, completions COMPLETION_LEN ids with text.

    python benchmarks/hooks.py [--n 20000] [--redis-n 2000] [--runs 5] [--write]
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.redis_server import RedisServer  # noqa: E402
from zerolayer.config.hooks import CacheConfig, HooksConfig, RateLimitConfig  # noqa: E402
from zerolayer.config.settings import AuthConfig  # noqa: E402
from zerolayer.hooks import Chain, Completion, RequestContext  # noqa: E402
from zerolayer.hooks.keys import add_key  # noqa: E402

PROMPT_LEN = 128
COMPLETION_LEN = 64
BIG = 10**12  # limits that never refuse: we measure the cost of checking, not of refusing


def settings(keys_file: str | None, ratelimit: RateLimitConfig, cache: CacheConfig):
    return SimpleNamespace(
        hooks=HooksConfig(),
        auth=AuthConfig(enabled=keys_file is not None, keys_file=keys_file or "unused"),
        ratelimit=ratelimit,
        cache=cache,
    )


def requests(principal, n: int, greedy: bool, distinct: bool) -> list[RequestContext]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, PROMPT_LEN, dtype=np.int32)
    out = []
    for i in range(n):
        ids = base.copy()
        if distinct:
            ids[0], ids[1] = i % 32000, i // 32000
        out.append(
            RequestContext(
                principal,
                "bench",
                ids,
                0,
                COMPLETION_LEN,
                0.0 if greedy else 0.8,
                1.0,
                0,
                None,
                (),
                (),
                True,
                {},
            )  # fmt: skip
        )
    return out


def completion() -> Completion:
    ids = np.arange(COMPLETION_LEN, dtype=np.int32)
    return Completion(1, PROMPT_LEN, COMPLETION_LEN, ids, "word " * COMPLETION_LEN, False)


def run_sync(chain: Chain, ctxs: list[RequestContext], done: Completion) -> float:
    """Mean microseconds per request over ctxs."""
    on_request, on_done = chain.on_request, chain.on_done
    hit = Completion(1, PROMPT_LEN, COMPLETION_LEN, done.token_ids, done.text, True)
    gc.disable()
    t0 = time.perf_counter_ns()
    for ctx in ctxs:
        cached = on_request(ctx)
        on_done(ctx, done if cached is None else hit)
    elapsed = time.perf_counter_ns() - t0
    gc.enable()
    return elapsed / len(ctxs) / 1000


async def run_async(chain: Chain, ctxs: list[RequestContext], done: Completion) -> float:
    on_request, on_done = chain.on_request_async, chain.on_done_async
    hit = Completion(1, PROMPT_LEN, COMPLETION_LEN, done.token_ids, done.text, True)
    t0 = time.perf_counter_ns()
    for ctx in ctxs:
        cached = await on_request(ctx)
        await on_done(ctx, done if cached is None else hit)
    return (time.perf_counter_ns() - t0) / len(ctxs) / 1000


def measure_memory(n: int, runs: int, keys_file: str, key: str) -> dict[str, float]:
    off = settings(None, RateLimitConfig(enabled=False), CacheConfig(enabled=False))
    on = settings(keys_file, RateLimitConfig(default_rpm=BIG, default_tpm=BIG), CacheConfig())
    done = completion()
    results: dict[str, list[float]] = {k: [] for k in ("empty", "sampled", "miss", "hit")}
    for _ in range(runs):
        empty = Chain.build(off)
        results["empty"].append(run_sync(empty, requests(empty.anonymous(), n, True, True), done))
        chain = Chain.build(on)
        principal = chain.on_hello(key.encode())
        results["sampled"].append(run_sync(chain, requests(principal, n, False, True), done))
        results["miss"].append(run_sync(chain, requests(principal, n, True, True), done))
        results["hit"].append(run_sync(chain, requests(principal, n, True, False), done))
        chain.close()
    return {k: statistics.median(v) for k, v in results.items()}


def measure_redis(n: int, runs: int, keys_file: str, key: str) -> dict[str, float]:
    done = completion()
    results: dict[str, list[float]] = {k: [] for k in ("empty", "sampled", "miss", "hit")}
    with RedisServer() as server:
        redis_on = settings(
            keys_file,
            RateLimitConfig(store="redis", redis_url=server.url, default_rpm=BIG, default_tpm=BIG),
            CacheConfig(store="redis", redis_url=server.url),
        )
        off = settings(None, RateLimitConfig(enabled=False), CacheConfig(enabled=False))

        async def one_run() -> None:
            empty = Chain.build(off)
            ctxs = requests(empty.anonymous(), n, True, True)
            results["empty"].append(await run_async(empty, ctxs, done))
            chain = Chain.build(redis_on)
            principal = chain.on_hello(key.encode())
            for name, greedy, distinct in (
                ("sampled", False, True),
                ("miss", True, True),
                ("hit", True, False),
            ):
                results[name].append(
                    await run_async(chain, requests(principal, n, greedy, distinct), done)
                )
            await chain.aclose()

        for _ in range(runs):
            server.flush()
            uvloop.run(one_run())  # the daemon's event loop
    return {k: statistics.median(v) for k, v in results.items()}


ROWS = (
    ("empty", "no hooks (baseline)"),
    ("sampled", "auth + rate limit (cache skips: sampled)"),
    ("miss", "auth + rate limit + cache miss, stored at DONE"),
    ("hit", "auth + rate limit + cache hit"),
)


def main() -> None:
    ap = parser()
    ap.add_argument("--n", type=int, default=20000, help="requests per in-process measurement")
    ap.add_argument("--redis-n", type=int, default=2000, help="requests per Redis measurement")
    ap.add_argument("--runs", type=int, default=5, help="runs per variant; the median is kept")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        keys_file = str(Path(tmp) / "keys.toml")
        for i in range(99):  # HELLO compares against every key; give it a realistic table
            add_key(keys_file, f"tenant{i}")
        key = add_key(keys_file, "bench")
        mem = measure_memory(args.n, args.runs, keys_file, key)
        red = measure_redis(args.redis_n, args.runs, keys_file, key)

    m = machine()
    rows = []
    for k, label in ROWS:
        rows.append(
            [
                label,
                f"{mem[k]:.2f}",
                "-" if k == "empty" else f"+{mem[k] - mem['empty']:.2f}",
                f"{red[k]:.1f}",
                "-" if k == "empty" else f"+{red[k] - red['empty']:.1f}",
            ]
        )
    headers = [
        "chain",
        "in-process µs/request",
        "vs no hooks",
        "Redis µs/request",
        "vs no hooks (awaited)",
    ]
    md = "\n".join(
        [
            "## Hook chain cost",
            "",
            "`benchmarks/hooks.py`: mean microseconds per request of `Chain.on_request` + "
            "`Chain.on_done` (median of "
            f"{args.runs} runs; {args.n} requests per in-process run, {args.redis_n} per Redis "
            f"run, one at a time; prompts of {PROMPT_LEN} ids, completions of {COMPLETION_LEN} "
            "ids with text; 100 keys in the keys file). Redis: a local redis-server on loopback, "
            "uvloop; each request awaits its rate-limit script and cache read, and its DONE work "
            "(reconcile script, cache write) before the next starts.",
            "",
            table(headers, rows),
            "",
            machine_line(m),
        ]
    )
    publish(
        args,
        "hooks",
        {
            "machine": m,
            "n": args.n,
            "redis_n": args.redis_n,
            "runs": args.runs,
            "prompt_len": PROMPT_LEN,
            "completion_len": COMPLETION_LEN,
            "us_per_request": {"memory": mem, "redis": red},
        },
        md,
    )


if __name__ == "__main__":
    main()
