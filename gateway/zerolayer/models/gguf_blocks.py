"""The quantized blocks a converted GGUF keeps beside its dense weights, for
``zerolayer.kernels.qmatmul``.

``gguf_import`` writes, next to the dense float32 ``model.safetensors``, a ``BLOCKS_FILE``
holding every matrix of a block type in ``BLOCK_BYTES`` exactly as the file stores it: one row of
bytes per output row ([N, K / 32 * block bytes] uint8, under the Hugging Face name, q/k rows
un-permuted like the dense weights), the type named in the file's metadata. The loader hands
them to ``zerolayer.kernels.qmatmul`` as they are. llama.cpp's layouts (ggml-common.h), blocks of 32
weights:

* Q4_0: d (f16), 16 bytes of 4-bit q (byte j: element j in its low nibble, j + 16 in its high
  one); w = d * (q - 8);
* Q4_1: d (f16), m (f16), the same 16 bytes; w = d * q + m;
* Q8_0: d (f16), 32 int8 q; w = d * q.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from zerolayer.kernels.qmatmul import BLOCK_BYTES, QWeight

BLOCKS_FILE = "blocks.safetensors"
__all__ = ["BLOCKS_FILE", "BLOCK_BYTES", "read_blocks", "write_blocks"]


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


def read_blocks(directory: Path) -> dict[str, QWeight]:
    """``{hf name: QWeight}`` from ``directory``'s BLOCKS_FILE; empty when there is none."""
    from safetensors import safe_open

    path = directory / BLOCKS_FILE
    if not path.is_file():
        return {}
    out: dict[str, QWeight] = {}
    with safe_open(str(path), framework="pt") as fh:
        kinds = fh.metadata() or {}
        for name in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
            out[name] = QWeight(fh.get_tensor(name), kinds[name])
    return out
