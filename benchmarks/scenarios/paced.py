"""Paced: the synthetic backend paced like a model (``--step-ms`` per engine step), a burst of
256 streams over 16 connections x 150 tokens into an idle server, ZeroLayer in four variants
against the paced pump and the pump with its pause on a thread; server CPU per token, ITL and
TTFT tails, the issue-13 aims, and the TTFT bound the admission ramp allows (``cover_steps``).
Interleaved rounds, ratios paired by round (benchmarks/scenarios/common.py)."""

from __future__ import annotations

import math

from benchmarks._report import table
from benchmarks.scenarios.common import (
    OTHER_LOAD,
    PACED_STREAMS,
    PACED_TOKENS,
    interleaved_md,
    interleaved_runs,
    itl_spread,
    median_of,
    paced_env,
    paced_load,
    paced_servers,
    paired_ratio,
    ratio_list,
)

NAME, KEY = "serving-paced", "paced"


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


def run(args) -> dict:
    plots = args.plots  # a directory for the first run's plots, or None
    streams, prompt_len = PACED_STREAMS, args.paced_prompt_len
    load, env = paced_load(args, PACED_TOKENS), paced_env(args)
    step_tokens, chunk = 512, 256  # the engine defaults (gateway/zerolayer/config/settings.py)
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
        from zerolayer.client.bench.plot import plot

        for name in ("pump", "zerolayer"):
            reports[name][0]["label"] = f"{name}, paced {args.step_ms:g} ms"
            plot(reports[name][0], plots / f"paced-{name}")
    return results


def markdown(r: dict, args) -> str:
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
