"""What logprobs cost: 64 streams with ``top_logprobs: 20`` against the same streams plain, on the
real default model (SmolLM2), on both doors.

Issue #40 item 3: ``top_logprobs: 20`` should cost at most 2x plain in wall time at 64 streams,
on a quiet machine and with another process keeping one core busy (``--busy-core``: a child
spinning on one CPU for the whole run, benchmarks/_support/busy.py). Each round runs, on each
source tree given (``--tree``; the first is this one, any other a baseline checkout, e.g.
``git archive <commit> | tar -x -C /tmp/base``), on each door, the plain run and the logprobs run
(which goes first alternates by round), rounds interleaved so that the load of the shared
machine falls on all alike. Greedy (temperature 0), so both runs of a door produce the same
tokens; the response cache is off.

- frames: protocol v2, 8 connections, prompt ids, token ids only (no text: the plain run is the
  cheapest path the door has), the client checks every token's LOGPROBS has k alternatives;
- http: OpenAI chat completions streamed (SSE), one connection per stream, ``ignore_eos`` so
  every stream runs ``--tokens``; the client counts the ``top_logprobs`` lists it receives
  (one per token, as the usage counts them) without decoding the JSON (so its own cost stays
  small beside the daemon's).

``--split STEPS`` only profiles, in this process on 1 thread: the decode forward at
``--streams`` rows, then the plain and the top_logprobs 20 sampling of the same logits (CPU and
wall ms, medians): what the logprobs add to a step beside what the model costs.

The engine runs ``--threads`` torch threads (default: 1 when the 1-minute load average is above 1
or a core is kept busy, else torch's default, one per core); the figures say which, and the load
at each round. Loopback only; the daemons and the spinning child end with the benchmark.

    python benchmarks/logprobs_cost.py [--model @smollm2] [--streams 64] [--tokens 64]
        [--rounds 3] [--doors frames,http] [--busy-core] [--threads N] [--tree /tmp/base]
        [--write]
    python benchmarks/logprobs_cost.py --split 10    # in process: where a step's time goes
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.busy import busy_core  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon  # noqa: E402
from zerolayer.client import Client  # noqa: E402

CONNECTIONS = 8  # frame connections the streams share
TOP = 20  # top_logprobs of the logprobs runs: the most any API allows
VARIANTS = (("plain", None), ("top20", TOP))
DOORS = ("frames", "http")


async def frames_run(d: Daemon, streams: int, tokens: int, top: int | None) -> tuple[float, int]:
    """Wall seconds for ``streams`` streams of at most ``tokens`` tokens on the frame door, and
    the tokens received."""
    clients = [await Client.connect(d.endpoint, b"") for _ in range(CONNECTIONS)]
    options: dict = {"temperature": 0.0, "cache": False}
    if top is not None:
        options |= {"logprobs": True, "top_logprobs": top}
    t0 = time.perf_counter()

    async def one(i: int) -> int:
        stream = await clients[i % CONNECTIONS].generate(
            [5 + i % 50, 6, 7], tokens, text=False, **options
        )
        result = await stream.collect()
        if top is not None:
            got = result.logprobs
            if len(got) != result.completion_tokens or any(len(t.top) != top for t in got):
                raise SystemExit(f"frames: stream {i} lacks logprobs: {len(got)} tokens")
        return result.completion_tokens

    got = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return wall, sum(got)


async def http_run(d: Daemon, streams: int, tokens: int, top: int | None) -> tuple[float, int]:
    """Wall seconds for ``streams`` streamed chat completions of ``tokens`` tokens on the HTTP
    door, and the tokens received (the usage's count; with logprobs, a list of alternatives is
    checked to be there for each token)."""
    body: dict = {
        "max_tokens": tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if top is not None:
        body |= {"logprobs": True, "top_logprobs": top}
    assert d.http_port is not None
    t0 = time.perf_counter()

    async def one(i: int) -> int:
        payload = json.dumps(
            body | {"messages": [{"role": "user", "content": f"Count to {i}."}]}
        ).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", d.http_port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: "
            b"application/json\r\ncache-control: no-cache\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        data = bytearray()
        while chunk := await reader.read(1 << 16):
            data += chunk
        writer.close()
        if not data.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in data:
            raise SystemExit(f"http: stream {i} failed: {bytes(data[:300])!r}")
        usage = re.search(rb'"completion_tokens":(\d+)', data)
        produced = int(usage.group(1)) if usage else 0
        lists = data.count(b'"top_logprobs":[')
        if top is not None and lists != produced:
            raise SystemExit(f"http: stream {i}: {lists} lists of alternatives, {produced} tokens")
        return produced

    got = await asyncio.gather(*(one(i) for i in range(streams)))
    return time.perf_counter() - t0, sum(got)


RUNS = {"frames": frames_run, "http": http_run}


def split(model: str, rows: int, steps: int) -> dict[str, float]:
    """Where a step's time goes, in this process (no daemon, no doors): the model's decode
    forward at ``rows`` rows, then the plain sampling and the top_logprobs 20 sampling of the
    same logits; medians over ``steps`` steps of this thread's CPU time (torch on 1 thread runs
    its kernels on the calling thread) and of wall time, in ms."""
    import numpy as np
    import torch

    from zerolayer.config.settings import EngineConfig, ModelConfig
    from zerolayer.engine.backends.cpu import create_cpu_backend
    from zerolayer.engine.sampling import Processing
    from zerolayer.engine.types import DecodeBatch
    from zerolayer.sampling_params import SamplingParams, sampling_rows

    engine_cfg = EngineConfig(max_batch_size=rows, threads=1, max_context=512)
    backend, _ = create_cpu_backend(ModelConfig(path=model), engine_cfg)
    params = sampling_rows([SamplingParams(temperature=0.0)] * rows)
    positions = np.full(rows, 32, np.int32)  # a short context: the forward as in these runs
    batch = DecodeBatch(np.arange(rows, dtype=np.int32), np.arange(5, 5 + rows, dtype=np.int32),
                        positions, params)  # fmt: skip
    for row in range(rows):  # KV in pages: each row's, as the engine reserves them
        assert backend.kv_pages.prepare_write(row, 0, 33) == []
    parts: dict[str, list[float]] = {}

    def timed(name: str, call: Callable[..., object], *call_args: object) -> object:
        c0, w0 = time.thread_time(), time.perf_counter()
        out = call(*call_args)
        parts.setdefault(f"{name}_cpu_ms", []).append(1e3 * (time.thread_time() - c0))
        parts.setdefault(f"{name}_wall_ms", []).append(1e3 * (time.perf_counter() - w0))
        return out

    sampler = backend.sampler
    with torch.inference_mode():
        for step in range(steps + 1):  # the first is a warm-up
            logits = timed("forward", backend.decode_logits, batch)
            timed("plain", sampler.sample, logits, params, positions)
            wants = Processing(logprobs=np.full(rows, TOP, np.int32))
            timed("top20", sampler.sample, logits, params, positions, wants)
            if step == 0:
                parts.clear()
    backend.close()
    return {name: round(statistics.median(xs), 1) for name, xs in parts.items()}


HEADERS = ["tree", "door", "plain", "top_logprobs 20", "ratio"]


def ratio_rows(names: list[str], doors: list[str], walls: dict) -> list[list[object]]:
    rows: list[list[object]] = []
    for name in names:
        for door in doors:
            plain = statistics.median(walls[name][door]["plain"])
            top = statistics.median(walls[name][door]["top20"])
            rows.append([name, door, f"{plain:.2f} s", f"{top:.2f} s", f"{top / plain:.2f}x"])
    return rows


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--model", default="@smollm2", help="a model.path (cpu), or synthetic")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doors", default=",".join(DOORS), help="frames, http or both")
    ap.add_argument("--busy-core", action="store_true", help="a child spins on CPU 1 meanwhile")
    ap.add_argument("--threads", type=int, default=None, help="engine.threads (0: torch's)")
    ap.add_argument("--tree", action="append", default=[], help="a baseline source tree")
    ap.add_argument(
        "--split", type=int, default=0, metavar="STEPS",
        help="only the in-process split of STEPS decode steps: forward, plain and top-20 sampling",
    )  # fmt: skip
    args = ap.parse_args()
    if args.split:
        load = os.getloadavg()[0]
        got = split(args.model, args.streams, args.split)
        print(json.dumps(got | {"load_1m_before": load, "load_1m_after": os.getloadavg()[0]}))
        return
    doors = [door for door in args.doors.split(",") if door]
    if not doors or any(door not in DOORS for door in doors):
        ap.error(f"--doors: a comma-separated subset of {', '.join(DOORS)}")
    load0 = os.getloadavg()[0]
    threads = args.threads
    if threads is None:  # a shared core: one thread, else a barrier waits on the busy one
        threads = 1 if args.busy_core or load0 > 1.0 else 0
    env = {
        "ENGINE__MAX_BATCH_SIZE": str(args.streams), "CACHE__ENABLED": "false",
        "ENGINE__THREADS": str(threads), "HTTP__ENABLED": "true",
    }  # fmt: skip
    if args.model != "synthetic":
        # a KV cache for the streams alone (64 x 512 positions of SmolLM2)
        env |= {"ENGINE__BACKEND": "cpu", "MODEL__PATH": args.model, "ENGINE__MAX_CONTEXT": "512"}
    trees = [ROOT, *map(Path, args.tree)]
    names = ["this tree", *(str(t) for t in args.tree)]
    walls = {n: {door: {v: [] for v, _ in VARIANTS} for door in doors} for n in names}
    tokens: dict[str, dict[str, dict[str, list[int]]]] = {
        n: {door: {v: [] for v, _ in VARIANTS} for door in doors} for n in names
    }
    loads: list[float] = []
    with contextlib.ExitStack() as stack:
        daemons = [
            stack.enter_context(
                Daemon(env, raw_env={"PYTHONPATH": str(tree / "gateway")}, root=tree)
            )
            for tree in trees
        ]
        if args.busy_core:
            stack.enter_context(busy_core(1))
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            variants = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for name, d in zip(names, daemons, strict=True):
                for door in doors:
                    for variant, top in variants:
                        wall, n = asyncio.run(RUNS[door](d, args.streams, args.tokens, top))
                        walls[name][door][variant].append(wall)
                        tokens[name][door][variant].append(n)
                        print(f"{name} {door} {variant}: {wall:.2f} s, {n} tokens", file=sys.stderr)
    m = machine()
    result = {
        "args": vars(args) | {"tree": args.tree, "threads": threads, "doors": doors},
        "walls": walls, "tokens": tokens, "load_1m": loads, "machine": m,
    }  # fmt: skip
    busy = "with a child spinning on CPU 1 throughout" if args.busy_core else "no busy core"
    thread_text = "torch's default threads (one per core)" if threads == 0 else f"{threads}"
    md = (
        f"## logprobs at {args.streams} streams on {args.model}: top_logprobs 20 against plain"
        f"{' (a busy core)' if args.busy_core else ''}\n\n"
        f"`python benchmarks/logprobs_cost.py --model {args.model} --streams {args.streams} "
        f"--tokens {args.tokens} --rounds {args.rounds}{' --busy-core' if args.busy_core else ''}"
        f"` — {args.streams} greedy streams of {args.tokens} tokens per door (frames: ids only, "
        f"8 connections; http: streamed chat completions, `ignore_eos`), plain and with "
        f"`top_logprobs: 20`, rounds interleaved; medians. Engine threads: {thread_text}; "
        f"{busy}. 1-minute load average at each round: "
        + ", ".join(f"{x:.1f}" for x in loads)
        + ".\n\n"
        + table(HEADERS, ratio_rows(names, doors, walls))
        + "\n\n"
        + machine_line(m)
        + "\n"
    )
    suffix = "_busy" if args.busy_core else ""
    publish(args, f"logprobs_cost_{args.model.strip('@')}{suffix}", result, md)


if __name__ == "__main__":
    main()
