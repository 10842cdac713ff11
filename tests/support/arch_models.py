"""Tiny random-weight models of every supported family, made at test time from a transformers
config: saved as a checkpoint, or written as a GGUF file the way llama.cpp's converter lays it
out (tensor names from gguf-py's own name map, q/k rows permuted for the llama architecture,
Gemma's norms with +1 added), as float32 or one block type. The GGUF's vocabulary is the
byte-level BPE one of ``tests.support.gguf_files``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.gguf_files import MERGES, SPECIAL, TEMPLATE, llama_cpp_permute, vocabulary

VOCAB = len(vocabulary())
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
GEMMA_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's pattern of 6


@dataclass(frozen=True)
class Case:
    config_class: str  # transformers config class
    model_class: str  # transformers *ForCausalLM class
    fields: dict[str, Any]
    gguf_arch: str | None = None  # written as a GGUF of this architecture too; None: not
    gguf_extra: dict[str, Any] = field(default_factory=dict)  # extra GGUF metadata (add_*)


CASES: dict[str, Case] = {
    "llama-gqa": Case(
        "LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}, gguf_arch="llama"
    ),
    "llama-mha-tied": Case(
        "LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}
    ),
    "llama-mqa-biases": Case(
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
    ),
    "llama3-rope": Case(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "head_dim": 32,  # head_dim * heads != hidden_size
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama-linear-rope": Case(
        "LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 4}}
    ),
    # llama.cpp writes Mistral as the llama architecture; the window is named in the file.
    "mistral-sliding": Case(
        "MistralConfig",
        "MistralForCausalLM",
        {"sliding_window": 8},
        gguf_arch="llama",
        gguf_extra={"sliding_window": 8},
    ),
    "qwen2": Case("Qwen2Config", "Qwen2ForCausalLM", {"rope_theta": 1e6}, gguf_arch="qwen2"),
    "qwen3": Case("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, gguf_arch="qwen3"),
    "gemma3": Case(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 6,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,  # llama.cpp scales by 1/sqrt(head_dim)
            "sliding_window": 8,
            "layer_types": GEMMA_LAYERS,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
        gguf_arch="gemma3",
        gguf_extra={"sliding_window": 8, "key_length": 16, "value_length": 16},
    ),
    "gemma3-softcap": Case(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            # transformers' Gemma 3 never passes attn_logit_softcapping to its attention, so
            # it cannot be the reference for that one (tests/unit/test_kernels.py has it).
            "final_logit_softcapping": 15.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    "phi3": Case(
        "Phi3Config",
        "Phi3ForCausalLM",
        {"sliding_window": 8},
        gguf_arch="phi3",
        gguf_extra={"sliding_window": 8},
    ),
}


# A Llama with K-quant-sized matrices (every input size a multiple of the 256-weight super-block),
# for Q4_K_M-style files (``q4_k_m``); not in CASES, whose parity runs it would only repeat.
K_CASES: dict[str, Case] = {
    "llama-kquant": Case(
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "head_dim": 64,
            "num_hidden_layers": 3,
            "tie_word_embeddings": True,
        },
        gguf_arch="llama",
    )
}


def q4_k_m(hf_name: str) -> str:
    """A matrix's type in a Q4_K_M-style file, as llama.cpp's Q4_K_M mixes them: Q4_K, with
    v_proj and the token embedding (here also the tied output head) Q6_K, down_proj Q6_K on
    the first layer only (llama.cpp gives some layers' ffn_down more bits), and one matrix of a
    type the block kernel does not compute on (o_proj after the first layer, Q5_0: dense)."""
    if hf_name.endswith(("v_proj.weight", "embed_tokens.weight", "layers.0.mlp.down_proj.weight")):
        return "Q6_K"
    if hf_name.endswith("o_proj.weight") and not hf_name.startswith("model.layers.0."):
        return "Q5_0"
    return "Q4_K"


def reference_model(name: str, seed: int = 0):  # noqa: ANN201 - a transformers model
    """The case's random transformers model, float32, eval mode, EOS never ending generate."""
    import torch
    import transformers

    case = {**CASES, **K_CASES}[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, case.config_class)(**{**BASE, **case.fields})
    model = getattr(transformers, case.model_class)(cfg).eval()
    # Default init leaves logits nearly flat; wider weights make greedy choices decisive, so
    # token-for-token comparisons test the math rather than tie-breaking. Norm weights move
    # off their init too, so that a wrong +1 offset or a missing norm shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
            else:  # biases
                p.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_checkpoint(model, directory: Path) -> None:  # noqa: ANN001
    """``model`` saved as safetensors, with the GGUF vocabulary's tokenizer files."""
    model.save_pretrained(directory, safe_serialization=True)
    tok = _tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SPECIAL[1], "eos_token": SPECIAL[2], "add_bos_token": False})
    )


def _tokenizer():  # noqa: ANN202
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = vocabulary()
    merges = [tuple(m.split(" ", 1)) for m in MERGES]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    return tok


def write_gguf(  # noqa: ANN201
    model,  # noqa: ANN001
    name: str,
    path: Path,
    matrix_type: str | Callable[[str], str] = "F32",
) -> dict[str, Any]:
    """Write ``model`` (of case ``name``) as a GGUF file, its matrices in ``matrix_type``
    (F32, a block type gguf.quants quantizes or a K-quant of ``benchmarks._support.kquants``; or a
    function of the Hugging Face name giving each matrix's type, e.g. ``q4_k_m``). Returns the
    Hugging Face state dict holding the weights as the file stores them (dequantized; Gemma's
    norms as (w + 1) - 1 in float32), for a transformers reference on exactly those weights."""
    import gguf
    import torch

    from benchmarks._support import kquants

    case = {**CASES, **K_CASES}[name]
    assert case.gguf_arch is not None
    cfg = model.config
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == case.gguf_arch)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    type_of = matrix_type if callable(matrix_type) else (lambda _: matrix_type)
    tokens = vocabulary()
    w = gguf.GGUFWriter(str(path), case.gguf_arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    for key, value in case.gguf_extra.items():
        getattr(w, f"add_{key}")(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    stored: dict[str, Any] = {}
    state = model.state_dict()
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf_name
        data = tensor.detach().float().numpy().copy()
        if case.gguf_arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if case.gguf_arch == "llama" and base.endswith(("q_proj", "k_proj")) and suffix == "weight":
            heads = cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
            permuted = heads
        else:
            permuted = 0
        qtype = gguf.GGMLQuantizationType[type_of(hf_name)]
        if data.ndim == 2 and qtype.name in kquants.BYTES:
            raw = kquants.quantize(data, qtype.name)
            w.add_tensor(f"{gguf_name}.{suffix}", raw, raw_dtype=qtype)
            data = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
        elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(f"{gguf_name}.{suffix}", raw, raw_dtype=qtype)
            data = gguf.quants.dequantize(raw, qtype).reshape(data.shape)
        else:
            w.add_tensor(f"{gguf_name}.{suffix}", data)
        if permuted:  # back to the Hugging Face layout for the reference
            half = data.shape[0] // permuted // 2
            data = data.reshape(permuted, half, 2, -1).swapaxes(1, 2).reshape(data.shape)
        if case.gguf_arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data - np.float32(1.0)
        stored[hf_name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored
