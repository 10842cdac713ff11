"""Tiny Llama GGUF files made at test time with the ``gguf`` package's writer, laid out as
llama.cpp's converter lays them out (q/k rows permuted for its rope, matrices quantized), with a
byte-level BPE vocabulary. Options break one thing at a time for the importer's error tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, CONTEXT = 64, 4, 2, 128, 2, 256
HEAD_DIM = HIDDEN // HEADS
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def vocabulary() -> list[str]:
    from tokenizers import pre_tokenizers

    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of the importer's un-permute)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensors(vocab: int, seed: int = 3, tied: bool = True) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, in Hugging Face layout."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        out["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = 1 + w(HIDDEN)
        out[p + "post_attention_layernorm.weight"] = 1 + w(HIDDEN)
        out[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        out[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        out[p + "mlp.gate_proj.weight"] = w(INTER, HIDDEN)
        out[p + "mlp.up_proj.weight"] = w(INTER, HIDDEN)
        out[p + "mlp.down_proj.weight"] = w(HIDDEN, INTER)
    return out


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        return f"blk.{i}.{_GGUF_NAMES[rest]}"
    return _GGUF_NAMES[hf_name]


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    matrix_type: str = "Q4_1",
    tied: bool = True,
    extra_tensor: str | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; returns its weights (HF names and layout) before quantization."""
    import gguf

    tokens = vocabulary()
    tensors = hf_tensors(len(tokens), tied=tied)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, data in tensors.items():
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, HEADS)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, KV_HEADS)
        if data.ndim == 1:
            w.add_tensor(gguf_name(name), data)
        elif name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif qtype in (gguf.GGMLQuantizationType.I8,):
            w.add_tensor(gguf_name(name), data.astype(np.int8), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(HEAD_DIM // 2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors
