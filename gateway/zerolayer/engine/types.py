"""Narrow types exchanged between the scheduler and a backend: plain dataclasses of int32 arrays.

A backend never sees a request, a connection or a tokenizer; the scheduler never sees a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch only where a batch has processing (zerolayer.engine.sampling)
    from zerolayer.engine.sampling import Processing


@dataclass(slots=True)
class PrefillChunk:
    """Part (or all) of one prompt to write into a slot's KV cache.

    ``tokens`` occupy positions ``start .. start + len(tokens) - 1`` of ``slot``. When ``last`` is
    true the chunk ends the prompt and the backend samples the first output token from its final
    position with the row's sampling parameters.
    """

    slot: int
    tokens: np.ndarray  # int32 [n]
    start: int
    last: bool
    sampling: SamplingRow
    # The row's logits processing for its first token (a last chunk of a row that needs it:
    # zerolayer.engine.rows), a batch of one; None = plain sampling.
    processing: Processing | None = None


@dataclass(slots=True)
class SamplingRow:
    """Sampling parameters of one sequence. temperature 0 = greedy; top_k 0 and top_p 1 = off.
    The logits processing (gateway/zerolayer/engine/sampling.py; off at the defaults): penalties, a
    sparse logit_bias, min_tokens, and logprobs (-1 = none, else the number of alternatives)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    seeded: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int = -1

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )


@dataclass(slots=True)
class DecodeBatch:
    """One decode step over ``b`` active slots, each feeding its last sampled token.

    All arrays have length ``b`` and are read-only for the backend (the engine reuses them
    across steps). ``positions[i]`` is the position ``tokens[i]`` is written at;
    a seeded row draws its randomness from (seed, position), so its output does not depend on
    which other rows share the batch.
    """

    slots: np.ndarray  # int32 [b]
    tokens: np.ndarray  # int32 [b]
    positions: np.ndarray  # int32 [b]
    temperature: np.ndarray  # float32 [b]
    top_p: np.ndarray  # float32 [b]
    top_k: np.ndarray  # int32 [b]
    seeds: np.ndarray  # uint64 [b]
    seeded: np.ndarray  # bool [b]
    processing: Processing | None = None  # only when a row needs it (zerolayer.engine.rows)

    @property
    def size(self) -> int:
        return int(self.slots.shape[0])
