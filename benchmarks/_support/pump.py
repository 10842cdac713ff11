"""The no-logic uvloop servers the serving scenarios compare ZeroLayer against, each run as its
own process (``Floor``): flat out, a server that parses only the frame header and max_tokens and
writes one-id TOKEN frames and DONE, one buffer per connection per loop iteration; paced, a pump
that every tick writes one TOKEN frame per active stream and one write per connection, its pause
a timer of its event loop or, with ``threaded``, a thread of its own (``Ticker``), as ZeroLayer's
engine thread. Frame layouts come from the codec (zerolayer.frames.protocol).

    python -m benchmarks._support.pump PACE_MS [--threaded]   (prints its port)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from benchmarks._support.daemon import ROOT, child_preexec
from zerolayer.frames import protocol as p

HDR = p.HEADER
VOCAB = 100_000  # the pump's announced vocabulary, and the synthetic daemons' (same prompts)
WELCOME = p.encode_welcome(1 << 24, 1024, VOCAB, -1, 4096, "floor")


@functools.lru_cache(maxsize=4096)
def _token(stream: int) -> bytes:
    """A one-id TOKEN frame (the codec's layout), made once per stream id."""
    return p.encode_token(stream, [97])


def _done(stream: int, sent: int) -> bytes:
    return p.encode_done(stream, p.Done(p.FinishReason.MAX_TOKENS, 0, 0, sent, 0, 0, 0))


class FloorProtocol(asyncio.Protocol):
    """Reads REQUESTs (max_tokens only) and HELLO; ``step`` writes one token per stream."""

    pace_s = 0.0  # 0: flat out (call_soon); > 0: the pump (a shared tick)
    conns: set[FloorProtocol] = set()
    ticking = False
    ticker: Ticker | None = None  # the threaded pump's; None: the loop's own timer paces

    def __init__(self) -> None:
        self.buf = bytearray()
        self.active: dict[int, int] = {}  # stream -> tokens left
        self.sent: dict[int, int] = {}
        self.scheduled = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        FloorProtocol.conns.add(self)

    def connection_lost(self, exc) -> None:
        FloorProtocol.conns.discard(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= p.HEADER_SIZE:
            length, ftype, _, _, stream = HDR.unpack_from(self.buf)
            if len(self.buf) < p.HEADER_SIZE + length:
                break
            if ftype == p.FrameType.REQUEST:  # max_tokens: the first field of a binary REQUEST
                max_tokens = p.REQUEST_FIXED.unpack_from(self.buf, p.HEADER_SIZE)[0]
                self.active[stream] = max_tokens
                self.sent[stream] = 0
            elif ftype == p.FrameType.HELLO:
                self.transport.write(WELCOME)
            del self.buf[: p.HEADER_SIZE + length]
        loop = asyncio.get_running_loop()
        if self.pace_s:
            if self.active and not FloorProtocol.ticking:
                FloorProtocol.start_ticking()
        elif self.active and not self.scheduled:
            self.scheduled = True
            loop.call_soon(self.step)

    def emit(self) -> None:
        out = bytearray()
        for stream in list(self.active):
            out += _token(stream)
            self.active[stream] -= 1
            self.sent[stream] += 1
            if not self.active[stream]:
                del self.active[stream]
                out += _done(stream, self.sent.pop(stream))
        if out:
            self.transport.write(out)

    def step(self) -> None:
        self.emit()
        if self.active:
            asyncio.get_running_loop().call_soon(self.step)
        else:
            self.scheduled = False

    @classmethod
    def tick(cls) -> None:
        for conn in list(cls.conns):
            conn.emit()
        if not any(c.active for c in cls.conns):
            cls.ticking = False
            if cls.ticker is not None:
                cls.ticker.wanted.clear()
        elif cls.ticker is None:
            asyncio.get_running_loop().call_later(cls.pace_s, cls.tick)

    @classmethod
    def start_ticking(cls) -> None:
        cls.ticking = True
        if cls.ticker is not None:
            cls.ticker.wanted.set()
        else:
            asyncio.get_running_loop().call_later(cls.pace_s, cls.tick)


class Ticker:
    """The threaded pump's pace: a thread of its own sleeps the step time, then hands the tick
    to the event loop (``call_soon_threadsafe``) and sleeps again, as ZeroLayer's engine thread
    hands each step over after its backend call. Its cost against the plain pump's is what
    running the step's pause on a second thread costs, with no logic on either thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pace_s: float) -> None:
        self.loop, self.pace_s = loop, pace_s
        self.wanted = threading.Event()  # set while streams are active
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.wanted.wait()
            time.sleep(self.pace_s)
            self.loop.call_soon_threadsafe(FloorProtocol.tick)


def run_floor_server(pace_ms: float, threaded: bool = False) -> None:
    import uvloop

    FloorProtocol.pace_s = pace_ms / 1000.0

    async def main() -> None:
        if threaded:
            FloorProtocol.ticker = Ticker(asyncio.get_running_loop(), FloorProtocol.pace_s)
        server = await asyncio.get_running_loop().create_server(FloorProtocol, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


class Floor:
    """A floor server subprocess (dies with this process); ``wrapper``: a command it runs under
    (e.g. valgrind and its options)."""

    def __init__(self, pace_ms: float, wrapper: Sequence[str] = (), threaded: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "benchmarks._support.pump", str(pace_ms)]
            + (["--threaded"] if threaded else []),
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            preexec_fn=child_preexec(),
        )
        assert self.proc.stdout is not None
        self.endpoint = f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}"

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a no-logic uvloop frame server; prints its port")
    ap.add_argument("pace_ms", type=float, help="0: flat out; > 0: a pump ticking every PACE_MS")
    ap.add_argument("--threaded", action="store_true", help="the pause on a thread of its own")
    a = ap.parse_args()
    run_floor_server(a.pace_ms, a.threaded)
