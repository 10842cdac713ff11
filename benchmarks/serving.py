"""Serving-layer cost: server CPU time per streamed token, ZeroLayer vs a no-logic floor.

Both servers run as their own processes on loopback; the load client runs in a third process.
- zerolayer: `zerolayer serve` with the synthetic backend (no model), step time 0.
- floor: a minimal uvloop server in this file that parses only the frame header and the
  request's max_tokens, then writes the same TOKEN/DONE frames, one buffer per connection per
  loop iteration, with no validation, scheduling, hooks or accounting: what Python costs at least.
Load: ROUNDS rounds of STREAMS concurrent streams x TOKENS tokens on one connection (token-id
prompts, no text).
Server CPU = utime + stime of the server process (/proc/PID/stat) across the load.

    python benchmarks/serving.py [--streams 64] [--tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, table, write_json, write_section  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402

HDR = struct.Struct("<IBBHI")
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


# --------------------------------------------------------------------------- floor server


class FloorProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.active: dict[int, int] = {}  # stream -> tokens left
        self.sent: dict[int, int] = {}
        self.scheduled = False
        self.out = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 12:
            length, ftype, _, _, stream = HDR.unpack_from(self.buf)
            if len(self.buf) < 12 + length:
                break
            if ftype == 1:
                (max_tokens,) = struct.unpack_from("<I", self.buf, 12)
                self.active[stream] = max_tokens
                self.sent[stream] = 0
            del self.buf[: 12 + length]
        if self.active and not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.step)

    def step(self) -> None:
        out = bytearray()
        for stream in list(self.active):
            out += struct.pack("<IBBHIHHi", 8, 2, 0, 0, stream, 1, 0, 97)
            self.active[stream] -= 1
            self.sent[stream] += 1
            if not self.active[stream]:
                del self.active[stream]
                out += struct.pack(
                    "<IBBHIBBHIIIII",
                    24,
                    3,
                    0,
                    0,
                    stream,
                    1,
                    0,
                    0,
                    0,
                    self.sent.pop(stream),
                    0,
                    0,
                    0,
                )
        self.transport.write(out)
        if self.active:
            asyncio.get_running_loop().call_soon(self.step)
        else:
            self.scheduled = False


def run_floor_server(protocol: type[asyncio.Protocol] = FloorProtocol) -> None:
    """Serve ``protocol`` on a free loopback port (printed first) until killed."""
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


# --------------------------------------------------------------------------- load client


def run_client(port: int, streams: int, tokens: int, rounds: int) -> None:
    import uvloop

    async def main() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        fixed = struct.Struct("<IffIQIHH")
        nonce = int(time.time_ns() % 100_000)
        rounds_frames = []
        for r in range(rounds):
            # Every prompt is unique (run, round, stream): no response-cache hits.
            frames = b""
            for s in range(1, streams + 1):
                prompt = struct.pack("<4i", 72, nonce, r, s)
                payload = fixed.pack(tokens, 0.0, 1.0, 0, 0, 0, 0, 0) + prompt
                frames += HDR.pack(len(payload), 1, 0, 0, s) + payload
            rounds_frames.append(frames)
        t0 = time.perf_counter()
        received = 0
        for frames in rounds_frames:
            received += await one_round(reader, writer, frames)
        elapsed = time.perf_counter() - t0
        writer.close()
        print(json.dumps({"tokens": received, "seconds": elapsed}))

    async def one_round(reader, writer, frames: bytes) -> int:
        writer.write(frames)
        buf = b""
        received = done = 0
        while done < streams:
            data = await reader.read(1 << 20)
            if not data:
                raise SystemExit("server closed the connection")
            buf += data
            pos = 0
            while len(buf) - pos >= 12:
                length, ftype, _, _, _ = HDR.unpack_from(buf, pos)
                if len(buf) - pos < 12 + length:
                    break
                if ftype == 2:
                    received += struct.unpack_from("<H", buf, pos + 12)[0]
                elif ftype == 3:
                    done += 1
                elif ftype == 6:
                    raise SystemExit("server answered ERROR")
                pos += 12 + length
            buf = buf[pos:]
        return received

    uvloop.run(main())


def load(port: int, pid: int, streams: int, tokens: int, rounds: int) -> dict:
    cpu0 = cpu_seconds(pid)
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--client",
            str(port),
            "--streams",
            str(streams),
            "--tokens",
            str(tokens),
            "--rounds",
            str(rounds),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    cpu = cpu_seconds(pid) - cpu0
    res = json.loads(out.stdout)
    if res["tokens"] != streams * tokens * rounds:
        raise SystemExit(f"expected {streams * tokens * rounds} tokens, got {res['tokens']}")
    return {"cpu_s": cpu, "wall_s": res["seconds"], "tokens": res["tokens"]}


def summarize(runs: list[dict]) -> dict:
    cpu = statistics.median(r["cpu_s"] for r in runs)
    wall = statistics.median(r["wall_s"] for r in runs)
    tokens = runs[0]["tokens"]
    return {
        "runs": runs,
        "cpu_us_per_token": cpu / tokens * 1e6,
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=60,
        help="load rounds per measured run (CPU time is read in 10 ms ticks)",
    )
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    if args.floor_server:
        return run_floor_server()
    if args.client:
        return run_client(args.client, args.streams, args.tokens, args.rounds)

    results: dict = {
        "machine": machine(),
        "streams": args.streams,
        "tokens": args.tokens,
        "rounds": args.rounds,
    }
    floor = subprocess.Popen(
        [sys.executable, __file__, "--floor-server"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(floor.stdout.readline())
        load(port, floor.pid, args.streams, args.tokens, args.rounds)  # warm-up
        results["floor"] = summarize(
            [
                load(port, floor.pid, args.streams, args.tokens, args.rounds)
                for _ in range(args.runs)
            ]
        )
    finally:
        floor.kill()
        floor.wait()
    base = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": str(args.streams),
        "ENGINE__MAX_CONTEXT": str(max(2048, args.tokens + 16)),
        "ENGINE__SYNTHETIC_VOCAB_SIZE": "100000",
    }
    variants = {
        # The default configuration: metrics, rate-limit hook, response cache recording every
        # greedy stream (ids and text) so it can be replayed.
        "zerolayer": base,
        # The same with the response cache off: no per-token recording or detokenization.
        "zerolayer_cache_off": {**base, "CACHE__ENABLED": "false"},
    }
    for name, env in variants.items():
        with Daemon(env) as d:
            load(d.port, d.proc.pid, args.streams, args.tokens, args.rounds)  # warm-up
            results[name] = summarize(
                [
                    load(d.port, d.proc.pid, args.streams, args.tokens, args.rounds)
                    for _ in range(args.runs)
                ]
            )
            d.terminate()
    floor_cpu = results["floor"]["cpu_us_per_token"]
    ratio = results["zerolayer"]["cpu_us_per_token"] / floor_cpu
    results["ratio_cpu_per_token"] = ratio
    results["ratio_cpu_per_token_cache_off"] = (
        results["zerolayer_cache_off"]["cpu_us_per_token"] / floor_cpu
    )
    labels = (
        ("floor (no-logic uvloop server)", "floor"),
        ("zerolayer, default config (synthetic backend)", "zerolayer"),
        ("zerolayer, response cache off", "zerolayer_cache_off"),
    )
    rows = [
        [
            label,
            f"{results[key]['cpu_us_per_token']:.2f}",
            f"{results[key]['cpu_us_per_token'] / floor_cpu:.2f}x",
            f"{results[key]['tokens_per_s']:,.0f}",
            f"{results[key]['wall_s']:.3f}",
        ]
        for label, key in labels
    ]
    md = (
        "## Serving layer: server CPU per streamed token\n\n"
        f"`python benchmarks/serving.py` — {args.rounds} rounds of {args.streams} concurrent "
        f"streams x {args.tokens} tokens on one loopback connection, client in its own process, "
        "median of "
        f"{args.runs} runs after a warm-up. Server CPU = user + system time of the server "
        "process during the load.\n\n"
        + table(["server", "CPU µs / token", "vs floor", "tokens / s", "wall s"], rows)
        + "\n\nZeroLayer's CPU includes its engine thread (scheduling, stop checks, the "
        "hand-off to the event loop) as well as the loop (framing, writes, metrics). The "
        "synthetic backend stands in for the model and is kept cheap on purpose (it hashes the "
        "tokens of several coming steps at once while a batch keeps its rows); the floor has no "
        "model at all. Every prompt is unique, so the response cache only records (never "
        "replays). Metrics are on in both zerolayer runs. Short runs on a shared VM vary by "
        "tens of percent from run to run; compare the rows of one run.\n\n"
        + machine_line(results["machine"])
    )
    print(md)
    if not args.no_write:
        write_json("serving", results)
        write_section("serving", md)


if __name__ == "__main__":
    main()
