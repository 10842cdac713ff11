"""Per-row token sampling: temperature, top-k, top-p, greedy, reproducible seeds.

Each row of a [b, vocab] logits batch has its own parameters. Every random draw is one uniform
``u`` in [0, 1) per row, turned into a token by inverse-CDF over the row's filtered distribution
(sorted by descending probability, ties by token id). A seeded row takes ``u`` from a
counter-based hash of (seed, position) alone, so its token never depends on which other rows
share the batch or on how many tokens other requests drew before it. Unseeded rows take ``u``
from the sampler's own process RNG.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied to ``x + golden``, elementwise on uint64 (wrapping)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float64 [b] uniforms in [0, 1), a pure function of each row's (seed, position)."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    positions = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = splitmix64(splitmix64(seeds) ^ positions)
    # Top 53 bits: every value is an exact float64 in [0, 1).
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_with_uniforms(
    logits: torch.Tensor,  # [b, vocab]
    temperature: torch.Tensor,  # [b] float; <= 0 means greedy
    top_k: torch.Tensor,  # [b] int; 0 = off
    top_p: torch.Tensor,  # [b] float; >= 1 = off
    uniforms: torch.Tensor,  # [b] float64 in [0, 1); ignored for greedy rows
) -> torch.Tensor:
    """Token ids [b] int64. Order of filters: temperature, then top-k, then top-p over the
    renormalised top-k distribution (the order Hugging Face generate uses)."""
    out = torch.argmax(logits, dim=-1)
    rows = torch.nonzero(temperature > 0).flatten()
    if rows.numel() == 0:
        return out
    # Float64 keeps the cumulative sums stable; each row's math touches only that row.
    x = logits[rows].double() / temperature[rows].double()[:, None]
    x, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [r, vocab]
    vocab = x.shape[-1]
    rank = torch.arange(vocab)[None, :]
    k = top_k[rows].long()
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    x = x.masked_fill(rank >= k[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    # top-p keeps the smallest prefix whose mass reaches p: a token stays if the mass strictly
    # before it is below p. The first token always stays.
    before = torch.cumsum(probs, dim=-1) - probs
    keep = (before < top_p[rows].double()[:, None]) | (rank == 0)
    probs = probs.masked_fill(~keep, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[rows].double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    # Rounding can put target at the very end; tokens with probability left are a prefix of the
    # sorted order, so clamp into that prefix.
    idx = torch.minimum(idx, (probs > 0).sum(dim=-1) - 1)
    out[rows] = order.gather(1, idx[:, None]).squeeze(1)
    return out


class Sampler:
    """Samples a batch of rows; owns the RNG for unseeded rows."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def sample(
        self,
        logits: torch.Tensor,  # [b, vocab]
        temperature: np.ndarray,  # float32 [b]
        top_k: np.ndarray,  # int32 [b]
        top_p: np.ndarray,  # float32 [b]
        seeds: np.ndarray,  # uint64 [b]
        seeded: np.ndarray,  # bool [b]
        positions: np.ndarray,  # int [b]: position of the token being sampled
    ) -> np.ndarray:
        """Sampled token ids, int32 [b]."""
        seeded = np.asarray(seeded, dtype=bool)
        uniforms = self._rng.random(len(seeded))
        if seeded.any():
            uniforms[seeded] = seeded_uniform(
                np.asarray(seeds)[seeded], np.asarray(positions)[seeded]
            )
        ids = sample_with_uniforms(
            logits,
            torch.from_numpy(np.asarray(temperature, dtype=np.float32)),
            torch.from_numpy(np.asarray(top_k, dtype=np.int64)),
            torch.from_numpy(np.asarray(top_p, dtype=np.float32)),
            torch.from_numpy(uniforms),
        )
        return ids.numpy().astype(np.int32)
