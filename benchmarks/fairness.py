"""Fairness of admission: one client with many queued streams vs another with a single request.

A daemon (synthetic backend, paced steps, 32 slots) on loopback. Connection A sends STREAMS
requests of A_TOKENS tokens at once; when A's first token arrives, connection B sends one
request of B_TOKENS tokens. Reported: B's time to first token and to DONE, and how many of A's
streams had finished by then. With first-come first-served admission B waits behind all of A's
queue; with round robin by client it takes the next free slot. Loopback only, bounded.

    python benchmarks/fairness.py [--streams 256] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.frames import protocol as p  # noqa: E402

HDR = p.HEADER


async def frame(reader: asyncio.StreamReader) -> tuple[int, int]:
    length, ftype, _, _, stream = HDR.unpack(await reader.readexactly(12))
    await reader.readexactly(length)
    return ftype, stream


async def run(host: str, port: int, args: argparse.Namespace) -> dict:
    ra, wa = await asyncio.open_connection(host, port)
    # B from another loopback address: anonymous clients are one principal per address
    rb, wb = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
    wa.write(b"".join(p.encode_request(2 * i + 1, [5, 6, i % 200 + 1], args.a_tokens)
                      for i in range(args.streams)))  # fmt: skip
    a_done = 0
    b: dict[str, float] = {}
    first_a = asyncio.Event()

    async def read_a() -> None:
        nonlocal a_done
        while a_done < args.streams:
            ftype, _ = await asyncio.wait_for(frame(ra), 120)
            if ftype == p.FrameType.TOKEN:
                first_a.set()
            elif ftype in (p.FrameType.DONE, p.FrameType.ERROR):
                a_done += 1

    async def read_b() -> None:
        await first_a.wait()
        t0 = time.perf_counter()
        wb.write(p.encode_request(1, [7, 8, 9], args.b_tokens))
        while True:
            ftype, _ = await asyncio.wait_for(frame(rb), 120)
            if ftype == p.FrameType.TOKEN and "ttft_s" not in b:
                b["ttft_s"] = time.perf_counter() - t0
                b["a_done_at_b_first_token"] = a_done
            elif ftype == p.FrameType.DONE:
                b["total_s"] = time.perf_counter() - t0
                return

    await asyncio.gather(read_a(), read_b())
    wa.close()
    wb.close()
    return b


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=256, help="client A's streams (one connection)")
    ap.add_argument("--a-tokens", type=int, default=100)
    ap.add_argument("--b-tokens", type=int, default=50)
    ap.add_argument("--step-ms", type=float, default=5.0, help="synthetic engine step time")
    args = ap.parse_args()
    env = {
        "ENGINE__SYNTHETIC_STEP_MS": str(args.step_ms),
        "ENGINE__MAX_BATCH_SIZE": "32",
        "CACHE__ENABLED": "false",
    }
    with Daemon(env) as d:
        result = asyncio.run(run(d.host, d.port, args))
        d.terminate()
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    result.update(machine=machine(), args=vars(args))
    md = (
        "## Fairness: a single request beside a client with a deep queue\n\n"
        f"`python benchmarks/fairness.py --streams {args.streams}` — synthetic backend, "
        f"{args.step_ms:g} ms per step, 32 slots. Client A queues {args.streams} streams of "
        f"{args.a_tokens} tokens on one connection; when A's first token arrives, client B sends "
        f"one request of {args.b_tokens} tokens on its own connection from another address "
        "(127.0.0.2: anonymous clients are one principal per address).\n\n"
        + table(
            ["B's time to first token", "B's total", "A's streams finished before B's first token"],
            [
                [
                    f"{result['ttft_s']:.3f} s",
                    f"{result['total_s']:.3f} s",
                    f"{result['a_done_at_b_first_token']} of {args.streams}",
                ]
            ],
        )  # fmt: skip
        + "\n\n"
        + machine_line(result["machine"])
    )
    publish(args, "fairness", result, md)


if __name__ == "__main__":
    main()
