"""What the serving scenarios share: one measured load run against a server process
(``measure``: the server's CPU per token, its event loop's share, the other load meanwhile), the
paced burst and the open loop (``paced_load``, ``open_load``, ``paced_env``), and the interleaved
rounds (``paced_servers``, ``interleaved_runs``, ``rotations``) whose ratios are taken within a
round (``paired_ratio``): a shared VM's speed drifts by tens of percent over minutes, so a ratio
of medians taken minutes apart keeps the drift a per-round ratio cancels. Also the callgrind
count of a server (``callgrind_total``) and the sentences the scenarios' sections share."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from benchmarks._report import cpu_seconds
from benchmarks._support.daemon import Daemon
from benchmarks._support.pump import VOCAB, Floor
from benchmarks.engine import ForeignLoad, wait_quiet
from zerolayer.client.bench import BenchOptions, run

# Each run draws its own random prompts, so the response cache never replays one.
SEEDS = itertools.count(time.time_ns() % 1_000_000)

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
        endpoint=endpoint, text_deltas=False, detailed=detailed, seed=next(SEEDS), **opts
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
    servers: Servers,
    loads: dict[K, dict],
    args,
    detailed: bool = False,
    warmup: dict | None = None,
) -> tuple[dict[tuple[str, K], list[dict]], list[list[str]]]:
    """Warm every server up with one run of ``warmup`` (default: the paced burst), then
    ``args.paced_runs`` rounds, each running every load (name -> bench options, e.g.
    ``paced_load``) once on every server in ``rotations`` order: the reports of each (server,
    load name), in round order, and each round's order."""
    for endpoint, pid in servers.values():
        measure(endpoint, pid, warmup or paced_load(args, PACED_TOKENS), warmup=True)
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


SPLIT_LENGTHS = (50, 150, 300)  # tokens per stream of the paced-split bursts


def latest_dump(out_dir: str, pid: int) -> Path:
    """The latest callgrind dump of process ``pid`` in ``out_dir`` (``callgrind_control -d``
    writes cg.PID.1, cg.PID.2, ...)."""
    dumps = list(Path(out_dir).glob(f"cg.{pid}.*"))
    if not dumps:
        raise SystemExit(f"no callgrind dump of process {pid} in {out_dir}")
    return max(dumps, key=lambda f: int(f.name.rsplit(".", 1)[1]))


def callgrind_total(out_dir: str, pid: int) -> int:
    """The instruction total of the latest callgrind dump of process ``pid`` in ``out_dir``."""
    latest = latest_dump(out_dir, pid)
    for line in latest.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"{latest}: no instruction total")


def callgrind_wrapper(out_dir: str) -> list[str]:
    """The command a server runs under to be counted by callgrind, its files in ``out_dir``
    (``callgrind_control -z PID`` zeroes its counters, ``-d PID`` dumps them); SystemExit when
    valgrind is not installed."""
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        raise SystemExit("counting instructions needs valgrind (Debian: valgrind)")
    return ["valgrind", "--tool=callgrind", f"--log-file={out_dir}/log.%p",
            f"--callgrind-out-file={out_dir}/cg.%p"]  # fmt: skip


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
