"""Flat out: server CPU per streamed token, ZeroLayer (default config and response cache off)
against the no-logic uvloop floor server. The synthetic backend with no step time, so the engine
runs ahead and a TOKEN frame carries many tokens; the load a closed loop of ``--streams``
concurrent streams x ``--tokens`` tokens on one connection."""

from __future__ import annotations

from benchmarks._report import table
from benchmarks._support.daemon import Daemon
from benchmarks._support.pump import VOCAB, Floor
from benchmarks.scenarios.common import OTHER_LOAD, RUN_TO_RUN, measure, median_of

NAME, KEY = "serving", "flat"  # results/serving.json, its key; the docs section "serving"


def run(args) -> dict:
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


def markdown(r: dict, args) -> str:
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
        "`zerolayer.client.bench` in the benchmark's process; median of "
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
