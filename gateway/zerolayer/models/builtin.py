"""The built-in model: a small Llama with seeded random weights and the byte tokenizer.

It exists so the daemon serves, and its tests run, with nothing downloaded. Its text is not
meaningful. The weights are written once as a real Hugging Face checkpoint directory
(config.json, model.safetensors, generation_config.json) under the data dir, then loaded through
the same loader as any checkpoint. They come from a counter-based hash of a fixed seed using only
integer arithmetic, so every run on every machine writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerolayer.cachedir import data_root, ensure_dir
from zerolayer.kernels.splitmix import splitmix64
from zerolayer.models.architectures import DecoderConfig
from zerolayer.tokenizer import ByteTokenizer

BUILTIN_NAME = "zerolayer-builtin"
BUILTIN_SEED = 20240601
INIT_STD = 0.02
# Bump when the generation procedure changes, so old directories are not reused.
GENERATOR_VERSION = 1

BUILTIN_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": ByteTokenizer.BASE_VOCAB,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": ByteTokenizer.BOS,
    "eos_token_id": ByteTokenizer.EOS,
    "torch_dtype": "float32",
}
GENERATION_CONFIG = {"bos_token_id": ByteTokenizer.BOS, "eos_token_id": ByteTokenizer.EOS}


def builtin_tokenizer() -> ByteTokenizer:
    return ByteTokenizer(BUILTIN_CONFIG["vocab_size"])


def config_hash() -> str:
    blob = json.dumps(
        {"config": BUILTIN_CONFIG, "seed": BUILTIN_SEED, "std": INIT_STD, "v": GENERATOR_VERSION},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def builtin_dir(data_dir: str = "") -> Path:
    base = data_root(data_dir)
    return base / f"builtin-{config_hash()}"


def _uniform_weights(shape: tuple[int, ...], stream: int) -> torch.Tensor:
    """Uniform in [-a, a) with standard deviation INIT_STD; element i of tensor ``stream`` is
    a hash of (seed, stream, i). Exact in float32: 24-bit integers times a power of two."""
    count = int(np.prod(shape))
    key = splitmix64(np.array([BUILTIN_SEED * 1_000_003 + stream], dtype=np.uint64))
    bits = splitmix64(np.arange(count, dtype=np.uint64) ^ key)
    unit = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)  # [0, 1)
    half_width = np.float32(INIT_STD * 3**0.5)
    return torch.from_numpy(((unit * 2 - 1) * half_width).reshape(shape))


def builtin_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the built-in checkpoint, named as Hugging Face names them."""
    cfg = DecoderConfig.from_hf(BUILTIN_CONFIG)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * hd)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    tensors = {name: _uniform_weights(shape, n) for n, (name, shape) in enumerate(shapes.items())}
    for i in range(cfg.num_hidden_layers):
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(h)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(h)
    tensors["model.norm.weight"] = torch.ones(h)
    return tensors


def write_builtin(directory: Path) -> None:
    """Write the built-in checkpoint files into an existing empty directory."""
    from safetensors.torch import save_file

    save_file(builtin_tensors(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name, data in (
        ("config.json", BUILTIN_CONFIG),
        ("generation_config.json", GENERATION_CONFIG),
    ):
        (directory / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ensure_builtin(data_dir: str = "") -> Path:
    """The built-in checkpoint directory, generated on first use (written atomically:
    ``zerolayer.cachedir``)."""
    return ensure_dir(builtin_dir(data_dir), "model.safetensors", write_builtin)
