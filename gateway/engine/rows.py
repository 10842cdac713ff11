"""The running sequences' per-row state: arrays indexed by KV slot, changed in place.

A sequence's row is its slot. ``add`` writes the row when the sequence is admitted (sampling
parameters, limits, stop ids, where its prompt ends); ``join`` puts prefilled rows into the
decode set and ``leave`` takes ended rows out of it; nothing is rebuilt per step. Per step the
engine asks for the decode batch (``batch``: views of the arrays while the decoding slots are
consecutive, which the lowest-free-slot rule makes the usual case) and ``advance``s every row
that sampled a token in one vectorized call, which also applies the one stop check of the
engine. Per-row sampling state that comes later (penalty counts, logit bias, grammar masks)
belongs here, as more arrays indexed by slot: a slot keeps its row for the sequence's whole
life, so a [slots, vocab] array is written at ``add`` and never moved.

Like vLLM v1's persistent InputBatch, but indexed by slot instead of by a compacted batch row:
rows are never moved, so nothing per row is copied when others come and go.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gateway.engine.sequence import Sequence
from gateway.engine.types import DecodeBatch

# Why an advanced row ended (``Advance.reason``); a row that goes on has GOES_ON.
GOES_ON, BY_EOS, BY_STOP_ID, BY_LIMIT = range(4)


@dataclass(slots=True)
class Advance:
    """What one ``Rows.advance`` did, by position in the step's rows: ``counts[i]`` tokens
    produced so far, and the positions that ended (``ended``) with why (``reasons``, same
    order). A row ended by EOS or a stop id did not produce its token (not counted)."""

    counts: np.ndarray  # int32 [rows]
    ended: list[int]
    reasons: list[int]


class Rows:
    """Per-slot state of the sequences holding a slot, and the set of decoding slots."""

    def __init__(self, num_slots: int, max_context: int, vocab_size: int, eos: Iterable[int]):
        n = num_slots
        self.max_context = max_context
        # Decode inputs: the last token of each row and the position it is written at.
        self.token = np.zeros(n, np.int32)
        self.pos = np.zeros(n, np.int32)
        # Tokens a row may still produce (max_tokens and the context, whichever ends first)
        # and how many it was allowed when it joined: produced = cap - left.
        self.left = np.zeros(n, np.int32)
        self.cap = np.zeros(n, np.int32)
        # The ids each row produced, in order (the response cache's recording, and where
        # repetition penalties will read them): ids[slot, :produced(slot)].
        self.ids = np.zeros((n, max_context), np.int32)
        self._ids = self.ids.reshape(-1)  # the same, flat: ids[slot, i] = _ids[slot * ctx + i]
        # Sampling parameters (DecodeBatch's per-row fields).
        self.temperature = np.zeros(n, np.float32)
        self.top_p = np.ones(n, np.float32)
        self.top_k = np.zeros(n, np.int32)
        self.seeds = np.zeros(n, np.uint64)
        self.seeded = np.zeros(n, np.bool_)
        # Stop rules beyond the limits: EOS (unless ignored) and the row's stop ids.
        self.eos = np.zeros(max(vocab_size, 1 + max(eos, default=0)), np.bool_)
        self.eos[list(eos)] = True
        self.ignore_eos = np.zeros(n, np.bool_)
        self.stop_ids = np.full((n, 0), -1, np.int32)  # padded with -1; grows to the widest
        self._ignoring = 0  # rows with ignore_eos set / with stop ids: checked only when any
        self._stopping = 0
        self.seq: list[Sequence | None] = [None] * n
        # The decoding slots, ascending, and what follows from them (rebuilt when they change):
        # their sequences, those sequences' owners (the same list object while the rows stay
        # the same), the rows that detokenize, the index of the rows into the arrays (a slice
        # when the slots are consecutive, else an index array) and the batch's sampling arrays.
        self.decoding: list[int] = []
        self.decoding_seqs: list[Sequence] = []
        self.owners: list[object] = []
        self.text_rows: list[tuple[int, Sequence]] = []
        self.index: slice | np.ndarray = slice(0, 0)
        self._sampling: tuple[np.ndarray, ...] | None = None
        self._last_id = np.empty(0, np.intp)  # per decode row: where its id 0 goes in _ids, - 1
        self._changed = False

    # ---- membership --------------------------------------------------------------------------

    def add(self, slot: int, seq: Sequence) -> None:
        """Write ``slot``'s row for ``seq``, just admitted (it decodes after ``join``)."""
        self.seq[slot] = seq
        prompt_len, sampling, stop_ids = len(seq.prompt), seq.sampling, seq.stop_ids
        self.pos[slot] = prompt_len - 1  # the first decode input follows the prompt's last id
        self.cap[slot] = self.left[slot] = min(seq.max_tokens, self.max_context - prompt_len)
        self.temperature[slot] = sampling.temperature
        self.top_p[slot] = sampling.top_p
        self.top_k[slot] = sampling.top_k
        self.seeds[slot] = sampling.seed
        self.seeded[slot] = sampling.seeded
        self.ignore_eos[slot] = seq.ignore_eos
        self._ignoring += seq.ignore_eos
        if stop_ids:
            width = self.stop_ids.shape[1]
            if len(stop_ids) > width:
                grown = np.full((len(self.seq), len(stop_ids)), -1, np.int32)
                grown[:, :width] = self.stop_ids
                self.stop_ids = grown
            self.stop_ids[slot, : len(stop_ids)] = sorted(stop_ids)
            self._stopping += 1

    def remove(self, slot: int) -> None:
        """``slot``'s sequence ended: its row is cleared (and leaves the decode set)."""
        if self.ignore_eos[slot]:
            self.ignore_eos[slot] = False
            self._ignoring -= 1
        if self.stop_ids.shape[1] and self.stop_ids[slot, 0] != -1:
            self.stop_ids[slot] = -1
            self._stopping -= 1
        self.seq[slot] = None
        if slot in self.decoding:
            self.decoding.remove(slot)
            self._changed = True

    def join(self, slots: list[int]) -> None:
        """Rows whose prompt is now in the cache decode from the next step on."""
        if not slots:
            return
        self.decoding = sorted(self.decoding + slots)
        self._changed = True

    def produced(self, slot: int) -> int:
        """Tokens ``slot``'s sequence produced so far."""
        return int(self.cap[slot]) - int(self.left[slot])

    def produced_ids(self, slot: int) -> np.ndarray:
        """A read-only copy of the ids ``slot``'s sequence produced so far."""
        ids: np.ndarray = self.ids[slot, : self.produced(slot)].copy()
        ids.flags.writeable = False
        return ids

    # ---- per step ----------------------------------------------------------------------------

    def batch(self) -> DecodeBatch | None:
        """The decode batch of the decoding rows (None when none decodes)."""
        if self._changed:
            self._rebuild()
        if not self.decoding:
            return None
        i = self.index
        assert self._sampling is not None
        slots, temperature, top_p, top_k, seeds, seeded = self._sampling
        return DecodeBatch(
            slots, self.token[i], self.pos[i], temperature, top_p, top_k, seeds, seeded
        )

    def _held(self, slot: int) -> Sequence:
        """The sequence in ``slot``, which every decoding slot has."""
        seq = self.seq[slot]
        assert seq is not None, f"decoding slot {slot} holds no sequence"
        return seq

    def _rebuild(self) -> None:
        self._changed = False
        slots = self.decoding
        seqs = [self._held(s) for s in slots]
        self.decoding_seqs = seqs
        self.owners = [s.owner for s in seqs]
        self.text_rows = [(i, s) for i, s in enumerate(seqs) if s.detok is not None]
        if slots and slots[-1] - slots[0] == len(slots) - 1:
            self.index = slice(slots[0], slots[-1] + 1)
        else:
            self.index = np.array(slots, np.intp)
        i = self.index
        self._last_id = np.array(slots, np.intp) * self.max_context - 1
        self._sampling = (
            np.array(slots, np.int32), self.temperature[i].copy(), self.top_p[i].copy(),
            self.top_k[i].copy(), self.seeds[i].copy(), self.seeded[i].copy(),
        )  # fmt: skip

    def advance(self, index: slice | np.ndarray, sampled: np.ndarray) -> Advance:
        """Every row at ``index`` sampled ``sampled`` (same order): feed it back as the row's
        next input, count it, and apply the stop rules, in this order: EOS (unless the row
        ignores it), a stop id (neither produces its token), then the row's limit."""
        self.token[index] = sampled
        self.pos[index] += 1
        self.left[index] -= 1
        left = self.left[index]
        eos = self.eos.take(sampled)
        if self._ignoring:
            eos &= ~self.ignore_eos[index]
        hit = eos
        if self._stopping:
            hit = eos | (self.stop_ids[index] == sampled[:, None]).any(axis=1)
        ended = hit | (left <= 0)
        counts = self.cap[index] - left
        if isinstance(index, np.ndarray):  # not the decode rows alone
            self._ids.put(index * self.max_context + (counts - 1), sampled)
        else:
            self._ids.put(self._last_id + counts, sampled)
        if not np.count_nonzero(ended):  # count_nonzero: no ufunc reduction set-up per step
            return Advance(counts, [], [])
        if np.count_nonzero(hit):
            counts -= hit  # EOS and stop ids end a row without producing their token
            self.left[index] += hit
        rows = np.flatnonzero(ended).tolist()
        reasons = [
            (BY_EOS if e else BY_STOP_ID) if h else BY_LIMIT
            for e, h in zip(eos[rows].tolist(), hit[rows].tolist(), strict=True)
        ]
        return Advance(counts, rows, reasons)
