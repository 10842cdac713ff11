"""Paged decode attention: the native kernel against a gather of the pages and SDPA (issue #38).

One decode step's attention for one layer with Llama-3-8B's heads (32 query heads on 8 kv heads
of 128), every row at 1,024 positions in pages of 16 drawn in shuffled order from one pool, at
B = 1, 8 and 32 rows, bfloat16 and float32 pages: ``zerolayer.kernels.attention``'s
``paged_decode_attention`` (read in place) against its ``reference`` (the pages gathered into
[B, kv, L, hd] by index_select, then torch's scaled_dot_product_attention, as the decoder
attends today). The pool holds 64 rows' pages and each round takes the next rows, so a step's
K/V come from memory, not from the last round's cache. Rounds are interleaved (each times one
call of every (dtype, B, path) in turn, so load that comes and goes falls on both paths);
figures are medians of wall time and of the process's CPU time (the machine is shared: CPU
time does not count waiting for a core), GB/s = the K/V bytes attended / the kernel's CPU
time, with the threads and the 1-minute load average beside them.

    python benchmarks/pattn.py [--rounds 7] [--threads 1] [--write]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from zerolayer.cachedir import data_root  # noqa: E402
from zerolayer.kernels import qmatmul  # noqa: E402
from zerolayer.kernels.attention import paged_decode_attention, reference  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128  # Llama-3-8B
POSITIONS, PAGE = 1024, 16
POOL_ROWS = 64
BATCHES = (1, 8, 32)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def pool(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V pages for POOL_ROWS rows of POSITIONS, and each row's table (shuffled pages)."""
    per_row = POSITIONS // PAGE
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(POOL_ROWS * per_row, generator=gen).to(torch.int32)
    shape = (POOL_ROWS * POSITIONS, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v, pages.view(POOL_ROWS, per_row)


def measure(rounds: int) -> list[dict]:
    scale = HEAD_DIM**-0.5
    paths = {"kernel": paged_decode_attention, "gather+sdpa": reference}
    caches = {name: pool(dtype) for name, dtype in DTYPES.items()}
    times: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    loads: list[float] = []
    for r in range(-1, rounds):  # round -1 warms up: first touches, the thread team
        loads.append(os.getloadavg()[0])
        for name, (k, v, tables) in caches.items():
            for batch in BATCHES:
                first = (max(r, 0) * batch) % POOL_ROWS
                rows = torch.arange(first, first + batch) % POOL_ROWS
                q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM)
                lens = torch.full((batch,), POSITIONS, dtype=torch.int32)
                t = tables.index_select(0, rows)
                for path, f in paths.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    f(q, k, v, t, lens, PAGE, scale)
                    spent = (time.perf_counter() - w0, time.process_time() - c0)
                    if r >= 0:
                        times.setdefault((name, batch, path), []).append(spent)
    results = []
    for (name, batch, path), spent in times.items():
        wall = statistics.median(s[0] for s in spent)
        cpu = statistics.median(s[1] for s in spent)
        nbytes = 2 * batch * POSITIONS * KV_HEADS * HEAD_DIM * DTYPES[name].itemsize
        results.append(
            {"dtype": name, "batch": batch, "path": path, "wall_ms": wall * 1e3}
            | {"cpu_ms": cpu * 1e3, "kv_bytes": nbytes, "gbs": nbytes / wall / 1e9}
        )
    return [{"load_1m": [min(loads), max(loads)]}, *results]


def render(data: dict) -> str:
    """The docs section of a run's results (``data`` as written to results/pattn.json)."""
    by = {(r["dtype"], r["batch"], r["path"]): r for r in data["results"]}
    rows = []
    for name in DTYPES:
        for batch in BATCHES:
            kern, ref = by[(name, batch, "kernel")], by[(name, batch, "gather+sdpa")]
            rows.append(
                [name, batch, f"{kern['wall_ms']:.2f}", f"{ref['wall_ms']:.2f}"]
                + [f"{kern['cpu_ms']:.2f}", f"{ref['cpu_ms']:.2f}"]
                + [f"{kern['kv_bytes'] / kern['cpu_ms'] / 1e6:.2f}"]
                + [
                    f"{ref['wall_ms'] / kern['wall_ms']:.1f}x",
                    f"{ref['cpu_ms'] / kern['cpu_ms']:.1f}x",
                ]
            )
    load = "{:.1f}-{:.1f}".format(*data["load_1m"])
    return "\n".join(
        [
            "## Paged decode attention: the kernel against gather + SDPA (`benchmarks/pattn.py`)",
            "",
            f"One layer's decode attention, Llama-3-8B heads ({KV_HEADS * GROUP} query heads on "
            f"{KV_HEADS} kv heads of {HEAD_DIM}), every row at {POSITIONS:,} positions in "
            f"shuffled pages of {PAGE} (a pool of {POOL_ROWS} rows, the next rows each round: "
            f"from memory); {data['threads']} thread(s), {data['rounds']} interleaved rounds, "
            f"medians; {data['capability']} code; 1-minute load {load} over the run. On a "
            "shared machine a call's wall time includes waiting for a core, its CPU time does "
            "not: GB/s = the K/V bytes attended / the kernel's CPU time; speed-ups = gather + "
            "SDPA's time / the kernel's, wall and CPU.",
            "",
            table(
                ["pages", "B", "kernel ms", "gather+SDPA ms", "kernel CPU ms"]
                + ["gather+SDPA CPU ms", "kernel GB/s (CPU)", "speed-up (wall)"]
                + ["speed-up (CPU)"],
                rows,
            ),
            "",
            machine_line(data["machine"]),
        ]
    )


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reason = qmatmul.build(data_root("") / "kernels")
    if reason is not None:
        sys.exit(f"the kernel library cannot be built: {reason}")
    header, *results = measure(args.rounds)
    data = {
        "machine": machine(),
        "threads": args.threads,
        "shape": {"kv_heads": KV_HEADS, "group": GROUP, "head_dim": HEAD_DIM}
        | {"positions": POSITIONS, "page": PAGE},
        "rounds": args.rounds,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "load_1m": header["load_1m"],
        "results": results,
    }
    markdown = render(data)
    publish(args, "pattn", data, markdown)


if __name__ == "__main__":
    main()
