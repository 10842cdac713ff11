"""GGUF import: a llama.cpp / Ollama ``.gguf`` file of a supported architecture (llama — which
is also how llama.cpp writes Mistral —, qwen2, qwen3, gemma3, phi3), converted once into a
Hugging Face checkpoint directory that ``zerolayer.models.loader`` reads.

``check_header`` first checks what the file's header says (architecture, settings, tensor
names and types, tokenizer model) without reading any tensor data, so an unsupported file is
refused at once. The conversion then reads the file with the ``gguf`` package (pure Python),
dequantizes every tensor to float32, renames it to the Hugging Face name of its family
(``TENSOR_NAMES``), and undoes what llama.cpp's converter changed: ``attn_q``/``attn_k`` rows
of the llama architecture are un-permuted (stored permuted for its rope kernel, per head), and
Gemma's norm weights, stored with the +1 of its RMSNorm added, get it taken off again (as
transformers does); Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate and up) stay fused, as in
its checkpoints. It writes config.json,
generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json (special
tokens, chat template). Matrices in a block type that ``zerolayer.kernels.qmatmul`` computes on
(Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) are also kept as the file's own blocks
(``zerolayer.models.gguf_blocks``); source.json names the other matrices and their types
(``dense_matrices``). The directory is keyed by the file's SHA-256 and this converter's version and
is written into a temporary sibling then renamed into place, so a second start reuses it and a crash
never leaves half a directory.

The tokenizer is rebuilt from the GGUF vocabulary by ``zerolayer.models.gguf_tokenizer``, as
llama.cpp defines it.

Anything outside what is converted faithfully (another architecture, a tensor type the ``gguf``
package cannot dequantize, another tokenizer model or pre-tokenizer, partial rotary dimensions,
rope scaling other than linear, per-frequency rope factors) is a ``GGUFImportError`` naming what
the file holds and what is supported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zerolayer.cachedir import data_root, ensure_dir
from zerolayer.models.architectures import ARCHITECTURES, BY_GGUF_ARCH, FULL, SLIDING, Architecture
from zerolayer.models.gguf_blocks import BLOCK_BYTES, write_blocks
from zerolayer.models.gguf_errors import GGUFImportError
from zerolayer.models.gguf_tokenizer import build_tokenizer, check_tokenizer

log = logging.getLogger("zerolayer.models")

# Bump when the output of the conversion changes, so old cache directories are not reused.
# 2: the quantized blocks are kept too (blocks.safetensors). 3: other architectures. 4: source.json
# names the matrices kept dense only, with their types (``dense_matrices``). 5: the same files,
# written for tools only: up to version 4 daemons converted a GGUF to serve it, and a daemon,
# which now serves the file mapped, removes those conversions at start (``remove_served``).
CONVERTER_VERSION = 5
LAST_SERVED_VERSION = 4
_CONVERSION = re.compile(r".+-[0-9a-f]{16}-v(\d+)")  # cache_dir_for's names
SOURCE_FILE = "source.json"
SUPPORTED_ARCHITECTURES = tuple(BY_GGUF_ARCH)
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# A layer's tensors (blk.<i>.<name>.weight / .bias -> model.layers.<i>.<HF module>.weight /
# .bias), as llama.cpp's gguf-py TensorNameMap pairs them for each architecture.
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TENSOR_NAMES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_BLOCK,
    "qwen2": _LLAMA_BLOCK,
    "qwen3": {**_LLAMA_BLOCK, **_QK_NORMS},
    "gemma3": {
        **_LLAMA_BLOCK,
        **_QK_NORMS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {
        **{k: v for k, v in _LLAMA_BLOCK.items() if k not in ("attn_q", "attn_k", "attn_v")},
        "attn_qkv": "self_attn.qkv_proj",
        "ffn_up": "mlp.gate_up_proj",  # gate and up, fused
    },
}


GGUF_MAGIC = b"GGUF"
# Llama 3.1's llama3 rope scaling as llama.cpp's converter writes it: one divisor per rotated
# pair of dimensions (config.json's rope_freq_factors), not a weight of the model.
ROPE_FREQS = "rope_freqs.weight"


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
    check_header(read_header(path), path)  # refused here, before hashing or converting
    target = cache_dir_for(path, data_dir)
    if not (target / "model.safetensors").is_file():
        log.info("converting %s into %s (once; later starts reuse it)", path, target)
    ensure_dir(target, "model.safetensors", lambda tmp: convert(path, tmp))
    _remove_earlier_versions(target)
    return target


def remove_served(data_dir: str = "") -> list[Path]:
    """Delete the conversions under ``data_dir`` that daemons wrote to serve from (converter
    versions up to ``LAST_SERVED_VERSION``: each the whole model in float32, never read again);
    returns them."""
    try:
        entries = list(os.scandir(data_root(data_dir) / "gguf"))
    except OSError:  # no cache yet, or unreadable
        return []
    removed = []
    for entry in entries:
        found = _CONVERSION.fullmatch(entry.name)
        if found and int(found[1]) <= LAST_SERVED_VERSION and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


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


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array ``read_header`` skipped over: its element type and length."""

    item_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's data lies in its file: its dims (outermost first, as numpy and torch
    list them; GGUF lists them innermost first), type name and byte offset from the start of
    the file (the data section's start plus the tensor's own offset)."""

    shape: tuple[int, ...]
    kind: str
    offset: int


@dataclass(frozen=True)
class Header:
    """What a GGUF file says before its tensor data: metadata values (arrays of more than
    ``SMALL_ARRAY`` elements as ``ArrayInfo``), each tensor's name and type name, where each
    tensor's data lies (``layout``) and how many bytes the header takes (``size``: where the
    aligned data section starts)."""

    values: dict[str, Any]
    tensors: list[tuple[str, str]]
    layout: dict[str, TensorInfo]
    size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


SMALL_ARRAY = 4096
# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 = string, 9 = array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def read_header(path: Path) -> Header:
    """The metadata and tensor list of GGUF file ``path``, parsed with ``struct`` from a memory
    map, without the vocabulary's arrays or any tensor data: milliseconds where the gguf
    package's reader, which makes an array view per vocabulary entry, takes many seconds on a
    262k-token vocabulary. Raises ``GGUFImportError`` for a file that is not GGUF."""
    import gguf

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_header(data, gguf)
    except (ValueError, OSError, struct.error, UnicodeDecodeError, IndexError) as exc:
        raise GGUFImportError(f"{path} is not a readable GGUF file: {exc}") from exc


def _parse_header(data: mmap.mmap, gguf: Any) -> Header:
    if bytes(data[:4]) != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    version, n_tensors, n_values = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    offset = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + n].decode("utf-8"), at + 8 + n

    def value(kind: int, at: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return string(at)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, n = struct.unpack_from("<IQ", data, at)
        at += 12
        if n <= SMALL_ARRAY:
            items = []
            for _ in range(n):
                v, at = value(item, at)
                items.append(v)
            return items, at
        if item in _SCALARS:
            return ArrayInfo(item, n), at + n * struct.calcsize(_SCALARS[item])
        for _ in range(n):  # strings, or nested arrays: walk them without keeping them
            _, at = value(item, at)
        return ArrayInfo(item, n), at

    values: dict[str, Any] = {}
    for _ in range(n_values):
        key, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        values[key], offset = value(kind, offset + 4)
    tensors = []
    places: list[tuple[str, tuple[int, ...], str, int]] = []
    for _ in range(n_tensors):
        name, offset = string(offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{dims}Q", data, offset + 4)
        offset += 4 + 8 * dims
        kind, at = struct.unpack_from("<IQ", data, offset)
        offset += 12
        kind_name = gguf.GGMLQuantizationType(kind).name
        tensors.append((name, kind_name))
        places.append((name, tuple(int(d) for d in reversed(shape)), kind_name, int(at)))
    alignment = values.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment {alignment!r} is not a positive integer")
    start = -(-offset // alignment) * alignment
    layout = {name: TensorInfo(shape, kind, start + at) for name, shape, kind, at in places}
    return Header(values, tensors, layout, start)


class _Fields:
    """Typed access to a reader's key/value metadata, errors naming the file and key."""

    def __init__(self, reader: Any, path: Path) -> None:
        """``reader``: a ``Header`` or the gguf package's reader."""
        self._reader = reader
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        if isinstance(self._reader, Header):
            return self._reader.get(key, default)
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self._path}: metadata key {key!r} is missing")
        return value


def _architecture(fields: _Fields, path: Path) -> Architecture:
    arch = fields.require("general.architecture")
    if arch not in BY_GGUF_ARCH:
        raise GGUFImportError(
            f"{path}: unsupported architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return BY_GGUF_ARCH[arch]


def read_config(fields: _Fields, path: Path, tensor_names: set[str]) -> dict[str, Any]:
    """config.json for the file, after checking the architecture and rope settings."""
    family = _architecture(fields, path)
    arch = fields.require("general.architecture")
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
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
    }
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear"}
        rope["factor"] = float(fields.require(f"{arch}.rope.scaling.factor"))
    elif scaling != "none":
        raise GGUFImportError(f"{path}: unsupported rope scaling {scaling!r}")
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensor_names:
            raise GGUFImportError(
                f"{path}: holds {name} (long-context Phi-3's per-frequency rope factors); "
                "not supported"
            )
    if ROPE_FREQS in tensor_names and family.sliding_pattern:
        raise GGUFImportError(f"{path}: {ROPE_FREQS} in a {arch} file is not supported")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields.require("tokenizer.ggml.tokens"))
    layers = int(fields.require(f"{arch}.block_count"))
    window = fields.get(f"{arch}.attention.sliding_window")
    model_type = family.model_type
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(fields.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(fields.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(fields.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if family.sliding_pattern:
        # Gemma 3 as llama.cpp runs it: every sliding_pattern-th layer global with the file's
        # rope, the others sliding with base 10000 unscaled; scores scaled by 1/sqrt(head_dim).
        if not window:
            raise GGUFImportError(f"{path}: {arch}.attention.sliding_window is missing")
        config["sliding_window"] = int(window)
        pattern = fields.get(f"{arch}.attention.sliding_window_pattern", family.sliding_pattern)
        if isinstance(pattern, list):  # per layer: true = sliding
            config["layer_types"] = [SLIDING if p else FULL for p in pattern]
        else:
            config["layer_types"] = [
                FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(layers)
            ]
        config["rope_parameters"] = {
            FULL: rope,
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        }
        config["query_pre_attn_scalar"] = head_dim
        config["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        config["rope_theta"] = rope.pop("rope_theta")
        if scaling != "none":
            config["rope_scaling"] = rope
        config["hidden_act"] = "silu"
        if window:
            # llama.cpp writes Mistral as the llama architecture; a file that names a sliding
            # window (which llama.cpp's llama converter does not write) gets Mistral's mask.
            config["sliding_window"] = int(window)
            if model_type == "llama":
                model_type = "mistral"
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = fields.get(f"{arch}.{key}")
        if value is not None:
            config[key] = float(value)
    config["architectures"] = [ARCHITECTURES[model_type].hf_class]
    config["model_type"] = model_type
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


def hf_name(name: str, arch: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in a file of architecture ``arch``."""
    stem, dot, kind = name.rpartition(".")
    if not dot or kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".", 2)
    block = TENSOR_NAMES[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{kind}"
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


def check_header(header: Header, path: Path) -> dict[str, Any]:
    """Everything about the file that decides whether it is converted, from its header alone
    (no tensor data is read): the architecture and its settings, every tensor's name and
    type, the tokenizer model and pre-tokenizer. Returns config.json for the file; raises
    ``GGUFImportError`` naming what the file holds and what is supported."""
    fields = _Fields(header, path)
    names = {name for name, _ in header.tensors}
    config = read_config(fields, path, names)
    arch = fields.require("general.architecture")
    supported = supported_tensor_types()
    unsupported: dict[str, str] = {}  # type name -> the first tensor of that type
    for name, kind in header.tensors:
        if kind not in supported:
            unsupported.setdefault(kind, name)
    if unsupported:
        found = ", ".join(f"{kind} (e.g. {name})" for kind, name in unsupported.items())
        raise GGUFImportError(
            f"{path}: unsupported tensor type {found}; the gguf package dequantizes "
            f"{', '.join(sorted(supported))}"
        )
    for name in sorted(names - {ROPE_FREQS}):
        if hf_name(name, arch) is None:
            raise GGUFImportError(
                f"{path}: unexpected tensor {name!r} for the {arch} architecture; its tensors: "
                f"{', '.join(sorted({*_GLOBAL_TENSORS, *TENSOR_NAMES[arch]}))}"
            )

    check_tokenizer(fields, path)
    return config


@dataclass
class Tensors:
    """What ``read_tensors`` reads: every tensor dequantized to float32 (``dense``), the
    matrices of a type in ``BLOCK_BYTES`` also as their block bytes (``blocks``: type name,
    [rows, bytes]), and the type of every other matrix (``dense_only``: float types, and the
    quantized types the block kernel does not compute on), all under Hugging Face names."""

    dense: dict[str, np.ndarray]
    blocks: dict[str, tuple[str, np.ndarray]]
    dense_only: dict[str, str]


def read_tensors(reader: Any, path: Path, config: dict[str, Any]) -> Tensors:
    """Every tensor under its Hugging Face name, with llama.cpp's changes undone (q/k rows of
    the llama architecture un-permuted, in the blocks too; Gemma's norms less 1).
    ``check_header`` has passed."""
    from gguf import quants

    arch = str(reader.fields["general.architecture"].contents())
    family = BY_GGUF_ARCH[arch]
    out = Tensors({}, {}, {})
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # in config.json (rope_freq_factors)
        name = hf_name(tensor.name, arch)
        assert name is not None  # check_header refused files with other tensors
        # F32 tensors come back as read-only views of the memory-mapped file: copy them.
        data = np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        data = data.reshape(shape)
        kind = tensor.tensor_type.name
        raw = np.asarray(tensor.data) if kind in BLOCK_BYTES and len(shape) == 2 else None
        heads = None
        if family.gguf_permuted_qk and name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif family.gguf_permuted_qk and name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        if heads is not None:
            data = unpermute_rows(data, heads)
            raw = None if raw is None else unpermute_rows(raw, heads)
        if family.norm_offset and name.endswith("norm.weight"):
            # llama.cpp's converter adds Gemma's +1 into the stored weight (its RMSNorm has no
            # offset); Hugging Face checkpoints and our decoder keep the difference from 1.
            data = data - np.float32(family.norm_offset)
        out.dense[name] = data
        if raw is not None:
            out.blocks[name] = (kind, np.array(raw, dtype=np.uint8))
        elif len(shape) == 2:
            out.dense_only[name] = kind
    return out


def convert(path: Path, directory: Path) -> None:
    """Write the checkpoint converted from GGUF file ``path`` into the existing ``directory``."""
    from safetensors.numpy import save_file

    config = check_header(read_header(path), path)
    reader = _open(path)
    _add_rope_factors(config, reader)
    tensors = read_tensors(reader, path, config)
    if tensors.blocks:  # a file of float matrices only keeps no blocks
        write_blocks(directory, tensors.blocks)
    save_file(tensors.dense, str(directory / "model.safetensors"), metadata={"format": "pt"})
    source = {
        "gguf": str(path),
        "converter_version": CONVERTER_VERSION,
        "dense_matrices": tensors.dense_only,
    }
    _write_small_files(directory, path, config, reader, source)


def _add_rope_factors(config: dict[str, Any], reader: Any) -> None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
            config["rope_freq_factors"] = [float(v) for v in values]


def _write_small_files(
    directory: Path, path: Path, config: dict[str, Any], reader: Any, source: dict[str, Any]
) -> None:
    """config.json, generation_config.json, tokenizer.json, tokenizer_config.json, source.json."""
    tokenizer, tok_cfg = build_tokenizer(_Fields(reader, path), path)
    tokenizer.save(str(directory / "tokenizer.json"))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tok_cfg),
        (SOURCE_FILE, source),
    ):
        (directory / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# Bump when what ``ensure_described`` writes changes. 1: config, generation config, tokenizer.
DESCRIPTION_VERSION = 1


def description_key(path: Path, header: Header) -> str:
    """Names what ``ensure_described`` caches for ``path``: the file's size, modification time
    and inode, and the SHA-256 of its header (metadata and tensor table), never of its tensor
    data (a whole 5 GB file read at every start)."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(header.size))
    return h.hexdigest()[:16]


def ensure_described(path: Path, data_dir: str = "") -> tuple[Path, Header]:
    """A small directory describing GGUF file ``path`` (config.json with the rope factors,
    tokenizer.json and tokenizer_config.json rebuilt from its vocabulary, generation_config.json,
    source.json), written on first use and reused while the file is unchanged; and the file's
    header. The weights stay in the file (``zerolayer.models.gguf_file``). Raises
    ``GGUFImportError`` for files it does not serve."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist")
    header = read_header(path)
    config = check_header(header, path)  # refused here, before anything is written
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:60]
    key = description_key(path, header)
    target = data_root(data_dir) / "gguf" / f"{stem}-{key}-d{DESCRIPTION_VERSION}"

    def write(tmp: Path) -> None:
        reader = _open(path)
        _add_rope_factors(config, reader)
        _write_small_files(tmp, path, config, reader, {"gguf": str(path)})

    ensure_dir(target, SOURCE_FILE, write)
    return target, header


def dense_matrices(directory: Path) -> dict[str, str]:
    """``{hf name: GGUF type}`` of the matrices a converted directory keeps as dense weights
    only (no blocks for the kernel); empty for a directory not converted from a GGUF."""
    try:
        source = json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    found = source.get("dense_matrices") if isinstance(source, dict) else None
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def describe_dense(matrices: dict[str, str]) -> str:
    """One line's worth: how many matrices of each type, and the first of each."""
    by_kind: dict[str, list[str]] = {}
    for name, kind in matrices.items():
        by_kind.setdefault(kind, []).append(name)
    return ", ".join(
        f"{len(names)} {kind} (e.g. {names[0]})" for kind, names in sorted(by_kind.items())
    )
