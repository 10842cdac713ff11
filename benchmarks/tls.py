"""TLS's cost per streamed token: server CPU per token, plain TCP vs TLS 1.3 vs mutual TLS.

The same daemon configuration (synthetic backend, step time 0, response cache off) serves the same
load three ways, side by side in one run: plain TCP (the baseline), TLS 1.3 with a server
certificate, and TLS 1.3 with a client certificate (mutual TLS). Certificates are made at start
(benchmarks/_support/certs.py, ECDSA P-256). The load client runs in its own process: ROUNDS rounds
of STREAMS concurrent streams x TOKENS tokens, spread over CONNECTIONS connections (token-id
prompts, no text). Server CPU = run time of the daemon's threads (schedstat, ns) across the load, so
the handshakes (one per connection per run) are included.

    python benchmarks/tls.py [--streams 64] [--tokens 256] [--rounds 60] [--connections 1 8 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import (  # noqa: E402
    cpu_seconds,
    machine,
    machine_line,
    parser,
    per_token,
    publish,
    table,
)
from benchmarks._support import fuzzframes as ff  # noqa: E402
from benchmarks._support.certs import CA  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.ops.tls import client_context  # noqa: E402

CIPHERS: set[str] = set()  # what the client's connections negotiated


# --------------------------------------------------------------------------- load client


async def _connection(port, ctx, streams: list[int], tokens: int, rounds: int, nonce: int) -> int:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1" if ctx else None
    )
    sslobj = writer.get_extra_info("ssl_object")
    CIPHERS.add(f"{sslobj.version()} {sslobj.cipher()[0]}" if sslobj else "plain")
    received = 0
    for r in range(rounds):
        batch = b""
        for s in streams:  # unique prompts: no response-cache hits even if it were on
            payload = ff.REQ.pack(tokens, 0.0, 1.0, 0, 0, 0, 0, 0) + struct.pack(
                "<4i", 72, nonce, r, s
            )
            batch += ff.frame(ff.REQUEST, s, payload)
        writer.write(batch)
        buf, done = b"", 0
        while done < len(streams):
            data = await reader.read(1 << 20)
            if not data:
                raise SystemExit("server closed the connection")
            frames, buf = ff.split_frames(buf + data)
            for ftype, _, payload in frames:
                if ftype == ff.TOKEN:
                    received += struct.unpack_from("<H", payload)[0]
                elif ftype == ff.DONE:
                    done += 1
                elif ftype == ff.ERROR:
                    raise SystemExit(f"server answered ERROR: {payload[8:]!r}")
    writer.close()
    return received


def run_client(args: argparse.Namespace) -> None:
    import uvloop

    ctx = None
    if args.ca:
        ctx = client_context(args.ca, args.cert or None, args.key or None)

    async def main() -> None:
        nonce = int(time.time_ns() % 100_000)
        ids = list(range(1, args.streams + 1))
        groups = [ids[i :: args.conns] for i in range(args.conns)]
        t0 = time.perf_counter()
        got = await asyncio.gather(
            *(_connection(args.client, ctx, g, args.tokens, args.rounds, nonce) for g in groups)
        )
        elapsed = time.perf_counter() - t0
        print(json.dumps({"tokens": sum(got), "seconds": elapsed, "tls": sorted(CIPHERS)}))

    uvloop.run(main())


def load(d: Daemon, args: argparse.Namespace, conns: int, tls: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--client", str(d.port), "--conns", str(conns)]
    cmd += ["--streams", str(args.streams), "--tokens", str(args.tokens)]
    cmd += ["--rounds", str(args.rounds), *tls]
    cpu0 = cpu_seconds(d.proc.pid)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    cpu = cpu_seconds(d.proc.pid) - cpu0
    res = json.loads(out.stdout)
    want = args.streams * args.tokens * args.rounds
    if res["tokens"] != want:
        raise SystemExit(f"expected {want} tokens, got {res['tokens']}")
    return {"cpu_s": cpu, "wall_s": res["seconds"], "tokens": res["tokens"], "tls": res["tls"]}


def summarize(runs: list[dict]) -> dict:
    return {**per_token(runs), "tls": runs[0]["tls"]}


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=60, help="load rounds per measured run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--conns", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--ca", default="", help=argparse.SUPPRESS)
    ap.add_argument("--cert", default="", help=argparse.SUPPRESS)
    ap.add_argument("--key", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return run_client(args)

    tmp = Path(tempfile.mkdtemp(prefix="zl-tls-bench-"))
    server_ca, client_ca = CA(tmp, "server-ca"), CA(tmp, "client-ca")
    server = server_ca.issue("server", "zerolayer", hosts=("127.0.0.1",))
    me = client_ca.issue("client", "bench", client=True)
    base = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": str(args.streams),
        "ENGINE__MAX_CONTEXT": str(max(2048, args.tokens + 16)),
        "ENGINE__SYNTHETIC_VOCAB_SIZE": "100000",
        "CACHE__ENABLED": "false",
    }
    tls_env = {"TLS__CERT_FILE": str(server.cert), "TLS__KEY_FILE": str(server.key)}
    variants = {
        "plain": (base, []),
        "tls13": ({**base, **tls_env}, ["--ca", str(server_ca.path)]),
        "mtls13": (
            {**base, **tls_env, "TLS__CLIENT_CA_FILE": str(client_ca.path)},
            ["--ca", str(server_ca.path), "--cert", str(me.cert), "--key", str(me.key)],
        ),
    }
    results: dict = {
        "machine": machine(),
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "results": {},
    }
    for name, (env, tls) in variants.items():
        with Daemon(env) as d:
            for conns in args.connections:
                load(d, args, conns, tls)  # warm-up
                runs = [load(d, args, conns, tls) for _ in range(args.runs)]
                results["results"][f"{name}/{conns}"] = summarize(runs)
            d.terminate()
    rows = []
    for conns in args.connections:
        plain = results["results"][f"plain/{conns}"]["cpu_us_per_token"]
        for name, label in (("plain", "plain TCP"), ("tls13", "TLS"), ("mtls13", "mutual TLS")):
            r = results["results"][f"{name}/{conns}"]
            if r["tls"] != ["plain"]:
                label = f"{label} ({', '.join(r['tls'])})"
            r["extra_us_per_token"] = r["cpu_us_per_token"] - plain
            rows.append(
                [
                    label,
                    conns,
                    f"{r['cpu_us_per_token']:.2f}",
                    f"{r['extra_us_per_token']:+.2f}",
                    f"{r['cpu_us_per_token'] / plain:.2f}x",
                    f"{r['tokens_per_s']:,.0f}",
                ]
            )
    md = (
        "## TLS cost per streamed token (`benchmarks/tls.py`)\n\n"
        f"{args.streams} concurrent streams x {args.tokens} tokens x {args.rounds} rounds per run, "
        f"median of {args.runs} runs after a warm-up; synthetic backend (no model, step time 0), "
        "response cache off, 1 worker; token-id prompts, no text deltas; server CPU from "
        "/proc (handshakes included). ECDSA P-256 certificates; the negotiated version and "
        "cipher are in the first column. The machine is shared with other jobs (2 cores): "
        "read the differences, not the absolute figures.\n\n"
        + table(
            ["transport", "connections", "server CPU us/token", "vs plain", "ratio", "tokens/s"],
            rows,
        )
        + "\n\n"
        + machine_line(results["machine"])
        + "\n"
    )
    publish(args, "tls", results, md)


if __name__ == "__main__":
    main()
