"""Loading a checkpoint directory of a supported family (``zerolayer.models.architectures``: Llama,
Mistral, Qwen2/2.5, Qwen3, Gemma 3, Phi-3) into ``zerolayer.models.decoder``.

A checkpoint is a local Hugging Face directory: config.json, *.safetensors (one file, or shards
listed in model.safetensors.index.json), tokenizer.json and the optional tokenizer_config.json,
chat_template.jinja and generation_config.json. Every problem a user can cause (wrong path,
missing file, other architecture, missing tensors) is a ``ModelLoadError`` naming the path and
what is wrong. ``load_model`` is what the engine calls; ``resolve_source`` turns ``model.path``
(a directory, a ``.gguf`` file, or a named model) into a checkpoint directory, or for a GGUF
file into a small directory describing it (config and tokenizer, ``gguf_import.ensure_described``)
beside the file itself. ``load_gguf`` opens a GGUF file mapped (``zerolayer.models.gguf_file``):
its matrices of a block type are the file's own blocks, views of the map that every forward
computes on (``model.quantized_decode``, ``zerolayer.kernels.qmatmul``), with no dense copy; only
the small tensors (norms, biases) and matrices of other types are read into dense float weights.
A directory converted from a GGUF (``gguf_import.ensure_converted``, for tools that need a dense
checkpoint) also gets block copies of its matrices, used for forwards of a few tokens. Products
on the blocks take 8-bit or float activations as ``model.kernel`` says.
Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` matrices (dense or blocks) are split into the
decoder's q/k/v and gate/up on the way in (``split_fused``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerolayer.cachedir import data_root
from zerolayer.config.settings import BUILTIN_MODEL, ModelConfig
from zerolayer.kernels import qmatmul
from zerolayer.kernels.qmatmul import QWeight
from zerolayer.models.architectures import DecoderConfig, find_architecture
from zerolayer.models.decoder import Decoder
from zerolayer.tokenizer import Tokenizer

log = logging.getLogger("zerolayer.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Checkpoint entries that are not weights of our modules (older exports save rope buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(Exception):
    """A model directory cannot be loaded; the message names the path and the problem."""


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: DecoderConfig
    model: Decoder  # weights in the requested dtype, in eval mode
    tokenizer: Tokenizer
    dtype: torch.dtype
    max_context: int  # min(requested max_context, max_position_embeddings)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def read_config(directory: Path) -> DecoderConfig:
    """Parse and check config.json of a checkpoint directory."""
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: config.json is missing (not a checkpoint directory?)")
    raw = _read_json(path)
    try:
        find_architecture(raw)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    try:
        return DecoderConfig.from_hf(raw)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: required field {exc.args[0]!r} is missing") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, shards in index order."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: 'weight_map' is missing or empty")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{directory}: shards listed in {index.name} are missing: {missing}"
            )
        return files
    from zerolayer.models.gguf_blocks import BLOCKS_FILE

    # A converted GGUF's quantized blocks are not weights of the dense model (attach_blocks).
    files = sorted(p for p in directory.glob("*.safetensors") if p.name != BLOCKS_FILE)
    if not files:
        other = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pth")
        )
        hint = f" (found {', '.join(other)}; only safetensors weights are loaded)" if other else ""
        raise ModelLoadError(f"{directory}: no *.safetensors weight files{hint}")
    return files


def read_state_dict(directory: Path, cfg: DecoderConfig, dtype: torch.dtype) -> dict[str, Any]:
    """Tensors named as ``zerolayer.models.decoder.Decoder`` names them, converted to ``dtype``."""
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    name = key.removeprefix("model.")
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # tied: the output projection is the embedding
                    tensors[name] = fh.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc
    return split_fused(tensors, cfg, lambda t, a, b: t[a:b])


# Fused checkpoint matrices (Phi-3) -> the decoder's own, as (name, rows) in order.
def _fused_parts(cfg: DecoderConfig) -> dict[str, list[tuple[str, int]]]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", kv),
            ("self_attn.v_proj", kv),
        ],
        "mlp.gate_up_proj": [("mlp.gate_proj", inter), ("mlp.up_proj", inter)],
    }


def split_fused(
    tensors: dict[str, Any], cfg: DecoderConfig, rows: Callable[[Any, int, int], Any]
) -> dict[str, Any]:
    """``tensors`` (model-prefix removed) with a fused family's ``qkv_proj`` and
    ``gate_up_proj`` matrices (and biases) split by output rows into the decoder's separate
    ones; ``rows(t, a, b)`` takes rows a..b of one (a dense tensor or a QWeight)."""
    if not cfg.arch.fused:
        return tensors
    out: dict[str, Any] = {}
    parts = _fused_parts(cfg)
    for name, tensor in tensors.items():
        pieces = name.split(".", 2)  # layers, <i>, <module>.<weight or bias>
        module, _, kind = pieces[-1].rpartition(".")
        if len(pieces) < 3 or pieces[0] != "layers" or module not in parts:
            out[name] = tensor
            continue
        start = 0
        for part, size in parts[module]:
            out[f"layers.{pieces[1]}.{part}.{kind}"] = rows(tensor, start, start + size)
            start += size
    return out


def load_checkpoint(
    directory: str | Path,
    max_context: int,
    dtype: torch.dtype = torch.float32,
    tokenizer: Tokenizer | None = None,
    name: str = "",
    kernel_cache: Path | None = None,
) -> LoadedModel:
    """Load config, weights and (unless given) the tokenizer of a checkpoint directory. With
    ``kernel_cache`` (where the block kernel is built), matrices whose GGUF blocks the directory
    keeps get block copies for small forwards (``Decoder.use_blocks``)."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    cfg = read_config(directory)
    if tokenizer is None:
        from zerolayer.models.hf_tokenizer import HFTokenizer, TokenizerLoadError

        try:
            tokenizer = HFTokenizer(directory)
        except TokenizerLoadError as exc:
            raise ModelLoadError(str(exc)) from exc
    context = min(max_context, cfg.max_position_embeddings)

    model = Decoder(cfg, context, dtype=dtype, device="meta")
    state = read_state_dict(directory, cfg, dtype)
    expected = set(model.state_dict())
    missing = sorted(expected - state.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{directory}: tensors missing from the weights: {shown}")
    unexpected = sorted(state.keys() - expected)
    if unexpected:
        raise ModelLoadError(
            f"{directory}: tensors the config does not account for: {', '.join(unexpected[:5])}"
        )
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:  # shape mismatches between config.json and the weights
        raise ModelLoadError(f"{directory}: weights do not match config.json: {exc}") from exc
    model.eval()
    if kernel_cache is not None:
        attach_blocks(model, cfg, directory, kernel_cache)
    return LoadedModel(
        name=name or directory.name,
        path=directory,
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        max_context=context,
    )


def attach_blocks(model: Decoder, cfg: DecoderConfig, directory: Path, kernel_cache: Path) -> None:
    """Block copies of the matrices whose GGUF blocks ``directory`` keeps (none for a
    checkpoint that was not converted from a GGUF), once the kernel is built under
    ``kernel_cache``. One log line names the matrices of types the kernel does not compute on
    (dense only). A kernel that cannot be built leaves the dense weights only, with one log
    line saying why."""
    from zerolayer.models.gguf_blocks import read_blocks
    from zerolayer.models.gguf_import import dense_matrices, describe_dense

    try:
        blocks = read_blocks(directory)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{directory}: cannot read its quantized blocks: {exc}") from exc
    dense = dense_matrices(directory)
    if dense:  # one line for the whole model, not one a tensor
        log.info(
            "%d of the GGUF's matrices load as dense weights only (types without a block "
            "kernel): %s",
            len(dense),
            describe_dense(dense),
        )
    if not blocks:
        return
    reason = qmatmul.build(kernel_cache)
    if reason is not None:
        log.warning("GGUF block kernel unavailable, serving dense weights only: %s", reason)
        return
    named = {name.removeprefix("model."): w for name, w in blocks.items()}
    used = model.use_blocks(split_fused(named, cfg, _block_rows))
    if used:
        log.info(
            "forwards of up to %d tokens compute on %d of the GGUF's quantized matrices",
            model.blocks_max_rows,
            used,
        )
    else:
        log.info("%s keeps no usable GGUF blocks: dense weights only", directory)


# The matrices the decoder computes on in one call each (Decoder.use_blocks): either all of a
# group are blocks or all are dense.
_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def load_gguf(
    path: Path,
    directory: Path,
    max_context: int,
    dtype: torch.dtype = torch.float32,
    name: str = "",
    kernel_cache: Path | None = None,
) -> LoadedModel:
    """Open GGUF file ``path`` (described by ``directory``: ``gguf_import.ensure_described``)
    without converting it. With ``kernel_cache`` (where the block kernel is built), every matrix
    of a type the kernel computes on stays the file's blocks, mapped; the rest is dequantized
    into dense ``dtype`` weights, the way llama.cpp's converter changed them undone (q/k rows of
    the llama architecture un-permuted: for blocks by reordering their outputs, Gemma's norms
    less 1). One log line names the matrices that are dense."""
    import numpy as np

    from zerolayer.kernels import qmatmul
    from zerolayer.models.architectures import BY_GGUF_ARCH
    from zerolayer.models.gguf_errors import GGUFImportError
    from zerolayer.models.gguf_file import GGUFFile
    from zerolayer.models.gguf_import import ROPE_FREQS, describe_dense, hf_name, unpermute_rows
    from zerolayer.models.hf_tokenizer import HFTokenizer, TokenizerLoadError

    cfg = read_config(directory)
    try:
        tokenizer = HFTokenizer(directory)
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        gguf_file = GGUFFile.open(path)
    except GGUFImportError as exc:
        raise ModelLoadError(str(exc)) from exc
    reason = (
        "model.quantized_decode is off" if kernel_cache is None else qmatmul.build(kernel_cache)
    )
    if reason is not None:
        log.warning("GGUF block kernel unavailable, serving dense weights only: %s", reason)
    arch = str(gguf_file.header.get("general.architecture"))
    # What llama.cpp changed follows the file's architecture, not the config's family (a llama
    # file with a sliding window is served as Mistral, its q/k rows permuted all the same).
    family = BY_GGUF_ARCH[arch]
    permuted = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}

    def qk_heads(key: str) -> int | None:
        """Heads of a q/k weight whose rows llama.cpp permuted, else None."""
        module, _, kind = key.rpartition(".")
        if not family.gguf_permuted_qk or kind != "weight":
            return None
        return permuted.get(module.rpartition(".")[2])

    blocks: dict[str, QWeight] = {}
    orders: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    dense_kinds: dict[str, str] = {}

    def read_dense(gguf_name: str, key: str) -> torch.Tensor:
        values = gguf_file.dense(gguf_name)
        heads = qk_heads(key)
        if heads is not None:
            values = torch.from_numpy(unpermute_rows(values.numpy(), heads))
        if family.norm_offset and key.endswith("norm.weight"):
            values = values - family.norm_offset
        return values.to(dtype)

    names: dict[str, str] = {}  # decoder name -> GGUF name
    for gguf_name, info in gguf_file.header.layout.items():
        if gguf_name == ROPE_FREQS:
            continue  # read into config.json's rope_freq_factors
        key = hf_name(gguf_name, arch)
        if key is None:
            raise ModelLoadError(f"{path}: unexpected tensor {gguf_name!r}")
        full, key = key, key.removeprefix("model.")
        names[key] = gguf_name
        if len(info.shape) == 2 and info.kind in qmatmul.KINDS and reason is None:
            blocks[key] = QWeight(gguf_file.blocks(gguf_name), info.kind)
            heads = qk_heads(key)
            if heads is not None:
                order = unpermute_rows(np.arange(info.shape[0]), heads)
                orders[key] = torch.from_numpy(order)
        else:
            dense[key] = read_dense(gguf_name, key)
            if len(info.shape) == 2:
                dense_kinds[full] = info.kind
    blocks = split_fused(blocks, cfg, _block_rows)
    dense = split_fused(dense, cfg, lambda t, a, b: t[a:b])
    # A group with a dense member is dense whole (one call per group).
    for i in range(cfg.num_hidden_layers):
        for group in _GROUPS:
            keys = [f"layers.{i}.{m}.weight" for m in group]
            if any(k in dense for k in keys):
                for k in keys:
                    if k in blocks:
                        del blocks[k]
                        orders.pop(k, None)
                        dense[k] = read_dense(names[k], k)
                        dense_kinds[f"model.{k}"] = gguf_file.info(names[k]).kind
    context = min(max_context, cfg.max_position_embeddings)
    model = Decoder(cfg, context, dtype=dtype, device="meta")
    expected = set(model.state_dict())
    missing = sorted(expected - dense.keys() - blocks.keys())
    if missing:
        raise ModelLoadError(f"{path}: tensors missing: {', '.join(missing[:5])}")
    unexpected = sorted((dense.keys() | blocks.keys()) - expected)
    if unexpected:
        raise ModelLoadError(f"{path}: tensors the model does not account for: {unexpected[:5]}")
    try:
        model.load_state_dict(dense, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"{path}: weights do not match its metadata: {exc}") from exc
    try:
        used = model.use_blocks(blocks, every_forward=bool(blocks), qk_orders=orders)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    model.eval()
    if dense_kinds:
        log.info(
            "%d of the GGUF's matrices load as dense weights only (types without a block "
            "kernel): %s",
            len(dense_kinds),
            describe_dense(dense_kinds),
        )
    if used:
        log.info(
            "%s mapped: all forwards compute on %d of the GGUF's quantized matrices, not copied",
            path,
            used,
        )
    return LoadedModel(
        name=name or path.stem,
        path=directory,
        config=cfg,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        max_context=context,
    )


def _block_rows(weight: QWeight, start: int, end: int) -> QWeight:
    return QWeight(weight.blocks[start:end], weight.kind)


def auto_dtype() -> torch.dtype:
    """The activations' dtype ``model.dtype = "auto"`` picks on this CPU: bfloat16 where the CPU
    multiplies bfloat16 natively (AVX512-BF16: faster at 32 streams on such a machine), else
    float32 (AVX2 has no bfloat16 products: a dense bfloat16 product ran ~7x slower than float32
    there). docs/benchmarks.md, "Defaults", has the measurements."""
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class ModelSource:
    """What ``model.path`` resolves to: a checkpoint directory, the name to report, and the
    tokenizer when the directory carries none (the built-in model's byte tokenizer)."""

    directory: Path
    name: str
    tokenizer: Tokenizer | None = None
    gguf: Path | None = None  # the GGUF file whose weights are served (directory describes it)


def resolve_source(model_cfg: ModelConfig) -> ModelSource:
    """Resolve ``model.path``: a named model (``bundled.NAMED_MODELS``), a ``.gguf`` file
    (converted once into a cached directory under ``model.data_dir``) or a checkpoint directory.
    Conversion runs here, so call it where the model is loaded (the engine thread)."""
    from zerolayer.models import bundled
    from zerolayer.models.gguf_errors import GGUFImportError
    from zerolayer.models.gguf_import import ensure_described, is_gguf

    path = model_cfg.path
    if not path:
        raise ModelLoadError(
            "model.path is empty: set a checkpoint directory, a .gguf file, or a named model "
            f"({', '.join(bundled.NAMED_MODELS)})"
        )
    try:
        if bundled.is_named(path):
            bundled.check_named(path)
            if path == BUILTIN_MODEL:
                from zerolayer.models.builtin import BUILTIN_NAME, builtin_tokenizer, ensure_builtin

                try:
                    directory = ensure_builtin(model_cfg.data_dir)
                except OSError as exc:
                    raise ModelLoadError(
                        f"cannot write the built-in model under {exc.filename}: {exc}"
                    ) from exc
                return ModelSource(directory, model_cfg.name or BUILTIN_NAME, builtin_tokenizer())
            gguf_file, default_name = bundled.named_gguf(path)
        elif is_gguf(Path(path).expanduser()):
            gguf_file = Path(path).expanduser()
            default_name = gguf_file.stem
        else:
            directory = Path(path).expanduser()
            if directory.is_file():
                raise ModelLoadError(
                    f"model.path {directory} is a file but not a GGUF file (no GGUF magic); give "
                    "a .gguf file or a checkpoint directory"
                )
            return ModelSource(directory, model_cfg.name or directory.name)
        directory, _ = ensure_described(gguf_file, model_cfg.data_dir)
        return ModelSource(directory, model_cfg.name or default_name, gguf=gguf_file)
    except (bundled.BundledModelError, GGUFImportError) as exc:
        raise ModelLoadError(str(exc)) from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot convert {path} under {exc.filename}: {exc}") from exc


def load_tokenizer(model_cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of the configured model, without loading its weights."""
    from zerolayer.models.hf_tokenizer import HFTokenizer, TokenizerLoadError

    source = resolve_source(model_cfg)
    if source.tokenizer is not None:
        return source.tokenizer
    try:
        return HFTokenizer(source.directory)
    except TokenizerLoadError as exc:
        raise ModelLoadError(str(exc)) from exc


def load_model(
    model_cfg: ModelConfig, max_context: int, dtype: torch.dtype | str | None = None
) -> LoadedModel:
    """The model the daemon serves, as ``model.path`` names it (``resolve_source``).
    ``dtype`` defaults to ``model_cfg.dtype``; float32 asked (not chosen by "auto") is the
    parity mode, whose block products keep float activations unless ``model.kernel`` says
    otherwise."""
    asked = dtype if dtype is not None else model_cfg.dtype
    torch_dtype = resolve_dtype(asked)
    int8 = qmatmul.uses_int8(model_cfg.kernel, parity=asked in ("float32", torch.float32))
    log.info(
        "activations %s (model.dtype=%s), block products on %s activations (model.kernel=%s)",
        str(torch_dtype).removeprefix("torch."), str(asked).removeprefix("torch."),
        "8-bit" if int8 else "float", model_cfg.kernel,
    )  # fmt: skip
    source = resolve_source(model_cfg)
    kernel_cache = data_root(model_cfg.data_dir) / "kernels"
    if source.gguf is not None:
        loaded = load_gguf(
            source.gguf,
            source.directory,
            max_context,
            torch_dtype,
            source.name,
            kernel_cache if model_cfg.quantized_decode else None,
        )
        loaded.model.use_int8_activations(int8)
        return loaded
    loaded = load_checkpoint(
        source.directory,
        max_context,
        torch_dtype,
        tokenizer=source.tokenizer,
        name=source.name,
        kernel_cache=kernel_cache if model_cfg.quantized_decode else None,
    )
    loaded.model.use_int8_activations(int8)
    return loaded
