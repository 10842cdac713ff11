"""Connection scale: memory per idle connection, accept rate, and many active streams at once.

A daemon (synthetic backend) on loopback; this process opens N connections, each sending HELLO
and waiting for WELCOME, and holds them idle. Reported: the daemon's resident memory (VmRSS)
before and after, per connection; connections accepted per second (connect + HELLO + WELCOME,
CONCURRENCY at a time). Then ACTIVE streams at once over ACTIVE / 10 of those connections, at a
paced engine step (engine.synthetic_step_ms), each of TOKENS tokens: every one must end in DONE
with all its tokens. Bounded in count and time; loopback only.

    python benchmarks/connections.py [--connections 10000] [--active 1000] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.frames import protocol as p  # noqa: E402

HDR = p.HEADER


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    length, ftype, _, _, stream = HDR.unpack(await reader.readexactly(12))
    return ftype, stream, await reader.readexactly(length)


async def open_idle(host: str, port: int, n: int, concurrency: int) -> list:
    conns: list = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(p.encode_hello(b"", version=1))  # no version 2 field is used
            ftype, _, _ = await asyncio.wait_for(read_frame(reader), 30)
            if ftype != p.FrameType.WELCOME:
                raise RuntimeError(f"expected WELCOME, got frame type {ftype}")
            conns.append((reader, writer))

    await asyncio.gather(*(one() for _ in range(n)))
    return conns


async def run_active(conns: list, active: int, tokens: int) -> dict:
    per_conn = 10
    users = conns[: max(1, active // per_conn)]
    done = 0
    token_count = 0

    async def stream_batch(i: int, reader, writer) -> None:  # noqa: ANN001
        nonlocal done, token_count
        streams = {2 * k + 1 for k in range(per_conn)}
        for s in streams:
            writer.write(p.encode_request(s, [1 + i % 200, 2, 3], tokens))
        while streams:
            ftype, stream, payload = await asyncio.wait_for(read_frame(reader), 60)
            if ftype == p.FrameType.TOKEN:
                token_count += len(p.parse_token(memoryview(payload))[0])
            elif ftype == p.FrameType.DONE:
                if p.parse_done(memoryview(payload)).completion_tokens != tokens:
                    raise RuntimeError("a stream ended short")
                streams.discard(stream)
                done += 1
            else:
                raise RuntimeError(f"unexpected frame type {ftype}")

    t0 = time.perf_counter()
    await asyncio.gather(*(stream_batch(i, r, w) for i, (r, w) in enumerate(users)))
    wall = time.perf_counter() - t0
    return {"streams": done, "tokens": token_count, "wall_s": round(wall, 3)}


async def measure(args: argparse.Namespace, d: Daemon) -> dict:
    gc.collect()
    rss0 = rss_kib(d.proc.pid)
    t0 = time.perf_counter()
    conns = await open_idle(d.host, d.port, args.connections, args.concurrency)
    accept_s = time.perf_counter() - t0
    await asyncio.sleep(1.0)
    rss1 = rss_kib(d.proc.pid)
    active = await run_active(conns, args.active, args.tokens)
    rss2 = rss_kib(d.proc.pid)
    for _, writer in conns:
        writer.close()
    return {
        "connections": len(conns),
        "rss_before_kib": rss0,
        "rss_idle_kib": rss1,
        "rss_after_active_kib": rss2,
        "kib_per_idle_connection": round((rss1 - rss0) / len(conns), 2),
        "accept_per_s": round(len(conns) / accept_s),
        "active": active,
    }


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=200, help="connections opened at a time")
    ap.add_argument("--active", type=int, default=1000, help="streams at once (10 a connection)")
    ap.add_argument("--tokens", type=int, default=50, help="tokens per active stream")
    ap.add_argument("--step-ms", type=float, default=5.0, help="synthetic engine step time")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 200
    if need > hard:
        sys.exit(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    env = {
        "ENGINE__SYNTHETIC_STEP_MS": str(args.step_ms),
        "ENGINE__MAX_BATCH_SIZE": "256",
        "ENGINE__MAX_QUEUE": str(max(1024, args.active)),
        "SERVER__MAX_CONNECTIONS": str(args.connections + 100),
        "SERVER__MAX_CONNECTIONS_PER_IP": "0",
        "SERVER__MAX_CONNECTIONS_PER_PRINCIPAL": "0",
        "SERVER__IDLE_TIMEOUT_S": "600",
        "SERVER__BACKLOG": "4096",
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as d:
        result = asyncio.run(measure(args, d))
        d.terminate()
    result.update(
        settings="default server settings (read_buffer_bytes 4096) but for the limits above",
        machine=machine(),
        step_ms=args.step_ms,
    )
    act = result["active"]
    md = (
        "## Connection scale: memory per idle connection, accept rate, active streams\n\n"
        f"`python benchmarks/connections.py --connections {args.connections} --active "
        f"{args.active}` — a daemon (synthetic backend, step {args.step_ms:g} ms) on loopback; "
        "this process opens the connections (each HELLO → WELCOME, "
        f"{args.concurrency} at a time) and holds them idle, then runs {args.active} streams "
        f"of {args.tokens} tokens at once over {max(1, args.active // 10)} of them.\n\n"
        + table(
            ["measure", "value"],
            [
                ["idle connections held", f"{result['connections']:,}"],
                [
                    "daemon RSS before / with them idle",
                    f"{result['rss_before_kib'] / 1024:.1f} MiB"
                    f" / {result['rss_idle_kib'] / 1024:.1f} MiB",
                ],
                ["memory per idle connection", f"{result['kib_per_idle_connection']:.1f} KiB"],
                ["accept rate (connect + HELLO + WELCOME)", f"{result['accept_per_s']:,} /s"],
                [
                    "active streams completed with all tokens",
                    f"{act['streams']:,} ({act['tokens']:,} tokens in {act['wall_s']} s)",
                ],
                [
                    "daemon RSS after the active streams",
                    f"{result['rss_after_active_kib'] / 1024:.1f} MiB",
                ],
            ],
        )  # fmt: skip
        + "\n\nRSS is the daemon's VmRSS. The file-descriptor limit must allow the connections: "
        "the systemd unit sets `LimitNOFILE=1048576`; the daemon raises its soft limit to the "
        "hard one at start.\n\n" + machine_line(result["machine"])
    )
    publish(args, "connections", result, md)


if __name__ == "__main__":
    main()
