"""How serving cost grows with the model: random-weight Qwen2-shaped models of about 0.5B and 1.5B
parameters, written as Q4_K_M-style GGUF files at benchmark time, served by ZeroLayer and, beside
it on the same files, by llama.cpp's ``llama-server`` (when its binary is found), each with 2
threads (``--threads``: 1 leaves a core to whatever else runs). The same load client
(``zerolayer bench``, OpenAI completions over HTTP, ``ignore_eos``: raw prompts, no chat
template — a base model's file has none, and two servers' templates differ) sends the same
random prompts to both at 1, 8 and 32 concurrent streams; the servers take turns (interleaved
rounds), one server running at a time.

Shapes: "0.5b" is Qwen2.5-0.5B's (24 layers, 14 heads / 2 key-value heads, MLP 4864, vocabulary
151,936, tied head) with hidden size 1024 and 16 heads of 64 instead of 896 and 14: 896 is not a
multiple of the 256-weight K-quant super-block, so its matrices could not be Q4_K. "1.5b" is
Qwen2.5-1.5B's (28 layers, hidden 1536, 12 / 2 heads of 128, MLP 8960). Q4_K_M-style: Q4_K
matrices, Q6_K v_proj and token embedding (the tied output head), ffn_down Q6_K on the first and
last quarter of the layers. The weights are random (one random matrix per shape, reused by every
layer: the same bytes a step reads); the vocabulary is a byte-level BPE one padded with plain
tokens. The files go to ``--cache-dir`` (not the repository) and are reused by later runs.
``--sizes`` also takes a named real model installed by make (``@gemma3-270m`` after ``make
install-gemma``, ``@smollm2``), served from its own file by both servers.

Per server and stream count: output tokens/s, median TTFT and TPOT (``zerolayer bench``'s
report), and the server's peak RSS (VmHWM, after the run). Public interfaces only: the daemons
are subprocesses, the client is the ``zerolayer bench`` command.

    python benchmarks/scale.py [--sizes 0.5b,1.5b,@gemma3-270m] [--streams 1,8,32] [--rounds 1]
        [--llama-server PATH] [--cache-dir DIR] [--write]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import ROOT, machine, machine_line, parser, publish, table  # noqa: E402
from benchmarks._support import kquants  # noqa: E402
from benchmarks._support.peers import (  # noqa: E402
    THREADS,
    Server,
    bench,
    find_llama_server,
    measured,
    running,
    start_llama,
    start_zerolayer,
)

DTYPE = "float32"
CONTEXT = 512  # per stream
MAX_STREAMS = 32


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 151936

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "0.5b": Shape(layers=24, hidden=1024, heads=16, kv_heads=2, intermediate=4864),
    "1.5b": Shape(layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960),
}


def parameters(path: Path) -> int:
    """The weights a GGUF file holds (every tensor's element count)."""
    import gguf

    return sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)


def model_file(size: str, cache: Path) -> Path:
    """A size of SHAPES (written into ``cache`` on first use) or a named real model's file
    (``@gemma3-270m``, ``@smollm2``: installed by make, never downloaded here)."""
    if size.startswith("@"):
        from zerolayer.models.bundled import named_gguf

        return named_gguf(size)[0]
    path = cache / f"scale-{size}-q4_k_m.gguf"
    if not path.is_file():
        t = time.monotonic()
        write_model(SHAPES[size], path)
        print(f"wrote {path} in {time.monotonic() - t:.0f} s", file=sys.stderr)
    return path


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M gives ffn_down Q6_K on some layers; here the first and last quarter."""
    return layer < layers // 4 or layer >= layers - layers // 4


def write_model(shape: Shape, path: Path) -> None:
    """A Q4_K_M-style qwen2 GGUF of ``shape`` with random weights."""
    import gguf
    from tokenizers import pre_tokenizers

    rng = np.random.default_rng(0)
    blocks: dict[tuple[str, int, int], np.ndarray] = {}

    def quantized(kind: str, rows: int, cols: int) -> np.ndarray:
        if (kind, rows, cols) not in blocks:  # one random matrix per shape and kind
            w = (rng.standard_normal((min(rows, 4096), cols)) * 0.02).astype(np.float32)
            q = kquants.quantize(w, kind)
            blocks[kind, rows, cols] = np.ascontiguousarray(np.resize(q, (rows, q.shape[1])))
        return blocks[kind, rows, cols]

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = special + alphabet + [m.replace(" ", "") for m in merges]
    tokens += [f"tok{i}" for i in range(shape.vocab - len(tokens))]  # plain, never merged into
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(shape.layers)
    w.add_context_length(32768)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(special) + [1] * (len(tokens) - len(special)))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim

    def matrix(name: str, kind: gguf.GGMLQuantizationType, rows: int, cols: int) -> None:
        w.add_tensor(name, quantized(kind.name, rows, cols), raw_dtype=kind)

    def vector(name: str, n: int, scale: float, base: float = 0.0) -> None:
        w.add_tensor(name, (base + rng.standard_normal(n) * scale).astype(np.float32))

    matrix("token_embd.weight", q6, shape.vocab, h)
    vector("output_norm.weight", h, 0.05, 1.0)
    for i in range(shape.layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", h, 0.05, 1.0)
        vector(p + "ffn_norm.weight", h, 0.05, 1.0)
        matrix(p + "attn_q.weight", q4, h, h)
        vector(p + "attn_q.bias", h, 0.02)
        matrix(p + "attn_k.weight", q4, kv, h)
        vector(p + "attn_k.bias", kv, 0.02)
        matrix(p + "attn_v.weight", q6, kv, h)
        vector(p + "attn_v.bias", kv, 0.02)
        matrix(p + "attn_output.weight", q4, h, h)
        matrix(p + "ffn_gate.weight", q4, shape.intermediate, h)
        matrix(p + "ffn_up.weight", q4, shape.intermediate, h)
        down = q6 if _more_bits(i, shape.layers) else q4
        matrix(p + "ffn_down.weight", down, h, shape.intermediate)
    tmp = path.with_suffix(".tmp")
    w.path = tmp  # written whole, then renamed: a killed run leaves no half file under the name
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def main() -> None:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.5b,1.5b", help="SHAPES' sizes and named real models")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per stream count")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--llama-server", default=None, metavar="PATH")
    ap.add_argument("--threads", type=int, default=THREADS, help="each server's")
    ap.add_argument(
        "--cache-dir",
        default=str(Path(tempfile.gettempdir()) / "zerolayer-scale"),
        help="model files and ZeroLayer's conversions (reused by later runs)",
    )
    args = ap.parse_args()
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    binary, skipped = find_llama_server(args.llama_server)
    streams = [int(s) for s in args.streams.split(",")]
    started = machine()
    results: dict = {"machine": started, "threads": args.threads, "dtype": DTYPE, "sizes": {}}
    results["peers"] = {"llama-server": binary or f"skipped: {skipped}"}
    rows = []
    for size in args.sizes.split(","):
        path = model_file(size, cache)
        weights = parameters(path)
        entry: dict = {"parameters": weights, "file_mib": path.stat().st_size >> 20}
        servers: list[Server] = []
        try:
            data = {"ZEROLAYER_MODEL__DATA_DIR": str(cache / "data")}
            data["ZEROLAYER_MODEL__DTYPE"] = DTYPE
            t = time.monotonic()
            log = cache / f"zerolayer-{size}.log"
            servers.append(
                start_zerolayer(
                    path, log, streams=MAX_STREAMS, context=CONTEXT, env=data, threads=args.threads
                )
            )
            entry["zerolayer_start_s"] = time.monotonic() - t
            if binary:
                log = cache / f"llama-{size}.log"
                servers.append(
                    start_llama(binary, path, log, streams=MAX_STREAMS, context=CONTEXT,
                                threads=args.threads)
                )  # fmt: skip
        except BaseException:
            for s in servers:
                s.stop()
            raise
        runs: dict = {s.name: {str(n): [] for n in streams} for s in servers}
        with running(servers):  # neither is timed while the other one is busy
            for _ in range(args.rounds):
                for n in streams:
                    for s in servers:
                        with measured(s):
                            out = cache / f"{s.name}-{size}-{n}.json"
                            runs[s.name][str(n)].append(
                                bench(s, out, streams=n, requests=2 * n, input_len=args.input_len,
                                      output_len=args.output_len)
                            )  # fmt: skip
        entry["runs"] = runs
        results["sizes"][size] = entry
        for name, by_streams in entry["runs"].items():
            for n, rs in by_streams.items():
                best = max(rs, key=lambda r: r["output_tokens_per_s"])
                rows.append(
                    [
                        size,
                        f"{weights / 1e9:.2f}B",
                        name,
                        n,
                        f"{best['output_tokens_per_s']:.1f}",
                        f"{best['median_ttft_ms']:.0f}",
                        f"{best['median_tpot_ms']:.0f}",
                        f"{max(r['peak_rss_mib'] for r in rs):.0f}",
                        f"{best['load_average_1m']:.1f}",
                    ]
                )
    headers = ["model", "params", "server", "streams", "output tok/s", "TTFT ms (median)"]
    headers += ["TPOT ms (median)", "peak RSS MiB", "load (1 min)"]
    peer = f"llama-server: {binary}" if binary else f"llama-server skipped: {skipped}"
    markdown = "\n".join(
        [
            "## Scale: random-weight Q4_K_M-style models, ZeroLayer beside llama-server",
            "",
            f"`benchmarks/scale.py`: {args.input_len}-token random prompts, "
            f"{args.output_len} output tokens (EOS ignored), {args.rounds} interleaved round(s); "
            f"ZeroLayer {DTYPE}, {args.threads} thread(s) each; {peer}. The best round is shown; "
            "peak "
            "RSS is the process's VmHWM. The machine is shared with other jobs: the load "
            "column is the 1-minute load average after each run.",
            "",
            table(headers, rows),
            "",
            machine_line(started),
        ]
    )
    publish(args, "scale", results, markdown)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
