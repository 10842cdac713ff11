"""Where the measurements stand against the aims: one table at the top of docs/benchmarks.md,
made from the results files (benchmarks/results/*.json) as the other scripts last wrote them, each
row naming its file, the commit it measured and the load when it started. It measures nothing:
run it after the benchmarks (``make bench`` does, last). A results file that is missing leaves
its rows out.

    python benchmarks/aims.py [--write]
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import RESULTS, parser, publish, table  # noqa: E402

Row = tuple[str, str, bool | str | None]  # aim, measured, met (None: no aim; str: as it says)


def verdict(met: bool | str | None) -> str:
    if isinstance(met, str):
        return met
    return "reported" if met is None else "met" if met else "not met"


def flat(r: dict) -> Iterator[Row]:
    f = r["flat"]
    z, off, floor = f["zerolayer"], f["zerolayer_cache_off"], f["floor"]["server_cpu_us_per_token"]
    yield (
        "serving layer within 1.5x of a no-logic uvloop server, CPU per streamed token (flat out)",
        f"{z['cpu_vs_floor']:.2f}x with the default config ({z['server_cpu_us_per_token']:.2f} vs "
        f"{floor:.2f} µs per token), {off['cpu_vs_floor']:.2f}x with the response cache off",
        z["cpu_vs_floor"] <= 1.5,
    )


def paced(r: dict) -> Iterator[Row]:
    p, a = r["paced"], r["paced"]["aims"]
    yield (
        "paced (20 ms steps, 256 streams): ITL P99/P50 ≤ 1.3 and ≤ 1.2x the paced pump's",
        f"{a['itl_ratio']:.2f} (pump {p['pump']['itl_p99_over_p50']:.2f}): "
        f"{a['itl_ratio_vs_pump']:.2f}x the pump's (median of per-round ratios)",
        a["itl_ratio"] <= 1.3 and a["itl_ratio_vs_pump"] <= 1.2,
    )
    yield (
        "paced: TTFT P99 ≤ two steps after the step whose prefill budget could first cover the "
        "request",
        f"{a['ttft_p99_ms']:.0f} ms ≤ {p['ttft_p99_bound_ms']:.0f} ms (default step budget); "
        f"{a['ttft_p99_ms_wide_budget']:.0f} ms ≤ {p['ttft_p99_bound_ms_wide_budget']:.0f} ms "
        "with a budget covering the burst",
        a["ttft_p99_ms"] <= p["ttft_p99_bound_ms"]
        and a["ttft_p99_ms_wide_budget"] <= p["ttft_p99_bound_ms_wide_budget"],
    )
    yield (
        "(retired by issue 24, see the guard) paced: server CPU per token ≤ 1.25x the pump",
        f"{a['cpu_vs_pump']:.2f}x (median of per-round ratios)",
        None,
    )


def engine(model: str) -> Callable[[dict], Iterator[Row]]:
    def rows(r: dict) -> Iterator[Row]:
        z, hf = r["zerolayer"], r["transformers"]
        top = max(z, key=int)
        one = hf["one_at_a_time"]["tokens_per_s"]
        vs_one = z[top]["tokens_per_s"] / one
        vs_static = z[top]["tokens_per_s"] / hf["static_batch"]["tokens_per_s"]
        yield (
            f"{model}, {r['dtype']}: {top} streams ≥ 10x transformers one at a time"
            + (" and ≥ its static batch" if r["size"] == "smollm2" else ""),
            f"{vs_one:.2f}x one at a time, {vs_static:.2f}x its static batch "
            f"({'median of ' + str(r['runs']) + ' runs' if r['runs'] > 1 else 'one run'})",
            vs_one >= 10 and (vs_static >= 1 or r["size"] != "smollm2"),
        )
        if r["size"] == "smollm2" and "1" in z:
            per_token = one / z["1"]["tokens_per_s"]  # ours / theirs, time per output token
            yield (
                f"{model}, {r['dtype']}: 1 stream ≤ 0.4x transformers' time per output token",
                f"{per_token:.2f}x ({1e3 / z['1']['tokens_per_s']:.1f} vs {1e3 / one:.1f} ms)",
                per_token <= 0.4,
            )

    return rows


def http(r: dict) -> Iterator[Row]:
    yield (
        "HTTP front end (OpenAI streaming): CPU per streamed token ≤ 1/3 of FastAPI + uvicorn "
        "and ≤ 1.5x a no-logic uvloop server writing the same SSE bytes",
        f"{r['http_vs_fastapi']:.2f}x FastAPI, {r['http_vs_floor']:.2f}x the floor "
        f"({r['zerolayer_http']['cpu_us_per_token']:.2f} vs {r['fastapi']['cpu_us_per_token']:.2f}"
        f" and {r['floor']['cpu_us_per_token']:.2f} µs per token)",
        r["http_vs_fastapi"] <= 1 / 3 and r["http_vs_floor"] <= 1.5,
    )


def prompts(r: dict) -> Iterator[Row]:
    ratios = {
        streams: [v["ttft_vs_inline"] for k, v in kinds.items() if k.startswith("registered")]
        for streams, kinds in r["runs"].items()
    }
    worst = max(x for xs in ratios.values() for x in xs)
    yield (
        f"registered system prompt TTFT ≤ 1/10 of inline ({r['size']} model)",
        "; ".join(
            f"{min(xs):.3f}–{max(xs):.3f} at {s} stream{'s' if s != '1' else ''}"
            for s, xs in ratios.items()
        ),
        worst <= 0.1,
    )


def prefix(r: dict) -> Iterator[Row]:
    s, c = r["shared"], r["conversation"]
    yield (
        f"automatic prefix reuse ({r['size']} model): requests sharing an unregistered "
        f"{s['prefix_tokens']:,}-token prefix, TTFT ≤ 1/5 of no reuse after the first",
        f"{s['later_ratio']:.3f} (median of requests 2–{s['requests']})",
        s["later_ratio"] <= 0.2,
    )
    lof = c["last_over_first"]
    yield (
        f"{c['turns']}-turn conversations resending their history: last turn's TTFT ≤ 1.5x "
        "the first's",
        f"{lof['reuse']:.2f}x with reuse, {lof['no reuse']:.2f}x without",
        lof["reuse"] <= 1.5,
    )


def chats(r: dict) -> Iterator[Row]:
    reuse, no = r["sides"]["reuse"], r["sides"]["no reuse"]
    yield (
        f"{r['args']['concurrency']} concurrent chats on SmolLM2 (no aim set)",
        f"TTFT P99 {reuse['p99_ttft_ms']:,.0f} ms with reuse vs {no['p99_ttft_ms']:,.0f} ms "
        "without",
        None,
    )


def guard_instructions(r: dict) -> Iterator[Row]:
    i = r["instructions"]
    vs = i["vs_pump"]["new"]
    yield (
        "guard: instructions per request (callgrind) no worse than at "
        f"{r['commits']['base']}, paced burst and open loop",
        f"{i['new_vs_base']['burst']:.2f}x burst, {i['new_vs_base']['open']:.2f}x open",
        max(i["new_vs_base"].values()) <= 1.0,
    )
    yield (
        "guard: open loop ≤ 1.5x the pump in instructions per request",
        f"{vs['open']:.2f}x (burst {vs['burst']:.2f}x)",
        vs["open"] <= 1.5,
    )


def guard_cpu(name: str) -> Callable[[dict], Iterator[Row]]:
    def rows(r: dict) -> Iterator[Row]:
        part = r[name]
        ratios = (
            {"flat out": part["new_vs_base"]}
            if name == "flat"
            else {f"paced {load}": part[load]["new_vs_base"] for load in ("burst", "open")}
        )
        load = r["machine"].get("load_average_1m")
        yield (
            f"guard: serving CPU per token ({', '.join(ratios)}) no worse than at "
            f"{r['commits']['base']}",
            ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
            "inconclusive (a loaded machine)"
            if load is None or load > 1.0
            else max(ratios.values()) <= 1.0,
        )

    return rows


def guard_engine(r: dict) -> Iterator[Row]:
    e = r["engine"]
    yield (
        f"guard: engine tokens/s ({e['size']}, {e['dtype']}) no lower than at "
        f"{r['commits']['base']}",
        ", ".join(f"{s} streams {v:.2f}x" for s, v in e["new_vs_base"].items()),
        min(e["new_vs_base"].values()) >= 1.0,
    )


def fuzz_http(r: dict) -> Iterator[Row]:
    c = r["counts"]
    bad = c.get("unanswered", 0) + c.get("status500", 0)
    yield (
        "HTTP door fuzz: 10⁶ requests, 0 unanswered, 0 descriptors leaked",
        f"{r['requests']:,} requests: {c.get('unanswered', 0)} unanswered, "
        f"{c.get('status500', 0)} 500s; descriptors {r['fds_before']} → {r['fds_after']}; canary "
        f"{r['canary_ok']:,} ok / {r['canary_failed']} failed",
        r["requests"] >= 1_000_000 and not bad and r["fds_after"] <= r["fds_before"]
        and r["alive"] and not r["canary_failed"],
    )  # fmt: skip


def structured(r: dict) -> Iterator[Row]:
    v, t, f = r["validity"], r["throughput"], r["first_token"]
    yield (
        "structured output: outputs that parse and validate against their schema (aim 100%)",
        f"{v['valid']}/{v['requests']} ({v['share_valid']:.0%}) at max_tokens {v['max_tokens']}",
        v["share_valid"] >= 1.0,
    )
    yield (
        f"structured output: tokens/s at {t['streams']} streams, every row constrained vs none "
        "(aim ≥ 0.9x)",
        f"{t['ratio_median']:.2f}x (median of paired rounds)",
        t["ratio_median"] >= 0.9,
    )
    yield (
        "structured output: first token with a cold vs a cached grammar",
        f"{f['cold_ms']:.0f} vs {f['cached_ms']:.0f} ms (no constraint {f['none_ms']:.0f} ms)",
        None,
    )


def peers(r: dict) -> Iterator[Row]:
    """Issue 28's aims, each on the best round of each server."""
    servers = r["servers"]
    ours = servers.get("ZeroLayer")
    vllm = next((s for name, s in servers.items() if name.startswith("vLLM")), None)
    llama = next((s for name, s in servers.items() if name.startswith("llama.cpp")), None)
    if ours is None:
        return

    def rounds(s: dict, n: int, key: str) -> list[float]:
        return [x[key] for x in s["decode"].get(str(n), [])] or [float("nan")]

    def best(s: dict, n: int) -> float:  # the most output tokens/s of a server's rounds
        return max(rounds(s, n, "output_tokens_per_s"))

    def low(s: dict, n: int, key: str) -> float:  # the lowest latency of its rounds
        return min(rounds(s, n, key))

    if vllm is not None:
        ratio = best(ours, 32) / best(vllm, 32)
        ttft, vttft = low(ours, 32, "p99_ttft_ms"), low(vllm, 32, "p99_ttft_ms")
        yield (
            "SmolLM2, 32 streams: output tokens/s ≥ 1.3x vLLM CPU's, TTFT P99 ≤ vLLM's",
            f"{ratio:.2f}x ({best(ours, 32):.0f} vs {best(vllm, 32):.0f} tok/s); TTFT P99 "
            f"{ttft:.0f} vs {vttft:.0f} ms",
            ratio >= 1.3 and ttft <= vttft,
        )
        ratio8 = best(ours, 8) / best(vllm, 8)
        yield (
            "SmolLM2, 8 streams: output tokens/s ≥ 1.2x vLLM CPU's",
            f"{ratio8:.2f}x ({best(ours, 8):.0f} vs {best(vllm, 8):.0f} tok/s)",
            ratio8 >= 1.2,
        )
        rss, vrss = ours["peak_rss_mib"], vllm["peak_rss_mib"]
        yield (
            "SmolLM2, 32 slots x 2,048 positions: peak RSS ≤ vLLM's",
            f"{rss:,.0f} vs {vrss:,.0f} MiB",
            rss <= vrss,
        )
    if llama is not None:
        tpot, ltpot = low(ours, 1, "median_tpot_ms"), low(llama, 1, "median_tpot_ms")
        yield (
            "SmolLM2, 1 stream: TPOT ≤ llama.cpp's",
            f"{tpot:.1f} vs {ltpot:.1f} ms",
            tpot <= ltpot,
        )
    modes = {name: s for name, s in servers.items() if name.startswith("ZeroLayer")}
    if len(modes) > 1:
        streams = sorted(int(n) for n in ours["decode"])
        fastest = {n: max(modes, key=lambda m: best(modes[m], n)) for n in streams}
        yield (
            "SmolLM2: the default configuration is the fastest mode at every batch size",
            "; ".join(f"{n}: {m}" for n, m in fastest.items()),
            all(m == "ZeroLayer" for m in fastest.values()),
        )


SOURCES: list[tuple[str, Callable[[dict], Iterator[Row]]]] = [
    ("serving", flat),
    ("serving-paced", paced),
    ("engine-bfloat16", engine("124M random-weight model")),
    ("engine-float32", engine("124M random-weight model")),
    ("engine-smollm2-bfloat16", engine("SmolLM2-135M-Instruct")),
    ("engine-smollm2-float32", engine("SmolLM2-135M-Instruct")),
    ("http", http),
    ("prompts-smollm2", prompts),
    ("prompts-medium", prompts),
    ("prompts-builtin", prompts),
    ("prefix-medium", prefix),
    ("prefix-chats-smollm2", chats),
    ("guard-instructions", guard_instructions),
    ("guard-flat", guard_cpu("flat")),
    ("guard-paced", guard_cpu("paced")),
    ("guard-engine", guard_engine),
    ("fuzz_http", fuzz_http),
    ("structured", structured),
    ("peers", peers),
]


def source(name: str, machine: dict[str, Any]) -> str:
    load = machine.get("load_average_1m")
    return f"`{name}.json` at {machine.get('commit', '?')}, {machine.get('date', '?')}" + (
        f", load {load:g}" if load is not None else ""
    )


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    for name, make in SOURCES:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            continue
        r = json.loads(path.read_text())
        rows += [[aim, got, verdict(met), source(name, r["machine"])] for aim, got, met in make(r)]
    md = (
        "## Where the measurements stand against the aims\n\n"
        "`python benchmarks/aims.py` — made from the results files as last written; each row "
        "names its file, the commit it measured, when, and the 1-minute load average when it "
        "started (where the file has it). The sections below give each run's conditions.\n\n"
        + table(["aim", "measured", "", "from"], rows)
    )
    publish(args, "aims", None, md)


if __name__ == "__main__":
    main()
