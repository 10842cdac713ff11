"""The synthetic backend: no model, deterministic tokens, optional fixed step time.

It runs through the same scheduler as a real model so the whole serving layer can be tested and
measured alone. Each slot keeps a 64-bit digest of its prompt (and seed); the token at position p
is a hash of (digest, p) mapped onto lowercase letters and spaces of the byte-level tokenizer, so
text deltas are readable and a request's output is a pure function of prompt, seed and position.
It never emits EOS: streams end on max_tokens, stop ids, stop sequences or cancel.
"""

from __future__ import annotations

import time

import numpy as np

from gateway.engine.backend import Backend, ModelInfo
from gateway.engine.types import DecodeBatch, PrefillChunk

_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8).astype(np.int32)
_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def synthetic_token(digest: int, position: int) -> int:
    return int(_ALPHABET[_mix(digest ^ (position * 0xD6E8FEB86659FD93 & _MASK)) % len(_ALPHABET)])


class SyntheticBackend(Backend):
    def __init__(
        self, num_slots: int, vocab_size: int, max_context: int, step_ms: float = 0.0
    ) -> None:
        self.num_slots = num_slots
        self.info = ModelInfo(
            name="synthetic", vocab_size=vocab_size, eos_token_id=257, max_context=max_context
        )
        self._step_s = step_ms / 1000.0
        self._digest = [0] * num_slots

    def _sleep(self) -> None:
        if self._step_s:
            time.sleep(self._step_s)

    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        self._sleep()
        out = np.full(len(chunks), -1, np.int32)
        for i, chunk in enumerate(chunks):
            d = 0 if chunk.start == 0 else self._digest[chunk.slot]
            for t in chunk.tokens.tolist():
                d = _mix(d ^ (t & _MASK))
            self._digest[chunk.slot] = d
            if chunk.last:
                if chunk.sampling.seeded:
                    self._digest[chunk.slot] = d = _mix(d ^ chunk.sampling.seed)
                out[i] = synthetic_token(d, chunk.start + len(chunk.tokens))
        return out

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        self._sleep()
        out = np.empty(batch.size, np.int32)
        for i, (slot, pos) in enumerate(zip(batch.slots.tolist(), batch.positions.tolist())):
            out[i] = synthetic_token(self._digest[slot], pos + 1)
        return out

    def free(self, slot: int) -> None:
        self._digest[slot] = 0

    def save_prefix(self, slot: int, length: int) -> object:
        return self._digest[slot]

    def load_prefix(self, prefix: object, slot: int) -> None:
        self._digest[slot] = int(prefix)  # type: ignore[call-overload]

    def prefix_nbytes(self, prefix: object) -> int:
        return 8
