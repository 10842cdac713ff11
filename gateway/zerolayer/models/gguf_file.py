"""A GGUF file memory-mapped once, its tensors as views of the map: the weights the decoder
computes on are the file's own pages, never copied into a dense twin.

``GGUFFile.open`` parses the header (``gguf_import.read_header``: where each tensor lies) and
maps the whole file once, copy-on-write (``mmap.ACCESS_COPY``, so torch gets a writable buffer
and never warns; nothing writes to it, so every page stays the file's, shared with the page
cache and reclaimable under memory pressure). ``blocks(name)`` is a matrix's raw blocks as a
[rows, row bytes] uint8 view; ``dense(name)`` dequantizes a tensor into float32 (the small
tensors: norms, biases, rope factors; and matrices of a type without a block kernel). The map
lives as long as any view of it. A file truncated or rewritten while it is served can make the
process fault (SIGBUS), as with llama.cpp's own mmap: replace model files by renaming a new one
into place, never by writing over the old one.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zerolayer.models.gguf_errors import GGUFImportError
from zerolayer.models.gguf_import import Header, TensorInfo, read_header


def tensor_nbytes(info: TensorInfo) -> int:
    """Bytes of a tensor's data: its elements in blocks of its type (gguf's GGML_QUANT_SIZES)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[info.kind]]
    elements = int(np.prod(info.shape)) if info.shape else 1
    return elements // block * size


@dataclass
class GGUFFile:
    """One GGUF file, mapped: its header and the map (as one uint8 tensor)."""

    path: Path
    header: Header
    data: torch.Tensor  # [file bytes] uint8, a view of the map

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        header = read_header(path)
        try:
            with open(path, "rb") as fh:
                mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise GGUFImportError(f"cannot map {path}: {exc}") from exc
        if hasattr(mmap, "MADV_WILLNEED"):  # start reading ahead; the pages stay the file's
            mapped.madvise(mmap.MADV_WILLNEED)
        for name, info in header.layout.items():
            if info.offset + tensor_nbytes(info) > len(mapped):
                raise GGUFImportError(f"{path}: tensor {name} lies beyond the end of the file")
        return cls(path, header, torch.frombuffer(mapped, dtype=torch.uint8))

    def info(self, name: str) -> TensorInfo:
        return self.header.layout[name]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes, a view of the map."""
        info = self.info(name)
        return self.data.narrow(0, info.offset, tensor_nbytes(info))

    def blocks(self, name: str) -> torch.Tensor:
        """A matrix [rows, cols] as [rows, row bytes] uint8: one row of blocks per output row."""
        info = self.info(name)
        return self.raw(name).view(info.shape[0], -1)

    def dense(self, name: str) -> torch.Tensor:
        """The tensor dequantized into float32 (a copy), shaped as numpy lists its dims."""
        import gguf
        from gguf import quants

        info = self.info(name)
        kind = gguf.GGMLQuantizationType[info.kind]
        row = quants.quant_shape_to_byte_shape((info.shape[-1],), kind)[-1]
        values = quants.dequantize(self.raw(name).numpy().reshape(-1, row), kind)
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(info.shape))
