"""The quantized blocks a converted GGUF keeps beside its dense weights, for ``kernels.int4``.

``gguf_import`` writes, next to the dense float32 ``model.safetensors``, a ``BLOCKS_FILE``
holding every matrix of a block type in ``BLOCK_BYTES`` exactly as the file stores it: one row of
bytes per output row ([N, K / 32 * block bytes] uint8, under the Hugging Face name, q/k rows
un-permuted like the dense weights), the type named in the file's metadata. The loader turns
them into ``kernels.int4.Groups``. llama.cpp's layouts (ggml-common.h), blocks of 32 weights:

* Q4_0: d (f16), 16 bytes of 4-bit q (byte j: element j in its low nibble, j + 16 in its high
  one); w = d * (q - 8);
* Q4_1: d (f16), m (f16), the same 16 bytes; w = d * q + m;
* Q8_0: d (f16), 32 int8 q; w = d * q.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kernels.int4 import Groups

BLOCKS_FILE = "blocks.safetensors"
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def write_blocks(directory: Path, blocks: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write ``{hf name: (type name, [N, row bytes] uint8)}`` into ``directory``."""
    from safetensors.numpy import save_file

    for name, (kind, raw) in blocks.items():
        if kind not in BLOCK_BYTES or raw.dtype != np.uint8 or raw.ndim != 2:
            raise ValueError(f"{name}: not a [rows, bytes] uint8 array of a kept type ({kind})")
    save_file(
        {name: np.ascontiguousarray(raw) for name, (_, raw) in blocks.items()},
        str(directory / BLOCKS_FILE),
        metadata={name: kind for name, (kind, _) in blocks.items()},
    )


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, blocks, 16] bytes -> [N, blocks * 32] values 0..15 in element order."""
    return torch.cat((qs & 15, qs >> 4), dim=-1).flatten(1)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[N, blocks, 2] bytes -> [N, blocks] float32."""
    return raw.contiguous().view(torch.float16)[..., 0].float()


def decode(kind: str, raw: torch.Tensor) -> Groups:
    """One matrix's block bytes [N, blocks * BLOCK_BYTES[kind]] as ``Groups``."""
    blocks = raw.view(raw.shape[0], -1, BLOCK_BYTES[kind])
    d = _f16(blocks[..., 0:2])
    if kind == "Q4_0":
        return Groups.affine(_nibbles(blocks[..., 2:]), d, -8 * d)
    if kind == "Q4_1":
        return Groups.affine(_nibbles(blocks[..., 4:]), d, _f16(blocks[..., 2:4]))
    if kind == "Q8_0":
        return Groups.signed8(blocks[..., 2:].contiguous().view(torch.int8).flatten(1), d)
    raise ValueError(f"unknown block type {kind!r}")


def read_blocks(directory: Path) -> dict[str, Groups]:
    """``{hf name: Groups}`` from ``directory``'s BLOCKS_FILE; empty when there is none."""
    from safetensors import safe_open

    path = directory / BLOCKS_FILE
    if not path.is_file():
        return {}
    out: dict[str, Groups] = {}
    with safe_open(str(path), framework="pt") as fh:
        kinds = fh.metadata() or {}
        for name in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
            out[name] = decode(kinds[name], fh.get_tensor(name))
    return out
