"""How a request samples: ``SamplingParams``, the one type that carries a request's sampling
parameters from each door's parser to the engine's sampler.

A door parses its wire into one (zerolayer.request_path.validation checks it, the same way for
every door), the ``Request`` holds it, the input processor hands it to the engine's
``Sequence``, the hooks see it in their ``RequestContext`` (the response cache's key hashes its
row), and a prompt's last chunk carries it to the backend. The engine stores the parameters the
sampler reads for every row in one structured array by slot (``SAMPLING_ROW``, one column per
field, written in place when a row joins: zerolayer.engine.rows); a decode batch carries those
rows, and the sampler (zerolayer.engine.sampling) reads its columns by name. The logits
processing fields (penalties, logit_bias, min_tokens, logprobs) are the rows' sparse per-row
state instead, read only for the rows that use them.

Adding a field: the field here (and its column in ``SAMPLING_ROW`` when the sampler reads it for
every row), its JSON parser and its range in zerolayer.request_path.validation, its key in the
doors' lists of accepted keys, and what the sampler does with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

#: The per-row columns of the engine's sampling storage and of a decode batch, in the order
#: ``SamplingParams.row`` gives them: temperature (0 = greedy), top_p (1 = off), top_k (0 = off),
#: min_p (0 = off), the seed and whether there is one.
SAMPLING_ROW = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_p", "<f4"),
        ("top_k", "<i4"),
        ("min_p", "<f4"),
        ("seed", "<u8"),
        ("seeded", "?"),
    ]
)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling parameters, as validated (zerolayer.request_path.validation: each
    field's range, ``top_k`` -1 written as 0, a negative seed as its uint64). The defaults are
    greedy decoding with no processing; a door with other defaults (the HTTP APIs' temperature
    1.0) says so when it parses.

    The logits processing (gateway/zerolayer/engine/sampling.py says the order and semantics):
    OpenAI's presence and frequency penalties over the output, Hugging Face's repetition
    penalty over prompt + output, a sparse ``logit_bias``, ``min_tokens`` (EOS and stop ids
    masked until that many tokens were produced) and logprobs (``top_logprobs`` alternatives
    with each sampled token's logprob, after the processing and the temperature)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature)
    seed: int | None = None  # None = unseeded
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit; never {}
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def penalised(self) -> bool:
        """Any penalty on (the rows then keep token counts)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Any logits processing on: penalties, logit_bias, min_tokens or logprobs."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0 or self.logprobs

    @property
    def logprob_count(self) -> int:
        """The alternatives a row wants with each token's logprob; -1 = no logprobs."""
        return self.top_logprobs if self.logprobs else -1

    @property
    def deterministic(self) -> bool:
        """The same inputs give the same tokens: greedy, or seeded."""
        return self.temperature == 0 or self.seed is not None

    def row(self) -> tuple[float, float, int, float, int, bool]:
        """The values of the ``SAMPLING_ROW`` columns."""
        seed = self.seed
        return (self.temperature, self.top_p, self.top_k, self.min_p, seed or 0, seed is not None)


def sampling_rows(params: Iterable[SamplingParams]) -> np.ndarray:
    """``SAMPLING_ROW`` [n]: one row per parameters."""
    return np.array([p.row() for p in params], SAMPLING_ROW)
