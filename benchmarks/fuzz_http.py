"""Fuzz campaign against the HTTP door of a running daemon: mutated heads, bodies and JSON
(tests/support/fuzzhttp.py: lone surrogates, deep nesting, huge numbers, wrong types, broken
headers, lying Content-Length, upgrades, long header lines), each request on its own connection
from attacker addresses 127.0.0.2 ... 127.0.0.33, while a canary on 127.0.0.1 keeps asking.

Bounded by --requests and --max-seconds. Counts: requests sent, answered (a status line came
back), closed without an answer (allowed only for bytes that are not HTTP), unanswered (nothing
within --hang-s: a failure), 500s (a failure), the daemon's descriptors and RSS before and
after, and whether it is alive with the canary served at the end.

    python benchmarks/fuzz_http.py [--requests 1000000] [--max-seconds 600] [--concurrency 32]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from gateway.client import Client, ConnectionClosed, ServerError  # noqa: E402
from tests.support import fuzzhttp as fh  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402

CANARY = fh.request(b"/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],'
                    b'"max_tokens":4,"stream":true}', b"connection: close\r\n")  # fmt: skip


def fds(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


async def one(port: int, data: bytes, source: str, hang_s: float) -> str:
    """'answered' / 'closed' / 'unanswered' / 'status500' / 'refused' (connect failed)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError:
        return "refused"
    try:
        writer.write(data)
        head = await asyncio.wait_for(reader.read(12), hang_s)
        if head.startswith(b"HTTP/1.1 500"):
            return "status500"
        if head.startswith(b"HTTP/1."):
            return "answered"
        return "closed" if not head else "garbage"
    except (asyncio.TimeoutError, TimeoutError):
        return "unanswered"
    except OSError:
        return "closed"
    finally:
        writer.close()


async def http_ttft(port: int, hang_s: float) -> float | None:
    """The canary's time to its first streamed event on the HTTP door (None: it failed)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    try:
        writer.write(CANARY)
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


async def frame_ttft(endpoint: str) -> float | None:
    """The canary's time to its first TOKEN on the frame door, a fresh connection each time
    (None: it failed)."""
    t0 = time.perf_counter()
    try:
        async with await Client.connect(endpoint) as client:
            stream = await client.generate("canary", 4, cache=False)
            async for _ in stream:
                ttft = time.perf_counter() - t0
                await stream.collect()
                return ttft
    except (OSError, ServerError, ConnectionClosed):
        return None
    return None


def percentiles(xs: list[float]) -> dict[str, float | None]:
    """p50 and p99 in ms (None without samples)."""
    if not xs:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    ys = sorted(xs)
    pick = lambda q: round(1000 * ys[min(len(ys) - 1, int(q * len(ys)))], 2)  # noqa: E731
    return {"n": len(ys), "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


async def canaries(d: Daemon, until: object, samples: dict[str, list[float]],
                   failed: dict[str, int], hang_s: float) -> None:  # fmt: skip
    """Both doors' canaries from 127.0.0.1, one request each every 50 ms, while ``until()``."""
    while until():  # type: ignore[operator]
        for door, ttft in (
            ("http", await http_ttft(d.http_port, hang_s)),
            ("frames", await frame_ttft(d.endpoint)),
        ):
            if ttft is None:
                failed[door] = failed.get(door, 0) + 1
            else:
                samples.setdefault(door, []).append(ttft)
        await asyncio.sleep(0.05)


async def campaign(d: Daemon, args) -> dict:  # noqa: ANN001
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    sent = 0
    deadline = time.monotonic() + args.max_seconds

    async def worker(k: int) -> None:
        nonlocal sent
        source = f"127.0.0.{2 + k % 32}"
        while sent < args.requests and time.monotonic() < deadline:
            sent += 1
            data = fh.mutated(rng).replace(b"host: f\r\n", b"host: f\r\nconnection: close\r\n", 1)
            r = await one(d.http_port, data, source, args.hang_s)
            counts[r] = counts.get(r, 0) + 1

    # The canaries alone first (their unattacked TTFT), then beside the attackers.
    quiet: dict[str, list[float]] = {}
    attacked: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    quiet_end = time.monotonic() + args.baseline_s
    await canaries(d, lambda: time.monotonic() < quiet_end, quiet, failed, args.hang_s)
    failed_quiet = dict(failed)
    failed.clear()

    def attacking() -> bool:
        return sent < args.requests and time.monotonic() < deadline

    t0 = time.monotonic()
    await asyncio.gather(
        canaries(d, attacking, attacked, failed, args.hang_s),
        *(worker(k) for k in range(args.concurrency)),
    )
    canary = {
        door: {"unattacked": percentiles(quiet.get(door, [])),
               "attacked": percentiles(attacked.get(door, [])),
               "failed_unattacked": failed_quiet.get(door, 0),
               "failed_attacked": failed.get(door, 0)}
        for door in ("http", "frames")
    }  # fmt: skip
    return {"counts": counts, "sent": sent, "elapsed_s": time.monotonic() - t0,
            "canary": canary,
            "canary_ok": sum(len(v) for v in attacked.values()),
            "canary_bad": sum(failed.values())}  # fmt: skip


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline-s", type=float, default=10.0, help="canaries alone first")
    args = ap.parse_args()
    # Short timeouts: a lying Content-Length is answered 408 when its body timeout passes.
    env = {
        "ENGINE__BACKEND": "synthetic",
        "HTTP__HEADER_TIMEOUT_S": "2",
        "HTTP__BODY_TIMEOUT_S": "2",
    }
    with Daemon(env) as d:
        import uvloop

        time.sleep(0.5)
        fd0, rss0 = fds(d), d.rss_mb()
        res = uvloop.run(campaign(d, args))
        time.sleep(2.0)  # connections the daemon closes after answering are gone by then
        fd1, rss1 = fds(d), d.rss_mb()
        alive = d.proc.poll() is None
        tracebacks = d.log.count("Traceback")
    c = res["counts"]
    out = {
        "machine": machine(),
        "args": {k: v for k, v in vars(args).items() if k != "write"},
        "requests": res["sent"],
        "counts": c,
        "elapsed_s": round(res["elapsed_s"], 1),
        "fds_before": fd0,
        "fds_after": fd1,
        "rss_before_mb": round(rss0, 1),
        "rss_after_mb": round(rss1, 1),
        "alive": alive,
        "tracebacks": tracebacks,
        "canary_ok": res["canary_ok"],
        "canary_failed": res["canary_bad"],
        "canary_ttft": res["canary"],
    }
    rows = [
        ["requests (each on its own connection)", res["sent"]],
        ["answered with a status line", c.get("answered", 0)],
        ["closed without an answer (not HTTP)", c.get("closed", 0)],
        ["unanswered within --hang-s", c.get("unanswered", 0)],
        ["500 responses", c.get("status500", 0)],
        ["connect refused", c.get("refused", 0)],
        ["daemon alive at the end", alive],
        ["tracebacks in the daemon log", tracebacks],
        ["descriptors before / after", f"{fd0} / {fd1}"],
        ["RSS before / after (MiB)", f"{rss0:.1f} / {rss1:.1f}"],
        ["canary requests ok / failed", f"{res['canary_ok']} / {res['canary_bad']}"],
        ["elapsed (s)", f"{res['elapsed_s']:.1f}"],
    ]
    for door, name in (("http", "HTTP"), ("frames", "frame")):
        q, a = res["canary"][door]["unattacked"], res["canary"][door]["attacked"]
        rows.append([
            f"{name} canary TTFT p50 / p99 (ms): alone → under attack",
            f"{q['p50_ms']} / {q['p99_ms']} → {a['p50_ms']} / {a['p99_ms']} "
            f"({q['n']} and {a['n']} requests)",
        ])  # fmt: skip
    md = (
        f"### HTTP door fuzz\n\n{machine_line(out['machine'])}; synthetic backend; "
        f"{args.concurrency} attacker connections at a time from 32 loopback addresses, seed "
        f"{args.seed}; run while other engineers' jobs shared the 2 cores.\n\n"
        + table(["", "value"], rows)
    )
    publish(args, "fuzz_http", out, md)
    bad = c.get("unanswered", 0) + c.get("status500", 0) + (not alive) + res["canary_bad"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
