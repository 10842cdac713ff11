"""How far the 8-bit-activation products move a model from the float path (issue #38 item 3),
in the terms of llama.cpp's perplexity tool (``--kl-divergence``).

A fixed text (``benchmarks/_support/kl_text.txt``, project-written prose) is tokenized and cut
into chunks of ``--chunk`` tokens; each chunk is fed from position 0 in forwards of as many
tokens as the model computes on its GGUF blocks (``Decoder.blocks_max_rows``: 64 in float32),
once with float activations (``model.kernel = "float"``: the dense model's weights exactly) and
once with 8-bit ones, each path with its own cache. For every position but a chunk's last, the
next-token distributions of the two paths give (float64): KL(p_float || p_int8), whether the top
token agrees, the probability and log-probability each gives to the text's actual next token.
Reported as llama.cpp reports them: mean KLD ± its standard error, median, 99th percentile and
maximum, "same top p" (%), RMS Δp of the next token (%), ln(PPL(int8) / PPL(float)).

Real files only (random weights give near-uniform logits): ``@smollm2`` (Q4_1 / Q8_0 blocks)
and ``@gemma3-270m`` (Q4_K_M: Q4_K, Q6_K, and Q8_0 / Q5_0 where the file says) when installed.

    python benchmarks/kl.py [--model @smollm2 --model @gemma3-270m] [--chunk 256] [--write]
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._report import machine, machine_line, parser, publish, table  # noqa: E402
from zerolayer.config.settings import ModelConfig  # noqa: E402
from zerolayer.kernels import qmatmul  # noqa: E402
from zerolayer.models.decoder import Decoder, KVCache  # noqa: E402
from zerolayer.models.loader import LoadedModel, load_model  # noqa: E402

TEXT = Path(__file__).parent / "_support" / "kl_text.txt"
# llama.cpp's perplexity README, Llama 3 8B against FP16 (wikitext-2, CUDA): the bounds.
LLAMA_CPP = {
    "Q4_K_M": {"kld": 0.031273, "same_top": 91.90},
    "Q8_0": {"kld": 0.001355, "same_top": 97.67},
}


def chunk_logits(model: Decoder, tokens: torch.Tensor, int8: bool) -> torch.Tensor:
    """[n, vocab] float32 logits of one chunk fed from position 0, in forwards of at most
    ``model.blocks_max_rows`` tokens and of the kernel's ``MAX_ROWS`` (more rows go through
    dequantized tiles), so every product runs on the blocks with the activations asked for."""
    model.use_int8_activations(int8)
    step = min(model.blocks_max_rows, qmatmul.MAX_ROWS[model.rope_cos.dtype])
    if step <= 0:
        raise ValueError("the model computes on no GGUF blocks (no kernel, or not a GGUF)")
    cache = KVCache.allocate(model.cfg, 1, len(tokens), model.rope_cos.dtype)
    parts = [
        model.prefill(tokens[s : s + step], s, 0, cache, all_logits=True)
        for s in range(0, len(tokens), step)
    ]
    return torch.cat(parts).float()


def token_stats(loaded: LoadedModel, text: str, chunk: int, chunks: int | None = None) -> dict:
    """Per-position figures of the int8 path against the float path over ``text``."""
    ids = loaded.tokenizer.encode(text)
    count = len(ids) // chunk if chunks is None else min(chunks, len(ids) // chunk)
    if count == 0:
        raise ValueError(f"{len(ids)} tokens make no chunk of {chunk}")
    kld, same, dp, lp_f, lp_q = [], [], [], [], []
    with torch.inference_mode():
        for c in range(count):
            tokens = torch.tensor(ids[c * chunk : (c + 1) * chunk], dtype=torch.int64)
            f = torch.log_softmax(chunk_logits(loaded.model, tokens, False).double(), -1)[:-1]
            q = torch.log_softmax(chunk_logits(loaded.model, tokens, True).double(), -1)[:-1]
            nxt = tokens[1:, None]
            kld.append((f.exp() * (f - q)).sum(-1))
            same.append(f.argmax(-1) == q.argmax(-1))
            lf, lq = f.gather(1, nxt)[:, 0], q.gather(1, nxt)[:, 0]
            lp_f.append(lf)
            lp_q.append(lq)
            dp.append(lq.exp() - lf.exp())
    loaded.model.use_int8_activations(False)
    k = torch.cat(kld).clamp_min(0.0)  # rounding can leave -1e-17
    n = len(k)
    return {
        "tokens": n,
        "chunks": count,
        "chunk": chunk,
        "kld_mean": float(k.mean()),
        "kld_se": float(k.std() / math.sqrt(n)),
        "kld_median": float(k.median()),
        "kld_p99": float(torch.quantile(k, 0.99)),
        "kld_max": float(k.max()),
        "same_top_pct": 100.0 * float(torch.cat(same).double().mean()),
        "rms_dp_pct": 100.0 * float(torch.cat(dp).pow(2).mean().sqrt()),
        "ln_ppl_ratio": float(torch.cat(lp_f).mean() - torch.cat(lp_q).mean()),
    }


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", help="repeatable; default @smollm2, @gemma3-270m")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--data-dir", default="", help="model.data_dir (default ~/.cache/zerolayer)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = TEXT.read_text()
    results = {}
    for name in args.model or ["@smollm2", "@gemma3-270m"]:
        cfg = ModelConfig(path=name, dtype=args.dtype, kernel="float", data_dir=args.data_dir)
        loaded = load_model(cfg, args.chunk)
        results[name] = token_stats(loaded, text, args.chunk)
        print(name, results[name], file=sys.stderr)
    info = machine()
    rows = [
        [name, r["tokens"], f"{r['kld_mean']:.6f} ± {r['kld_se']:.6f}", f"{r['kld_median']:.6f}"]
        + [f"{r['kld_p99']:.5f}", f"{r['kld_max']:.4f}", f"{r['same_top_pct']:.2f}%"]
        + [f"{r['rms_dp_pct']:.3f}%", f"{r['ln_ppl_ratio']:+.5f}"]
        for name, r in results.items()
    ]
    rows += [
        [f"llama.cpp: Llama 3 8B {kind} vs FP16", "wikitext-2", f"{b['kld']:.6f}"]
        + ["", "", "", f"{b['same_top']:.2f}%", "", ""]
        for kind, b in LLAMA_CPP.items()
    ]
    markdown = "\n".join(
        [
            "## Block kernel: 8-bit activations, KL divergence to the float path "
            "(`benchmarks/kl.py`)",
            "",
            f'The distance of `model.kernel = "int8"` to the float path (`"float"`: the dense '
            f"model's weights exactly), {args.dtype}, over the fixed text "
            f"`benchmarks/_support/kl_text.txt` in chunks of {args.chunk} tokens, every position "
            "but a chunk's last, as llama.cpp's perplexity tool reports it (`--kl-divergence`). "
            "The last rows are llama.cpp's own figures for whole quantized models against FP16 "
            "(its perplexity README): ours isolate the activations' rounding, on top of the "
            "file's own quantization which both paths share.",
            "",
            table(
                ["model", "tokens", "mean KLD", "median KLD", "99% KLD", "max KLD"]
                + ["same top", "RMS Δp", "ln(PPL int8 / PPL float)"],
                rows,
            ),
            "",
            machine_line(info),
        ]
    )
    publish(args, "kl", {"machine": info, "dtype": args.dtype, "results": results}, markdown)


if __name__ == "__main__":
    main()
