"""Weights in 4-bit groups, multiplied by torch's int4 CPU kernel (bfloat16 activations).

``torch.ops.aten._weight_int4pack_mm_for_cpu`` multiplies bfloat16 rows by a weight [N, K]
stored as 4-bit values q in 0..15, in groups of ``GROUP`` along K, each group of each row with a
bfloat16 scale s and zero z: w = (q - 8) * s + z, accumulated in float32. Two block formats of
llama.cpp's GGUF files map onto it exactly up to the rounding of s and z to bfloat16:

* affine 4-bit (Q4_1: w = d * q + m per block of 32; Q4_0 is the case m = -8 d): s = d, z = m + 8 d;
* signed 8-bit (Q8_0: w = d * q, q in -127..127): q + 128 = 16 hi + lo with hi, lo in 0..15, two
  4-bit halves laid side by side along K (the input is read twice): the hi half with s = 16 d,
  z = 0, the lo half with s = d, z = 8 d; their sum is d * q.

A weight element thus differs from the file's value by at most 2^-8 * (|q - 8| |d| + |z|)
(bfloat16 keeps 8 significant bits; z is m + 8 d, or 0 or 8 d), against 2^-8 * |w| for the
same weight stored densely in bfloat16 (``max_rounding_error``).

The kernel reads a quarter of the bytes a dense bfloat16 matrix takes (half for 8-bit), and its
time grows with the number of input rows, a dense matmul's hardly at all: on the 2-core machine
of docs/benchmarks.md, per matrix of SmolLM2's shapes, it is 3-5x faster at one row and slower
from 8-16 rows up; callers use it for at most ``MAX_ROWS`` rows. In float32 the same op is
several times slower than a dense float32 matmul: it is for bfloat16 models only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP = 32  # elements per block: llama.cpp's Q4_0/Q4_1/Q8_0 block size
# Input rows up to which models use the int4 kernel. Whole SmolLM2 decode steps on the 2-core
# machine of docs/benchmarks.md, 4-bit against dense bfloat16: 8.6 vs 18.8 ms at 2 rows, 16.0 vs
# 22.4 ms at 8, 22.7 vs 26.7 at 12, even at 16 (2 threads; 1 thread: 25.8 vs 32.8 ms at 8).
MAX_ROWS = 8


@dataclass(frozen=True)
class Groups:
    """A weight [N, K] as 4-bit groups before packing: q [N, K * repeats] int32 in 0..15, scale
    and zero [N, K * repeats / GROUP] float32, w = (q - 8) * scale + zero; with ``repeats`` 2
    the input row is read twice (its two halves of K add up)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    repeats: int = 1

    @classmethod
    def affine(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Groups:
        """w = d * q + m per block (q [N, K] in 0..15, d and m [N, K / GROUP])."""
        return cls(q.to(torch.int32), d.float(), m.float() + 8 * d.float())

    @classmethod
    def signed8(cls, q: torch.Tensor, d: torch.Tensor) -> Groups:
        """w = d * q per block (q [N, K] int8, d [N, K / GROUP])."""
        biased = q.to(torch.int32) + 128  # 0..255 = 16 * hi + lo
        d = d.float()
        return cls(
            torch.cat((biased >> 4, biased & 15), dim=1),
            torch.cat((16 * d, d), dim=1),
            torch.cat((torch.zeros_like(d), 8 * d), dim=1),
            repeats=2,
        )

    @staticmethod
    def stack(parts: list[Groups]) -> Groups:
        """Weights of one input laid one under the other: one matmul for all their outputs."""
        if len({p.repeats for p in parts}) != 1:
            raise ValueError("cannot stack 4-bit and 8-bit groups")
        return Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].repeats,
        )

    @property
    def in_features(self) -> int:
        return self.q.shape[1] // self.repeats

    def max_rounding_error(self) -> torch.Tensor:
        """[N, K * repeats] float32: the bound on |packed weight - (q - 8) * scale - zero| that
        rounding scale and zero to bfloat16 allows (per half, when repeats is 2)."""
        err = (self.q - 8).abs() * self.scale.abs().repeat_interleave(GROUP, dim=1)
        return (err + self.zero.abs().repeat_interleave(GROUP, dim=1)) * 2.0**-8

    @property
    def packable(self) -> bool:
        """The kernel's shape limit: K a multiple of the group size (N is padded to 16)."""
        return self.q.shape[1] % GROUP == 0

    def pack(self) -> Int4Weight:
        if not self.packable:
            raise ValueError(f"cannot pack a [{self.q.shape[0]}, {self.q.shape[1]}] weight")
        n = self.q.shape[0]
        pad = -n % 16  # the kernel takes N in multiples of 16: zero rows (q = 8, s = z = 0)
        q = F.pad(self.q, (0, 0, 0, pad), value=8)
        scale, zero = F.pad(self.scale, (0, 0, 0, pad)), F.pad(self.zero, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [K / GROUP, N, 2]: per group and output, (scale, zero).
        scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
        return Int4Weight(packed, scales_zeros, self.in_features, n, self.repeats)


@dataclass(frozen=True)
class Int4Weight:
    """A packed weight; calling it on x [..., K] (bfloat16) gives x @ w.T [..., N] (bfloat16)."""

    packed: torch.Tensor  # the kernel's own layout, made by _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor  # [K * repeats / GROUP, N padded to 16, 2] bfloat16
    in_features: int
    out_features: int
    repeats: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.repeats == 2:
            rows = torch.cat((rows, rows), dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, GROUP, self.scales_zeros
        )
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        """The weight [N, K] as the kernel sees it (bfloat16), read back through the kernel."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self(eye).t().contiguous()
