"""What logprobs cost: 64 streams with ``top_logprobs: 20`` against the same streams plain.

Issue #40 item 3: ``top_logprobs`` should cost at most 2x plain in wall time, loaded or not.
Each round runs, on each source tree given (``--tree``; the first is "after", any other a
baseline checkout, e.g. ``git archive <commit> | tar -x -C /tmp/base``), the plain run then the
logprobs run, rounds interleaved so that the load of the shared machine falls on all alike.
Greedy (temperature 0), so both runs of a tree produce the same tokens; frame door, protocol v2,
8 connections. Loopback only.

    python benchmarks/logprobs_cost.py [--model @smollm2] [--streams 64] [--tokens 300]
        [--rounds 3] [--tree /tmp/base] [--write]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support.daemon import ROOT, Daemon  # noqa: E402
from zerolayer.client import Client  # noqa: E402

CONNECTIONS = 8


async def run(url: str, streams: int, tokens: int, top: int | None) -> tuple[float, int]:
    """Wall seconds for ``streams`` streams of ``tokens`` tokens, and the tokens received."""
    clients = [await Client.connect(url, b"") for _ in range(CONNECTIONS)]
    options: dict = {"temperature": 0.0, "cache": False}
    if top is not None:
        options |= {"logprobs": True, "top_logprobs": top}
    t0 = time.perf_counter()

    async def one(i: int) -> int:
        stream = await clients[i % CONNECTIONS].generate(
            [5 + i % 50, 6, 7], tokens, text=False, **options
        )
        result = await stream.collect()
        if top is not None:
            assert len(result.logprobs) == result.completion_tokens
        return result.completion_tokens

    got = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return wall, sum(got)


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic", help="synthetic, or a model.path (cpu)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", action="append", default=[], help="a baseline source tree")
    args = ap.parse_args()
    env = {"ENGINE__MAX_BATCH_SIZE": str(args.streams), "CACHE__ENABLED": "false"}
    if args.model != "synthetic":
        # a KV cache for the streams alone (64 x 512 positions of SmolLM2: 1.5 GB per daemon)
        env |= {"ENGINE__BACKEND": "cpu", "MODEL__PATH": args.model, "ENGINE__MAX_CONTEXT": "512"}
    trees = [ROOT, *map(Path, args.tree)]
    names = ["this tree", *(str(t) for t in args.tree)]
    walls: dict[str, dict[str, list[float]]] = {n: {"plain": [], "top20": []} for n in names}
    loads: list[float] = []
    daemons = [
        Daemon(env, raw_env={"PYTHONPATH": str(tree / "gateway")}, root=tree) for tree in trees
    ]
    try:
        for d in daemons:
            d.__enter__()
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, d in zip(names, daemons, strict=True):
                url = f"tcp://{d.host}:{d.port}"
                for variant, top in (("plain", None), ("top20", 20)):
                    wall, _ = asyncio.run(run(url, args.streams, args.tokens, top))
                    walls[name][variant].append(wall)
                    print(f"{name} {variant}: {wall:.2f} s", file=sys.stderr)
    finally:
        for d in daemons:
            d.__exit__(None, None, None)
    rows = []
    for name in names:
        plain = statistics.median(walls[name]["plain"])
        top20 = statistics.median(walls[name]["top20"])
        rows.append([name, f"{plain:.2f} s", f"{top20:.2f} s", f"{top20 / plain:.2f}x"])
    m = machine()
    result = {"args": vars(args) | {"tree": args.tree}, "walls": walls, "load_1m": loads,
              "machine": m}  # fmt: skip
    md = (
        "## logprobs at 64 streams: top_logprobs 20 against plain\n\n"
        f"`python benchmarks/logprobs_cost.py --model {args.model} --streams {args.streams} "
        f"--tokens {args.tokens} --rounds {args.rounds}` — {args.streams} greedy streams of "
        f"{args.tokens} tokens on the frame door, plain then with `top_logprobs: 20`, rounds "
        f"interleaved across the trees; medians. 1-minute load average at each round: "
        + ", ".join(f"{x:.1f}" for x in loads)
        + ".\n\n"
        + table(["tree", "plain", "top_logprobs 20", "ratio"], rows)
        + "\n\n"
        + machine_line(m)
        + "\n"
    )
    publish(args, f"logprobs_cost_{args.model.strip('@')}", result, md)


if __name__ == "__main__":
    main()
