"""Serving-layer cost and tail latency: ZeroLayer vs no-logic uvloop servers, two scenarios.

Every server runs as its own process on loopback; the load comes from `zerolayer bench`'s Python
API (gateway.bench) in this process, with token-id prompts and no text deltas. Server CPU = the
server's threads' run time (/proc/PID/task/*/schedstat, nanoseconds) across the measured load.

flat-out: the synthetic backend with no step time, so the engine runs ahead and a TOKEN frame
  carries many tokens. Floor: a uvloop server that parses only the frame header and max_tokens
  and writes one-id TOKEN frames and DONE, one buffer per connection per loop iteration. Load:
  a closed loop of STREAMS concurrent streams x TOKENS tokens on one connection.
paced: the synthetic backend paced like a model (ENGINE__SYNTHETIC_STEP_MS, one pause per engine
  step; see gateway/engine/synthetic.py), 256 concurrent streams over 16 connections x 150
  tokens, each run a burst of 256 requests into an idle server. Floor: a uvloop pump with the
  same pace: every tick one TOKEN frame per active stream and one write per connection; beside
  it the same pump with its pause on a thread of its own (``Ticker``), as the engine thread's.
  Measured: server CPU per token, ITL P50/P99 (per token) and TTFT P50/P99 at the client.

paced-open (its own section): the paced servers under the paced burst and under an open loop of
  random (Poisson) arrivals that keeps about 90% of the slots busy, where the batch's rows change
  at nearly every step (``open_load``).

paced-split (a diagnostic, its own section): the paced burst at several output lengths, for the
  pump and ZeroLayer: a straight line through server CPU per burst against tokens per stream
  splits the cost into a part per step (256 tokens) and a part per request.

The paced scenarios interleave: every server is started first (all alive at once; an idle one
costs next to nothing), warmed up once, then each round runs every load once, the order rotated
round by round (``rotations``). A shared VM's speed drifts by tens of percent over minutes, so a
ratio to the pump is taken within each round and the median taken over rounds (``paired_ratio``).
engine-step (a diagnostic, its own section): the engine and the synthetic backend in this
  process on their own thread, no server (outputs through the Outbox to an event loop that
  drops them), 256 streams x 150 tokens of 16-id prompts at several step times: the engine
  thread's CPU per step, back to back and paced, by kind of step, and what parts of a steady
  step cost (``ablations``: each left out of every other step, paired within a burst).

    python benchmarks/serving.py [--scenario both|flat|paced|paced-open|paced-split|
                                  paced-instructions|engine-step] [--write]
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import (  # noqa: E402
    RESULTS,
    cpu_seconds,
    machine,
    machine_line,
    parser,
    publish,
    table,
)
from benchmarks.engine import ForeignLoad, wait_quiet  # noqa: E402
from gateway import protocol as p  # noqa: E402
from gateway.bench import BenchOptions, run  # noqa: E402
from tests.support.daemon import Daemon, child_preexec  # noqa: E402

HDR = p.HEADER
VOCAB = 100_000
WELCOME = p.encode_welcome(1 << 24, 1024, VOCAB, -1, 4096, "floor")


# --------------------------------------------------------------------------- floor servers


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
    """A floor server subprocess (dies with this process)."""

    def __init__(self, pace_ms: float, wrapper: Sequence[str] = (), threaded: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, __file__, "--floor-server", str(pace_ms)]
            + (["--floor-threaded"] if threaded else []),
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=child_preexec(),
        )
        self.endpoint = f"tcp://127.0.0.1:{int(self.proc.stdout.readline())}"

    def __enter__(self) -> Floor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


# --------------------------------------------------------------------------- load


# Each run draws its own random prompts, so the response cache never replays one.
_SEEDS = itertools.count(time.time_ns() % 1_000_000)


QUIET_WAIT_S = 20.0  # before a measured run, wait up to this long for other load to go away


def measure(
    endpoint: str, pid: int, opts: dict, detailed: bool = False, warmup: bool = False
) -> dict:
    """One bench run; the report plus the server's CPU per output token, in all and in its main
    thread (the event loop: sockets, frames, metrics; the rest is the engine thread), and the
    share of the machine other processes used meanwhile."""
    if not warmup:
        wait_quiet(QUIET_WAIT_S)
    cpu0, main0 = cpu_seconds(pid), cpu_seconds(pid, pid)
    options = BenchOptions(
        endpoint=endpoint, text_deltas=False, detailed=detailed, seed=next(_SEEDS), **opts
    )
    with ForeignLoad((pid,)) as foreign:
        report = asyncio.run(run(options))
    cpu, main = cpu_seconds(pid) - cpu0, cpu_seconds(pid, pid) - main0
    report["foreign_load"] = foreign.share
    expected = opts["num_requests"] * int(opts["output_len"])
    if report["response_cache_hits"]:
        raise SystemExit(f"{endpoint}: {report['response_cache_hits']} response-cache replays")
    if report["failed"] or report["total_output_tokens"] != expected:
        raise SystemExit(
            f"{endpoint}: {report['failed']} failed ({report['errors_by_kind']}), "
            f"{report['total_output_tokens']} of {expected} tokens"
        )
    report["server_cpu_us_per_token"] = cpu / report["total_output_tokens"] * 1e6
    report["loop_cpu_us_per_token"] = main / report["total_output_tokens"] * 1e6
    return report


KEYS = (
    "foreign_load",
    "server_cpu_us_per_token",
    "loop_cpu_us_per_token",
    "output_throughput",
    "median_itl_ms",
    "p99_itl_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "client_cpu_us_per_token",
    "duration",
)


def itl_spread(report: dict) -> float:
    """A run's ITL P99/P50 (its median gap must not be 0)."""
    return report["p99_itl_ms"] / report["median_itl_ms"]


def median_of(reports: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in reports) for k in KEYS}
    # Flat out, most per-token gaps are 0 (many tokens per read): no ratio then.
    ratios = [itl_spread(r) for r in reports if r["median_itl_ms"]]
    out["itl_p99_over_p50"] = statistics.median(ratios) if ratios else None
    return out


def flat_out(args) -> dict:
    load = {
        "concurrency": args.streams,
        "num_requests": args.streams * args.rounds,
        "input_len": "4",
        "output_len": str(args.tokens),
        "connections": 1,
    }
    base = {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": str(args.streams),
        "ENGINE__MAX_CONTEXT": str(max(2048, args.tokens + 16)),
        "ENGINE__SYNTHETIC_VOCAB_SIZE": str(VOCAB),
    }
    results: dict = {"load": load}
    with Floor(0) as floor:
        measure(floor.endpoint, floor.proc.pid, load, warmup=True)
        runs = [measure(floor.endpoint, floor.proc.pid, load) for _ in range(args.runs)]
        results["floor"] = median_of(runs)
    variants = {
        # The default configuration: metrics, rate-limit hook, response cache recording every
        # greedy stream (ids and text) so it can be replayed.
        "zerolayer": base,
        # The same with the response cache off: no per-token recording or detokenization.
        "zerolayer_cache_off": {**base, "CACHE__ENABLED": "false"},
    }
    for name, env in variants.items():
        with Daemon(env) as d:
            measure(d.endpoint, d.proc.pid, load, warmup=True)
            runs = [measure(d.endpoint, d.proc.pid, load) for _ in range(args.runs)]
            results[name] = median_of(runs)
            d.terminate()
    floor_cpu = results["floor"]["server_cpu_us_per_token"]
    for name in variants:
        results[name]["cpu_vs_floor"] = results[name]["server_cpu_us_per_token"] / floor_cpu
    return results


def cover_steps(n: int, prompt_len: int, step_tokens: int, chunk: int) -> list[int]:
    """For a burst of n equal prompts into an idle engine: the 1-based step in which the prefill
    budget (step_tokens minus one per decode row, at most ``chunk`` per prompt per step) could
    first have finished each request's prompt, in arrival order."""
    left = [prompt_len] * n
    decoding, step, done_at = 0, 0, [0] * n
    i = 0
    while i < n:
        step += 1
        budget = step_tokens - decoding
        finished = 0
        j = i
        while j < n and budget > 0:
            take = min(left[j], chunk, budget)
            left[j] -= take
            budget -= take
            if left[j] == 0:
                done_at[j] = step
                finished += 1
                j += 1
            else:
                break
        i += finished
        decoding += finished
    return done_at


PACED_STREAMS, PACED_CONNECTIONS = 256, 16  # the paced burst (paced and paced-split)
PACED_TOKENS = 150  # tokens per stream of the paced scenario's burst


def paced_load(args, tokens: int) -> dict:
    """One burst of PACED_STREAMS requests of ``tokens`` tokens each, over PACED_CONNECTIONS."""
    return {
        "concurrency": PACED_STREAMS,
        "num_requests": PACED_STREAMS,
        "input_len": str(args.paced_prompt_len),
        "output_len": str(tokens),
        "connections": PACED_CONNECTIONS,
    }


def paced_env(args) -> dict[str, str]:
    """The daemon of the paced scenarios: the synthetic backend paced like a model."""
    return {
        "ENGINE__BACKEND": "synthetic",
        "ENGINE__MAX_BATCH_SIZE": str(PACED_STREAMS),
        "ENGINE__SYNTHETIC_VOCAB_SIZE": str(VOCAB),
        "ENGINE__SYNTHETIC_STEP_MS": str(args.step_ms),
        "ENGINE__SYNTHETIC_PREFILL_US_PER_TOKEN": str(args.prefill_us_per_token),
    }


T = TypeVar("T")


def rotations(items: Sequence[T], rounds: int) -> list[list[T]]:
    """The order of each round: ``items`` rotated left by the round's index, so over len(items)
    rounds each item goes first once, and neighbours stay neighbours (but for the wrap)."""
    n = len(items)
    return [[items[(r + i) % n] for i in range(n)] for r in range(rounds)]


def paired_ratio(a_runs: Sequence[float], b_runs: Sequence[float]) -> tuple[float, list[float]]:
    """The median over rounds of a / b within a round, and those per-round ratios: run i of
    ``a_runs`` and of ``b_runs`` come from the same round, so the host's drift between rounds
    cancels (a ratio of medians taken minutes apart keeps it)."""
    ratios = [a / b for a, b in zip(a_runs, b_runs, strict=True)]  # unequal: ValueError
    if not ratios:
        raise ValueError("paired_ratio of no runs")
    return statistics.median(ratios), ratios


Servers = dict[str, tuple[str, int]]  # server name -> (endpoint, pid)


@contextlib.contextmanager
def paced_servers(args, variants: dict[str, dict[str, str]]):
    """The pump ("pump"), the threaded pump ("pump_threaded": the pause on a thread of its own,
    ``Ticker``) and a daemon for each variant's env, all started before any is measured and
    alive together; yields name -> (endpoint, pid)."""
    with contextlib.ExitStack() as stack:
        servers: Servers = {}
        for name, threaded in (("pump", False), ("pump_threaded", True)):
            floor = stack.enter_context(Floor(args.step_ms, threaded=threaded))
            servers[name] = (floor.endpoint, floor.proc.pid)
        daemons = []
        for name, env in variants.items():
            d = stack.enter_context(Daemon(env))
            daemons.append(d)
            servers[name] = (d.endpoint, d.proc.pid)
        yield servers
        for d in daemons:
            d.terminate()


K = TypeVar("K")


def interleaved_runs(
    servers: Servers, loads: dict[K, dict], args, detailed: bool = False
) -> tuple[dict[tuple[str, K], list[dict]], list[list[str]]]:
    """Warm every server up with one paced burst, then ``args.paced_runs`` rounds, each running
    every load (name -> bench options, e.g. ``paced_load``) once on every server in
    ``rotations`` order: the reports of each (server, load name), in round order, and each
    round's order."""
    for endpoint, pid in servers.values():
        measure(endpoint, pid, paced_load(args, PACED_TOKENS), warmup=True)
    units = [(name, load) for load in loads for name in servers]
    reports: dict[tuple[str, K], list[dict]] = {u: [] for u in units}
    orders = rotations(units, args.paced_runs)
    for i, order in enumerate(orders, 1):
        for name, load in order:
            endpoint, pid = servers[name]
            r = measure(endpoint, pid, loads[load], detailed=detailed)
            reports[(name, load)].append(r)
            print(
                f"round {i}/{len(orders)}: {name}, {load}: "
                f"{r['server_cpu_us_per_token']:.2f} µs/token, other load {r['foreign_load']:.2f}",
                file=sys.stderr,
            )
    return reports, [[f"{name}@{load}" for name, load in order] for order in orders]


def paced(args, plots: Path | None) -> dict:
    streams, prompt_len = PACED_STREAMS, args.paced_prompt_len
    load, env = paced_load(args, PACED_TOKENS), paced_env(args)
    step_tokens, chunk = 512, 256  # the engine defaults (gateway/config.py)
    # A step budget that covers the whole burst's prompts (plus a row per stream) at once: how
    # much of the TTFT tail is the admission ramp of the default budget.
    wide = streams * prompt_len + streams
    variants = {
        "zerolayer": env,
        "zerolayer_cache_off": {**env, "CACHE__ENABLED": "false"},
        "zerolayer_prefix_off": {**env, "ENGINE__PREFIX_CACHE": "false"},
        "zerolayer_wide_budget": {**env, "ENGINE__MAX_STEP_TOKENS": str(wide)},
    }
    with paced_servers(args, variants) as servers:
        loads = {PACED_TOKENS: load}
        runs, orders = interleaved_runs(servers, loads, args, detailed=True)
    reports = {name: runs[(name, PACED_TOKENS)] for name in servers}
    results: dict = {
        "load": load,
        "step_ms": args.step_ms,
        "prefill_us_per_token": args.prefill_us_per_token,
        "prompt_len": prompt_len,
        "rounds": args.paced_runs,
        "round_orders": orders,
    }
    for name, rs in reports.items():
        results[name] = median_of(rs)
    cpu = {name: [r["server_cpu_us_per_token"] for r in rs] for name, rs in reports.items()}
    for name in ("pump_threaded", *variants):
        x = results[name]
        x["cpu_vs_pump"], x["cpu_vs_pump_rounds"] = paired_ratio(cpu[name], cpu["pump"])
        x["cpu_vs_pump_of_medians"] = (
            x["server_cpu_us_per_token"] / results["pump"]["server_cpu_us_per_token"]
        )
    for name in variants:
        x = results[name]
        x["cpu_vs_pump_threaded"], x["cpu_vs_pump_threaded_rounds"] = paired_ratio(
            cpu[name], cpu["pump_threaded"]
        )
    # A step lasts the pause plus the engine's own work: its length is the variant's median ITL.
    for key, budget in (("", step_tokens), ("_wide_budget", wide)):
        steps = cover_steps(streams, prompt_len, budget, chunk)
        p99_step = sorted(steps)[math.ceil(0.99 * len(steps)) - 1]
        step_len = results[f"zerolayer{key}"]["median_itl_ms"]
        results[f"ttft_p99_bound_ms{key}"] = (p99_step + 2) * step_len
        results[f"cover_step_p99{key}"] = p99_step
    results["wide_budget"] = wide
    z = results["zerolayer"]
    results["aims"] = {
        "itl_ratio": z["itl_p99_over_p50"],
        # Paired by round, as the CPU ratio: each round's ITL P99/P50 against the pump's.
        "itl_ratio_vs_pump": paired_ratio(
            [itl_spread(r) for r in reports["zerolayer"]], [itl_spread(r) for r in reports["pump"]]
        )[0],
        # The median of per-round ratios (paired_ratio); the ratio of medians for comparison.
        "cpu_vs_pump": z["cpu_vs_pump"],
        "cpu_vs_pump_rounds": z["cpu_vs_pump_rounds"],
        "cpu_vs_pump_of_medians": z["cpu_vs_pump_of_medians"],
        # The pause on a thread of its own, no logic (Ticker): what that part of the design costs.
        "pump_threaded_vs_pump": results["pump_threaded"]["cpu_vs_pump"],
        "cpu_vs_pump_threaded": z["cpu_vs_pump_threaded"],
        "ttft_p99_ms": z["p99_ttft_ms"],
        "ttft_p99_ms_wide_budget": results["zerolayer_wide_budget"]["p99_ttft_ms"],
    }
    if plots is not None:
        from gateway.bench.plot import plot

        for name in ("pump", "zerolayer"):
            reports[name][0]["label"] = f"{name}, paced {args.step_ms:g} ms"
            plot(reports[name][0], plots / f"paced-{name}")
    return results


OPEN_FILL = 0.9  # paced-open: the share of the slots its arrival rate keeps busy on average
OPEN_REQUESTS = 3 * PACED_STREAMS  # paced-open: requests per run


def open_load(args, tokens: int = PACED_TOKENS) -> dict:
    """Requests arriving at random (Poisson) at the rate that keeps OPEN_FILL of the
    PACED_STREAMS slots busy on average (Little's law: a stream lasts about ``tokens`` steps),
    OPEN_REQUESTS of them over PACED_CONNECTIONS: rows join and leave the batch at nearly every
    step, as in a server's everyday traffic, where the burst starts all of them together."""
    lifetime_s = tokens * args.step_ms / 1e3
    return {
        "request_rate": OPEN_FILL * PACED_STREAMS / lifetime_s,
        "num_requests": OPEN_REQUESTS,
        "input_len": str(args.paced_prompt_len),
        "output_len": str(tokens),
        "connections": PACED_CONNECTIONS,
    }


def paced_open(args) -> dict:
    """The paced burst and the open loop (``open_load``) side by side, interleaved, on the two
    pumps and ZeroLayer: per server and load the medians over rounds and the CPU per token
    against the pump's under the same load, paired by round."""
    loads = {"burst": paced_load(args, PACED_TOKENS), "open": open_load(args)}
    with paced_servers(args, {"zerolayer": paced_env(args)}) as servers:
        runs, orders = interleaved_runs(servers, loads, args)
    results: dict = {
        "loads": loads,
        "step_ms": args.step_ms,
        "prompt_len": args.paced_prompt_len,
        "rounds": args.paced_runs,
        "round_orders": orders,
    }
    for load in loads:
        pump = [r["server_cpu_us_per_token"] for r in runs[("pump", load)]]
        for name in servers:
            x = median_of(runs[(name, load)])
            x["cpu_vs_pump"], x["cpu_vs_pump_rounds"] = paired_ratio(
                [r["server_cpu_us_per_token"] for r in runs[(name, load)]], pump
            )
            results.setdefault(name, {})[load] = x
    return results


def paced_open_md(r: dict, args) -> str:
    labels = (
        ("pump", "uvloop pump (floor)"),
        ("pump_threaded", "uvloop pump, pause on a thread"),
        ("zerolayer", "zerolayer (synthetic, paced)"),
    )
    rows = [
        [
            label,
            load,
            f"{x['server_cpu_us_per_token']:.2f}",
            f"{x['cpu_vs_pump']:.2f}x" if name != "pump" else "—",
            f"{x['loop_cpu_us_per_token']:.2f}",
            f"{x['server_cpu_us_per_token'] - x['loop_cpu_us_per_token']:.2f}",
            f"{x['median_itl_ms']:.1f}",
            f"{x['p99_itl_ms']:.1f}",
            f"{x['median_ttft_ms']:.1f}",
            f"{x['p99_ttft_ms']:.1f}",
            f"{x['output_throughput']:,.0f}",
            f"{x['foreign_load']:.2f}",
        ]
        for load in r["loads"]
        for name, label in labels
        for x in (r[name][load],)
    ]
    burst, open_ = r["loads"]["burst"], r["loads"]["open"]
    z, pump = r["zerolayer"], r["pump"]
    return (
        "## Serving layer at a model's pace: a burst against everyday arrivals (paced-open)\n\n"
        f"`python benchmarks/serving.py --scenario paced-open` — the servers of the paced "
        f"scenario (synthetic step time {r['step_ms']:g} ms), each under two loads of "
        f"{burst['output_len']}-token streams with {r['prompt_len']}-id prompts over "
        f"{burst['connections']} connections: **burst**, the paced scenario's "
        f"{burst['num_requests']} requests sent together into an idle server; **open**, "
        f"{open_['num_requests']} requests arriving at random (Poisson, "
        f"{open_['request_rate']:.1f} a second: the rate that keeps {OPEN_FILL:.0%} of the "
        f"{PACED_STREAMS} slots busy on average, since a stream lasts about "
        f"{open_['output_len']} steps). In a burst the batch's rows change only while the "
        "burst is admitted and while it ends; in the open loop some rows join or leave at "
        "nearly every step, as in a server's everyday traffic. "
        + interleaved_md(r["rounds"], "both loads on every server")
        + " "
        + OTHER_LOAD
        + "\n\n"
        + table(
            [
                "server",
                "load",
                "CPU µs / token",
                "vs pump, same load",
                "event loop",
                "other threads",
                "ITL P50 ms",
                "ITL P99 ms",
                "TTFT P50 ms",
                "TTFT P99 ms",
                "tokens / s",
                "other load",
            ],
            rows,
        )
        + "\n\nZeroLayer's CPU per token against the pump's, round by round (in round order): "
        f"burst {ratio_list(z['burst']['cpu_vs_pump_rounds'])}; "
        f"open {ratio_list(z['open']['cpu_vs_pump_rounds'])}. "
        f"From the burst to the open loop the pump goes from "
        f"{pump['burst']['server_cpu_us_per_token']:.2f} to "
        f"{pump['open']['server_cpu_us_per_token']:.2f} µs per token (fewer tokens share each "
        f"tick: {pump['open']['output_throughput']:,.0f} against "
        f"{pump['burst']['output_throughput']:,.0f} a second), ZeroLayer from "
        f"{z['burst']['server_cpu_us_per_token']:.2f} to "
        f"{z['open']['server_cpu_us_per_token']:.2f}: its engine and output processor rebuild "
        "their per-row state (decode batch, columnar set, frame plan) whenever the rows change, "
        "which in the open loop is nearly every step."
    )


SPLIT_LENGTHS = (50, 150, 300)  # tokens per stream of the paced-split bursts


def split_fit(cpu_ms: Sequence[float]) -> dict[str, float]:
    """The least-squares line through CPU ms per burst at SPLIT_LENGTHS: its slope as µs per step
    (a token for each stream), its intercept as µs per request."""
    slope, intercept = statistics.linear_regression(SPLIT_LENGTHS, cpu_ms)
    return {"per_step_us": slope * 1e3, "per_request_us": intercept * 1e3 / PACED_STREAMS}


def callgrind_total(out_dir: str, pid: int) -> int:
    """The instruction total of the latest callgrind dump of process ``pid`` in ``out_dir``
    (``callgrind_control -d`` writes cg.PID.1, cg.PID.2, ...)."""
    dumps = list(Path(out_dir).glob(f"cg.{pid}.*"))
    if not dumps:
        raise SystemExit(f"no callgrind dump of process {pid} in {out_dir}")
    latest = max(dumps, key=lambda f: int(f.name.rsplit(".", 1)[1]))
    for line in latest.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{latest}: no instruction total")


def paced_instructions(args) -> dict:
    """User-space instructions per paced burst of the pump and of ZeroLayer at each of
    SPLIT_LENGTHS, each server run under callgrind: a warm-up burst, then per length the
    counters zeroed, ``--paced-runs`` bursts, one dump; and the line through them (per step,
    per request) as in paced-split."""
    import shutil
    import tempfile

    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        raise SystemExit("--scenario paced-instructions needs valgrind (Debian: valgrind)")
    results: dict = {"step_ms": args.step_ms, "bursts": args.paced_runs}
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = ["valgrind", "--tool=callgrind", f"--log-file={tmp}/log.%p",
                   f"--callgrind-out-file={tmp}/cg.%p"]  # fmt: skip

        def count(endpoint: str, pid: int) -> dict:
            control = ["callgrind_control"]
            measure(endpoint, pid, paced_load(args, SPLIT_LENGTHS[0]), warmup=True)
            out: dict = {"points": {}}
            for tokens in SPLIT_LENGTHS:
                load = paced_load(args, tokens)
                subprocess.run([*control, "-z", str(pid)], check=True, capture_output=True)
                runs = [measure(endpoint, pid, load, warmup=True) for _ in range(args.paced_runs)]
                subprocess.run([*control, "-d", str(pid)], check=True, capture_output=True)
                total = callgrind_total(tmp, pid)
                out["points"][tokens] = {
                    "instructions_per_burst": total / args.paced_runs,
                    "instructions_per_token": total / sum(r["total_output_tokens"] for r in runs),
                    "median_itl_ms": statistics.median(r["median_itl_ms"] for r in runs),
                }
            per_burst = [out["points"][t]["instructions_per_burst"] for t in SPLIT_LENGTHS]
            slope, intercept = statistics.linear_regression(SPLIT_LENGTHS, per_burst)
            out["per_step"], out["per_request"] = slope, intercept / PACED_STREAMS
            return out

        with Floor(args.step_ms, wrapper) as floor:
            results["pump"] = count(floor.endpoint, floor.proc.pid)
        with Daemon(paced_env(args), wrapper=wrapper) as d:
            results["zerolayer"] = count(d.endpoint, d.proc.pid)
            d.terminate()
    z, f = results["zerolayer"]["points"], results["pump"]["points"]
    results["instructions_vs_pump"] = {
        t: z[t]["instructions_per_token"] / f[t]["instructions_per_token"] for t in SPLIT_LENGTHS
    }
    return results


def paced_instructions_md(r: dict, args) -> str:
    rows = []
    for name, label in (("pump", "uvloop pump (floor)"), ("zerolayer", "zerolayer, default")):
        x = r[name]
        rows.append(
            [
                label,
                *(f"{x['points'][t]['instructions_per_burst'] / 1e6:.1f}" for t in SPLIT_LENGTHS),
                f"{x['points'][PACED_TOKENS]['instructions_per_token']:,.0f}",
                "—" if name == "pump" else f"{r['instructions_vs_pump'][PACED_TOKENS]:.2f}x",
                f"{x['per_step'] / 1e3:,.0f}k",
                f"{x['per_request'] / 1e3:,.0f}k",
                "–".join(f"{p['median_itl_ms']:.1f}" for p in x["points"].values()),
            ]
        )
    ratios = ", ".join(f"{r['instructions_vs_pump'][t]:.2f}x at {t}" for t in SPLIT_LENGTHS)
    return (
        "## Serving layer at a model's pace: instructions per token (callgrind)\n\n"
        "`python benchmarks/serving.py --scenario paced-instructions` — the paced burst "
        f"(synthetic step time {r['step_ms']:g} ms, {PACED_STREAMS} streams over "
        f"{PACED_CONNECTIONS} connections, {args.paced_prompt_len}-id prompts) at "
        f"{', '.join(map(str, SPLIT_LENGTHS))} tokens per stream, each server run under "
        "valgrind's callgrind: one warm-up burst, then per length the counters zeroed and "
        f"{r['bursts']} bursts counted; a least-squares line through instructions per burst "
        "against tokens per stream splits them into a part per step (a token for each stream) "
        "and a part per request, as paced-split does for CPU time. Callgrind counts the "
        "server's user-space instructions, all threads: within 2% from run to run on this "
        "machine, whatever its load, unlike CPU time. It counts no kernel work (the same socket "
        "writes for both servers) and none of what an instruction costs more on a CPU just "
        "woken from idle (the engine-step diagnostic), so it is the code's share of the paced "
        "CPU, not all of it. Under valgrind a server runs tens of times slower: the ITL column "
        "shows whether it still kept the pace.\n\n"
        + table(
            [
                "server",
                *(f"M instructions / burst, {t} tokens" for t in SPLIT_LENGTHS),
                f"instructions / token, {PACED_TOKENS} tokens",
                "vs pump",
                "instructions / step",
                "instructions / request",
                "ITL P50 ms (under valgrind)",
            ],
            rows,
        )
        + f"\n\nZeroLayer's instructions per token against the pump's: {ratios} tokens a "
        "stream."
    )


def paced_split(args) -> dict:
    """Server CPU per burst at each of SPLIT_LENGTHS (median over rounds), the least-squares
    line through those medians: the slope is the cost of a step (one token for each of the 256
    streams), the intercept the cost of the burst's requests themselves (admission, prefill,
    endings, their frames); and ZeroLayer's cost per step against the pump's, paired by round."""
    with paced_servers(args, {"zerolayer": paced_env(args)}) as servers:
        loads = {tokens: paced_load(args, tokens) for tokens in SPLIT_LENGTHS}
        runs, orders = interleaved_runs(servers, loads, args)
    results: dict = {
        "step_ms": args.step_ms,
        "streams": PACED_STREAMS,
        "connections": PACED_CONNECTIONS,
        "rounds": args.paced_runs,
        "round_orders": orders,
    }
    per_round_step: dict[str, list[float]] = {}
    for name in servers:
        points = {}
        for tokens in SPLIT_LENGTHS:
            rs = runs[(name, tokens)]
            per_burst = PACED_STREAMS * tokens / 1e3  # µs per token -> ms per burst
            points[tokens] = {
                "cpu_ms": statistics.median(r["server_cpu_us_per_token"] for r in rs) * per_burst,
                "loop_cpu_ms": statistics.median(r["loop_cpu_us_per_token"] for r in rs)
                * per_burst,
                "foreign_load": statistics.median(r["foreign_load"] for r in rs),
            }
        fit = {
            key: split_fit([points[t][key] for t in SPLIT_LENGTHS])
            for key in ("cpu_ms", "loop_cpu_ms")
        }
        per_round_step[name] = [
            split_fit(
                [
                    runs[(name, t)][i]["server_cpu_us_per_token"] * PACED_STREAMS * t / 1e3
                    for t in SPLIT_LENGTHS
                ]
            )["per_step_us"]
            for i in range(args.paced_runs)
        ]
        results[name] = {"points": points, "fit": fit, "per_step_us_rounds": per_round_step[name]}
    results["per_step_vs_pump"], results["per_step_vs_pump_rounds"] = paired_ratio(
        per_round_step["zerolayer"], per_round_step["pump"]
    )
    results["per_step_vs_pump_threaded"], _ = paired_ratio(
        per_round_step["zerolayer"], per_round_step["pump_threaded"]
    )
    results["pump_threaded_per_step_vs_pump"], _ = paired_ratio(
        per_round_step["pump_threaded"], per_round_step["pump"]
    )
    return results


def paced_split_md(r: dict, args) -> str:
    rows = []
    labels = (
        ("pump", "uvloop pump (floor)"),
        ("pump_threaded", "uvloop pump, pause on a thread"),
        ("zerolayer", "zerolayer, default"),
    )
    for name, label in labels:
        fit, points = r[name]["fit"], r[name]["points"]
        rows.append(
            [
                label,
                *(f"{points[t]['cpu_ms']:.1f}" for t in SPLIT_LENGTHS),
                f"{fit['cpu_ms']['per_step_us']:.0f}",
                f"{fit['loop_cpu_ms']['per_step_us']:.0f}",
                f"{fit['cpu_ms']['per_request_us']:.0f}",
                f"{fit['loop_cpu_ms']['per_request_us']:.0f}",
                f"{max(p['foreign_load'] for p in points.values()):.2f}",
            ]
        )
    z, f = r["zerolayer"]["fit"]["cpu_ms"], r["pump"]["fit"]["cpu_ms"]
    return (
        "## Serving layer at a model's pace: CPU per step and per request (diagnostic)\n\n"
        "`python benchmarks/serving.py --scenario paced-split` — the paced burst (synthetic "
        f"step time {r['step_ms']:g} ms, {r['streams']} streams over {r['connections']} "
        f"connections, {args.paced_prompt_len}-id prompts) at "
        f"{', '.join(map(str, SPLIT_LENGTHS))} tokens per stream; a least-squares line "
        "through server CPU per burst against tokens per stream: its slope is the cost of one "
        "step (a token for each stream), its intercept per stream the cost of a request apart "
        "from its tokens. "
        + interleaved_md(r["rounds"], "every server at every length")
        + " "
        + OTHER_LOAD
        + "\n\n"
        + table(
            [
                "server",
                *(f"CPU ms / burst, {t} tokens" for t in SPLIT_LENGTHS),
                "µs / step",
                "of which event loop",
                "µs / request",
                "of which event loop",
                "other load (max)",
            ],
            rows,
        )
        + f"\n\nPer step ZeroLayer costs {r['per_step_vs_pump']:.2f}x the pump (median of the "
        "per-round ratios of the lines fitted to each round's bursts; per round, in order: "
        f"{ratio_list(r['per_step_vs_pump_rounds'])}; the lines through the medians give "
        f"{z['per_step_us'] / f['per_step_us']:.2f}x), per request {z['per_request_us']:.0f} "
        f"against {f['per_request_us']:.0f} µs. Against the pump with its pause on a thread, "
        f"ZeroLayer's step costs {r['per_step_vs_pump_threaded']:.2f}x, and that pump's step "
        f"{r['pump_threaded_per_step_vs_pump']:.2f}x the plain pump's (medians of per-round "
        "ratios)."
    )


OTHER_LOAD = (
    "Other load: the share of the machine's cores that other processes used during the run "
    "(median over runs; each measured run first waits up to 20 s for it to fall under 0.10)."
)
RUN_TO_RUN = (
    "Short runs on a shared VM vary by tens of percent from run to run; compare the rows of one "
    "run."
)


def interleaved_md(rounds: int, each: str) -> str:
    """The paced scenarios' sentence on how their runs were ordered (``interleaved_runs``)."""
    return (
        "A shared VM's speed drifts by tens of percent within minutes, so the runs are "
        "interleaved round by round: every server is started first (all alive at once) and "
        f"warmed up with one burst, then {rounds} round{'s' if rounds != 1 else ''}, each "
        f"running {each} once, in an order rotated round by round so that no server always goes "
        "first. A figure in the table is the median over rounds; a ratio to the pump is the "
        "median of the per-round ratios (each against the pump's run of the same round)."
    )


def ratio_list(ratios: Sequence[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in ratios)


STEP_KINDS = ("admitting", "ending", "steady")
# Parts of a steady step that engine_step_cost(skip=...) leaves out of every other step: the
# engine's attribute, and what stands in for it (given the real one and the call's arguments).
ABLATIONS: dict[str, tuple[str, Callable[..., object]]] = {
    # A step that ends sequences still hands them over: only steps of tokens alone are dropped.
    "hand-off to the event loop": (
        "_deliver",
        lambda real, step: real(step) if step.finished else None,
    ),
    "step metrics": ("_report", lambda real, *args: None),
}
NOTHING = "nothing"  # skip=NOTHING: steps split by turns as for a part, none left out


def engine_step_cost(
    step_ms: float, streams: int = 256, tokens: int = 150, skip: str | None = None
) -> dict:
    """The engine thread's CPU per step for one burst, its outputs handed through the daemon's
    Outbox to an event loop on a thread of its own, which drops them (no server); and by kind of
    step, the thread CPU from one step's end to the next's: "admitting" (sequences waiting or
    prefilling when it began: the admission ramp), "ending" (some sequence ended in it),
    "steady" (neither: the decode rows go on unchanged). With ``skip`` (an ABLATIONS key, or
    NOTHING) every other step leaves that part out, and the steady steps' median is kept apart
    for steps with it and without it: a difference paired within one burst, free of the host's
    drift between runs."""
    import numpy as np
    import uvloop

    from gateway.engine.engine import Engine, Sequence
    from gateway.engine.outbox import Outbox
    from gateway.engine.synthetic import SyntheticBackend
    from gateway.engine.types import SamplingRow
    from gateway.tokenizer import ByteTokenizer

    finished = threading.Event()
    ended = [0]

    def consume(steps) -> None:  # noqa: ANN001 - on the event loop
        for step in steps:
            ended[0] += len(step.finished)
        if ended[0] >= streams:
            finished.set()

    loop = uvloop.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    outbox = Outbox()
    outbox.attach(loop, consume)
    backend = SyntheticBackend(streams, VOCAB, 2048, step_ms=step_ms)
    engine = Engine(
        backend,
        ByteTokenizer(VOCAB),
        outbox.put,
        max_queue=4 * streams,
        max_step_tokens=512,
        prefill_chunk=256,
    )
    skipping = [False]  # whether the step under way leaves ``skip`` out
    left_out = [0]  # calls the stand-in took: 0 would mean the engine no longer makes this call
    if skip is not None and skip != NOTHING:
        attr, stand_in = ABLATIONS[skip]
        real = getattr(engine, attr)

        def either(*args):  # noqa: ANN002, ANN202
            if not skipping[0]:
                return real(*args)
            left_out[0] += 1
            return stand_in(real, *args)

        setattr(engine, attr, either)
    kinds: dict[str, list[int]] = {kind: [] for kind in STEP_KINDS}
    steady_by_skip: dict[bool, list[int]] = {False: [], True: []}
    last_end = [0]
    real_step = engine.step

    def timed_step():  # noqa: ANN202 - on the engine thread, in place of step
        admitting = bool(engine._inbox or engine._waiting or engine._prefilling)
        out = real_step()
        now = time.thread_time_ns()
        if last_end[0]:
            ending = bool(out.finished)
            kind = "admitting" if admitting else "ending" if ending else "steady"
            kinds[kind].append(now - last_end[0])
            if kind == "steady":
                steady_by_skip[skipping[0]].append(now - last_end[0])
        last_end[0] = now
        # The next step's turn; this step's hand-off comes after this, so it counts (in time
        # and in being skipped) with the next step, as it does in that step's interval.
        skipping[0] = skip is not None and not skipping[0]
        return out

    engine.step = timed_step  # type: ignore[method-assign]
    engine.start()
    try:
        time.sleep(0.1)
        tid = engine._compute.thread.native_id  # type: ignore[union-attr]
        rng = np.random.default_rng(next(_SEEDS))
        cpu0, steps0 = cpu_seconds(os.getpid(), tid), engine.steps
        for i in range(streams):
            prompt = rng.integers(0, VOCAB, 16).astype(np.int32)
            engine.submit(Sequence(i, prompt, tokens, SamplingRow()))
        finished.wait(120)
        cpu, steps = cpu_seconds(os.getpid(), tid) - cpu0, engine.steps - steps0
    finally:
        engine.stop()
        outbox.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()

    def median_us(ns: list[int]) -> float:
        return statistics.median(ns) / 1e3 if ns else 0.0

    return {
        "step_ms": step_ms,
        "steps": steps,
        "cpu_us_per_step": cpu / max(steps, 1) * 1e6,
        "steady_us_with": median_us(steady_by_skip[False]),
        "steady_us_without": median_us(steady_by_skip[True]),
        "left_out_calls": left_out[0],
        "kinds": {
            kind: {"steps": len(ns), "median_us": median_us(ns), "ms_per_burst": sum(ns) / 1e6}
            for kind, ns in kinds.items()
        },
    }


def ablations(runs: int) -> dict[str, dict[str, float]]:
    """At 20 ms, per ABLATIONS part (and NOTHING, where both halves keep everything: the
    pairing's own spread), the steady steps' median with the part and without it, medians over
    ``runs`` bursts, and their difference: what the part costs a steady step."""
    out = {}
    for name in (NOTHING, *ABLATIONS):
        rs = [engine_step_cost(20.0, skip=name) for _ in range(runs)]
        with_us = statistics.median(r["steady_us_with"] for r in rs)
        without_us = statistics.median(r["steady_us_without"] for r in rs)
        out[name] = {"with_us": with_us, "without_us": without_us, "cost_us": with_us - without_us}
    return out


def sleep_floor(pause_s: float, n: int = 150) -> float:
    """Thread CPU (µs, median of ``n``) of a thread that only sleeps ``pause_s`` per step: what
    waking from a backend call costs before any work."""
    sleep = "sleep"
    return cold_call_cost(0.0, calls=n, ops={sleep: lambda: time.sleep(pause_s)})[sleep]


# A busy loop pinned to one CPU at SCHED_IDLE priority, for at most argv[2] seconds; it prints an
# empty line once pinned and demoted.
SPINNER = (
    "import os, sys, time\n"
    "cpu, limit = int(sys.argv[1]), float(sys.argv[2])\n"
    "os.sched_setaffinity(0, {cpu})\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "print(flush=True)\n"
    "end = time.monotonic() + limit\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


def can_keep_busy() -> bool:
    """Whether ``idle_spinner`` can run here: Linux, and at least 2 CPUs this process may use."""
    return hasattr(os, "SCHED_IDLE") and len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def idle_spinner(cpu: int, limit_s: float):
    """A child process busy-looping on ``cpu`` at SCHED_IDLE priority while the block runs (and
    never longer than ``limit_s``): that CPU never idles, yet a thread waking on it preempts the
    spinner at once."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPINNER, str(cpu), str(limit_s)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=child_preexec(),
    )
    try:
        if proc.stdout.readline() != "\n" or os.sched_getscheduler(proc.pid) != os.SCHED_IDLE:
            raise RuntimeError("the SCHED_IDLE spinner did not start")
        yield
    finally:
        proc.kill()
        proc.wait()


def cold_call_cost(
    pause_s: float,
    calls: int = 60,
    keep_busy: bool = False,
    ops: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Thread CPU (µs) of single calls on a thread of their own (by default a few the engine
    thread could make once per step), each measured right after ``pause_s`` of sleep (0: back
    to back), median over ``calls``: what a call costs on a thread that wakes from a backend
    call. With ``keep_busy`` the measuring thread is pinned to one CPU and an ``idle_spinner``
    runs there while it sleeps: a call that then costs what it does back to back pays, after a
    plain sleep, for the CPU waking from idle (its caches cold after the host ran something
    else), not for its own working set."""
    import numpy as np

    a = np.arange(256, dtype=np.int32)
    if ops is None:
        ops = {
            "nothing (the clock read alone)": lambda: None,
            "numpy ufunc: (a == 2).any() on 256 int32": lambda: bool((a == 2).any()),
            "numpy ufunc: a + 1 on 256 int32": lambda: a + 1,
            "a.tolist() and a list search": lambda: 2 in a.tolist(),
            "Python loop over 256 ints": lambda: sum(range(256)),
        }
    out: dict[str, float] = {}
    cpu = max(os.sched_getaffinity(0)) if keep_busy else -1

    def body() -> None:
        if keep_busy:
            os.sched_setaffinity(0, {cpu})  # this thread only
        for name, op in ops.items():
            times = []
            for _ in range(calls):
                if pause_s:
                    time.sleep(pause_s)
                t0 = time.thread_time_ns()
                op()
                times.append(time.thread_time_ns() - t0)
            out[name] = statistics.median(times) / 1e3

    with contextlib.ExitStack() as stack:
        if keep_busy:  # started from this thread: child_preexec ties it to the main thread
            stack.enter_context(idle_spinner(cpu, len(ops) * calls * (pause_s + 0.01) + 30))
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    return out


def engine_step(args) -> dict:
    runs = {ms: [engine_step_cost(ms) for _ in range(args.runs)] for ms in (0.0, 1.0, 5.0, 20.0)}
    return {
        "steps": {
            str(ms): {
                "steps": statistics.median(r["steps"] for r in rs),
                "cpu_us_per_step": statistics.median(r["cpu_us_per_step"] for r in rs),
            }
            for ms, rs in runs.items()
        },
        # At the paced scenario's 20 ms: each kind's figures, median over runs.
        "kinds_20ms": {
            kind: {
                key: statistics.median(r["kinds"][kind][key] for r in runs[20.0])
                for key in ("steps", "median_us", "ms_per_burst")
            }
            for kind in STEP_KINDS
        },
        "sleep_floor_20ms_us": sleep_floor(0.02),
        "ablations_20ms": ablations(args.runs),
        "cold_calls": {
            "back_to_back": cold_call_cost(0.0),
            "after_20ms": cold_call_cost(0.02),
            # None where the CPU cannot be kept busy (not Linux, or a single CPU).
            "after_20ms_busy": cold_call_cost(0.02, keep_busy=True) if can_keep_busy() else None,
        },
    }


def engine_step_md(r: dict, args) -> str:
    rows = [
        [f"{float(ms):g}", f"{v['steps']:.0f}", f"{v['cpu_us_per_step']:.0f}"]
        for ms, v in r["steps"].items()
    ]
    cold = r["cold_calls"]
    busy = cold["after_20ms_busy"]
    call_rows = [
        [
            name,
            f"{us:.1f}",
            f"{cold['after_20ms'][name]:.1f}",
            f"{busy[name]:.1f}" if busy else "n/a (needs Linux and 2 CPUs)",
        ]
        for name, us in cold["back_to_back"].items()
    ]
    kind_rows = [
        [kind, f"{k['steps']:.0f}", f"{k['median_us']:.0f}", f"{k['ms_per_burst']:.1f}"]
        for kind, k in r["kinds_20ms"].items()
    ]
    part_rows = [
        [name, f"{a['with_us']:.0f}", f"{a['without_us']:.0f}", f"{a['cost_us']:+.0f}"]
        for name, a in r["ablations_20ms"].items()
    ]
    return (
        "## Engine thread CPU per step, back to back and paced (diagnostic)\n\n"
        "`python benchmarks/serving.py --scenario engine-step` — the engine and the synthetic "
        "backend in the benchmark's process on their own thread, no server (outputs handed "
        "through the daemon's Outbox to an event loop thread that drops them), "
        "one burst of 256 streams x 150 tokens with 16-id prompts; CPU of the engine thread "
        f"(schedstat) per step, median of {args.runs} runs. The work per step is the same at "
        "every step time; what changes is the pause before it.\n\n"
        + table(["step time ms", "steps", "engine thread CPU µs / step"], rows)
        + "\n\nAt 20 ms by kind of step (thread CPU from one step's end to the next's, so a "
        "step's pause and hand-off included; steps and ms per burst are medians over runs): "
        "admitting steps began with sequences waiting or prefilling (the admission ramp), "
        "ending steps ended some sequence, steady steps did neither. A thread that only sleeps "
        f"20 ms a step costs {r['sleep_floor_20ms_us']:.0f} µs a step (median of 150): the "
        "floor of any step after a backend call.\n\n"
        + table(["kind of step", "steps / burst", "median µs / step", "ms / burst"], kind_rows)
        + "\n\nWhat parts of a steady step cost at 20 ms, paired within each burst: every other "
        "step leaves the part out (the hand-off of a step that has only a column to hand over; "
        "the step's metrics call; the columnar EOS check), and the steady steps' median with it "
        "is set against the median without it, both medians over "
        f"{args.runs} bursts. The first row leaves nothing out: its difference is the pairing's "
        "own spread.\n\n"
        + table(
            ["left out of every other step", "steady step with it µs", "without it µs", "cost µs"],
            part_rows,
        )
        + "\n\nWhy the pause matters: single calls on a thread of their own, thread CPU "
        "(`time.thread_time_ns`) of one call, median of 60, back to back and right after a "
        "20 ms sleep (as the engine thread runs after a 20 ms backend call); the last column "
        "sleeps 20 ms too, but with the measuring thread pinned to one CPU and, pinned to the "
        "same CPU, a child process busy-looping at SCHED_IDLE priority, so the CPU never idles "
        "while the thread sleeps yet the thread preempts the spinner as soon as it wakes: where a "
        "call costs there about what it costs back to back, its cost after a plain sleep is the "
        "CPU waking from idle (caches cold after the host ran something else), not the thread's "
        "own working set.\n\n"
        + table(
            ["call", "back to back µs", "after 20 ms µs", "after 20 ms, CPU kept busy µs"],
            call_rows,
        )
    )


def flat_md(r: dict, args) -> str:
    labels = (
        ("floor (no-logic uvloop server)", "floor"),
        ("zerolayer, default config (synthetic backend)", "zerolayer"),
        ("zerolayer, response cache off", "zerolayer_cache_off"),
    )
    floor_cpu = r["floor"]["server_cpu_us_per_token"]
    rows = [
        [
            label,
            f"{r[k]['server_cpu_us_per_token']:.2f}",
            f"{r[k]['server_cpu_us_per_token'] / floor_cpu:.2f}x",
            f"{r[k]['output_throughput']:,.0f}",
            f"{r[k]['client_cpu_us_per_token']:.2f}",
            f"{r[k]['foreign_load']:.2f}",
        ]
        for label, k in labels
    ]
    return (
        "## Serving layer: server CPU per streamed token (flat out)\n\n"
        f"`python benchmarks/serving.py --scenario flat` — a closed loop of {args.streams} "
        f"concurrent streams x {args.tokens} tokens on one loopback connection, "
        f"{args.streams * args.rounds} requests per run (4-id prompts, no text), driven by "
        "`gateway.bench` in the benchmark's process; median of "
        f"{args.runs} runs after a warm-up. Synthetic backend with no step time, so the engine "
        "runs ahead and frames carry many tokens. Server CPU = run time of the server's threads "
        "during the load (schedstat, ns).\n\n"
        + table(
            [
                "server",
                "CPU µs / token",
                "vs floor",
                "tokens / s",
                "client CPU µs / token",
                "other load",
            ],
            rows,
        )
        + "\n\nZeroLayer's CPU includes its engine thread (scheduling, stop checks, the "
        "hand-off to the event loop) as well as the loop (framing, writes, metrics). Every "
        "prompt is unique, so the response cache only records (never replays). "
        + OTHER_LOAD
        + " "
        + RUN_TO_RUN
    )


def paced_md(r: dict, args) -> str:
    z, f, a = r["zerolayer"], r["pump"], r["aims"]
    servers = (
        ("uvloop pump (floor)", f),
        ("uvloop pump, pause on a thread", r["pump_threaded"]),
        ("zerolayer (synthetic, paced)", z),
        ("zerolayer, response cache off", r["zerolayer_cache_off"]),
        ("zerolayer, prefix cache off", r["zerolayer_prefix_off"]),
        (f"zerolayer, max_step_tokens {r['wide_budget']}", r["zerolayer_wide_budget"]),
    )
    rows = [
        [
            name,
            f"{x['server_cpu_us_per_token']:.2f}",
            f"{x['cpu_vs_pump']:.2f}x" if "cpu_vs_pump" in x else "—",
            f"{x['loop_cpu_us_per_token']:.2f}",
            f"{x['server_cpu_us_per_token'] - x['loop_cpu_us_per_token']:.2f}",
            f"{x['median_itl_ms']:.1f}",
            f"{x['p99_itl_ms']:.1f}",
            f"{x['itl_p99_over_p50']:.2f}",
            f"{x['median_ttft_ms']:.1f}",
            f"{x['p99_ttft_ms']:.1f}",
            f"{x['output_throughput']:,.0f}",
            f"{x['foreign_load']:.2f}",
        ]
        for name, x in servers
    ]

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    aims = [
        [
            "ITL P99/P50 ≤ 1.3",
            f"{a['itl_ratio']:.2f} (pump {f['itl_p99_over_p50']:.2f})",
            verdict(a["itl_ratio"] <= 1.3),
        ],
        [
            "ITL P99/P50 ≤ 1.2x the pump's",
            f"{a['itl_ratio_vs_pump']:.2f}x (median of the per-round ratios)",
            verdict(a["itl_ratio_vs_pump"] <= 1.2),
        ],
        [
            "server CPU / token ≤ 1.25x the pump",
            f"{a['cpu_vs_pump']:.2f}x (median of the per-round ratios; ratio of the medians "
            f"{a['cpu_vs_pump_of_medians']:.2f}x)",
            verdict(a["cpu_vs_pump"] <= 1.25),
        ],
        [
            "(context, not an aim) the same against the pump with its pause on a thread",
            f"{a['cpu_vs_pump_threaded']:.2f}x; that pump itself {a['pump_threaded_vs_pump']:.2f}x "
            "the pump",
            "",
        ],
        [
            f"TTFT P99 ≤ {r['ttft_p99_bound_ms']:.0f} ms (step {r['cover_step_p99']} + 2)",
            f"{a['ttft_p99_ms']:.0f} ms",
            verdict(a["ttft_p99_ms"] <= r["ttft_p99_bound_ms"]),
        ],
        [
            f"the same with max_step_tokens {r['wide_budget']}: "
            f"≤ {r['ttft_p99_bound_ms_wide_budget']:.0f} ms "
            f"(step {r['cover_step_p99_wide_budget']} + 2)",
            f"{a['ttft_p99_ms_wide_budget']:.0f} ms",
            verdict(a["ttft_p99_ms_wide_budget"] <= r["ttft_p99_bound_ms_wide_budget"]),
        ],
    ]
    load = r["load"]
    return (
        "## Serving layer at a model's pace (paced)\n\n"
        f"`python benchmarks/serving.py --scenario paced` — synthetic step time {r['step_ms']:g} "
        f"ms per engine step (+{r['prefill_us_per_token']:g} µs per prefill token), "
        f"{load['concurrency']} concurrent streams over "
        f"{load['connections']} connections x {load['output_len']} tokens, {r['prompt_len']}-id "
        "prompts, each run one burst of "
        f"{load['num_requests']} requests into an idle server (closed loop, token ids, no text). "
        "The pump is a no-logic uvloop server "
        "paced the same way (a tick every step: one TOKEN frame per active stream, one write per "
        "connection), its pause a timer of its event loop; the pump with its pause on a thread "
        "does the same, but a second thread sleeps the step time and hands each tick to the "
        "event loop, as ZeroLayer's engine thread hands over each step after its backend call "
        "(which a real backend needs: a device call blocks its thread). "
        "ITL is per token at the client, TTFT from send to first TOKEN frame. "
        + interleaved_md(r["rounds"], "every server")
        + " "
        + OTHER_LOAD
        + "\n\n"
        + table(
            [
                "server",
                "CPU µs / token",
                "vs pump",
                "event loop",
                "other threads",
                "ITL P50 ms",
                "ITL P99 ms",
                "P99/P50",
                "TTFT P50 ms",
                "TTFT P99 ms",
                "tokens / s",
                "other load",
            ],
            rows,
        )
        + "\n\nServer CPU per token against the pump, round by round (in round order): "
        + "; ".join(
            f"{name}: {ratio_list(x['cpu_vs_pump_rounds'])}" for name, x in servers if x is not f
        )
        + "."
        + "\n\nAims (issue 13):\n\n"
        + table(["aim", "measured", ""], aims)
        + "\n\nThe TTFT bound: with the engine defaults (max_step_tokens 512, prefill_chunk "
        "256) and one budget token per decode row, the step in which the prefill budget could "
        f"first have finished the P99 request of the burst is step {r['cover_step_p99']}; the "
        "bound is two steps later, a step lasting the variant's median ITL (the pause plus the "
        "engine's own work). "
        "Plots of the first run of each: `benchmarks/results/plots/paced-*`."
    )


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    scenarios = (
        "both", "flat", "paced", "paced-open", "paced-split", "paced-instructions", "engine-step"
    )  # fmt: skip
    ap.add_argument("--scenario", choices=scenarios, default="both")
    ap.add_argument("--streams", type=int, default=64, help="flat: concurrent streams")
    ap.add_argument("--tokens", type=int, default=256, help="flat: tokens per stream")
    ap.add_argument("--runs", type=int, default=3, help="flat: measured runs")
    ap.add_argument("--rounds", type=int, default=30, help="flat: requests = streams x rounds")
    ap.add_argument("--step-ms", type=float, default=20.0, help="paced: engine step time")
    ap.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="paced: added to a step's pause per prefill token (the pump has no prefill)",
    )
    ap.add_argument(
        "--paced-runs",
        type=int,
        default=3,
        help="paced, paced-open, paced-split: rounds, each running every server (under every "
        "load) once",
    )
    ap.add_argument("--paced-prompt-len", type=int, default=16)
    ap.add_argument("--floor-server", type=float, help=argparse_suppress())
    ap.add_argument("--floor-threaded", action="store_true", help=argparse_suppress())
    args = ap.parse_args()
    if args.floor_server is not None:
        return run_floor_server(args.floor_server, args.floor_threaded)
    # Each scenario has its own results file and docs section, whichever way it is run:
    # scenario -> (results name, results key, run, markdown); "both" runs flat and paced.
    plots = RESULTS / "plots" if args.write else None
    scenarios_run = {
        "flat": ("serving", "flat", flat_out, flat_md),
        "engine-step": ("serving-engine-step", "engine_step", engine_step, engine_step_md),
        "paced-split": ("serving-paced-split", "paced_split", paced_split, paced_split_md),
        "paced-open": ("serving-paced-open", "paced_open", paced_open, paced_open_md),
        "paced-instructions": (
            "serving-paced-instructions",
            "paced_instructions",
            paced_instructions,
            paced_instructions_md,
        ),
        "paced": ("serving-paced", "paced", lambda a: paced(a, plots), paced_md),
    }
    for scenario in ("flat", "paced") if args.scenario == "both" else (args.scenario,):
        name, key, run_scenario, md_of = scenarios_run[scenario]
        results = {"machine": machine(), key: run_scenario(args)}
        md = md_of(results[key], args) + "\n\n" + machine_line(results["machine"])
        publish(args, name, results, md)


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
