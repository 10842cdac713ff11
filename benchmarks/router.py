"""Two ZeroLayer replicas behind vllm-router: cache-aware (prefix) routing against round robin on
a multi-turn chat workload, and a rate limit shared through Redis across both replicas.

Everything runs on 127.0.0.1 and stops by itself: one redis-server, two daemons (SmolLM2-135M by
default, one torch thread each: the two share the machine's cores), two routers in front of the
same two daemons (one per policy), the workload, then everything is stopped (SIGTERM, then
SIGKILL after a bound; the children also die with this process). Only public interfaces are
used: the `zerolayer` and `vllm-router` commands, redis-server, HTTP through the official
openai SDK, and each daemon's /metrics.

The workload: conversations of several turns, each turn resending the whole history (the
OpenAI chat API is stateless), a long distinct first message per conversation, short follow-ups,
greedy answers of a fixed length (`ignore_eos`), the response cache bypassed. Rounds alternate
between the two routers (paired, interleaved), each round with fresh conversations, so the load
of a shared machine falls on both policies alike. Per policy: the prefix-cache hit rate from the
daemons' own counters (`zerolayer_prefix_cache_hits_total` / `..._queries_total`, deltas over that
policy's rounds, both replicas), and TTFT P50/P99 at the client through the router.

The rate limit: a key limited to `--limit-rpm` requests per minute sends twice that many
requests at once through the round-robin router; with `ratelimit.store = "redis"` the replicas
share one bucket, so `--limit-rpm` are answered and the rest refused (429), by both replicas.

    python benchmarks/router.py --router-bin /path/to/venv/bin/vllm-router [--write]

Install the router in a venv of its own (docs/operations.md, "Replicas behind a router").
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from openai import APIStatusError, AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, machine, machine_line, parser, publish, table  # noqa: E402

POLICIES = ("cache_aware", "round_robin")
_TEXT = """river stone garden window market engine letter candle winter harbor mountain pencil
silver meadow thunder violin island lantern forest bridge copper orchard planet saddle canvas
feather marble rocket shadow tunnel velvet walnut yellow zebra anchor basket cabinet dolphin
emerald falcon glacier hammer igloo jasmine kettle ladder magnet napkin"""
WORDS = tuple(_TEXT.split())


# -- processes ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """In the child: SIGKILL when this benchmark's process dies (Linux PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Child:
    """A subprocess with its output in a log file, stopped by SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name, self.log = name, log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, cwd=ROOT, preexec_fn=_die_with_parent,
        )  # fmt: skip

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{tail}")

    def stop(self, timeout: float = 45.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


def wait_http(url: str, child: Child, deadline: float, what: str) -> None:
    """Until GET ``url`` answers 200."""
    while True:
        child.check()
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready at {url}; see {child.log}")
        time.sleep(0.5)


def add_key(keys_file: Path, name: str, rpm: int | None) -> str:
    """A new API key through `zerolayer keys add` (it prints the key once, on its first line)."""
    argv = [
        sys.executable,
        "-m",
        "zerolayer.cli.main",
        "keys",
        "add",
        "--keys-file",
        str(keys_file),
    ]
    argv += [name] + (["--rpm", str(rpm)] if rpm else [])
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()[0]


def daemon_env(tmp: Path, keys_file: Path, redis_port: int, args) -> dict[str, str]:  # noqa: ANN001
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROLAYER_")}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(args.threads),
        ZEROLAYER_ENGINE__THREADS=str(args.threads),
        ZEROLAYER_MODEL__DTYPE=args.dtype,
        ZEROLAYER_ENGINE__MAX_BATCH_SIZE="8",
        ZEROLAYER_CACHE__ENABLED="false",
        ZEROLAYER_AUTH__ENABLED="true",
        ZEROLAYER_AUTH__KEYS_FILE=str(keys_file),
        ZEROLAYER_RATELIMIT__STORE="redis",
        ZEROLAYER_RATELIMIT__REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
    )
    return env


# -- metrics -----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
COUNTERS = (
    "zerolayer_prefix_cache_queries_total",
    "zerolayer_prefix_cache_hits_total",
    "zerolayer_prompt_tokens_total",
    "zerolayer_request_success_total",
    "zerolayer_rate_limited_total",
)


def scrape(http_url: str) -> dict[str, float]:
    """The COUNTERS of one daemon's /metrics (API port), each summed over its labels."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def deltas(before: list[dict[str, float]], after: list[dict[str, float]], name: str) -> list:
    """Per replica, how far counter ``name`` moved between two scrapes of every replica."""
    return [a[name] - b[name] for b, a in zip(before, after, strict=True)]


# -- workload ----------------------------------------------------------------------------------


def conversation_texts(seed: int, turns: int, first_words: int) -> list[str]:
    rng = random.Random(seed)
    notes = " ".join(rng.choice(WORDS) for _ in range(first_words))
    texts = [f"Here are my notes: {notes}. Which words come up most?"]
    for _ in range(turns - 1):
        texts.append("And " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?")
    return texts


async def converse(client: AsyncOpenAI, model: str, texts: list[str], max_tokens: int) -> list:
    """One conversation, turn by turn; per turn (TTFT s, prompt tokens)."""
    history: list[dict[str, str]] = []
    out = []
    for text in texts:
        history.append({"role": "user", "content": text})
        sent = time.perf_counter()
        ttft = None
        parts: list[str] = []
        prompt_tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=history, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            extra_headers={"cache-control": "no-cache"},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - sent
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
        history.append({"role": "assistant", "content": "".join(parts)})
        out.append((ttft, prompt_tokens))
    return out


async def one_round(url: str, key: str, model: str, seeds: list[int], args) -> list:  # noqa: ANN001
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
    try:
        convs = [conversation_texts(s, args.turns, args.first_words) for s in seeds]
        return await asyncio.gather(*(converse(client, model, c, args.max_tokens) for c in convs))
    finally:
        await client.close()


async def limit_burst(url: str, key: str, model: str, n: int) -> dict[str, int]:
    """``n`` one-token requests at once; counts by HTTP status."""
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)

    async def one(i: int) -> int:
        try:
            await client.chat.completions.create(
                model=model, max_tokens=1, messages=[{"role": "user", "content": f"hi {i}"}],
                extra_headers={"cache-control": "no-cache"},
            )  # fmt: skip
            return 200
        except APIStatusError as exc:
            return exc.status_code

    try:
        codes = await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await client.close()
    return {str(c): codes.count(c) for c in sorted(set(codes))}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if q < 100 else values[-1]


# -- main --------------------------------------------------------------------------------------


def run(args, tmp: Path) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + args.timeout
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is missing (Debian: apt-get install redis-server)")
    router_bin = args.router_bin or shutil.which("vllm-router")
    if not router_bin:
        raise SystemExit("vllm-router not found: pass --router-bin (docs/operations.md)")
    keys_file = tmp / "keys.toml"
    bench_key = add_key(keys_file, "bench", None)
    limited_key = add_key(keys_file, "limited", args.limit_rpm)
    with ExitStack() as stack:
        redis_port = free_port()
        argv = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no"]  # fmt: skip
        redis = Child("redis-server", argv, tmp / "redis.log")
        stack.callback(redis.stop)
        env = daemon_env(tmp, keys_file, redis_port, args)
        daemons = []
        for i in range(2):
            port, http, metrics = free_port(), free_port(), free_port()
            argv = [sys.executable, "-m", "zerolayer.cli.main", "serve", args.model,
                    "--port", str(port),
                    "--http-port", str(http), "--metrics-port", str(metrics)]  # fmt: skip
            d = Child(f"replica {i}", argv, tmp / f"replica{i}.log", env)
            stack.callback(d.stop)
            daemons.append((d, f"http://127.0.0.1:{http}"))
        for d, url in daemons:
            wait_http(url + "/health", d, deadline, d.name)
        with urllib.request.urlopen(daemons[0][1] + "/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        routers = {}
        for policy in POLICIES:
            port = free_port()
            argv = [router_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                    "--worker-urls", *(u for _, u in daemons), "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
                    "--disable-retries", "--disable-circuit-breaker",
                    "--log-level", "warning"]  # fmt: skip
            r = Child(f"vllm-router {policy}", argv, tmp / f"router-{policy}.log")
            stack.callback(r.stop)
            routers[policy] = (r, f"http://127.0.0.1:{port}")
        for r, url in routers.values():
            wait_http(url + "/health", r, deadline, r.name)
        # warm both replicas alike (the chat template's own prefix, the first forward)
        for _, url in daemons:
            asyncio.run(one_round(url, bench_key, model, [999_999], _warm(args)))

        samples: dict[str, list] = {p: [] for p in POLICIES}
        counters: dict[str, dict[str, float]] = {p: dict.fromkeys(COUNTERS, 0.0) for p in POLICIES}
        for rnd in range(args.rounds):
            order = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
            for policy in order:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"--timeout {args.timeout} s reached")
                seeds = [1000 * rnd + 100 * POLICIES.index(policy) + c
                         for c in range(args.conversations)]  # fmt: skip
                before = [scrape(u) for _, u in daemons]
                t0 = time.perf_counter()
                convs = asyncio.run(one_round(routers[policy][1], bench_key, model, seeds, args))
                wall = time.perf_counter() - t0
                after = [scrape(u) for _, u in daemons]
                for name in COUNTERS:
                    counters[policy][name] += sum(deltas(before, after, name))
                served = deltas(before, after, "zerolayer_request_success_total")
                samples[policy].append({"round": rnd, "wall_s": wall, "turns": convs,
                                        "served_by_replica": served})  # fmt: skip
                print(f"round {rnd} {policy}: {wall:.1f} s, served {served}", file=sys.stderr)

        before = [scrape(u) for _, u in daemons]
        codes = asyncio.run(limit_burst(routers["round_robin"][1], limited_key, model,
                                        2 * args.limit_rpm))  # fmt: skip
        after = [scrape(u) for _, u in daemons]
        limit = {
            "rpm": args.limit_rpm, "sent": 2 * args.limit_rpm, "status_counts": codes,
            "refused_by_replica": deltas(before, after, "zerolayer_rate_limited_total"),
            "answered_by_replica": deltas(before, after, "zerolayer_request_success_total"),
        }  # fmt: skip
    return {"model": model, "samples": samples, "counters": counters, "rate_limit": limit}


def _warm(args):  # noqa: ANN001, ANN202
    return type(args)(**{**vars(args), "turns": 1})


def summarize(data: dict) -> dict:
    out = {}
    for policy in POLICIES:
        ttfts = [t for s in data["samples"][policy] for conv in s["turns"] for t, _ in conv]
        later = [t for s in data["samples"][policy] for conv in s["turns"] for t, _ in conv[1:]]
        c = data["counters"][policy]
        out[policy] = {
            "requests": len(ttfts),
            "prefix_hit_rate": c["zerolayer_prefix_cache_hits_total"]
            / max(c["zerolayer_prefix_cache_queries_total"], 1.0),
            "prefix_hits_tokens": c["zerolayer_prefix_cache_hits_total"],
            "prefix_queries_tokens": c["zerolayer_prefix_cache_queries_total"],
            "ttft_p50_ms": 1000 * pct(ttfts, 50),
            "ttft_p99_ms": 1000 * pct(ttfts, 99),
            "ttft_p50_later_turns_ms": 1000 * pct(later, 50),
            "wall_s": sum(s["wall_s"] for s in data["samples"][policy]),
        }
    return out


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument(
        "--render", metavar="JSON", help="only print (and --write) a results file's table"
    )
    ap.add_argument("--router-bin", default="", help="the vllm-router executable (its own venv)")
    ap.add_argument("--model", default="@smollm2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--conversations", type=int, default=4, help="per round, run at once")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-words", type=int, default=250, help="words of a first message")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per policy, interleaved")
    ap.add_argument("--limit-rpm", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1500, help="bound on the whole run, s")
    args = ap.parse_args()
    if args.render:
        results = json.loads(Path(args.render).read_text())
        publish(args, "router", results, markdown(results))
        return
    started = machine()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zl-router-") as tmp:
        data = run(args, Path(tmp))
    ended_load = os.getloadavg()[0]
    summary = summarize(data)
    results = {"machine": started, "load_average_1m_at_end": ended_load,
               "args": {k: v for k, v in vars(args).items() if k not in ("write", "render")},
               "router": _router_version(args.router_bin), "total_s": time.monotonic() - t0,
               "summary": summary, **data}  # fmt: skip
    publish(args, "router", results, markdown(results))


def _router_version(router_bin: str) -> str:
    pip = Path(router_bin or shutil.which("vllm-router") or "").with_name("pip")
    try:
        out = subprocess.run([str(pip), "show", "vllm-router"], capture_output=True, text=True)
    except OSError:
        return "vllm-router (version unknown)"
    version = re.search(r"^Version: (\S+)", out.stdout, re.M)
    return f"vllm-router {version.group(1)}" if version else "vllm-router (version unknown)"


def markdown(r: dict) -> str:
    a, s, lim = r["args"], r["summary"], r["rate_limit"]
    rows = [
        [p, s[p]["requests"], f"{100 * s[p]['prefix_hit_rate']:.0f} %",
         f"{s[p]['prefix_hits_tokens']:.0f} of {s[p]['prefix_queries_tokens']:.0f}",
         f"{s[p]['ttft_p50_ms']:.0f}", f"{s[p]['ttft_p99_ms']:.0f}",
         f"{s[p]['ttft_p50_later_turns_ms']:.0f}", f"{s[p]['wall_s']:.0f}"]
        for p in POLICIES
    ]  # fmt: skip
    answered = lim["status_counts"].get("200", 0)
    by_status = ", ".join(f"{n} x {code}" for code, n in lim["status_counts"].items())
    return (
        "## Two replicas behind vllm-router: cache-aware against round robin\n\n"
        f"`python benchmarks/router.py --router-bin …/vllm-router` — {r['router']} in its own "
        f"venv, two ZeroLayer daemons on 127.0.0.1 serving {r['model']} ({a['dtype']}, "
        f"**{a['threads']} torch thread each**: the two replicas share the machine's cores), "
        "rate limits in one redis-server, response cache off, router retries and circuit "
        f"breaker off. Workload: {a['rounds']} rounds per policy, interleaved (paired), each "
        f"of {a['conversations']} conversations at once, {a['turns']} turns each resending the "
        f"history, a first message of {a['first_words']} words, {a['max_tokens']} greedy "
        "tokens per answer (`ignore_eos`). Hit rate: the replicas' "
        "`zerolayer_prefix_cache_hits_total` / `zerolayer_prefix_cache_queries_total` (prompt "
        "tokens), deltas over that policy's rounds; TTFT at the client through the router. A "
        "small workload (the whole run took "
        f"{r['total_s'] / 60:.1f} min, start-up included) on a shared machine.\n\n"
        + table(["policy", "requests", "prefix-cache hit rate", "prompt tokens reused",
                 "TTFT P50 ms", "TTFT P99 ms", "TTFT P50 ms, turns 2+", "wall s"], rows)
        + "\n\nWall time of each paired round (the same workload, fresh conversations), "
        + "; ".join(
            f"round {i}: " + ", ".join(
                f"{p} {r['samples'][p][i]['wall_s']:.0f} s" for p in POLICIES)
            for i in range(a["rounds"])
        )  # fmt: skip
        + f".\n\nShared rate limit: a key limited to {lim['rpm']} requests a minute sent "
        f"{lim['sent']} at once through the round-robin router: {answered} answered, "
        f"({by_status}); refused (`zerolayer_rate_limited_total`) by replica "
        f"{', '.join(f'{v:.0f}' for v in lim['refused_by_replica'])}, answered by replica "
        f"{', '.join(f'{v:.0f}' for v in lim['answered_by_replica'])}.\n\n"
        + machine_line(r["machine"])
        + f" Load average at the end: {r['load_average_1m_at_end']:.1f}.\n"
    )  # fmt: skip


if __name__ == "__main__":
    main()
