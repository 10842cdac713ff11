"""Structured output on the real model, over the public HTTP API only (issue #27 item 5).

Starts ``zerolayer serve`` (the default model, SmolLM2-135M-Instruct, CPU backend, response
cache off) or talks to a running daemon (``--url``), and measures through the OpenAI API:

1. validity: each of the 50 JSON Schemas of benchmarks/json_schemas.py x ``--prompts`` prompts
   as ``response_format: json_schema``, greedy: the share of outputs that parse as JSON and
   validate against their schema with ``jsonschema`` (format checks on);
2. throughput: 32 streams at once, every row constrained (a JSON array of strings that no row
   completes inside ``max_tokens``) vs none (``ignore_eos``), so every stream produces exactly
   ``max_tokens`` tokens in both: output tokens/s, in interleaved rounds (none, constrained,
   none, ...), the median of each and their ratio;
3. first-token time with a cold grammar (a schema the daemon has not seen: a fresh property
   name) vs the same schema again (cached), and with no constraint, one stream at a time.

Loopback only, bounded by its counts. The machine may be shared: the load average is recorded
beside the figures.

    python benchmarks/structured.py [--url http://127.0.0.1:8080] [--prompts 3] [--write]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks.json_schemas import CASES  # noqa: E402

PROMPTS = (
    "Give an example JSON value for this schema.",
    "Describe a person, a place or a thing as JSON.",
    "Reply with JSON only.",
    "Fill in realistic values.",
)
# No row completes it inside max_tokens (each string takes 3 tokens at least); without minItems,
# rows answered [] and ended after two tokens.
ENDLESS = {"type": "array", "items": {"type": "string"}, "minItems": 64}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``zerolayer serve`` as a child process, on free loopback ports."""

    def __init__(self, dtype: str, threads: int, batch: int) -> None:
        self.port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
        env.update(
            ZEROLAYER_HTTP__PORT=str(self.port),
            ZEROLAYER_SERVER__PORT=str(_free_port()),
            ZEROLAYER_METRICS__PORT=str(_free_port()),
            ZEROLAYER_ENGINE__BACKEND="cpu",
            ZEROLAYER_ENGINE__MAX_BATCH_SIZE=str(batch),
            ZEROLAYER_ENGINE__MAX_CONTEXT="1024",
            ZEROLAYER_ENGINE__THREADS=str(threads),
            ZEROLAYER_MODEL__DTYPE=dtype,
            ZEROLAYER_CACHE__ENABLED="false",
            ZEROLAYER_LOGGING__LEVEL="warning",
        )
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - open while the daemon runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zerolayer.cli.main", "serve"], env=env, stderr=self.log
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError("the daemon exited:\n" + self.log.read().decode())
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("the daemon did not become ready in 600 s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def first_token_s(url: str, body: dict) -> float:
    """Seconds from sending a streamed request to its first content delta."""
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"content-type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            text = line.startswith(b"data: {") and b'"content":"' in line
            if first is None and text and b'"content":""' not in line:
                first = time.perf_counter() - t0
    assert first is not None, "no content in the stream"
    return first


def chat(prompt: str, max_tokens: int, **extra: object) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def validity(url: str, prompts: int, max_tokens: int, concurrency: int) -> dict:
    checker = jsonschema.FormatChecker()
    jobs = [(name, schema, PROMPTS[p]) for name, schema, _ in CASES for p in range(prompts)]

    def one(job: tuple[str, dict, str]) -> dict:
        name, schema, prompt = job
        try:
            out = post(url, chat(prompt, max_tokens, response_format=schema_format("s", schema)))
        except (OSError, urllib.error.URLError) as exc:  # counted as a failure, with why
            return {"schema": name, "parsed": False, "valid": False, "finish": repr(exc)}
        text = out["choices"][0]["message"]["content"]
        finish = out["choices"][0]["finish_reason"]
        try:
            value = json.loads(text)
        except ValueError:
            return {"schema": name, "parsed": False, "valid": False, "finish": finish}
        errors = list(
            jsonschema.Draft202012Validator(schema, format_checker=checker).iter_errors(value)
        )
        return {
            "schema": name,
            "parsed": True,
            "valid": not errors,
            "finish": finish,
            "error": errors[0].message if errors else None,
            "tokens": out["usage"]["completion_tokens"],
        }

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, jobs))
    valid = sum(r["valid"] for r in results)
    return {
        "requests": len(results),
        "parsed": sum(r["parsed"] for r in results),
        "valid": valid,
        "share_valid": valid / len(results),
        "max_tokens": max_tokens,
        "failures": [r for r in results if not r["valid"]],
    }


def throughput_round(url: str, streams: int, max_tokens: int, constrained: bool) -> dict:
    extra: dict = {"ignore_eos": True}
    if constrained:
        extra["response_format"] = schema_format("list", ENDLESS)
    bodies = [
        chat(f"{PROMPTS[i % len(PROMPTS)]} ({i})", max_tokens, **extra) for i in range(streams)
    ]
    barrier = threading.Barrier(streams)

    def one(body: dict) -> int:
        barrier.wait()
        return post(url, body)["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(one, bodies))
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def throughput(url: str, streams: int, max_tokens: int, rounds: int) -> dict:
    throughput_round(url, 4, 8, True)  # warm-up: the endless schema compiled once
    runs: dict[str, list[dict]] = {"none": [], "constrained": []}
    for _ in range(rounds):
        for mode in ("none", "constrained"):
            runs[mode].append(throughput_round(url, streams, max_tokens, mode == "constrained"))
    med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in runs.items()}
    # Paired ratios of each round (the rounds alternate, so load shifts hit both alike).
    ratios = [
        c["tokens_per_s"] / n["tokens_per_s"]
        for n, c in zip(runs["none"], runs["constrained"], strict=True)
    ]
    return {
        "streams": streams,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "runs": runs,
        "tokens_per_s_none": med["none"],
        "tokens_per_s_constrained": med["constrained"],
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
    }


def first_token(url: str, samples: int) -> dict:
    cold, cached, plain = [], [], []
    for _ in range(samples):
        name = "f" + uuid.uuid4().hex[:8]  # a schema no earlier request had
        schema = {
            "type": "object",
            "properties": {name: {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
            "required": [name, "n"],
        }
        body = chat("Reply with JSON.", 4, response_format=schema_format("t", schema))
        cold.append(first_token_s(url, body))
        cached.append(first_token_s(url, body))
        plain.append(first_token_s(url, chat("Reply with JSON.", 4)))
    return {
        "samples": samples,
        "cold_ms": statistics.median(cold) * 1e3,
        "cached_ms": statistics.median(cached) * 1e3,
        "none_ms": statistics.median(plain) * 1e3,
        "cold_all_ms": [round(v * 1e3, 1) for v in cold],
        "cached_all_ms": [round(v * 1e3, 1) for v in cached],
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--url", help="a running daemon's HTTP address (default: start one)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per schema (validity)")
    ap.add_argument("--max-tokens", type=int, default=256, help="validity's max_tokens")
    ap.add_argument("--concurrency", type=int, default=8, help="validity's concurrent requests")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-tokens", type=int, default=48, help="tokens per throughput stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-samples", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="engine.threads (0: one per core)")
    args = ap.parse_args()
    m = machine()
    server = None if args.url else Server(args.dtype, args.threads, args.streams)
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        load_before = os.getloadavg()[0]
        valid = validity(url, args.prompts, args.max_tokens, args.concurrency)
        speed = throughput(url, args.streams, args.stream_tokens, args.rounds)
        ttft = first_token(url, args.ttft_samples)
        load_after = os.getloadavg()[0]
    finally:
        if server is not None:
            server.close()
    conditions = {
        "model": "SmolLM2-135M-Instruct (the default model), CPU backend",
        "dtype": args.dtype,
        "threads": args.threads or os.cpu_count(),
        "load_average_1m_before": load_before,
        "load_average_1m_after": load_after,
    }
    data = {"machine": m, "conditions": conditions, "validity": valid, "throughput": speed,
            "first_token": ttft}  # fmt: skip
    rows = [
        ["outputs that parse and validate (50 schemas x "
         f"{args.prompts} prompts, greedy, max_tokens {args.max_tokens})",
         f"{valid['valid']}/{valid['requests']} ({valid['share_valid']:.1%}); "
         f"parsed {valid['parsed']}"],
        [f"output tokens/s, {speed['streams']} streams, none",
         f"{speed['tokens_per_s_none']:.1f}"],
        [f"output tokens/s, {speed['streams']} streams, every row constrained",
         f"{speed['tokens_per_s_constrained']:.1f}"],
        ["constrained / none (median of paired rounds)",
         f"{speed['ratio_median']:.2f} (rounds: "
         + ", ".join(f"{r:.2f}" for r in speed["ratios"]) + ")"],
        ["first token, cold grammar (median ms)", f"{ttft['cold_ms']:.0f}"],
        ["first token, cached grammar (median ms)", f"{ttft['cached_ms']:.0f}"],
        ["first token, no constraint (median ms)", f"{ttft['none_ms']:.0f}"],
    ]  # fmt: skip
    md = "\n".join(
        [
            "## Structured output on the default model (`benchmarks/structured.py`)",
            "",
            f"SmolLM2-135M-Instruct on the CPU backend, {args.dtype}, "
            f"{conditions['threads']} threads, through the OpenAI API over loopback; "
            f"{args.rounds} interleaved throughput rounds of {speed['streams']} streams x "
            f"{args.stream_tokens} "
            "tokens. The machine is shared with other jobs: 1-minute load average "
            f"{load_before:.1f} before, {load_after:.1f} after.",
            "",
            table(["measure", "value"], rows),
            "",
            machine_line(m),
        ]
    )
    publish(args, "structured", data, md)


if __name__ == "__main__":
    main()
