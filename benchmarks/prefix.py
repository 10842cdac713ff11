"""Automatic prefix reuse: time to first token with the prefix store versus without.

Two real daemons on the same checkpoint (CPU backend), one with ``engine.prefix_cache = true``
(the default) and one with it off, no prompt registered in either. Every request goes to both,
one after the other, so the two sides share the machine's state; each answer with reuse is
checked token-identical to the one without.

(a) ``shared``: requests made of one unregistered 1,000-token prefix plus a distinct user turn
    (USER_TOKENS ids), one at a time, greedy, SHARED_MAX_TOKENS tokens each. The first request
    computes the prefix; the aim is a median TTFT of the later ones <= 1/5 of no reuse.
(b) ``conversation``: CONVERSATIONS 8-turn conversations, one at a time. A conversation opens
    with its own SYSTEM_TOKENS-id system part; every turn resends the whole history (the earlier
    turns and answers, as token ids) plus a new USER_TOKENS-id user turn, and asks for
    ANSWER_TOKENS tokens. The aim: the last turn's TTFT <= 1.5x the first turn's (median over
    conversations).
Prompts are token ids (binary REQUEST), drawn at random from the model's vocabulary with a fixed
seed: the engine's work does not depend on which ids they are. TTFT is the daemon's own DONE
``ttft_us`` (request received -> first TOKEN written). The store's memory is read from the reuse
daemon's metrics (``zerolayer_prefix_cache_bytes``) after each part.

Models (``--size``): ``medium`` (default), the 124M-parameter random-weight Llama of
benchmarks/engine.py; ``builtin``, the daemon's ~3M-parameter built-in model.

    python benchmarks/prefix.py [--size medium|builtin] [--dtype float32|bfloat16] [--write]

Results are printed; ``--write`` also writes benchmarks/results/prefix-<size>.json and section
``prefix-<size>`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.client import Client  # noqa: E402
from zerolayer.frames.protocol import CACHE_PROMPT  # noqa: E402

PREFIX_TOKENS = 1000
USER_TOKENS = 24
SHARED_REQUESTS = 10
SHARED_MAX_TOKENS = 8
CONVERSATIONS = 4
TURNS = 8
SYSTEM_TOKENS = 48
ANSWER_TOKENS = 32
MODES = ("reuse", "no reuse")
CONV_HEADERS = ["turn", "prompt tokens", "TTFT ms, reuse", "TTFT ms, no reuse", "ratio", "reused"]


class Ids:
    """Random prompt ids from the checkpoint's vocabulary (specials below ``low`` excluded)."""

    def __init__(self, low: int, high: int, bos: int | None) -> None:
        self.rng = np.random.default_rng(20261130)
        self.low, self.high, self.bos = low, high, bos

    def take(self, n: int, first: bool = False) -> list[int]:
        ids = self.rng.integers(self.low, self.high, n).tolist()
        return ([self.bos] + ids[1:]) if first and self.bos is not None else ids


async def ask(client: Client, ids: list[int], max_tokens: int) -> dict:
    stream = await client.generate(ids, max_tokens, text=False)
    result = await stream.collect()
    return {
        "ttft_ms": result.ttft_us / 1000,
        "reused": bool(result.cache & CACHE_PROMPT),
        "ids": result.ids,
        "prompt_tokens": result.prompt_tokens,
    }


def store_facts(daemon: Daemon) -> dict:
    with urllib.request.urlopen(daemon.metrics_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    facts = {}
    for line in text.splitlines():
        for key, name in (
            ("cached_bytes", 'zerolayer_prefix_cache_bytes{kind="cached"}'),
            ("queried_tokens", "zerolayer_prefix_cache_queries_total"),
            ("hit_tokens", "zerolayer_prefix_cache_hits_total"),
        ):
            if line.startswith(name + " "):
                facts[key] = int(float(line.split()[-1]))
    return facts


async def both(clients: dict[str, Client], ids: list[int], max_tokens: int) -> dict[str, dict]:
    return {mode: await ask(clients[mode], ids, max_tokens) for mode in MODES}


async def part_shared(clients: dict[str, Client], gen: Ids) -> list[dict[str, dict]]:
    prefix = gen.take(PREFIX_TOKENS, first=True)
    return [
        await both(clients, prefix + gen.take(USER_TOKENS), SHARED_MAX_TOKENS)
        for _ in range(SHARED_REQUESTS)
    ]


async def part_conversation(clients: dict[str, Client], gen: Ids) -> list[list[dict[str, dict]]]:
    conversations = []
    for _ in range(CONVERSATIONS):
        history = gen.take(SYSTEM_TOKENS, first=True)
        turns = []
        for _ in range(TURNS):
            prompt = history + gen.take(USER_TOKENS)
            got = await both(clients, prompt, ANSWER_TOKENS)
            turns.append(got)
            history = prompt + got["reuse"]["ids"]  # the same as without reuse, checked below
        conversations.append(turns)
    return conversations


def load_average() -> float:
    """The machine's 1-minute load average: how busy the shared machine was."""
    with open("/proc/loadavg") as fh:
        return float(fh.read().split()[0])


async def measure(endpoints: dict[str, str], gen: Ids, daemons: dict[str, Daemon]) -> dict:
    loads = [load_average()]
    clients = {mode: await Client.connect(endpoints[mode]) for mode in MODES}
    try:
        warm = gen.take(64, first=True)  # first allocations and kernels, on both sides
        await both(clients, warm, 4)
        t0 = time.perf_counter()
        shared = await part_shared(clients, gen)
        shared_store = store_facts(daemons["reuse"])
        loads.append(load_average())
        conv = await part_conversation(clients, gen)
        loads.append(load_average())
        conv_store = store_facts(daemons["reuse"])
        seconds = time.perf_counter() - t0
    finally:
        for client in clients.values():
            await client.close()
    return {
        "shared": shared,
        "conversation": conv,
        "store_after_shared": shared_store,
        "store_after_conversation": conv_store,
        "seconds": seconds,
        "load_average": loads,
    }


def identical(pairs: list[dict[str, dict]]) -> bool:
    return all(p["reuse"]["ids"] == p["no reuse"]["ids"] for p in pairs)


def summarise(raw: dict, kv_bytes_per_token: int) -> dict:
    shared = raw["shared"]
    later = shared[1:]
    med = {m: statistics.median(p[m]["ttft_ms"] for p in later) for m in MODES}
    out: dict = {
        "shared": {
            "prefix_tokens": PREFIX_TOKENS,
            "user_tokens": USER_TOKENS,
            "requests": len(shared),
            "first_ttft_ms": {m: shared[0][m]["ttft_ms"] for m in MODES},
            "later_ttft_ms_median": med,
            "later_ratio": med["reuse"] / med["no reuse"],
            "aim_met": med["reuse"] <= med["no reuse"] / 5,
            "reused": sum(p["reuse"]["reused"] for p in shared),
            "reused_without_store": sum(p["no reuse"]["reused"] for p in shared),
            "identical": identical(shared),
            "store": raw["store_after_shared"],
        }
    }
    conv = raw["conversation"]
    by_turn = []
    for t in range(TURNS):
        row = {m: statistics.median(c[t][m]["ttft_ms"] for c in conv) for m in MODES}
        row["prompt_tokens"] = statistics.median(c[t]["reuse"]["prompt_tokens"] for c in conv)
        row["reused"] = sum(c[t]["reuse"]["reused"] for c in conv)
        by_turn.append(row)
    out["conversation"] = {
        "conversations": len(conv),
        "turns": TURNS,
        "by_turn": by_turn,
        "last_over_first": {m: by_turn[-1][m] / by_turn[0][m] for m in MODES},
        "aim_met": by_turn[-1]["reuse"] <= 1.5 * by_turn[0]["reuse"],
        "identical": all(identical(c) for c in conv),
        "store": raw["store_after_conversation"],
    }
    out["kv_bytes_per_token"] = kv_bytes_per_token
    out["seconds"] = raw["seconds"]
    out["load_average"] = raw["load_average"]
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def markdown(r: dict, m: dict, args: argparse.Namespace, model: str) -> str:
    s, c = r["shared"], r["conversation"]
    shared_rows = [
        ["first request (computes the prefix)"]
        + [f"{s['first_ttft_ms'][mode]:.1f}" for mode in MODES]
        + ["–"],
        [f"requests 2-{s['requests']} (median)"]
        + [f"{s['later_ttft_ms_median'][mode]:.1f}" for mode in MODES]
        + [f"{s['later_ratio']:.3f}"],
    ]
    conv_rows = [
        [t + 1, f"{row['prompt_tokens']:.0f}", f"{row['reuse']:.1f}", f"{row['no reuse']:.1f}",
         f"{row['reuse'] / row['no reuse']:.3f}", f"{row['reused']}/{c['conversations']}"]
        for t, row in enumerate(c["by_turn"])
    ]  # fmt: skip
    lo = c["last_over_first"]
    invocation = ("" if args.size == "medium" else f" --size {args.size}") + (
        "" if args.dtype == "float32" else f" --dtype {args.dtype}"
    )
    per_token = r["kv_bytes_per_token"]
    return "\n".join(
        [
            f"## Automatic prefix reuse: time to first token, {args.size} model",
            "",
            f"`python benchmarks/prefix.py{invocation} --write` — two daemons on {model}, CPU "
            f"backend, {args.dtype}, torch threads: one per core, `max_batch_size = 4`, response "
            "cache off, no prompt registered; one has `engine.prefix_cache` on (the default), "
            "the other off. Every request goes to both, one after the other (one request in "
            "flight at a time), as token ids; greedy. TTFT is the daemon's DONE `ttft_us`. "
            f"Block size 16 tokens; KV is {per_token:,} bytes per token. Ran on a shared 2-core "
            "machine while other jobs were busy (1-minute load average "
            + ", ".join(f"{x:.1f}" for x in r["load_average"])
            + " at the start, between the parts and at the end): absolute times are noisy, the "
            "two columns of one row were measured moments apart.",
            "",
            f"**(a) Shared unregistered prefix**: {s['prefix_tokens']} tokens + a distinct "
            f"{s['user_tokens']}-token user turn, {SHARED_MAX_TOKENS} tokens out. Aim: later "
            f"requests <= 1/5 of no reuse — **{'met' if s['aim_met'] else 'not met'}** "
            f"({s['later_ratio']:.3f}). Reuse (DONE bit 1) on {s['reused']}/{s['requests']} "
            f"requests (0/{s['requests']} without the store); answers identical: "
            f"{'yes' if s['identical'] else '**no**'}. Store after this part: "
            f"{mib(s['store'].get('cached_bytes', 0))}.",
            "",
            table(["request", "TTFT ms, reuse", "TTFT ms, no reuse", "ratio"], shared_rows),
            "",
            f"**(b) {TURNS}-turn conversations** ({c['conversations']}, medians by turn): each "
            f"turn resends the history plus a {USER_TOKENS}-token user turn and asks for "
            f"{ANSWER_TOKENS} tokens; the first turn is a {SYSTEM_TOKENS}-token system part plus "
            f"the user turn. Last turn / first turn: {lo['reuse']:.2f}x with reuse, "
            f"{lo['no reuse']:.2f}x without. Aim <= 1.5x: "
            f"**{'met' if c['aim_met'] else 'not met'}**. Answers identical: "
            f"{'yes' if c['identical'] else '**no**'}. Store after both parts: "
            f"{mib(c['store'].get('cached_bytes', 0))}, prefix hits "
            f"{c['store'].get('hit_tokens', 0):,} of {c['store'].get('queried_tokens', 0):,} "
            "prompt tokens queried.",
            "",
            table(CONV_HEADERS, conv_rows),
            "",
            machine_line(m),
        ]
    )


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("medium", "builtin"), default="medium")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--data-dir", default="", help="where generated checkpoints are cached")
    args = ap.parse_args()
    if args.size == "medium":
        from benchmarks.engine import MEDIUM_CONFIG, ensure_medium, parameter_count

        directory = ensure_medium(args.data_dir)
        model_env = {"MODEL__PATH": str(directory)}
        model = f"`{directory.name}` ({parameter_count(directory) / 1e6:.0f}M parameters)"
        cfg = MEDIUM_CONFIG
        gen = Ids(3, cfg["vocab_size"], bos=1)
        layers, kv_heads, head_dim = (
            cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
        )  # fmt: skip
    else:
        from zerolayer.models.builtin import BUILTIN_CONFIG, ensure_builtin

        directory = ensure_builtin(args.data_dir)
        model_env = {"MODEL__DATA_DIR": str(directory.parent)}
        model = "the built-in model (byte tokenizer)"
        gen = Ids(3, 250, bos=None)
        cfg = BUILTIN_CONFIG
        layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * layers * kv_heads * head_dim * (4 if args.dtype == "float32" else 2)
    env = {
        **model_env,
        "MODEL__DTYPE": args.dtype,
        "ENGINE__BACKEND": "cpu",
        "ENGINE__MAX_BATCH_SIZE": "4",
        "ENGINE__MAX_CONTEXT": "2048",
        "CACHE__ENABLED": "false",  # greedy repeats would be replayed, not run
        "SERVER__IDLE_TIMEOUT_S": "600",  # a connection waits while the other daemon works
        "LOGGING__LEVEL": "warning",
    }
    with (
        Daemon(env) as reuse,
        Daemon({**env, "ENGINE__PREFIX_CACHE": "false"}) as plain,
    ):
        daemons = {"reuse": reuse, "no reuse": plain}
        endpoints = {mode: d.endpoint for mode, d in daemons.items()}
        raw = asyncio.run(measure(endpoints, gen, daemons))
    result = summarise(raw, per_token)
    m = machine()
    text = markdown(result, m, args, model)
    report = {"machine": m, "size": args.size, "dtype": args.dtype, **result}
    publish(args, f"prefix-{args.size}", report, text)
    ok = result["shared"]["identical"] and result["conversation"]["identical"]
    if not ok:
        print("answers with reuse differ from answers without", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
