"""Paced-instructions: the paced burst at ``SPLIT_LENGTHS`` tokens a stream, the pump and
ZeroLayer each run under valgrind's callgrind; user-space instructions per burst, split by a
least-squares line into a part per step and a part per request. Counts survive the host's load,
CPU time does not."""

from __future__ import annotations

import statistics
import subprocess
import tempfile

from benchmarks._report import table
from benchmarks._support.daemon import Daemon
from benchmarks._support.pump import Floor
from benchmarks.scenarios.common import (
    PACED_CONNECTIONS,
    PACED_STREAMS,
    PACED_TOKENS,
    SPLIT_LENGTHS,
    callgrind_total,
    callgrind_wrapper,
    measure,
    paced_env,
    paced_load,
)

NAME, KEY = "serving-paced-instructions", "paced_instructions"


def run(args) -> dict:
    """User-space instructions per paced burst of the pump and of ZeroLayer at each of
    SPLIT_LENGTHS, each server run under callgrind: a warm-up burst, then per length the
    counters zeroed, ``--paced-runs`` bursts, one dump; and the line through them (per step,
    per request) as in paced-split."""
    results: dict = {"step_ms": args.step_ms, "bursts": args.paced_runs}
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = callgrind_wrapper(tmp)

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


def markdown(r: dict, args) -> str:
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
