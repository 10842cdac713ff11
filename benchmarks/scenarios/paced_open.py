"""Paced-open: the paced servers under the paced burst and under an open loop of random
(Poisson) arrivals that keeps about 90% of the slots busy (``common.open_load``), where the
batch's rows change at nearly every step; CPU per token against the pump under the same load,
paired by round."""

from __future__ import annotations

from benchmarks._report import table
from benchmarks.scenarios.common import (
    OPEN_FILL,
    OTHER_LOAD,
    PACED_STREAMS,
    PACED_TOKENS,
    interleaved_md,
    interleaved_runs,
    median_of,
    open_load,
    paced_env,
    paced_load,
    paced_servers,
    paired_ratio,
    ratio_list,
)

NAME, KEY = "serving-paced-open", "paced_open"


def run(args) -> dict:
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


def markdown(r: dict, args) -> str:
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
