"""The machine's own limits for decoding a model (issue #28 item 1): memory bandwidth and the
best matrix-product throughput for the model's shapes, and the roofline they give per batch size.

Measured here, on the machine it runs on, with torch's CPU kernels (oneDNN/MKL) at the thread
count given:
- **bandwidth**: a stream-style read, the sum of a 1 GiB float32 tensor (larger than any cache),
  best of several passes, GB/s;
- **GEMM peak** for each of the model's weight shapes (q, k, v, o, gate, up, down, the output
  head) at 1, 8 and 32 rows, float32 and bfloat16: the best time of repeated ``x @ W.T``, summed
  over one decode step's products, as FLOP/s;
- **the roofline** per batch size b and dtype: a decode step reads every weight once (bytes) and
  does 2 × parameters × b FLOPs, so its time is at least max(bytes / bandwidth, FLOPs / GEMM
  peak at b rows); the limit in tokens/s is b over that. Attention over the KV cache and the
  small ops are left out: the limit is a ceiling, not an estimate;
- **blocks**: the same for a server that reads the GGUF file's own blocks (ZeroLayer's block
  kernel, llama.cpp): bytes = the file's matrices as stored (the output head: ``output.weight``,
  or the tied token embedding), FLOPs against the float32 GEMM peak.

The model's shapes come from its converted checkpoint (``zerolayer.models.gguf_import``), the
default model unless ``--model`` names another GGUF file.

    python benchmarks/roofline.py [--threads 2] [--model PATH] [--write]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from zerolayer.models.bundled import smollm2_gguf  # noqa: E402
from zerolayer.models.gguf_import import ensure_converted  # noqa: E402

ROWS = (1, 8, 32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # and "blocks": float32 GEMM


def shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """Each weight of one decode step as (out, in, count per step)."""
    h, inter, layers = (
        config["hidden_size"],
        config["intermediate_size"],
        config["num_hidden_layers"],
    )
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads") or config["num_attention_heads"],
    )
    hd = config.get("head_dim") or h // heads
    return {
        "q": (heads * hd, h, layers),
        "k": (kv * hd, h, layers),
        "v": (kv * hd, h, layers),
        "o": (h, heads * hd, layers),
        "gate": (inter, h, layers),
        "up": (inter, h, layers),
        "down": (h, inter, layers),
        "head": (config["vocab_size"], h, 1),
    }  # fmt: skip


def block_bytes(path: Path) -> int:
    """The bytes one decode step reads from a GGUF file's matrices as stored: every 2-D tensor,
    the token embedding only as the output head (when no ``output.weight`` is there)."""
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)  # one row of it is read a token
    return sum(int(t.n_bytes) for t in tensors.values())


def bandwidth_gbs(passes: int = 5) -> float:
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    x.sum()  # touch every page first
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def gemm_seconds(out: int, inp: int, rows: int, dtype: torch.dtype, reps: int) -> float:
    """Best time of ``x @ W.T`` for x [rows, inp], W [out, inp]."""
    w = torch.randn(out, inp).to(dtype)
    x = torch.randn(rows, inp).to(dtype)
    for _ in range(3):
        x @ w.T
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x @ w.T
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="", help="a GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else smollm2_gguf()
    config = json.loads((ensure_converted(model) / "config.json").read_text())
    weights = shapes(config)
    params = sum(o * i * n for o, i, n in weights.values())
    bw = bandwidth_gbs()
    out: dict = {
        "machine": machine(), "threads": args.threads, "model": model.name,
        "weight_parameters": params, "bandwidth_gbs": round(bw, 2), "by_dtype": {},
    }  # fmt: skip
    rows_md = []
    sizes = {name: params * torch.tensor([], dtype=d).element_size() for name, d in DTYPES.items()}
    sizes["blocks"] = block_bytes(model)
    steps: dict[tuple[torch.dtype, int], float] = {}
    for name, nbytes in sizes.items():
        dtype = DTYPES.get(name, torch.float32)
        per_rows = {}
        for b in ROWS:
            if (dtype, b) not in steps:  # "blocks" multiplies in float32: timed once
                steps[dtype, b] = sum(
                    n * gemm_seconds(o, i, b, dtype, args.reps) for o, i, n in weights.values()
                )
            step_s = steps[dtype, b]
            flops = 2 * params * b
            gemm_flops = flops / step_s
            bound_s = max(nbytes / (bw * 1e9), flops / gemm_flops)
            per_rows[b] = {
                "gemm_step_ms": round(step_s * 1000, 3),
                "gemm_gflops": round(gemm_flops / 1e9, 2),
                "bandwidth_step_ms": round(nbytes / (bw * 1e9) * 1000, 3),
                "limit_tokens_per_s": round(b / bound_s, 1),
                "bound_by": "bandwidth" if nbytes / (bw * 1e9) >= flops / gemm_flops else "gemm",
            }
            r = per_rows[b]
            rows_md.append([
                name, b, f"{nbytes / 1e6:.0f}", r["bandwidth_step_ms"], r["gemm_step_ms"],
                r["gemm_gflops"], r["limit_tokens_per_s"], r["bound_by"],
            ])  # fmt: skip
        out["by_dtype"][name] = {"weight_bytes": nbytes, "rows": per_rows}
    md = (
        f"### Roofline: the machine's limits for decoding {model.name}\n\n"
        f"{machine_line(out['machine']).removesuffix('.')}; torch {torch.__version__}, "
        f"{args.threads} threads. "
        f"Read bandwidth {bw:.1f} GB/s (sum of a 1 GiB float32 tensor, best of 5); "
        f"{params / 1e6:.1f}M weight parameters per decode step. GEMM: the best of "
        f"{args.reps} runs of each weight's product, summed over a step. The limit ignores "
        "attention and the small ops: a ceiling, not an estimate.\n\n"
        + table(
            [
                "dtype",
                "rows",
                "weight MB",
                "bandwidth ms/step",
                "GEMM ms/step",
                "GEMM GFLOP/s",
                "limit tok/s",
                "bound by",
            ],
            rows_md,
        )  # fmt: skip
    )
    publish(args, "roofline", out, md)


if __name__ == "__main__":
    main()
