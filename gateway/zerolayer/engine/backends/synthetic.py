"""The synthetic backend: no model, deterministic tokens, optional step time.

It runs through the same scheduler as a real model so the whole serving layer can be tested and
measured alone. Each slot keeps a 64-bit digest of its ids so far at every position; the token at
position p is a hash of (digest, seed, p) mapped onto lowercase letters and spaces of the
byte-level tokenizer, so text deltas are readable and a request's output is a pure function of
prompt, seed and position.
It never emits EOS: streams end on max_tokens, stop ids, stop sequences or cancel.

A sequence folds into its digest id by id, ``d = d * _FOLD + mix(id)`` (mod 2**64): a polynomial
hash, so a chunk's digests at all its positions come from one cumulative sum (``_fold``) instead
of a numpy call per position. Its "KV cache" is the running digest after every position, prompt
and output alike, kept in pages (zerolayer.engine.kv_pages: uint64 [num_pages * 16], position p
of a slot at ``tables[slot, p // 16] * 16 + p % 16``): a chunk or a decode step goes on from the
digest of the position before it, read through the slot's page table, and the next token is a
hash of the digest after its input (mixed with the seed of a seeded row) and the position. So the
output is a function of the sequence's ids, seed and position, like a model's, and a wrong page
mapping (a page shared without a copy, a page freed while in use, a preempted sequence
recomputed wrongly) gives wrong tokens. Decode rows also keep their running digest (the last
position's): the same rows one position on (the engine's batch arrays unchanged) go on from it
with a few numpy calls per step, still writing each digest through the page tables; a row's
digest is read from its page whenever the rows change and its slot's last known digest is not the
position's before its input (admission, recompute, a prefix or a prompt's KV loaded). A copy on
write keeps a page's digests, so it needs no read. A range shared from one slot into another
(the prefix store, n choices) gives exactly the tokens that prefilling those ids would. Reused
positions are never sent to ``prefill``, so with a per-token cost (``prefill_us_per_token``) they
cost nothing, as on a model.

The engine reserves every page a call writes (``kv_pages``); a position without a page is the
scheduler's bug and raises. The pool holds ``num_pages`` pages (default: every slot's whole
context, so nothing ever waits); a page is 128 bytes (16 digests).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zerolayer.engine.backend import Backend, ModelInfo, PagedKV
from zerolayer.engine.kv_pages import PAGE_TOKENS, PagePool, pages_for
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
PAGE_BYTES = PAGE_TOKENS * 8  # a page of 16 uint64 digests
_POS = _U64(0xD6E8FEB86659FD93)


_FOLD = 0x100000001B3  # odd, so invertible mod 2**64
_UNFOLD = pow(_FOLD, -1, 2**64)


def _powers(base: int, n: int) -> np.ndarray:
    """base**0 .. base**(n-1) mod 2**64 (uint64 [n])."""
    out = np.full(n, base, _U64)
    out[0] = 1
    return np.cumprod(out, dtype=_U64)


def _next_tokens(
    digests: np.ndarray, seeds: np.ndarray, seeded: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """The token after each digest (the sequence's ids up to ``positions - 1``): a seeded row's
    digest is mixed with its seed first."""
    if np.count_nonzero(seeded):  # count_nonzero: no ufunc reduction set up per step
        digests = np.where(seeded, splitmix64(digests ^ seeds.astype(_U64)), digests)
    return synthetic_tokens(digests, positions)


def synthetic_tokens(digests: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token ids for (digest, position) pairs, broadcast: int32 of their shape. One multiply
    spreads (digest, position) into the top bits, which pick the letter: few numpy calls, as
    this runs whenever the decode rows change."""
    return _letters(digests ^ (positions.astype(_U64) * _POS))


def _letters(h: np.ndarray) -> np.ndarray:
    """The tokens of hashes ``digest ^ position * _POS`` (``synthetic_tokens``), ``h`` mixed in
    place."""
    h *= MIX1
    h >>= _U64(58)
    tokens: np.ndarray = _ALPHABET.take(h)
    return tokens


class SyntheticBackend(PagedKV, Backend):
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        max_context: int,
        step_ms: float = 0.0,
        prefill_us_per_token: float = 0.0,
        num_pages: int = 0,
    ) -> None:
        self.num_slots = num_slots
        row_pages = pages_for(max_context)
        pool = PagePool(num_pages or num_slots * row_pages, num_slots, row_pages)
        self.kv_pages: PagePool = pool
        self.kv_page_bytes = PAGE_BYTES
        self.info = ModelInfo(
            name="synthetic",
            vocab_size=vocab_size,
            eos_token_id=257,
            max_context=max_context,
            hidden_size=HIDDEN,
            kv_positions=pool.positions,
        )
        self._step_s = step_ms / 1000.0
        self._prefill_token_s = prefill_us_per_token / 1e6
        # Slots whose prompt the last call (a prefill) finished; None after a decode.
        self._just_prefilled: set[int] | None = None
        self._kv = np.zeros(pool.num_pages * PAGE_TOKENS, _U64)  # unseeded digest after each
        self._up = _powers(_FOLD, max_context + 1)  # _FOLD ** k, for _fold
        self._down = _powers(_UNFOLD, max_context + 1)  # _FOLD ** -k
        self._sampler: Sampler | None = None  # for rows with processing, made at first use
        # Each slot's running digest: the digest after position ``_at[slot]`` (-1: none known,
        # read from the pages). Up to date only while no decode rows are cached (``_rows``).
        self._digest = np.zeros(num_slots, _U64)
        self._at = np.full(num_slots, -1, np.int64)
        self._rows: _DecodeRows | None = None
        # the page tables as unsigned ids: a missing page (-1) addresses far beyond ``_kv``
        self._page_ids = pool.tables.view(np.uint32).reshape(-1)
        self._row_pages = row_pages
        # mix(id) of every id, so that a decode step folds its inputs with one lookup (256 KiB
        # for 32,000 ids; none beyond 2**20 ids, hashed per step then)
        self._mix = (
            splitmix64(np.arange(vocab_size, dtype=_U64))
            if vocab_size <= 1 << 20
            else (np.empty(0, _U64))
        )

    def _where(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Where (slot, position) pairs live in ``_kv``, through the page tables."""
        pages = self.kv_pages.tables[slots, positions // PAGE_TOKENS]
        if pages.min() < 0:
            raise AssertionError("the synthetic KV was addressed at a position without a page")
        where: np.ndarray = pages.astype(np.intp) * PAGE_TOKENS + positions % PAGE_TOKENS
        return where

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        pairs = np.array(copies, np.intp).reshape(-1, 2) * PAGE_TOKENS
        lanes = np.arange(PAGE_TOKENS)
        self._kv[(pairs[:, 1:] + lanes).ravel()] = self._kv[(pairs[:, :1] + lanes).ravel()]

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
        self._settle()
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
        positions = np.arange(chunk.start, chunk.start + n)
        digests = self._kv[self._where(np.full(n, chunk.slot), positions)]
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
        after = starts > 0
        digests = np.zeros(n, _U64)
        if after.any():
            digests[after] = kv[self._where(slots[after], starts[after] - 1)]
        row = np.repeat(np.arange(n), lengths)  # each id's chunk ...
        col = np.arange(len(row)) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # ... column
        ids = np.zeros((n, int(lengths.max(initial=0))), _U64)
        ids[row, col] = np.concatenate([c.tokens for c in chunks])
        history = self._fold(digests, ids)  # the digest after each id: the chunk's "KV"
        kv[self._where(slots[row], starts[row] + col)] = history[row, col]
        if ids.shape[1]:  # each chunk's digest after its last id (an empty chunk keeps its own)
            digests = np.where(
                lengths > 0, history[np.arange(n), np.maximum(lengths - 1, 0)], digests
            )
        self._digest[slots] = digests  # each slot's running digest (distinct slots)
        self._at[slots] = starts + lengths - 1
        last = np.array([c.last for c in chunks], np.bool_)
        out = np.full(n, -1, np.int32)
        if last.any():
            seeds = np.array([c.sampling.seed or 0 for c in chunks], _U64)
            seeded = np.array([c.sampling.seed is not None for c in chunks], np.bool_)
            out[last] = _next_tokens(
                digests[last], seeds[last], seeded[last], (starts + lengths)[last]
            )
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
        """Each row's input folds into its running digest (the digest of the position before
        it), which is written at its position through the page tables; the next token hashes
        that digest (seeded rows: mixed with the seed). The same rows as the last step's, one
        position on, go on from the digests cached with them (``_DecodeRows``): a handful of
        numpy calls per step, whatever the number of rows."""
        self._pause_decode(batch)
        rows = self._rows
        if (
            rows is None
            or rows.slots is not batch.slots
            or rows.sampling is not batch.sampling
            or rows.positions.tobytes() != batch.positions.tobytes()
        ):
            rows = self._start_rows(batch)
        self._rows = None  # until this step is done: a failed step leaves no cache
        positions = rows.positions
        mixed = self._mix.take(batch.tokens) if len(self._mix) else splitmix64(batch.tokens)
        digests = rows.digests
        digests *= _U64(_FOLD)
        digests += mixed
        # Written through the page table every step: a copy on write or a new page is used at
        # once. A missing page (-1) wraps to an index beyond ``_kv`` (uint32 ids).
        pages = self._page_ids.take(rows.base + positions // PAGE_TOKENS)
        try:
            self._kv[pages * PAGE_TOKENS + positions % PAGE_TOKENS] = digests
        except IndexError as err:
            self._at[batch.slots] = -1
            msg = "the synthetic KV was addressed at a position without a page"
            raise AssertionError(msg) from err
        h = digests ^ rows.position_hash
        if rows.seeds is not None:
            seeded = splitmix64(digests ^ rows.seeds) ^ rows.position_hash
            h = np.where(rows.seeded, seeded, h)
        positions += 1
        rows.position_hash += _POS
        self._rows = rows
        return _letters(h)

    def _start_rows(self, batch: DecodeBatch) -> _DecodeRows:
        """The cache of new decode rows: each row's running digest, read from its page when the
        slot's last known digest is not that of the position before its input (its table
        changed: admission, recompute, a prefix or a prompt's KV loaded, or never decoded)."""
        self._settle()
        slots, positions = batch.slots, batch.positions.copy()
        digests = self._digest[slots]
        stale = self._at[slots] != positions - 1
        if np.count_nonzero(stale):  # a decode input always follows a prompt: position >= 1
            digests[stale] = self._kv[self._where(slots[stale], positions[stale] - 1)]
        sampling = batch.sampling
        seeded = sampling["seeded"]
        return _DecodeRows(
            slots=slots,
            sampling=sampling,
            positions=positions,
            digests=digests,
            base=slots.astype(np.intp) * self._row_pages,
            position_hash=(positions + 1).astype(_U64) * _POS,
            seeded=seeded,
            seeds=sampling["seed"].astype(_U64) if np.count_nonzero(seeded) else None,
        )

    def _settle(self) -> None:
        """The cached decode rows' digests back into the per-slot state (before anything else
        reads or changes it)."""
        rows = self._rows
        if rows is not None:
            self._rows = None
            self._digest[rows.slots] = rows.digests
            self._at[rows.slots] = rows.positions - 1

    def free(self, slot: int) -> None:
        self._settle()
        self._at[slot] = -1

    def load_kv(self, handle: np.ndarray, slot: int, start: int) -> None:
        super().load_kv(handle, slot, start)
        self._settle()
        self._at[slot] = -1


@dataclass(slots=True)
class _DecodeRows:
    """The last decode step's rows, kept for the next step with the same rows (the same
    ``slots`` and ``sampling`` arrays, as the engine hands them while its rows do not change).
    ``positions`` are the next step's inputs' positions and ``digests`` the digests before
    them; both advance in place."""

    slots: np.ndarray  # int32 [rows]
    sampling: np.ndarray  # SAMPLING_ROW [rows]
    positions: np.ndarray  # [rows], batch.positions' dtype
    digests: np.ndarray  # uint64 [rows]
    base: np.ndarray  # intp [rows]: where each slot's table starts in the flat tables
    position_hash: np.ndarray  # uint64 [rows]: (positions + 1) * _POS
    seeded: np.ndarray  # bool [rows]
    seeds: np.ndarray | None  # uint64 [rows], None when no row is seeded
