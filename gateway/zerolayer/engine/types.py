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

    Prompt outputs (embeddings, prompt logprobs) are asked per chunk and written back by the
    backend into the chunk, which the engine reads after the call: with ``pool``, ``pooled`` is
    the SUM over the chunk's positions of the last layer's hidden states after the final norm
    (float32 [hidden]; the engine adds a prompt's chunks up and normalises); with ``score`` >= 0,
    ``scored`` holds, for each of ``targets`` (the prompt's ids that follow the chunk's
    positions: ``prompt[start + 1 : start + n + 1]``, one fewer on the last chunk), its logprob
    under the raw next-token distribution (temperature 1, no processing, as vLLM's prompt
    logprobs) and the ``score`` most likely ids with theirs.
    """

    slot: int
    tokens: np.ndarray  # int32 [n]
    start: int
    last: bool
    sampling: SamplingParams
    # The row's logits processing for its first token (a last chunk of a row that needs it:
    # zerolayer.engine.rows), a batch of one; None = plain sampling.
    processing: Processing | None = None
    pool: bool = False
    score: int = -1  # >= 0: score ``targets``, with this many alternatives each
    targets: np.ndarray | None = None  # int32 [m]
    pooled: np.ndarray | None = None  # OUT: float32 [hidden], the chunk's sum (see above)
    scored: PromptLogprobs | None = None  # OUT


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The logprobs of m prompt ids, each under the distribution of the position before it:
    ``token`` float32 [m], the ``k`` most likely alternatives ``top_ids`` int32 [m, k] and
    ``top`` float32 [m, k] (descending)."""

    token: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray

    @staticmethod
    def join(parts: list[PromptLogprobs]) -> PromptLogprobs:
        """A prompt's chunks' logprobs as one, in order."""
        if len(parts) == 1:
            return parts[0]
        return PromptLogprobs(
            np.concatenate([p.token for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top for p in parts]),
        )


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
