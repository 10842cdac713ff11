"""Llama-shaped GGUF files with random weights in llama.cpp's Q4_K_M type mix, written at
benchmark time (benchmarks/scale.py): the shapes of Llama-3.2-1B, Llama-3.2-3B and
Llama-3.1-8B, so both servers read the bytes a real file of that size makes them read.

The type of each tensor follows ``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``
for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``: Q4_K by default; ``attn_v`` and ``ffn_down`` Q6_K on the
layers ``use_more_bits`` picks (the first and last eighth, and every third layer between); the
output head Q6_K, which is the token embedding when the model ties it (no ``output.weight``);
an untied token embedding keeps Q4_K; norms float32. The weights are random: one random matrix
per shape and type, reused by every layer (the bytes a step reads are the same as distinct
matrices'; the values do not matter to a random model). The vocabulary is a byte-level BPE one
(llama.cpp's ``llama-bpe`` pre-tokenizer) padded with plain tokens that no merge produces, and
Llama 3's 256 control tokens at its end; no BOS is added, so a prompt sent as token ids is
served as exactly those ids by every server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks._support import kquants

SPECIAL_TOKENS = 256  # Llama 3 keeps its control tokens at the end of the vocabulary


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes; ``tied``: no ``output.weight``, the token embedding is the head."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    rope_theta: float = 500000.0


SHAPES = {
    "1b": Shape(16, 2048, 32, 8, 64, 8192, 128256, tied=True),  # Llama-3.2-1B
    "3b": Shape(28, 3072, 24, 8, 128, 8192, 128256, tied=True),  # Llama-3.2-3B
    "8b": Shape(32, 4096, 32, 8, 128, 14336, 128256, tied=False),  # Llama-3.1-8B
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, shape: Shape) -> str:
    """The type llama.cpp's Q4_K_M gives the tensor ``name`` of a model of ``shape``."""
    if name.endswith("norm.weight") or name == "rope_freqs.weight":
        return "F32"
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if use_more_bits(layer, shape.layers) else "Q4_K"
    return "Q4_K"


def llama3_rope_factors(shape: Shape, factor: float = 32.0) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for ``rope_type: llama3``
    (Llama-3.2's settings: factor 32, low 1, high 4, 8,192 original positions): one divisor per
    frequency pair."""
    low, high, original = 1.0, 4.0, 8192
    pairs = np.arange(0, shape.head_dim, 2, dtype=np.float64)
    freqs = shape.rope_theta ** -(pairs / shape.head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _base_tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return alphabet + [m.replace(" ", "") for m in _MERGES]


_MERGES = ["Ġ t", "h e", "Ġt he"]


def write_model(shape: Shape, path: Path, *, rope_freqs: bool = False, seed: int = 0) -> None:
    """A Q4_K_M llama GGUF of ``shape`` with random weights at ``path`` (written under a
    temporary name, then renamed: a killed run leaves no half file under the name).
    ``rope_freqs``: also write Llama 3's per-frequency rope divisors, as real files carry."""
    import gguf

    rng = np.random.default_rng(seed)
    blocks: dict[tuple[str, int, int], np.ndarray] = {}

    def quantized(kind: str, rows: int, cols: int) -> np.ndarray:
        if (kind, rows, cols) not in blocks:  # one random matrix per shape and type
            w = (rng.standard_normal((min(rows, 4096), cols)) * 0.02).astype(np.float32)
            q = kquants.quantize(w, kind)
            blocks[kind, rows, cols] = np.ascontiguousarray(np.resize(q, (rows, q.shape[1])))
        return blocks[kind, rows, cols]

    tokens = _base_tokens()
    tokens += [f"tok{i}" for i in range(shape.vocab - SPECIAL_TOKENS - len(tokens))]
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    special += [f"<|reserved_special_token_{i}|>" for i in range(SPECIAL_TOKENS - len(special))]
    bos = len(tokens)
    tokens += special
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(shape.layers)
    w.add_context_length(131072)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - SPECIAL_TOKENS) + [3] * SPECIAL_TOKENS)
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(bos + 1)
    w.add_add_bos_token(False)  # prompts are sent as ids: both servers take them as they are
    w.add_chat_template(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    h, q_rows, kv_rows = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim

    def matrix(name: str, rows: int, cols: int) -> None:
        kind = q4_k_m_type(name, shape)
        w.add_tensor(name, quantized(kind, rows, cols), raw_dtype=gguf.GGMLQuantizationType[kind])

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + rng.standard_normal(h) * 0.05).astype(np.float32))

    matrix("token_embd.weight", shape.vocab, h)
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(shape))
    norm("output_norm.weight")
    if not shape.tied:
        matrix("output.weight", shape.vocab, h)
    for i in range(shape.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        matrix(p + "attn_q.weight", q_rows, h)
        matrix(p + "attn_k.weight", kv_rows, h)
        matrix(p + "attn_v.weight", kv_rows, h)
        matrix(p + "attn_output.weight", h, q_rows)
        matrix(p + "ffn_gate.weight", shape.intermediate, h)
        matrix(p + "ffn_up.weight", shape.intermediate, h)
        matrix(p + "ffn_down.weight", h, shape.intermediate)
    tmp = path.with_suffix(".tmp")
    w.path = tmp
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def file_bytes(shape: Shape) -> int:
    """About the bytes ``write_model`` writes for ``shape`` (its matrices; the rest is small):
    to check the disk and memory before writing or loading a file."""
    per = {"Q4_K": 144, "Q6_K": 210}
    h, q_rows = shape.hidden, shape.heads * shape.head_dim
    kv_rows = shape.kv_heads * shape.head_dim
    sizes = [("token_embd.weight", shape.vocab, h)]
    if not shape.tied:
        sizes.append(("output.weight", shape.vocab, h))
    for i in range(shape.layers):
        p = f"blk.{i}."
        sizes += [
            (p + "attn_q.weight", q_rows, h), (p + "attn_k.weight", kv_rows, h),
            (p + "attn_v.weight", kv_rows, h), (p + "attn_output.weight", h, q_rows),
            (p + "ffn_gate.weight", shape.intermediate, h),
            (p + "ffn_up.weight", shape.intermediate, h),
            (p + "ffn_down.weight", h, shape.intermediate),
        ]  # fmt: skip
    return sum(r * c // 256 * per[q4_k_m_type(n, shape)] for n, r, c in sizes)
