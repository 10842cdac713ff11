"""Driving a run: the load loop (closed or open), warm-up, progress line, client CPU, sweep.

``run(options)`` is the Python API the benchmarks call; it returns the report dict (schema in
docs/bench.md). Closed loop: ``concurrency`` workers, each sending its next request when the last
one ends. Open loop: requests start at gamma-distributed arrival times (``request_rate``,
``burstiness``), capped at ``concurrency`` in flight when that is given too. A run ends after
``num_requests`` or when ``duration`` seconds have passed (no new request starts after it; those in
flight finish). Warm-up requests go first, closed loop, and are not measured.

Requests bypass the server's response cache unless ``use_cache`` (a bench measures the engine,
not replays). SIGINT (Ctrl-C) during a run stops it: requests in flight are cancelled, and the
report covers the requests that ended, with ``interrupted`` true.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import resource
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from zerolayer.client.bench import prom
from zerolayer.client.bench.endpoint import parse_endpoint
from zerolayer.client.bench.frames import FrameTarget
from zerolayer.client.bench.http import HttpTarget
from zerolayer.client.bench.options import BenchOptions
from zerolayer.client.bench.report import build_report
from zerolayer.client.bench.stats import RequestRecord, parse_slo
from zerolayer.client.bench.workload import (
    WorkItem,
    arrival_offsets,
    load_file,
    parse_len,
    random_items,
)
from zerolayer.ops.tls import ALPN_FRAME, ALPN_HTTP, client_context

DEFAULT_NUM_REQUESTS = 100


class ItemSource:
    """Request i of the run, drawn lazily (a duration-bounded run has no fixed count)."""

    def __init__(self, opts: BenchOptions, rng: np.random.Generator, ids: bool, vocab: int):
        self._opts, self._rng, self._ids, self._vocab = opts, rng, ids, vocab
        self._out = parse_len(opts.output_len or "128")
        self._in = parse_len(opts.input_len)
        system = Path(opts.system_file).read_text() if opts.system_file else None
        self._system = system
        self._file: list[WorkItem] | None = None
        if opts.input:
            out = parse_len(opts.output_len) if opts.output_len else None
            self._file = load_file(opts.input, out, rng)
        self._items: list[WorkItem] = []

    def get(self, i: int) -> WorkItem:
        if self._file is not None:
            base = self._file[i % len(self._file)]
            item = replace(base)
        else:
            while len(self._items) <= i:
                self._items += random_items(
                    256, self._in, self._out, self._rng, ids=self._ids, vocab_size=self._vocab
                )
            item = self._items[i]
        if self._system is not None:
            item.system = self._system
        if self._opts.prompt_id:
            item.prompt_id = self._opts.prompt_id
        return item


class Progress:
    """Status on stderr: on a terminal one line rewritten twice a second, otherwise (a log, a
    pipe) one line every ``interval`` seconds."""

    def __init__(
        self,
        records: list[RequestRecord],
        live: dict[int, RequestRecord],
        clock: Callable[[], float],
        tty: bool,
        interval: float,
    ):
        self._records, self._live, self._clock = records, live, clock
        self._tty, self._interval = tty, (0.5 if tty else interval)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        last_t, last_tokens = self._clock(), 0
        while True:
            await asyncio.sleep(self._interval)
            now = self._clock()
            recs = self._records
            live = list(self._live.values())
            tokens = sum(r.output_tokens for r in recs) + sum(r.output_tokens for r in live)
            failed = sum(not r.ok for r in recs)
            ttfts = [r.ttft for r in recs[-1000:] if r.ok and r.ttft is not None]
            p50 = f"{np.median(ttfts) * 1000:.1f} ms" if ttfts else "-"
            rate = (tokens - last_tokens) / max(now - last_t, 1e-9)
            last_t, last_tokens = now, tokens
            line = (
                f"done {len(recs) - failed}  in flight {len(live)}  failed {failed}  "
                f"{rate:,.0f} tok/s  TTFT p50 {p50}"
            )
            sys.stderr.write(f"\r {line}   " if self._tty else f"bench: {line}\n")
            sys.stderr.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            if self._tty:
                sys.stderr.write("\n")


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _scrape(url: str | None) -> prom.Samples | None:
    return prom.scrape(url) if url else None


Target = FrameTarget | HttpTarget  # what a run drives: open, request, close


async def _one(
    target: Target, item: WorkItem, rec: RequestRecord, timeout: float, clock: Callable[[], float]
) -> RequestRecord:
    try:
        await asyncio.wait_for(target.request(item, rec), timeout)
    except asyncio.TimeoutError:
        rec.error, rec.t_end = "timeout", clock()
    return rec


async def _drive(
    target: Target,
    source: ItemSource,
    opts: BenchOptions,
    start: int,
    clock: Callable[[], float],
    records: list[RequestRecord],
) -> int:
    """Send the measured requests; append each finished record to ``records``. Returns how
    many were sent."""
    n = opts.num_requests
    if n is None and opts.duration is None:
        n = DEFAULT_NUM_REQUESTS
    t0 = clock()
    deadline = t0 + opts.duration if opts.duration is not None else math.inf
    state = {"next": 0}
    live: dict[int, RequestRecord] = {}  # in flight, for the progress line

    def take() -> int | None:
        i = state["next"]
        if (n is not None and i >= n) or clock() >= deadline:
            return None
        state["next"] = i + 1
        return i

    async def send(i: int) -> None:
        rec = RequestRecord()
        live[id(rec)] = rec
        try:
            records.append(
                await _one(target, source.get(start + i), rec, opts.request_timeout, clock)
            )
        finally:
            del live[id(rec)]

    tty = sys.stderr.isatty()
    progress = Progress(records, live, clock, tty, opts.progress_interval_s)
    if opts.progress if opts.progress is not None else True:
        progress.start()
    try:
        if math.isinf(opts.request_rate):

            async def worker() -> None:
                while (i := take()) is not None:
                    await send(i)

            await asyncio.gather(*(worker() for _ in range(opts.concurrency or 1)))
        else:
            rng = np.random.default_rng(opts.seed + 1)
            cap = asyncio.Semaphore(opts.concurrency) if opts.concurrency else None
            tasks = []
            offsets = np.empty(0)
            while True:
                i = state["next"]
                if i >= len(offsets):  # arrival times in blocks, continuing the process
                    base = offsets[-1] if len(offsets) else 0.0
                    more = arrival_offsets(1024, opts.request_rate, opts.burstiness, rng) + base
                    offsets = np.concatenate([offsets, more])
                delay = t0 + offsets[i] - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if cap is not None:
                    await cap.acquire()
                if take() is None:
                    break

                async def capped(i: int = i) -> None:
                    try:
                        await send(i)
                    finally:
                        if cap is not None:
                            cap.release()

                tasks.append(asyncio.ensure_future(capped()))
            await asyncio.gather(*tasks)
    finally:
        await progress.stop()
    return state["next"]


async def run(opts: BenchOptions, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One bench run against ``opts.endpoint``; returns the report dict."""
    endpoint = parse_endpoint(opts.endpoint, opts.protocol)
    slo = parse_slo(opts.slo) if opts.slo else None
    tls = None
    if endpoint.tls:
        alpn = [ALPN_HTTP] if endpoint.is_http else [ALPN_FRAME]
        tls = client_context(opts.tls_ca, opts.tls_cert, opts.tls_key, alpn=alpn)
    if endpoint.is_http:
        target: Target = HttpTarget(
            endpoint,
            ssl=tls,
            api_key=opts.api_key,
            model=opts.model,
            ignore_eos=opts.ignore_eos,
            use_cache=opts.use_cache,
            clock=clock,
        )
    else:
        target = FrameTarget(
            endpoint,
            ssl=tls,
            connections=opts.connections,
            api_key=opts.api_key,
            text_deltas=opts.text_deltas,
            request_format=opts.request_format,
            use_cache=opts.use_cache,
            version=opts.frame_version,
            clock=clock,
        )
    info = await target.open()
    try:
        rng = np.random.default_rng(opts.seed)
        ids = not endpoint.is_http and opts.system_file is None and opts.request_format != "json"
        source = ItemSource(opts, rng, ids, min(info.get("vocab_size", 256), 1 << 20))
        warm: list[RequestRecord] = []
        if opts.warmup:
            warm_opts = replace(opts, num_requests=opts.warmup, duration=None, progress=False)
            warm_opts.request_rate = math.inf
            warm_opts.concurrency = min(opts.concurrency or 1, opts.warmup)
            await _drive(target, source, warm_opts, 0, clock, warm)
        before = await asyncio.to_thread(_scrape, opts.metrics_url)
        records: list[RequestRecord] = []
        cpu0, t0 = _cpu_seconds(), clock()
        measured = _drive(target, source, opts, opts.warmup, clock, records)
        interrupted = await _interruptible(measured)
        t1, cpu1 = clock(), _cpu_seconds()
        after = await asyncio.to_thread(_scrape, opts.metrics_url)
    finally:
        await target.close()
    server = prom.server_view(before, after) if before is not None and after else None
    report = build_report(
        opts,
        endpoint,
        info,
        records,
        t0=t0,
        duration=t1 - t0,
        cpu_seconds=cpu1 - cpu0,
        warmup_requests=len(warm),
        slo=slo,
        server=server,
    )
    report["interrupted"] = interrupted
    return report


async def _interruptible(work: Awaitable[object]) -> bool:
    """Await ``work``; SIGINT cancels it instead of ending the program. True if it did."""
    task = asyncio.ensure_future(work)
    loop = asyncio.get_running_loop()
    hit = []

    def stop() -> None:
        hit.append(True)
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, stop)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        await task
        return False
    try:
        await task
    except asyncio.CancelledError:
        if not hit:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return bool(hit)


async def sweep(
    opts: BenchOptions, levels: list[int], clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """One run per concurrency level (each with the same options); the report holds them all."""
    runs = []
    for level in levels:
        runs.append(await run(replace(opts, concurrency=level), clock))
        if runs[-1]["interrupted"]:
            break
    return {"schema": runs[0]["schema"], "sweep_concurrency": levels, "sweep": runs}
