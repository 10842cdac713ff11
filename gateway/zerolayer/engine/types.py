"""Narrow types exchanged between the scheduler and a backend: plain dataclasses of int32 arrays.

A backend never sees a request, a connection or a tokenizer; the scheduler never sees a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zerolayer.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch only where a batch has processing (zerolayer.engine.sampling)
    from zerolayer.engine.sampling import Processing


@dataclass(slots=True)
class PrefillChunk:
    """Part (or all) of one prompt to write into a slot's KV cache.

    ``tokens`` occupy positions ``start .. start + len(tokens) - 1`` of ``slot``. When ``last`` is
    true the chunk ends the prompt and the backend samples the first output token from its final
    position with the row's sampling parameters (``sampling``).
    """

    slot: int
    tokens: np.ndarray  # int32 [n]
    start: int
    last: bool
    sampling: SamplingParams
    # The row's logits processing for its first token (a last chunk of a row that needs it:
    # zerolayer.engine.rows), a batch of one; None = plain sampling.
    processing: Processing | None = None


@dataclass(slots=True)
class DecodeBatch:
    """One decode step over ``b`` active slots, each feeding its last sampled token.

    All arrays have length ``b`` and are read-only for the backend (the engine reuses them
    across steps). ``positions[i]`` is the position ``tokens[i]`` is written at; ``sampling``
    holds the rows' sampling parameters (zerolayer.sampling_params.SAMPLING_ROW, one column per
    parameter): a seeded row draws its randomness from (seed, position), so its output does not
    depend on which other rows share the batch.
    """

    slots: np.ndarray  # int32 [b]
    tokens: np.ndarray  # int32 [b]
    positions: np.ndarray  # int32 [b]
    sampling: np.ndarray  # SAMPLING_ROW [b]: each row's sampling parameters
    processing: Processing | None = None  # only when a row needs it (zerolayer.engine.rows)

    @property
    def size(self) -> int:
        return int(self.slots.shape[0])
