"""GGUF import: a llama.cpp / Ollama ``.gguf`` file of the Llama architecture, converted once
into a Hugging Face checkpoint directory that ``gateway.models.loader`` reads.

The conversion reads the file with the ``gguf`` package (pure Python), dequantizes every tensor
to float32, renames it to the Hugging Face name, un-permutes ``attn_q``/``attn_k`` (llama.cpp
stores their rows permuted for its rope kernel, per head), and writes config.json,
generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json (special
tokens, chat template). Matrices in a block type that ``kernels.qmatmul`` computes on (Q4_0, Q4_1,
Q8_0) are also kept as the file's own blocks (``gateway.models.gguf_blocks``). The directory
is keyed by the file's SHA-256 and this converter's version and is written into a temporary
sibling then renamed into place, so a second start reuses it and a crash never leaves half a
directory.

The tokenizer is rebuilt from the GGUF vocabulary by ``gateway.models.gguf_tokenizer``, as
llama.cpp defines it.

Anything outside what is converted faithfully (another architecture, a tensor type the ``gguf``
package cannot dequantize, another tokenizer model or pre-tokenizer, partial rotary dimensions,
rope scaling) is a ``GGUFImportError`` naming what the file holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from gateway.models.cachedir import data_root, ensure_dir
from gateway.models.gguf_blocks import BLOCK_BYTES, write_blocks

log = logging.getLogger("zerolayer.models")

# Bump when the output of the conversion changes, so old cache directories are not reused.
# 2: the quantized blocks are kept too (blocks.safetensors).
CONVERTER_VERSION = 2
SUPPORTED_ARCHITECTURES = ("llama",)
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFImportError(Exception):
    """The file is not a GGUF this importer converts; the message names the file and what it
    holds."""


GGUF_MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """A path names a GGUF file: it ends in .gguf, or it is a file starting with the GGUF magic
    (as an Ollama blob, named by its digest, does)."""
    if path.suffix == ".gguf":
        return True
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir_for(path: Path, data_dir: str = "") -> Path:
    """Where the conversion of ``path`` is cached: keyed by its digest and CONVERTER_VERSION."""
    base = data_root(data_dir)
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:60]
    return base / "gguf" / f"{stem}-{file_digest(path)[:16]}-v{CONVERTER_VERSION}"


def ensure_converted(path: str | Path, data_dir: str = "") -> Path:
    """The checkpoint directory converted from the GGUF file ``path``, converting it on first
    use. Raises ``GGUFImportError`` for files it does not convert."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist")
    target = cache_dir_for(path, data_dir)
    if not (target / "model.safetensors").is_file():
        log.info("converting %s into %s (once; later starts reuse it)", path, target)
    ensure_dir(target, "model.safetensors", lambda tmp: convert(path, tmp))
    _remove_earlier_versions(target)
    return target


def _remove_earlier_versions(target: Path) -> None:
    """Conversions of the same file by an earlier CONVERTER_VERSION are never read again (each
    holds the whole model in float32): delete them."""
    keyed = target.name.rsplit("-v", 1)[0]
    for version in range(1, CONVERTER_VERSION):
        old = target.with_name(f"{keyed}-v{version}")
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed %s, written by converter version %d", old, version)


def _open(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, EOFError) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from exc


class _Fields:
    """Typed access to a reader's key/value metadata, errors naming the file and key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self._path}: metadata key {key!r} is missing")
        return value


def read_config(fields: _Fields, path: Path, tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the file, after checking the architecture and rope settings."""
    arch = fields.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = int(fields.require(f"{arch}.embedding_length"))
    heads = int(fields.require(f"{arch}.attention.head_count"))
    kv_heads = int(fields.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(fields.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(fields.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFImportError(
            f"{path}: rotary dimension {rope_dims} differs from head dimension {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    scaling = fields.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling: dict[str, Any] | None = None
    if scaling == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": float(fields.require(f"{arch}.rope.scaling.factor")),
        }
    elif scaling != "none":
        raise GGUFImportError(f"{path}: unsupported rope scaling {scaling!r}")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFImportError(
            f"{path}: holds rope_freqs.weight (per-frequency rope factors, as Llama 3.1 files do); "
            "not supported"
        )
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields.require("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(fields.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(fields.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    for key in ("bos_token_id", "eos_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a q/k projection [heads * head_dim, in]: within each
    head, llama.cpp interleaves the two rotated halves (rows 0, d/2, 1, d/2+1, ...); Hugging Face
    keeps them as two halves."""
    half = weight.shape[0] // heads // 2
    return np.ascontiguousarray(
        weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}"
    return None


def supported_tensor_types() -> set[str]:
    """Tensor type names the installed ``gguf`` package dequantizes."""
    import gguf
    from gguf import quants

    return (
        {"F32", "F16"}
        | {t.name for t in quants._type_traits}
        | {gguf.GGMLQuantizationType.BF16.name}
    )


def read_tensors(
    reader: Any, path: Path, config: dict[str, Any]
) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, np.ndarray]]]:
    """Every tensor dequantized to float32, under its Hugging Face name, q/k un-permuted; and
    the matrices of a type in ``BLOCK_BYTES`` as their block bytes (type name, [rows, bytes]),
    rows un-permuted the same way."""
    from gguf import quants

    supported = supported_tensor_types()
    unsupported: dict[str, str] = {}  # type name -> the first tensor of that type
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in supported:
            unsupported.setdefault(tensor.tensor_type.name, tensor.name)
    if unsupported:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in unsupported.items())
        raise GGUFImportError(
            f"{path}: unsupported tensor type {found}; the gguf package dequantizes "
            f"{', '.join(sorted(supported))}"
        )
    out: dict[str, np.ndarray] = {}
    blocks: dict[str, tuple[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise GGUFImportError(f"{path}: unexpected tensor {tensor.name!r} for a Llama model")
        # F32 tensors come back as read-only views of the memory-mapped file: copy them.
        data = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        data = data.reshape(shape)
        kind = tensor.tensor_type.name
        raw = np.asarray(tensor.data) if kind in BLOCK_BYTES and len(shape) == 2 else None
        heads = None
        if name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if heads is not None:
            data = unpermute_rows(data, heads)
            raw = None if raw is None else unpermute_rows(raw, heads)
        out[name] = data
        if raw is not None:
            blocks[name] = (kind, np.array(raw, dtype=np.uint8))
    return out, blocks


def convert(path: Path, directory: Path) -> None:
    """Write the checkpoint converted from GGUF file ``path`` into the existing ``directory``."""
    from safetensors.numpy import save_file

    from gateway.models.gguf_tokenizer import build_tokenizer

    reader = _open(path)
    fields = _Fields(reader, path)
    config = read_config(fields, path, {t.name for t in reader.tensors})
    tokenizer, tok_cfg = build_tokenizer(fields, path)
    tensors, blocks = read_tensors(reader, path, config)
    write_blocks(directory, blocks)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(directory / "tokenizer.json"))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tok_cfg),
        ("source.json", {"gguf": str(path), "converter_version": CONVERTER_VERSION}),
    ):
        (directory / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
