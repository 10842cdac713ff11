"""The block kernel's bytes per second, 8-bit activations against float ones (issue #38 item 3).

For each block type, one Llama-3-8B-sized matrix (14,336 x 4,096) of random blocks (finite
scales), two copies used in turn so that together they exceed the last-level cache and the
weights come from memory; the product x @ W.T at 1, 8 and 32 input rows through both paths of
``zerolayer.kernels.qmatmul`` (``QWeight.int8`` False / True), **interleaved**: each round times
one call of every (path, rows) pair in turn, so load that comes and goes falls on both paths
alike. One thread (torch.set_num_threads(1)). Figures: the median over the rounds as GB/s of
the matrix's bytes, and that as a fraction of the machine's read bandwidth measured the same
way as ``benchmarks/roofline.py`` (the sum of 1 GiB float32, one thread), with the 1-minute
load average beside every figure.

    python benchmarks/q8kernel.py [--rounds 7] [--write]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support import kquants  # noqa: E402
from benchmarks.roofline import bandwidth_gbs  # noqa: E402
from zerolayer.cachedir import data_root  # noqa: E402
from zerolayer.kernels import qmatmul  # noqa: E402
from zerolayer.kernels.qmatmul import QWeight  # noqa: E402

N, K = 14336, 4096
ROWS = (1, 8, 32)
KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1")
SCALE_BYTES = {"Q6_K": (208, 210)}  # where a block's float16 scales are (else bytes 0..3)


def random_weight(kind: str, seed: int) -> QWeight:
    """[N, K] random blocks with finite float16 scales (the values do not change the time)."""
    if kind in kquants.BYTES:
        raw = kquants.random_blocks(kind, N, K // 256, seed)
    else:
        size = qmatmul.BLOCK_BYTES[kind]
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, (N * K // 32, size), dtype=np.uint8)
        raw[:, 0:4] = rng.uniform(-0.01, 0.01, (len(raw), 2)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(N, K // 32 * size)
    return QWeight(torch.from_numpy(raw), kind)


def measure(kind: str, rounds: int) -> dict:
    copies = [random_weight(kind, seed) for seed in (1, 2)]
    paths = {"float": copies, "int8": [w.with_int8(True) for w in copies]}
    inputs = {m: torch.randn(m, K) for m in ROWS}
    for ws in paths.values():  # warm: first touches, the thread team
        for w in ws:
            w(inputs[1])
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in paths for m in ROWS}
    loads = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for m in ROWS:
            for path, ws in paths.items():
                w = ws[r % 2]
                t0 = time.perf_counter()
                w(inputs[m])
                times[(path, m)].append(time.perf_counter() - t0)
    nbytes = copies[0].blocks.numel()
    out = {"kind": kind, "bytes": nbytes, "load_1m": [min(loads), max(loads)], "rows": {}}
    for m in ROWS:
        row = {}
        for path in paths:
            seconds = statistics.median(times[(path, m)])
            row[path] = {"ms": seconds * 1e3, "gbs": nbytes / seconds / 1e9}
        out["rows"][str(m)] = row
    return out


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    reason = qmatmul.build(data_root("") / "kernels")
    if reason is not None:
        sys.exit(f"the block kernel cannot be built: {reason}")
    load_before = os.getloadavg()[0]
    bandwidth = bandwidth_gbs()
    results = [measure(kind, args.rounds) for kind in KINDS]
    info = machine()
    data = {
        "machine": info,
        "threads": 1,
        "shape": [N, K],
        "rounds": args.rounds,
        "bandwidth_gbs": bandwidth,
        "bandwidth_load_1m": load_before,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "results": results,
    }
    rows = []
    for r in results:
        load = "{:.1f}-{:.1f}".format(*r["load_1m"])
        for m in ROWS:
            f, q = r["rows"][str(m)]["float"], r["rows"][str(m)]["int8"]
            rows.append(
                [r["kind"], m, f"{f['ms']:.1f}", f"{q['ms']:.1f}", f"{f['gbs']:.2f}"]
                + [f"{q['gbs']:.2f}", f"{f['ms'] / q['ms']:.2f}x"]
                + [f"{q['gbs'] / bandwidth:.0%}", load]
            )
    markdown = "\n".join(
        [
            "## Block kernel: 8-bit activations against float ones (`benchmarks/q8kernel.py`)",
            "",
            f"One {N:,} x {K:,} matrix per block type (random blocks, two copies in turn: from "
            f"memory), x @ W.T at 1, 8 and 32 rows, 1 thread, {args.rounds} interleaved rounds, "
            f"medians; {data['capability']} code. GB/s = the matrix's bytes / time; roofline = "
            f"the measured read bandwidth, {bandwidth:.1f} GB/s (1 thread, sum of 1 GiB "
            f"float32, load {load_before:.1f}). The machine is shared: the 1-minute load "
            "average over each type's rounds is beside its figures.",
            "",
            table(
                ["type", "rows", "float ms", "int8 ms", "float GB/s", "int8 GB/s"]
                + ["int8 speed-up", "int8 / roofline", "load"],
                rows,
            ),
            "",
            machine_line(info),
        ]
    )
    publish(args, "q8kernel", data, markdown)


if __name__ == "__main__":
    main()
