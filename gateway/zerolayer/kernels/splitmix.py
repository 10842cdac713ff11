"""splitmix64: the counter-based hash behind every reproducible random number here — seeded
sampling's uniforms (``zerolayer.engine.sampling``), the synthetic backend's tokens and the
built-in model's weights."""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied to ``x + golden``, elementwise on uint64 (wrapping)."""
    z = np.asarray(x, dtype=np.uint64) + GOLDEN
    z = (z ^ (z >> np.uint64(30))) * MIX1
    z = (z ^ (z >> np.uint64(27))) * MIX2
    out: np.ndarray = z ^ (z >> np.uint64(31))  # numpy types uint64 ``^`` as Any
    return out


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of an n > 1 request seeded with ``seed``: index 0 keeps
    ``seed`` (so n = 1 is unchanged), the others get independent streams."""
    if index == 0:
        return seed
    mixed = splitmix64(np.array([seed ^ (index * 0x9E3779B97F4A7C15 & (2**64 - 1))], np.uint64))
    return int(mixed[0])
