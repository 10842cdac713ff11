"""The synthetic backend: no model, deterministic tokens, optional step time.

It runs through the same scheduler as a real model so the whole serving layer can be tested and
measured alone. Each slot keeps a 64-bit digest of its prompt (and seed); the token at position p
is a hash of (digest, p) mapped onto lowercase letters and spaces of the byte-level tokenizer, so
text deltas are readable and a request's output is a pure function of prompt, seed and position.
It never emits EOS: streams end on max_tokens, stop ids, stop sequences or cancel.

A prompt folds into its digest id by id, ``d = d * _FOLD + mix(id)`` (mod 2**64): a polynomial
hash, so a chunk's digests at all its positions come from one cumulative sum (``_fold``) instead
of a numpy call per position. Its "KV cache" is the running digest at every prompt position of
every slot (uint64 [slots, max_context]): a chunk continues from the digest of the position
before it, so a range saved from one slot and loaded into another (``save_kv`` / ``load_kv``,
the prefix store) gives exactly the digest, and so the tokens, that prefilling those ids would.
Reused positions are never sent to ``prefill``, so with a per-token cost
(``prefill_us_per_token``) they cost nothing, as on a model.

Hashing costs about as much per step as the rest of the engine, and this backend stands in for a
model in the serving benchmark, so while a batch keeps its rows (the engine passes the same
``slots`` array, its positions one further each step) decode computes the tokens of several
coming steps at once and hands them out step by step: the same tokens, hashed in fewer calls.

Rows with logits processing (gateway/zerolayer/engine/sampling.py: penalties, logit bias,
min_tokens, a grammar, logprobs) get logits made up for the purpose, 0 everywhere but ``PEAK`` at
the hashed token, processed by the real sampler and taken greedily: an unconstrained, unbiased row
keeps its hashed token, a grammar row the lowest-id token its grammar allows unless the hashed one
is allowed, and logprobs are those of that made-up distribution (T = 1).

Prompt outputs come from the same digests: a position's "hidden state" is ``HIDDEN`` floats
hashed from its digest (so a chunk's sum, ``pooled``, does not depend on how the prompt was
chunked), and its next-token distribution is the made-up one above (``PEAK`` at the token hashed
from its digest and the next position, 0 elsewhere), which scores the prompt's ids.

Pacing (``step_ms``, ``prefill_us_per_token``) imitates a model: one pause per engine step,
whether the step carries prefill chunks, decode rows or both, plus a cost per prefill token. An
engine step calls ``prefill`` (if it has chunks) and then ``decode`` (if it has decode rows), so
``prefill`` pays the step's pause (and its tokens' cost), and a ``decode`` that directly follows
a ``prefill`` skips its own pause when it belongs to the same step. It does unless its batch holds
a slot that prefill just finished: the engine decodes a sequence from the step after the one that
finished its prompt, so such a decode opens the next step. (A decode right after a prefill is in
the next step only when that step had no decode rows, and then every row it decodes is one the
prefill just finished.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from zerolayer.engine.backend import Backend, ModelInfo, PrefixKV
from zerolayer.engine.types import DecodeBatch, PrefillChunk, PromptLogprobs
from zerolayer.kernels.splitmix import MIX1, splitmix64
from zerolayer.sampling_params import SamplingParams, sampling_rows

if TYPE_CHECKING:
    from zerolayer.engine.sampling import Processing, Sampler

GREEDY = SamplingParams()  # how a processed row is taken from its made-up logits
PEAK = 8.0  # the made-up logit of a processed row's hashed token (module docstring)
HIDDEN = 64  # the length of a synthetic embedding
_LANES = (np.arange(HIDDEN, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)

# 64 entries, indexed by the top 6 bits of a token's hash: letters twice, then spaces.
_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz" * 2 + b" " * 12, np.uint8).astype(np.int32)
_U64 = np.uint64
_POS = _U64(0xD6E8FEB86659FD93)


_FOLD = 0x100000001B3  # odd, so invertible mod 2**64
_UNFOLD = pow(_FOLD, -1, 2**64)


def _powers(base: int, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) mod 2**64 (uint64 [n])."""
    out = np.full(n, base, _U64)
    out[0] = 1
    return np.cumprod(out, dtype=_U64)


_MIN_BLOCK, _MAX_BLOCK = 4, 64  # decode steps hashed at once; doubles while the rows stay


def synthetic_tokens(digests: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token ids for (digest, position) pairs, broadcast: int32 of their shape. One multiply
    spreads (digest, position) into the top bits, which pick the letter: few numpy calls, as
    this runs whenever the decode rows change."""
    h = digests ^ (positions.astype(_U64) * _POS)
    h *= MIX1
    h >>= _U64(58)
    tokens: np.ndarray = _ALPHABET[h]  # numpy types fancy indexing as Any
    return tokens


class SyntheticBackend(Backend, PrefixKV[np.ndarray]):
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        max_context: int,
        step_ms: float = 0.0,
        prefill_us_per_token: float = 0.0,
    ) -> None:
        self.num_slots = num_slots
        self.info = ModelInfo(
            name="synthetic",
            vocab_size=vocab_size,
            eos_token_id=257,
            max_context=max_context,
            hidden_size=HIDDEN,
        )
        self._step_s = step_ms / 1000.0
        self._prefill_token_s = prefill_us_per_token / 1e6
        # Slots whose prompt the last call (a prefill) finished; None after a decode.
        self._just_prefilled: set[int] | None = None
        self._digest = np.zeros(num_slots, _U64)  # what decode hashes: the prompt's, seeded
        self._kv = np.zeros((num_slots, max_context), _U64)  # unseeded digest after position p
        self._up = _powers(_FOLD, max_context + 1)  # _FOLD ** k, for _fold
        self._down = _powers(_UNFOLD, max_context + 1)  # _FOLD ** -k
        # Tokens of coming decode steps for one batch of rows: the slots array they are for,
        # the positions each step's batch will carry (int32 [k, b]), the tokens (int32 [k, b]),
        # the next step to hand out, and the size of the next block.
        self._block_slots: np.ndarray | None = None
        self._block_positions: list[bytes] = []  # each step's positions, as bytes to compare
        self._block: list[np.ndarray] = []  # each step's tokens (read-only rows)
        self._block_next = 0
        self._block_size = _MIN_BLOCK
        self._sampler: Sampler | None = None  # for rows with processing, made at first use

    def _processed(self, tokens: np.ndarray, proc: Processing) -> np.ndarray:
        """The tokens of rows with processing (module docstring): greedy over made-up logits."""
        import torch

        from zerolayer.engine.sampling import Sampler

        if self._sampler is None:
            self._sampler = Sampler(0)
        b = len(tokens)
        logits = torch.zeros(b, self.info.vocab_size)
        logits[torch.arange(b), torch.from_numpy(tokens.astype(np.int64))] = PEAK
        greedy = sampling_rows([GREEDY] * b)
        return self._sampler.sample(logits, greedy, np.zeros(b, np.int64), proc).ids

    def _pause_prefill(self, chunks: list[PrefillChunk]) -> None:
        pause = self._step_s + self._prefill_token_s * sum(len(c.tokens) for c in chunks)
        if pause:
            time.sleep(pause)
        self._just_prefilled = {c.slot for c in chunks if c.last}

    def _pause_decode(self, batch: DecodeBatch) -> None:
        """The step's pause, unless a prefill of the same step paid it (module docstring)."""
        after = self._just_prefilled
        self._just_prefilled = None
        if after is not None and after.isdisjoint(batch.slots.tolist()):
            return
        if self._step_s:
            time.sleep(self._step_s)

    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        self._pause_prefill(chunks)
        self._forget_block()
        slots = [chunk.slot for chunk in chunks]
        if len(set(slots)) < len(slots):  # a slot's chunks chain: one after the other
            out = np.concatenate([self._prefill([chunk]) for chunk in chunks])
        else:
            out = self._prefill(chunks)
        for i, chunk in enumerate(chunks):
            if chunk.processing is not None:
                out[i] = self._processed(out[i : i + 1], chunk.processing)[0]
            if chunk.pool or chunk.score >= 0:
                self._prompt_outputs(chunk)
        return out

    def _prompt_outputs(self, chunk: PrefillChunk) -> None:
        """``pooled`` and ``scored`` from the digests after each of the chunk's positions
        (module docstring)."""
        n = len(chunk.tokens)
        digests = self._kv[chunk.slot, chunk.start : chunk.start + n]
        if chunk.pool:
            bits = splitmix64(digests[:, None] ^ _LANES[None, :]) >> _U64(11)
            states = bits.astype(np.float64) / float(1 << 52) - 1.0  # [n, HIDDEN] in [-1, 1)
            chunk.pooled = states.sum(0).astype(np.float32)
        if chunk.score >= 0:
            assert chunk.targets is not None
            m, k, vocab = len(chunk.targets), chunk.score, self.info.vocab_size
            positions = np.arange(chunk.start, chunk.start + m, dtype=np.int64)
            peak = synthetic_tokens(digests[:m], positions + 1)
            log_z = float(np.logaddexp(PEAK, np.log(vocab - 1)))
            token = np.where(chunk.targets == peak, PEAK, 0.0) - log_z
            others = np.arange(k, dtype=np.int32)[None, :]  # the lowest ids but the peak's
            others = others + (others >= peak[:, None])
            top_ids = np.concatenate([peak[:, None], others[:, : k - 1]], 1)[:, :k]
            top = np.where(np.arange(k)[None, :] == 0, PEAK, 0.0) - log_z
            chunk.scored = PromptLogprobs(
                token.astype(np.float32),
                top_ids.astype(np.int32),
                np.broadcast_to(top, (m, k)).astype(np.float32),
            )

    def _prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        """Each chunk's ids fold into its slot's digest in order; the chunks (distinct slots)
        fold side by side, all positions at once (``_fold``). Every id is addressed by its
        (chunk, column) pair, so gathering the ids and storing the "KV" are one numpy call each
        whatever the number of chunks (this runs on the engine thread, where a call costs)."""
        n = len(chunks)
        kv = self._kv
        slots = np.fromiter([c.slot for c in chunks], np.intp, n)
        starts = np.fromiter([c.start for c in chunks], np.intp, n)
        lengths = np.fromiter([len(c.tokens) for c in chunks], np.intp, n)
        # A chunk goes on from the digest of the position before it (0 at the prompt's start).
        digests = np.where(starts > 0, kv[slots, np.maximum(starts - 1, 0)], _U64(0))
        row = np.repeat(np.arange(n), lengths)  # each id's chunk ...
        col = np.arange(len(row)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # ... column
        ids = np.zeros((n, int(lengths.max(initial=0))), _U64)
        ids[row, col] = np.concatenate([c.tokens for c in chunks])
        history = self._fold(digests, ids)  # the digest after each id: the chunk's "KV"
        kv[slots[row], starts[row] + col] = history[row, col]
        if ids.shape[1]:  # each chunk's digest after its last id (an empty chunk keeps its own)
            digests = np.where(
                lengths > 0, history[np.arange(n), np.maximum(lengths - 1, 0)], digests
            )
        last = np.array([c.last for c in chunks], np.bool_)
        seeded = np.array([c.last and c.sampling.seed is not None for c in chunks], np.bool_)
        if seeded.any():
            seeds = np.array([c.sampling.seed or 0 for c in chunks], _U64)
            digests[seeded] = splitmix64(digests[seeded] ^ seeds[seeded])
        out = np.full(n, -1, np.int32)
        if last.any():
            out[last] = synthetic_tokens(digests[last], (starts + lengths)[last])
        self._digest[slots] = digests
        return out

    def _fold(self, digests: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Row i's digest after each of its ids, from ``digests[i]``: with P = _FOLD,
        h[j] = d * P**(j+1) + sum over i <= j of mix(id[i]) * P**(j-i)
             = d * P**(j+1) + P**j * cumsum(mix(id[i]) * P**-i)  (all mod 2**64)."""
        width = ids.shape[1]  # at most max_context: the tables' length - 1
        up, down = self._up, self._down
        acc = np.cumsum(splitmix64(ids) * down[:width], axis=1, dtype=_U64)
        folded: np.ndarray = acc * up[:width] + digests[:, None] * up[1 : width + 1]
        return folded

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        tokens = self._decode(batch)
        if batch.processing is not None:
            return self._processed(tokens, batch.processing)
        return tokens

    def _decode(self, batch: DecodeBatch) -> np.ndarray:
        self._pause_decode(batch)
        if batch.slots is not self._block_slots:  # new rows: one step, and remember them
            self._forget_block()
            self._block_slots = batch.slots
            return synthetic_tokens(self._digest[batch.slots], batch.positions + 1)
        j = self._block_next
        # One bytes comparison instead of numpy calls: this runs once per paced step.
        if j < len(self._block) and batch.positions.tobytes() == self._block_positions[j]:
            self._block_next = j + 1
            return self._block[j]
        # The same rows again: hash this step and the next ones in one go.
        k = self._block_size
        self._block_size = min(2 * k, _MAX_BLOCK)
        steps = np.arange(k, dtype=np.int32)[:, None]
        positions = batch.positions[None, :] + steps
        block = synthetic_tokens(self._digest[batch.slots][None, :], positions + 1)
        block.flags.writeable = False  # handed out row by row: nobody may change them
        self._block_positions = [row.tobytes() for row in positions]  # batch.positions dtype
        self._block = list(block)
        self._block_next = 1
        return self._block[0]

    def _forget_block(self) -> None:
        """Slots' digests may change: tokens hashed ahead are no longer valid."""
        self._block_slots = None
        self._block_next = len(self._block)
        self._block_size = _MIN_BLOCK

    def free(self, slot: int) -> None:
        self._forget_block()
        self._digest[slot] = 0

    def save_kv(self, slot: int, start: int, end: int) -> np.ndarray:
        saved: np.ndarray = self._kv[slot, start:end].copy()  # numpy types indexing as Any
        return saved

    def load_kv(self, handle: np.ndarray, slot: int, start: int) -> None:
        self._forget_block()
        self._kv[slot, start : start + len(handle)] = handle

    def kv_nbytes(self, handle: np.ndarray) -> int:
        return int(handle.nbytes)
