"""Paced-split (a diagnostic): the paced burst at several output lengths (``SPLIT_LENGTHS``) for
the pumps and ZeroLayer; a least-squares line through server CPU per burst against tokens per
stream splits the cost into a part per step (a token for each stream) and a part per request."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from benchmarks._report import table
from benchmarks.scenarios.common import (
    OTHER_LOAD,
    PACED_CONNECTIONS,
    PACED_STREAMS,
    SPLIT_LENGTHS,
    interleaved_md,
    interleaved_runs,
    paced_env,
    paced_load,
    paced_servers,
    paired_ratio,
    ratio_list,
)

NAME, KEY = "serving-paced-split", "paced_split"


def split_fit(cpu_ms: Sequence[float]) -> dict[str, float]:
    """The least-squares line through CPU ms per burst at SPLIT_LENGTHS: its slope as µs per step
    (a token for each stream), its intercept as µs per request."""
    slope, intercept = statistics.linear_regression(SPLIT_LENGTHS, cpu_ms)
    return {"per_step_us": slope * 1e3, "per_request_us": intercept * 1e3 / PACED_STREAMS}


def run(args) -> dict:
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


def markdown(r: dict, args) -> str:
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
