"""Precompiled system prompts: time to first token, registered versus inline.

One real daemon (CPU backend) with a 1,000-token system prompt registered through a temporary
config file ([[prompts]]), and for the inline baseline a second one with nothing registered and
``engine.prefix_cache = false`` (the first would reuse the pinned prompt for any request with its
ids, docs/prefix-cache.md). Each request is that system prompt plus a short user turn, greedy,
MAX_TOKENS tokens. Two checkpoints (``--size``):
- ``medium`` (default): the 124M-parameter random-weight Llama of benchmarks/engine.py (hidden
  1024, word-level tokenizer). The English text is written in its vocabulary, one token per word
  or punctuation mark, each mapped to one of the short pseudo-words w3..w99 (a fixed hash), so
  the user turn is about as many tokens as a subword tokenizer would make of it and 1,000 tokens
  take under 4,000 characters, as real subword text does (a registered prompt may have at most
  4,096 characters).
- ``builtin``: the daemon's built-in model (~3M parameters, hidden 256, byte tokenizer). One
  token per byte makes the 1,000-token system prompt only ~1,000 characters while the user turn
  is ~70 tokens, and the tiny hidden size makes attention over the prefix a large share of the
  user turn's cost: a pessimistic case. Three ways to send the same tokens, interleaved
round by round, so they share the machine's state:
- inline: binary REQUEST with the full prompt as token ids, to the daemon without reuse;
- registered (prompt_id): binary REQUEST with prompt_id and the user turn's ids;
- registered (JSON system): JSON chat request whose ``system`` equals the registered text.
At 1 stream (requests one after another) and 16 concurrent streams. TTFT is the daemon's own
DONE ``ttft_us`` (request received -> first TOKEN written); the client-observed TTFT (send ->
first TOKEN read) is recorded too. Each registered answer is checked token-identical to inline.

Results: ``benchmarks/results/prompts-<size>.json`` and section ``prompts-<size>`` of
docs/benchmarks.md.

    python benchmarks/prompts.py [--size medium|builtin|smollm2] [--dtype float32|bfloat16]
                                 [--rounds N] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import Daemon  # noqa: E402
from zerolayer.client import Client  # noqa: E402
from zerolayer.config.settings import BUILTIN_MODEL, SMOLLM2_MODEL  # noqa: E402
from zerolayer.frames.protocol import CACHE_PROMPT  # noqa: E402
from zerolayer.request_path.prompts import system_ids  # noqa: E402
from zerolayer.tokenizer import ByteTokenizer, Tokenizer  # noqa: E402

PROMPT_ID = 1
TARGET_TOKENS = 1000
MAX_TOKENS = 8
CONCURRENCY = (1, 16)
MODES = ("inline", "registered (prompt_id)", "registered (JSON system)")
ROUNDS = {"medium": 5, "builtin": 8, "smollm2": 2}
SIZE_NOTES = {
    "medium": (
        "The text is written in the checkpoint's word-level vocabulary, one token per word or "
        "punctuation mark (pseudo-words w3..w99), so the user turn has about as many tokens as "
        "a subword tokenizer makes of it."
    ),
    "smollm2": (
        "The default model on its real weights and subword tokenizer. Its 1,000-token system "
        "prompt is the support text followed by a parts list (part numbers and prices, one "
        "token per digit), which keeps it within the 4,096 characters a registered prompt may "
        "have."
    ),
    "builtin": (
        "A pessimistic case for the ratio: with one token per byte the user turn is 77-79 "
        "tokens against the 1,000 of the system prompt, and with a hidden size of 256 the user "
        "turn's attention over the 1,000 prefix positions costs about two thirds as much as its "
        "projections and MLP."
    ),
}

_SENTENCES = [
    "You are the support assistant of a company that sells bicycles and spare parts.",
    "Answer in plain English, in at most three short sentences, without marketing language.",
    "When a customer asks about an order, ask for the order number before anything else.",
    "Never promise a delivery date; say that the tracking page shows the carrier's estimate.",
    "Returns are accepted within thirty days when the part is unused and in its box.",
    "Warranty claims need a photo of the fault and the serial number under the bottom bracket.",
    "If a question is about safety, such as brakes or a cracked frame, tell the customer to "
    "stop riding and visit a workshop.",
    "Do not give medical, legal or financial advice; suggest a professional instead.",
    "Prices and stock change daily, so point to the product page rather than quoting numbers.",
    "Be polite, stay on topic, and end with a question only when you need more information.",
]


class Workload:
    """The tokenizer of the served checkpoint, and English written in its vocabulary."""

    def __init__(self, tok: Tokenizer, word_level: bool, subword: bool = False) -> None:
        self.tok = tok
        self.word_level = word_level
        self.subword = subword

    def render(self, english: str) -> str:
        """Byte tokenizer: the text itself. Word-level: each word or run of punctuation becomes
        one of the pseudo-words w3..w99 (a fixed hash of it), one token and at most 4 characters
        with its space."""
        if not self.word_level:
            return english
        pieces = re.findall(r"\w+|[^\w\s]+", english)
        return " ".join(f"w{3 + zlib.crc32(p.encode()) % 97}" for p in pieces)

    def system_prompt(self, tokens: int = TARGET_TOKENS) -> str:
        """Text whose chat-template system part is exactly ``tokens`` tokens."""
        # BOS, the role header, the closing newline: what the template adds to one token.
        need = tokens - (len(system_ids(self.tok, self.render("x"))) - 1)
        text, i = "", 0
        if self.subword:
            return self._subword_prompt(tokens)
        if self.word_level:
            words: list[str] = []
            while len(words) < need:
                words += self.render(_SENTENCES[i % len(_SENTENCES)]).split()
                i += 1
            text = " ".join(words[:need])
        else:
            while len(text) < need:
                text += ("" if not text else " ") + _SENTENCES[i % len(_SENTENCES)]
                i += 1
            text = text[:need].rstrip()
            while len(system_ids(self.tok, text)) < tokens:  # rstrip dropped a character or two
                text += "."
        assert len(system_ids(self.tok, text)) == tokens
        return text

    def _subword_prompt(self, tokens: int) -> str:
        """The sentences, then a parts list, cut to exactly ``tokens`` tokens. Digits are one
        token each for a tokenizer that splits them (SmolLM2's), so the cut is made just below
        the target and digits fill it up exactly."""
        parts = [
            f"Part {10000 + 7919 * k % 90000}, {name}: {499 + 1733 * k % 20000} cents."
            for k, name in enumerate(["brake pads", "chain", "tyre", "tube", "saddle"] * 40)
        ]
        full = " ".join(_SENTENCES) + " Parts and prices: " + " ".join(parts)

        def count(text: str) -> int:
            return len(system_ids(self.tok, text))

        lo, hi = 0, len(full)
        while lo < hi:  # the shortest prefix with at least `tokens` tokens
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if count(full[:mid].rstrip()) < tokens else (lo, mid)
        text = full[:lo].rstrip()
        while count(text) > tokens:
            text = text[:-1].rstrip()
        while count(text) < tokens:
            text += "1"
        assert count(text) == tokens
        return text

    def user_turn(self, n: int) -> str:
        return self.render(f"Question {n}: which tyre pressure suits a touring bike?")


def config_file(directory: Path, text: str, model: dict[str, str]) -> str:
    path = directory / "prompts-bench.toml"
    # A JSON string is a valid TOML basic string.
    path.write_text(
        "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in model.items()) + "\n[engine]\n"
        'backend = "cpu"\n'
        "max_batch_size = 16\n"
        "max_context = 2048\n"
        f"max_prefix_tokens = {TARGET_TOKENS + 24}\n"
        # Greedy repeats of one user turn would otherwise be answered from the response cache.
        "\n[cache]\nenabled = false\n"
        "\n[[prompts]]\n"
        f"id = {PROMPT_ID}\n"
        'name = "support"\n'
        f"text = {json.dumps(text)}\n"
    )
    return str(path)


async def one_request(
    clients: dict[str, Client], work: Workload, mode: str, system: str, n: int
) -> dict:
    client = clients["inline" if mode == "inline" else "registered"]
    tok = work.tok
    messages = [{"role": "user", "content": work.user_turn(n)}]
    chat_ids = tok.encode_prompt(tok.render_chat(messages, system))
    prefix = len(system_ids(tok, system))
    t0 = time.perf_counter()
    if mode == "inline":
        stream = await client.generate(chat_ids.tolist(), MAX_TOKENS, text=False)
    elif mode == "registered (prompt_id)":
        user_ids = chat_ids[prefix:].tolist()
        stream = await client.generate(user_ids, MAX_TOKENS, prompt_id=PROMPT_ID, text=False)
    else:
        req = {"max_tokens": MAX_TOKENS, "system": system, "messages": messages}
        stream = await client.generate_json(req)
    first = 0.0
    async for event in stream:
        if not first and event.ids:
            first = time.perf_counter()
    result = stream.result
    assert result is not None
    return {
        "ttft_ms": result.ttft_us / 1000,
        "client_ttft_ms": (first - t0) * 1000 if first else float("nan"),
        "prompt_tokens": result.prompt_tokens,
        "reused": bool(result.cache & CACHE_PROMPT),
        "ids": result.ids,
    }


async def measure(endpoints: dict[str, str], work: Workload, system: str, rounds: int) -> dict:
    samples: dict[int, dict[str, list[dict]]] = {c: {m: [] for m in MODES} for c in CONCURRENCY}
    clients = {name: await Client.connect(ep) for name, ep in endpoints.items()}
    try:
        for mode in MODES:  # warm-up: first allocations, first kernels
            await one_request(clients, work, mode, system, 0)
        n = 1
        for _ in range(rounds):
            for concurrency in CONCURRENCY:
                for mode in MODES:  # the same user turns in every mode
                    batch = [
                        one_request(clients, work, mode, system, n + i) for i in range(concurrency)
                    ]
                    if concurrency == 1:
                        samples[1][mode].append(await batch[0])
                    else:
                        samples[concurrency][mode] += await asyncio.gather(*batch)
                n += concurrency
    finally:
        for client in clients.values():
            await client.close()
    return samples


def summarise(samples: dict, work: Workload, system: str) -> dict:
    tokens = len(system_ids(work.tok, system))
    out: dict = {"system_prompt_tokens": tokens, "max_tokens": MAX_TOKENS, "runs": {}}
    totals = [s["prompt_tokens"] for by_mode in samples.values() for s in by_mode["inline"]]
    out["user_turn_tokens"] = [min(totals) - tokens, max(totals) - tokens]
    for concurrency, by_mode in samples.items():
        inline_ids = [s["ids"] for s in by_mode["inline"]]
        row = {}
        for mode, got in by_mode.items():
            ttft = [s["ttft_ms"] for s in got]
            client = [s["client_ttft_ms"] for s in got]
            row[mode] = {
                "requests": len(got),
                "ttft_ms_median": statistics.median(ttft),
                "ttft_ms_p90": statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else ttft[0],
                "client_ttft_ms_median": statistics.median(client),
                "prefix_reused": sum(s["reused"] for s in got),
                # Greedy, same user turns in the same order: must equal inline token for token.
                "identical_to_inline": [s["ids"] for s in got] == inline_ids,
                "prompt_tokens": sorted({s["prompt_tokens"] for s in got}),
            }
        base = row["inline"]["ttft_ms_median"]
        for mode in MODES:
            row[mode]["ttft_vs_inline"] = row[mode]["ttft_ms_median"] / base
        out["runs"][str(concurrency)] = row
    return out


def markdown(result: dict, m: dict, args: argparse.Namespace) -> str:
    rows = []
    for concurrency, row in result["runs"].items():
        for mode in MODES:
            r = row[mode]
            rows.append(
                [
                    concurrency,
                    mode,
                    f"{r['ttft_ms_median']:.1f}",
                    f"{r['ttft_ms_p90']:.1f}",
                    f"{r['client_ttft_ms_median']:.1f}",
                    f"{r['ttft_vs_inline']:.3f}",
                    f"{r['prefix_reused']}/{r['requests']}",
                    "yes" if r["identical_to_inline"] else "**no**",
                ]
            )
    lo, hi = result["user_turn_tokens"]
    users = f"{lo}" if lo == hi else f"{lo}-{hi}"
    invocation = ("" if args.size == "medium" else f" --size {args.size}") + (
        "" if args.dtype == "float32" else f" --dtype {args.dtype}"
    )
    headers = [
        "streams",
        "request",
        "TTFT median ms",
        "TTFT p90 ms",
        "client TTFT median ms",
        "vs inline",
        "prefix reused",
        "tokens = inline",
    ]
    return "\n".join(
        [
            f"## Precompiled system prompts: time to first token, {args.size} model",
            "",
            f"`python benchmarks/prompts.py{invocation}` — a "
            f"{result['system_prompt_tokens']}-token system prompt plus a short user turn "
            f"({users} tokens with its chat-template markers), greedy, {MAX_TOKENS} tokens per "
            f"request; CPU backend, {result['model']}, {args.dtype}, default engine settings "
            "(torch threads: one per core). The same tokens are sent inline (token ids, to a "
            "second daemon with nothing registered and `engine.prefix_cache = false`), by "
            "`prompt_id`, and as a JSON chat whose `system` is the registered text, interleaved "
            f"round by round after a warm-up; {args.rounds} rounds at each concurrency. TTFT is "
            "the daemon's DONE `ttft_us` (request received to first TOKEN written); client TTFT "
            'adds the loopback round trip. "tokens = inline" checks every registered answer '
            "against the inline one. " + SIZE_NOTES[args.size],
            "",
            table(headers, rows),
            "",
            machine_line(m),
        ]
    )


def main() -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--size",
        choices=sorted(ROUNDS),
        default="medium",
        help="medium (the 124M checkpoint of benchmarks/engine.py), smollm2 (the default "
        "model, real weights) or the built-in model",
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rounds", type=int, help="rounds per concurrency (default: by --size)")
    ap.add_argument("--data-dir", default="", help="where generated checkpoints are cached")
    args = ap.parse_args()
    args.rounds = args.rounds or ROUNDS[args.size]
    if args.size == "medium":
        from benchmarks.engine import ensure_medium, parameter_count
        from zerolayer.models.hf_tokenizer import HFTokenizer

        directory = ensure_medium(args.data_dir)
        work = Workload(HFTokenizer(directory), word_level=True)
        model = {"path": str(directory), "dtype": args.dtype}
        name = f"`{directory.name}`"
    elif args.size == "smollm2":
        from benchmarks.engine import parameter_count
        from zerolayer.models.bundled import smollm2_gguf
        from zerolayer.models.gguf_import import ensure_converted
        from zerolayer.models.hf_tokenizer import HFTokenizer

        directory = ensure_converted(smollm2_gguf(), args.data_dir)
        work = Workload(HFTokenizer(directory), word_level=False, subword=True)
        data_dir = str(directory.parent.parent)
        model = {"path": SMOLLM2_MODEL, "data_dir": data_dir, "dtype": args.dtype}
        name = "SmolLM2-135M-Instruct (the default model, `@smollm2`)"
    else:
        from zerolayer.models.builtin import ensure_builtin

        directory = ensure_builtin(args.data_dir)
        work = Workload(ByteTokenizer(), word_level=False)
        model = {"path": BUILTIN_MODEL, "data_dir": str(directory.parent), "dtype": args.dtype}
        name = "the built-in model (byte tokenizer)"
    params = parameter_count(directory) if args.size != "builtin" else None
    system = work.system_prompt()
    with tempfile.TemporaryDirectory() as tmp:
        config = config_file(Path(tmp), system, model)
        env = {"LOGGING__LEVEL": "warning", "ENGINE__BACKEND": "cpu"}
        # The inline baseline: the same engine settings as config_file's, nothing reused.
        plain = {**env, "ENGINE__PREFIX_CACHE": "false", "SERVER__IDLE_TIMEOUT_S": "600",
                 "ENGINE__MAX_BATCH_SIZE": "16", "ENGINE__MAX_CONTEXT": "2048",
                 "CACHE__ENABLED": "false"}  # fmt: skip
        plain.update({f"MODEL__{k.upper()}": v for k, v in model.items()})
        env["SERVER__IDLE_TIMEOUT_S"] = "600"  # a connection waits while the other daemon works
        with Daemon(env, config=config) as daemon, Daemon(plain) as inline:
            endpoints = {"registered": daemon.endpoint, "inline": inline.endpoint}
            samples = asyncio.run(measure(endpoints, work, system, args.rounds))
    result = summarise(samples, work, system)
    result["model"] = name if params is None else f"{name} ({params / 1e6:.0f}M parameters)"
    m = machine()
    report = {"machine": m, "rounds": args.rounds, "size": args.size, "dtype": args.dtype, **result}
    text = markdown(result, m, args)
    publish(args, f"prompts-{args.size}", report, text)
    bad = [
        (c, mode)
        for c, row in result["runs"].items()
        for mode, r in row.items()
        if not r["identical_to_inline"]
        or r["prefix_reused"] != (0 if mode == "inline" else r["requests"])
    ]
    if bad:
        print(f"registered answers differ from inline or missed the prefix: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
