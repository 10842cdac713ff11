"""Fuzz campaign against the HTTP door of a running daemon: mutated heads, bodies and JSON
(benchmarks/_support/fuzzhttp.py: lone surrogates, deep nesting, huge numbers, wrong types, broken
headers, lying Content-Length, upgrades, long header lines), each request on its own connection
from attacker addresses 127.0.0.2 ... 127.0.0.33, while a canary on 127.0.0.1 keeps asking.

Bounded by --requests and --max-seconds. Counts: requests sent, answered (a status line came
back), closed without an answer (allowed only for bytes that are not HTTP), unanswered (nothing
within --hang-s: a failure), 500s (a failure), the daemon's descriptors and RSS before and
after, and whether it is alive with the canary served at the end. The bytes of every unanswered
request are kept (the first --keep of them, in the results file) and replayed one at a time on
the same daemon once the campaign is over, so a request the daemon never answers is told apart
from one a loaded machine answered late.

    python benchmarks/fuzz_http.py [--requests 1000000] [--max-seconds 600] [--concurrency 32]
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._canary import Canary  # noqa: E402
from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support import fuzzhttp as fh  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402


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


async def campaign(d: Daemon, args) -> dict:  # noqa: ANN001
    rng = random.Random(args.seed)
    counts: dict[str, int] = {}
    sent = 0
    deadline = time.monotonic() + args.max_seconds

    kept: list[bytes] = []

    async def worker(k: int) -> None:
        nonlocal sent
        source = f"127.0.0.{2 + k % 32}"
        while sent < args.requests and time.monotonic() < deadline:
            sent += 1
            data = fh.mutated(rng).replace(b"host: f\r\n", b"host: f\r\nconnection: close\r\n", 1)
            r = await one(d.http_port, data, source, args.hang_s)
            counts[r] = counts.get(r, 0) + 1
            if r in ("unanswered", "status500") and len(kept) < args.keep:
                kept.append(data)

    # The canaries alone first (their unattacked TTFT), then beside the attackers.
    quiet = Canary(d.http_port, d.endpoint, args.hang_s)
    await quiet.for_seconds(args.baseline_s)
    attacked = Canary(d.http_port, d.endpoint, args.hang_s)

    def attacking() -> bool:
        return sent < args.requests and time.monotonic() < deadline

    t0 = time.monotonic()
    await asyncio.gather(attacked.run(attacking), *(worker(k) for k in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    canary = {"unattacked": quiet.summary(), "attacked": attacked.summary()}
    # Replay each kept request alone: still unanswered with nothing else running is a real hang.
    replayed = [await one(d.http_port, data, "127.0.0.2", args.hang_s) for data in kept]
    return {"counts": counts, "sent": sent, "elapsed_s": elapsed,
            "kept": kept, "replayed": replayed,
            "canary": canary,
            "canary_ok": sum(len(v) for v in attacked.samples.values()),
            "canary_bad": sum(attacked.failed.values())}  # fmt: skip


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline-s", type=float, default=10.0, help="canaries alone first")
    ap.add_argument("--keep", type=int, default=100, help="unanswered requests kept and replayed")
    args = ap.parse_args()
    # Short timeouts: a lying Content-Length is answered 408 when its body timeout passes.
    env = {
        "ENGINE__BACKEND": "synthetic",
        "HTTP__HEADER_TIMEOUT_S": "2",
        "HTTP__BODY_TIMEOUT_S": "2",
    }
    started = machine()  # the commit and load when the run begins, not when it ends
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
        "machine": started,
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
        "unanswered_kept": [data.decode("latin-1") for data in res["kept"]],
        "unanswered_replayed": res["replayed"],
        "load_average_1m_end": round(os.getloadavg()[0], 2),
    }
    rows = [
        ["requests (each on its own connection)", res["sent"]],
        ["answered with a status line", c.get("answered", 0)],
        ["closed without an answer (not HTTP)", c.get("closed", 0)],
        ["unanswered within --hang-s", c.get("unanswered", 0)],
        ["500 responses", c.get("status500", 0)],
        [
            "of those, replayed alone afterwards: still unanswered / 500",
            f"{res['replayed'].count('unanswered')} / {res['replayed'].count('status500')}"
            f" (of {len(res['replayed'])} kept)",
        ],
        ["connect refused", c.get("refused", 0)],
        ["daemon alive at the end", alive],
        ["tracebacks in the daemon log", tracebacks],
        ["descriptors before / after", f"{fd0} / {fd1}"],
        ["RSS before / after (MiB)", f"{rss0:.1f} / {rss1:.1f}"],
        ["canary requests ok / failed", f"{res['canary_ok']} / {res['canary_bad']}"],
        ["elapsed (s)", f"{res['elapsed_s']:.1f}"],
    ]
    for door, name in (("http", "HTTP"), ("frames", "frame")):
        q, a = res["canary"]["unattacked"][door], res["canary"]["attacked"][door]
        rows.append([
            f"{name} canary TTFT p50 / p99 (ms): alone → under attack",
            f"{q['p50_ms']} / {q['p99_ms']} → {a['p50_ms']} / {a['p99_ms']} "
            f"({q['n']} and {a['n']} requests)",
        ])  # fmt: skip
    md = (
        f"### HTTP door fuzz\n\n{machine_line(out['machine']).rstrip('.')}; synthetic backend; "
        f"{args.concurrency} attacker connections at a time from 32 loopback addresses, seed "
        f"{args.seed}; 1-minute load average {out['load_average_1m_end']} at the end.\n\n"
        + table(["", "value"], rows)
    )
    publish(args, "fuzz_http", out, md)
    bad = c.get("unanswered", 0) + c.get("status500", 0) + (not alive) + res["canary_bad"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
