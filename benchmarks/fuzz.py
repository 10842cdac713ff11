"""Fuzz campaign against a running daemon: valid and mutated frames on many connections.

Starts a daemon (synthetic backend; benchmarks/_support/daemon.py), warms it up with the same mix,
then writes --frames frames (a frame = one unit written: a well-formed frame, a mutated one, or a
random blob) from --connections concurrent connections. Each connection writes batches: mostly
requests (valid, or with a broken payload: a stream error at most), PINGs and CANCELs, and now and
then a frame that must end the connection (bad header, oversized, random blob, a close mid-frame).
After each batch it sends a PING and waits for the PONG and for every request of the batch to end;
requests still running 2 s after the PONG (a mutation made max_tokens large) are cancelled, and must
then end too.

Checks, reported as pass/fail:
- no crash: the daemon process is alive and /healthz answers 200 at the end;
- no hang: every surviving connection answers its PING and ends all its requests (after CANCEL
  at the latest) within --hang-s;
- no INTERNAL error on any stream or connection;
- accounting: every request on a surviving connection ended in exactly one DONE or ERROR;
- resident memory after the campaign within 32 MB of where it stood after warm-up;
- long valid streams on another connection finish with all their tokens, all along.

Frames answered with INTERNAL (and the batch that preceded a crash or hang) are written to
--findings as corpus files (benchmarks/_support/fuzzframes.py). A run is reproducible from --seed.

    python benchmarks/fuzz.py [--frames 1000000] [--connections 32] [--seed 1] [--cache]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import struct
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support import fuzzframes as ff  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.frames import protocol as p  # noqa: E402

CANCEL_AFTER_S = 2.0  # requests of a batch still running after its PONG + this are cancelled
ERROR_NAMES = {
    1: "MALFORMED_FRAME",
    2: "FRAME_TOO_LARGE",
    3: "UNSUPPORTED_VERSION",
    4: "UNAUTHENTICATED",
    5: "RATE_LIMITED",
    6: "OVERLOADED",
    7: "INVALID_REQUEST",
    8: "PROMPT_TOO_LONG",
    9: "UNKNOWN_PROMPT",
    10: "STREAM_IN_USE",
    11: "TOO_MANY_STREAMS",
    12: "IDLE_TIMEOUT",
    13: "SHUTTING_DOWN",
    14: "SLOW_CONSUMER",
    15: "INTERNAL",
}


@dataclass
class Tally:
    frames: int = 0
    connections: int = 0
    requests: int = 0
    done: int = 0
    stream_errors: dict[str, int] = field(default_factory=dict)
    conn_errors: dict[str, int] = field(default_factory=dict)
    internal: int = 0
    hangs: int = 0
    unexpected_close: int = 0  # the server closed a connection that sent nothing fatal
    double_ends: int = 0
    long_streams: int = 0
    long_short: int = 0  # long streams that ended without all their tokens
    findings: list[str] = field(default_factory=list)


class Campaign:
    def __init__(self, d: Daemon, args: argparse.Namespace, tally: Tally) -> None:
        self.d = d
        self.args = args
        self.t = tally
        self.vocab = args.vocab
        self.stop = False
        self.findings_dir = Path(args.findings)

    def finding(self, why: str, data: bytes) -> None:
        """Record a finding; the first 10 of each kind (its first word) are written as files."""
        self.t.findings.append(why)
        kind = why.split(":")[0].split()[0].lower()
        n = sum(1 for f in self.t.findings if f.split(":")[0].split()[0].lower() == kind)
        if n <= 10:
            self.findings_dir.mkdir(parents=True, exist_ok=True)
            ff.write_corpus(self.findings_dir / f"{kind}-{n:02d}.hex", why, data)

    def batch(self, rng: random.Random, first_stream: int) -> tuple[list[bytes], dict, str]:
        """Frames for one batch, the requests it opens, and how it ends ('' = keep going)."""
        frames: list[bytes] = []
        opened: dict[int, bytes] = {}  # stream -> its REQUEST frame
        stream = first_stream
        for _ in range(rng.randint(4, 48)):
            r = rng.random()
            if r < 0.40:
                data, _ = ff.valid_request(rng, stream, self.vocab)
                opened[stream] = data
                stream += 1
            elif r < 0.85:
                data = ff.mutated_request(rng, stream, self.vocab)
                opened[stream] = data
                stream += 1
            elif r < 0.93:
                data = ff.frame(ff.PING, 0, rng.randbytes(rng.randint(0, 64)))
            else:  # a CANCEL, for a stream of this batch or one that does not exist
                target = rng.choice([*opened, rng.getrandbits(32) or 1])
                data = ff.frame(ff.CANCEL, target)
            frames.append(data)
        end = ""
        r = rng.random()
        if r < 0.08:
            frames.append(ff.bad_header(rng, self.args.max_frame))
            end = "conn_error"
        elif r < 0.12:
            frames.append(rng.randbytes(rng.randint(1, 64)))
            end = "blob"
        elif r < 0.15:
            frames.append(frames.pop()[: rng.randint(1, 11)] if frames else b"\x01")
            end = "cut"  # we close mid-frame
        return frames, opened, end

    async def worker(self, wid: int) -> None:
        rng = random.Random(self.args.seed * 1000 + wid)
        while not self.stop and self.t.frames < self.target:
            with contextlib.suppress(ConnectionError, OSError):
                await self.connection(rng)

    async def connection(self, rng: random.Random) -> None:
        reader, writer = await asyncio.open_connection(self.d.host, self.d.port)
        self.t.connections += 1
        stream = 1
        try:
            while not self.stop and self.t.frames < self.target:
                frames, opened, end = self.batch(rng, stream)
                stream += len(opened) + 1
                data = b"".join(frames)
                writer.write(data)
                self.t.frames += len(frames)
                self.t.requests += len(opened)
                if end in ("blob", "cut"):
                    # A random blob may announce a frame that never comes: we go away.
                    await writer.drain()
                    await self.settle(reader, writer, opened, data, expect_close=None, ping=False)
                    return
                nonce = rng.randbytes(8)
                writer.write(ff.frame(ff.PING, 0, nonce))
                alive = await self.settle(
                    reader, writer, opened, data, expect_close=end == "conn_error", ping=nonce
                )
                if not alive:
                    return
        finally:
            writer.close()

    async def settle(self, reader, writer, opened, data, expect_close, ping) -> bool:
        """Read until the PING is answered and every request ended, or the server closed.
        Returns whether the connection is still usable."""
        ended: set[int] = set()
        pong = ping is False
        buf = b""
        now = time.monotonic()
        deadline = now + self.args.hang_s
        cancel_at = now + CANCEL_AFTER_S  # then long (mutated max_tokens) requests are cancelled
        while True:
            if pong and len(ended) == len(opened) and not expect_close:
                return expect_close is not None
            if expect_close is False and pong and time.monotonic() > cancel_at:
                cancel_at = float("inf")
                writer.write(b"".join(ff.frame(ff.CANCEL, s) for s in opened if s not in ended))
                deadline = time.monotonic() + self.args.hang_s
            left = min(deadline, cancel_at) - time.monotonic()
            if ping is False and not expect_close:
                left = min(left, 0.05)  # blob/cut: collect what is there, then go
            try:
                chunk = await asyncio.wait_for(reader.read(1 << 16), max(left, 0.001))
            except asyncio.TimeoutError:
                if ping is False:
                    return False  # blob/cut: we go away now
                if time.monotonic() < deadline:
                    continue  # time to cancel
                self.t.hangs += 1
                open_ids = [sid for sid in opened if sid not in ended]
                for sid in open_ids[:3]:  # the exact frames that never ended
                    self.finding(
                        f"hang: REQUEST on stream {sid} got no DONE or ERROR within "
                        f"{self.args.hang_s} s (PONG {'seen' if pong else 'missing'})",
                        opened[sid],
                    )
                if not open_ids:
                    self.finding(f"hang: no PONG within {self.args.hang_s} s", data)
                return False
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:  # closed: a connection error stands for every stream
                if expect_close is False:
                    self.t.unexpected_close += 1
                    self.finding("connection closed after a batch with nothing fatal", data)
                return False
            frames, buf = ff.split_frames(buf + chunk)
            for ftype, sid, payload in frames:
                if ftype == ff.PONG and payload == ping:
                    pong = True
                elif ftype in (ff.DONE, ff.ERROR) and sid:
                    if sid in ended:
                        self.t.double_ends += 1
                        self.finding(f"stream {sid} ended twice", data)
                    ended.add(sid)
                    if ftype == ff.DONE:
                        self.t.done += 1
                    else:
                        self.error(payload, data, self.t.stream_errors)
                elif ftype == ff.ERROR:
                    self.error(payload, data, self.t.conn_errors)

    def error(self, payload: bytes, data: bytes, into: dict[str, int]) -> None:
        try:
            code, _, msg = p.parse_error(memoryview(payload))
        except p.ProtocolError:
            code, msg = -1, ""
        name = ERROR_NAMES.get(code, str(code))
        into[name] = into.get(name, 0) + 1
        if code == ff.INTERNAL:
            self.t.internal += 1
            self.finding(f"INTERNAL: {msg}", data)

    async def long_streams(self) -> None:
        """Sequential long valid streams on their own connection: each must end with all its
        tokens (max_tokens, finish 1), the last one after the campaign has stopped."""
        reader, writer = await asyncio.open_connection(self.d.host, self.d.port)
        n, sid = self.args.long_tokens, 0
        while True:
            sid += 1
            payload = ff.REQ.pack(n, 0.0, 1.0, 0, 0, 0, 0, 0) + struct.pack("<3i", 1, 2, sid)
            writer.write(ff.frame(ff.REQUEST, sid, payload))
            got, buf, finished = 0, b"", None
            while finished is None:
                chunk = await reader.read(1 << 20)
                if not chunk:
                    finished = "closed"
                    break
                frames, buf = ff.split_frames(buf + chunk)
                for ftype, _, payload in frames:
                    if ftype == ff.TOKEN:
                        got += len(p.parse_token(memoryview(payload))[0])
                    elif ftype == ff.DONE:
                        done = p.parse_done(memoryview(payload))
                        reason, ct = done.finish_reason, done.completion_tokens
                        finished = f"finish={reason} completion_tokens={ct}"
                        ok = reason == p.FinishReason.MAX_TOKENS and ct == n == got
                    elif ftype == ff.ERROR:
                        finished = "ERROR " + p.parse_error(memoryview(payload))[2]
                        ok = False
            self.t.long_streams += 1
            if finished == "closed" or not ok:
                self.t.long_short += 1
                self.t.findings.append(f"long stream {sid}: got {got} of {n} tokens, {finished}")
                if finished == "closed":
                    return
            if self.stop:
                writer.close()
                return

    async def run(self, frames: int) -> None:
        self.target = self.t.frames + frames
        self.stop = False
        workers = [self.worker(i) for i in range(self.args.connections)]
        await asyncio.gather(*workers)


def healthz(d: Daemon) -> int:
    try:
        return urllib.request.urlopen(d.metrics_url + "/healthz", timeout=5).status
    except Exception:
        return 0


async def campaign(d: Daemon, args: argparse.Namespace) -> dict:
    tally = Tally()
    c = Campaign(d, args, tally)
    await c.run(args.warmup)
    warm = {"frames": tally.frames, "rss_mb": d.rss_mb()}
    samples = [(0.0, warm["rss_mb"])]
    t0 = time.monotonic()
    long_task = asyncio.create_task(c.long_streams())

    async def sample() -> None:
        while True:
            await asyncio.sleep(5)
            if d.proc.poll() is not None:
                c.stop = True
                return
            samples.append((round(time.monotonic() - t0, 1), d.rss_mb()))
            print(
                f"  {tally.frames - warm['frames']:>9} frames  rss {samples[-1][1]:.1f} MB  "
                f"internal {tally.internal}  hangs {tally.hangs}",
                flush=True,
            )
            if time.monotonic() - t0 > args.max_seconds:
                c.stop = True
                return

    sampler = asyncio.create_task(sample())
    await c.run(args.frames)
    elapsed = time.monotonic() - t0
    sampler.cancel()
    c.stop = True
    try:
        await asyncio.wait_for(long_task, 120)
    except asyncio.TimeoutError:
        tally.hangs += 1
        tally.findings.append("the long stream did not finish within 120 s of the campaign's end")
    alive = d.proc.poll() is None
    await asyncio.sleep(2)  # let the daemon settle (idle connections close, tasks end)
    final = d.rss_mb() if alive else 0.0
    return {
        "tally": tally,
        "warm": warm,
        "final_rss_mb": final,
        "elapsed_s": elapsed,
        "alive": alive,
        "healthz": healthz(d) if alive else 0,
        "rss_samples": samples,
    }


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--long-tokens", type=int, default=20_000, help="tokens per long stream")
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="stop after this long")
    ap.add_argument("--cache", action="store_true", help="response cache on (default off)")
    ap.add_argument("--findings", default="benchmarks/results/fuzz-findings")
    args = ap.parse_args()
    args.vocab = 32000
    args.max_frame = 1_048_576
    env = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_CONTEXT": str(args.long_tokens + 64),
        "CACHE__ENABLED": "true" if args.cache else "false",
        "SERVER__IDLE_TIMEOUT_S": "5",
    }
    with Daemon(env) as d:
        import uvloop

        res = uvloop.run(campaign(d, args))
        exit_code = d.terminate() if res["alive"] else d.proc.returncode
        # What the daemon logged as failures: the last line of each traceback, counted.
        failures: dict[str, int] = {}
        for line in d.log.splitlines():
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line) or " ERROR " in line:
                failures[line[:200]] = failures.get(line[:200], 0) + 1
    t: Tally = res["tally"]
    growth = res["final_rss_mb"] - res["warm"]["rss_mb"]
    checks = {
        "no crash (alive, /healthz 200, clean exit)": res["alive"]
        and res["healthz"] == 200
        and exit_code == 0,
        "no hang": t.hangs == 0,
        "no connection closed without cause": t.unexpected_close == 0,
        "no INTERNAL": t.internal == 0,
        "every request ended once": t.double_ends == 0,
        "RSS growth after warm-up <= 32 MB": res["alive"] and growth <= 32,
        "long streams complete": t.long_short == 0 and t.long_streams > 0,
    }
    out = {
        "machine": machine(),
        "args": {k: v for k, v in vars(args).items() if k != "write"},
        "frames": t.frames - res["warm"]["frames"],
        "warmup_frames": res["warm"]["frames"],
        "connections_opened": t.connections,
        "requests": t.requests,
        "done": t.done,
        "stream_errors": t.stream_errors,
        "connection_errors": t.conn_errors,
        "internal": t.internal,
        "hangs": t.hangs,
        "long_streams": t.long_streams,
        "rss_after_warmup_mb": round(res["warm"]["rss_mb"], 1),
        "rss_after_mb": round(res["final_rss_mb"], 1),
        "rss_growth_mb": round(growth, 1),
        "rss_samples": res["rss_samples"],
        "elapsed_s": round(res["elapsed_s"], 1),
        "daemon_exit": exit_code,
        "checks": checks,
        "findings": t.findings[:50],
        "daemon_failures": failures,
    }
    print(
        json.dumps({k: v for k, v in out.items() if k not in ("rss_samples", "machine")}, indent=1)
    )
    md = (
        "## Fuzz campaign (`benchmarks/fuzz.py`)\n\n"
        f"{out['frames']:,} frames after {out['warmup_frames']:,} of warm-up, from "
        f"{args.connections} concurrent connections ({t.connections:,} opened in all), seed "
        f"{args.seed}, {out['elapsed_s']} s; synthetic backend, response cache "
        f"{'on' if args.cache else 'off'}. "
        f"{t.requests:,} requests: {t.done:,} DONE, {sum(t.stream_errors.values()):,} stream "
        f"ERRORs, the rest ended by their connection's error. {t.long_streams} long streams of "
        f"{args.long_tokens:,} tokens ran alongside. Resident memory "
        f"{out['rss_after_warmup_mb']} MB after warm-up, {out['rss_after_mb']} MB after "
        f"({growth:+.1f} MB).\n\n"
        + table(["check", "result"], [[k, "pass" if v else "FAIL"] for k, v in checks.items()])
        + "\n\n"
        + machine_line(out["machine"])
        + "\n"
    )
    publish(args, "fuzz", out, md)
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
