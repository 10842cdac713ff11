"""Automatic prefix reuse on the real model: 32 concurrent chats, TTFT with the store and without.

Two daemons serving the default model (SmolLM2-135M-Instruct, CPU backend) side by side, one with
``engine.prefix_cache`` on (the default) and one with it off, no prompt registered, response
cache off. ``zerolayer bench`` sends each the same chats (distinct user questions as JSON
``messages``; the server applies the model's chat template, whose default system prompt every
chat shares) at a concurrency of 32 and reports TTFT percentiles. The daemons run one after the
other, so they never share the CPU. Loopback only, bounded by --num-requests.

    python benchmarks/prefix_chats.py [--num-requests 96] [--concurrency 32] [--write]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon  # noqa: E402

TOPICS = [
    "the sea",
    "mountains",
    "bread",
    "a violin",
    "rain",
    "the moon",
    "trains",
    "coffee",
    "a library",
    "winter",
    "bees",
    "a lighthouse",
    "chess",
    "tea",
    "rivers",
    "clocks",
]
ASKS = (
    "Write one sentence about {}.",
    "What is special about {}?",
    "Give me a fact about {}.",
    "Describe {} in a few words.",
    "Why do people like {}?",
    "Name something related to {}.",
)


def write_chats(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            text = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
            text += f" (request {i})"  # every chat distinct: no response-cache or full-prompt hit
            fh.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


def prefix_metrics(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("zerolayer_prefix_cache_queries_total", "zerolayer_prefix_cache_hits")):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return (values.get("zerolayer_prefix_cache_queries_total", 0.0),
            values.get("zerolayer_prefix_cache_hits_total", 0.0))  # fmt: skip


def run_side(prefix_cache: bool, chats: Path, args, out: Path) -> dict:  # noqa: ANN001
    env = {
        "ENGINE__BACKEND": "cpu",
        "MODEL__PATH": "@smollm2",
        "ENGINE__PREFIX_CACHE": "true" if prefix_cache else "false",
        "CACHE__ENABLED": "false",
        "ENGINE__MAX_BATCH_SIZE": str(args.concurrency),
        "ENGINE__MAX_CONTEXT": "1024",
    }
    with Daemon(env) as d:
        cmd = [sys.executable, "-m", "zerolayer.cli.main", "bench", "--endpoint", d.endpoint,
               "--input", str(chats), "--concurrency", str(args.concurrency),
               "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
               "--warmup", str(args.concurrency), "--output", str(out)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1800)
        queries, hits = prefix_metrics(d.metrics_url)
        d.terminate()
    report = json.loads(out.read_text())
    report["prefix_queries_tokens"], report["prefix_hits_tokens"] = queries, hits
    return report


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=24, help="max tokens per chat")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        chats = Path(tmp) / "chats.jsonl"
        write_chats(chats, args.num_requests + args.concurrency)
        sides = {
            "reuse": run_side(True, chats, args, Path(tmp) / "reuse.json"),
            "no reuse": run_side(False, chats, args, Path(tmp) / "none.json"),
        }
    rows = []
    for name, r in sides.items():
        reused = f"{r['prefix_hits_tokens']:.0f} of {r['prefix_queries_tokens']:.0f}"
        rows.append([name, f"{r['median_ttft_ms']:.0f}", f"{r['p99_ttft_ms']:.0f}",
                     f"{r['output_throughput']:.0f}", r["completed"], reused])  # fmt: skip
    ratio = sides["reuse"]["p99_ttft_ms"] / sides["no reuse"]["p99_ttft_ms"]
    results = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "write"},
               "sides": sides, "p99_ttft_ratio": ratio}  # fmt: skip
    md = (
        "## Automatic prefix reuse on SmolLM2: 32 concurrent chats\n\n"
        f"`python benchmarks/prefix_chats.py` — the default model (SmolLM2-135M-Instruct, CPU "
        "backend, float32, torch threads one per core), response cache off, no prompt "
        f"registered; `zerolayer bench` at concurrency {args.concurrency}, {args.num_requests} "
        f"chats after {args.concurrency} warm-up chats, each a distinct user question as JSON "
        "messages (the chat template's default system prompt is the shared prefix), up to "
        f"{args.output_len} tokens each. The two daemons ran one after the other.\n\n"
        + table(
            [
                "prefix store",
                "TTFT P50 ms",
                "TTFT P99 ms",
                "output tok/s",
                "completed",
                "prompt tokens reused (metrics, all requests)",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nTTFT P99 with reuse / without: **{ratio:.2f}**.\n\n"
        + machine_line(results["machine"])
    )
    publish(args, "prefix-chats-smollm2", results, md)


if __name__ == "__main__":
    main()
