"""The running sequences' per-row state: arrays indexed by KV slot, changed in place.

A sequence's row is its slot. ``add`` writes the row when the sequence is admitted (sampling
parameters, limits, stop ids, where its prompt ends); ``join`` puts prefilled rows into the decode
set, ``remove`` takes ended rows out of it and ``leave`` preempted ones (they keep their state);
nothing is rebuilt per step. Per step the engine asks for the decode batch (``batch``: views of the
arrays while the decoding slots are consecutive, which the lowest-free-slot rule makes the usual
case) and ``advance``s every row that sampled a token in one vectorized call, which also notes the
finish rules its token fires (``fired``). The logits processing
(gateway/zerolayer/engine/sampling.py: penalties, logit bias, min_tokens, logprobs, a grammar's
matcher) is per-row state here too, by slot: written at ``add``; the token counts the penalties read
([slots, vocab], allocated with the first penalised row) and the grammar's state advance in
``advance``, the one place a sampled token is taken in. A batch or a prefill's last chunk carries a
``Processing`` (``processing``) only when one of its rows needs it: rows without any of these
features cost nothing more per step.

A constrained row's next mask is grammar work of unbounded cost (issue #40), so it never runs on
the engine thread: the row submits it to a ``MaskWorker`` (zerolayer.structured) when it joins and
after each token it takes in, and ``prepare`` waits for the decoding rows' masks at most the
step's budget. A row whose mask is late is **parked**: it leaves the decode set but keeps its slot,
KV and state, gets no token in that step, and rejoins the first step its mask is ready; the other
rows never wait for it beyond the budget. A prompt's last chunk waits for its row's first mask
the same way (``mask_ready``), else it runs at a later step. A matcher that fails (its limits
exceeded, or raising) ends its row alone (finish GRAMMAR_LIMIT).

Like vLLM v1's persistent InputBatch, but indexed by slot instead of by a compacted batch row:
rows are never moved, so nothing per row is copied when others come and go.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from zerolayer.engine.finish import (
    EOS,
    FAILED,
    GRAMMAR,
    GRAMMAR_LIMIT,
    LENGTH,
    STOP_ID,
    UNPRODUCED,
)
from zerolayer.engine.sequence import Sequence
from zerolayer.engine.types import DecodeBatch
from zerolayer.sampling_params import SAMPLING_ROW

if TYPE_CHECKING:
    from zerolayer.engine.sampling import Processing, SparseRows
    from zerolayer.structured import MaskWorker, RowMatcher

# How long a step with nothing else to run waits for a late row's mask before it returns (the
# engine loop then looks at its inbox again): the loop never spins while rows are parked.
PARKED_WAIT_S = 0.02


@dataclass(slots=True)
class SavedRow:
    """A row's state while its sequence is out of the rows (preempted to give its slot to
    another principal): what ``add`` does not rebuild from the sequence."""

    token: int
    pos: int
    left: int
    cap: int
    ids: np.ndarray  # int32: what it produced so far
    matcher: RowMatcher | None
    counts: np.ndarray | None  # its penalties' rows, when penalised
    seen: np.ndarray | None
    # the matcher's next mask (computing or done): for its state, so it is kept, never made
    # again while it may still run (one mask at a time per matcher)
    next_mask: concurrent.futures.Future[np.ndarray] | None


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
        # The sampling parameters the sampler reads for every row (a DecodeBatch's ``sampling``):
        # one SAMPLING_ROW record per slot, a column per parameter.
        self.sampling = np.zeros(n, SAMPLING_ROW)
        # Stop rules beyond the limits: EOS (unless ignored) and the row's stop ids.
        self.eos = np.zeros(max(vocab_size, 1 + max(eos, default=0)), np.bool_)
        self.eos[list(eos)] = True
        self.ignore_eos = np.zeros(n, np.bool_)
        self.stop_ids = np.full((n, 0), -1, np.int32)  # padded with -1; grows to the widest
        self._ignoring = 0  # rows with ignore_eos set / with stop ids: checked only when any
        self._stopping = 0
        # The finish rules that fired for each row's token in the step under way (bits of
        # zerolayer.engine.finish). 0 between steps: a row with any ends, and ``remove`` clears it.
        self.fired = np.zeros(n, np.uint8)
        # EOS per id, as the rule's bit (``advance`` reads the bits of a step's tokens at once).
        self._eos_bit = self.eos * np.uint8(EOS)
        self.seq: list[Sequence | None] = [None] * n
        # Logits processing by slot (gateway/zerolayer/engine/sampling.py), read only for rows with
        # ``processed``.
        self.vocab = vocab_size
        self.eos_ids = sorted(eos)
        self.presence = np.zeros(n, np.float32)
        self.frequency = np.zeros(n, np.float32)
        self.repetition = np.ones(n, np.float32)
        # logit_bias by slot as (ids int64, values float32), made once at admission; the decode
        # set's SparseRows is made once per row set (``_decode_bias``), not per step.
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n
        self._decode_bias: SparseRows | None = None
        self.min_tokens = np.zeros(n, np.int32)
        self.top_logprobs = np.full(n, -1, np.int32)  # -1: no logprobs
        self.matcher: list[RowMatcher | None] = [None] * n
        # Each constrained row's next mask, being computed off the engine thread (int32 words),
        # and the rows parked until theirs is ready (out of ``decoding``, slots held).
        self.next_mask: list[concurrent.futures.Future[np.ndarray] | None] = [None] * n
        self.parked: set[int] = set()
        self.held: set[int] = set()  # prompts whose last chunk waits for the row's first mask
        self._masks: MaskWorker | None = None  # made with the first constrained row
        self._constrained = 0  # rows with a matcher
        self.penalised = np.zeros(n, np.bool_)
        self.processed = np.zeros(n, np.bool_)  # any of the above on
        self._processing = 0  # rows with processed set
        self.logprob_rows = 0  # rows that want logprobs
        # Per penalised slot: each token's count in its output, and whether it is in its prompt
        # or output (Processing.counts / seen); allocated with the first penalised row.
        self.counts: np.ndarray | None = None  # int32 [slots, vocab]
        self.seen: np.ndarray | None = None  # bool [slots, vocab]
        # The decoding slots, ascending, and what follows from them (rebuilt when they change):
        # their sequences, those sequences' owners (the same list object while the rows stay
        # the same), the rows that detokenize, the index of the rows into the arrays (a slice
        # when the slots are consecutive, else an index array) and the batch's slots and
        # sampling rows.
        self.decoding: list[int] = []
        self.decoding_seqs: list[Sequence] = []
        self.owners: list[object] = []
        self.text_rows: list[tuple[int, Sequence]] = []
        self.index: slice | np.ndarray = slice(0, 0)
        self._sampling: tuple[np.ndarray, np.ndarray] | None = None
        self._last_id = np.empty(0, np.intp)  # per decode row: where its id 0 goes in _ids, - 1
        self._slots_array = np.empty(0, np.intp)  # the decoding slots (decoding_slots)
        self._proc_rows: list[tuple[int, int]] = []  # (row, slot) of the processed decode rows
        self.scratch = np.zeros(n, np.int32)  # a token per slot, to put a step's rows in order
        self._changed = False

    # ---- membership --------------------------------------------------------------------------

    def add(self, slot: int, seq: Sequence) -> None:
        """Write ``slot``'s row for ``seq``, just admitted (it decodes after ``join``)."""
        self.seq[slot] = seq
        prompt_len, sampling, stop_ids = len(seq.prompt), seq.sampling, seq.stop_ids
        self.pos[slot] = prompt_len - 1  # the first decode input follows the prompt's last id
        self.cap[slot] = self.left[slot] = min(seq.max_tokens, self.max_context - prompt_len)
        self.sampling[slot] = sampling.row()
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
        if sampling.processed or seq.grammar is not None:
            self._add_processing(slot, seq)

    def _add_processing(self, slot: int, seq: Sequence) -> None:
        """The row's logits processing (its matcher is made here, at admission)."""
        sampling = seq.sampling
        if seq.grammar is not None:
            self.matcher[slot] = seq.grammar.matcher()
            self._constrained += 1
            self._submit_mask(slot)
        self.presence[slot] = sampling.presence_penalty
        self.frequency[slot] = sampling.frequency_penalty
        self.repetition[slot] = sampling.repetition_penalty
        bias = sampling.logit_bias
        if bias:
            self.bias[slot] = (
                np.fromiter(bias.keys(), np.int64, len(bias)),
                np.fromiter(bias.values(), np.float32, len(bias)),
            )
        self.min_tokens[slot] = sampling.min_tokens
        self.top_logprobs[slot] = sampling.logprob_count
        self.logprob_rows += sampling.logprobs
        if sampling.penalised:
            if self.counts is None or self.seen is None:
                shape = (len(self.seq), self.vocab)
                self.counts, self.seen = np.zeros(shape, np.int32), np.zeros(shape, np.bool_)
            self.counts[slot] = 0
            self.seen[slot] = False
            self.seen[slot, seq.prompt] = True
            self.penalised[slot] = True
        self.processed[slot] = True
        self._processing += 1

    def remove(self, slot: int) -> None:
        """``slot``'s sequence ended: its row is cleared (and leaves the decode set)."""
        self.fired[slot] = 0
        if self.ignore_eos[slot]:
            self.ignore_eos[slot] = False
            self._ignoring -= 1
        if self.stop_ids.shape[1] and self.stop_ids[slot, 0] != -1:
            self.stop_ids[slot] = -1
            self._stopping -= 1
        if self.processed[slot]:
            self.processed[slot] = self.penalised[slot] = False
            self._processing -= 1
            self.logprob_rows -= bool(self.top_logprobs[slot] >= 0)
            self.presence[slot] = self.frequency[slot] = 0.0
            self.repetition[slot] = 1.0
            if self.matcher[slot] is not None:
                self._constrained -= 1
                self.parked.discard(slot)
                self.held.discard(slot)
                self.next_mask[slot] = None  # a late result is dropped with it
            self.bias[slot] = self.matcher[slot] = None
            self.min_tokens[slot] = 0
            self.top_logprobs[slot] = -1
        self.seq[slot] = None
        if slot in self.decoding:
            self.decoding.remove(slot)
            self._changed = True

    def save(self, slot: int) -> SavedRow:
        """``slot``'s state, before ``remove`` clears it (the sequence comes back with
        ``restore``, in any slot)."""
        penalised = self.penalised[slot] and self.counts is not None and self.seen is not None
        return SavedRow(
            int(self.token[slot]),
            int(self.pos[slot]),
            int(self.left[slot]),
            int(self.cap[slot]),
            self.ids[slot, : self.produced(slot)].copy(),
            self.matcher[slot],
            self.counts[slot].copy() if penalised and self.counts is not None else None,
            self.seen[slot].copy() if penalised and self.seen is not None else None,
            self.next_mask[slot],
        )

    def restore(self, slot: int, seq: Sequence, saved: SavedRow) -> None:
        """``seq``'s row again, in ``slot``, as ``save`` left it (it joins after ``join``)."""
        self.add(slot, seq)
        self.token[slot], self.pos[slot] = saved.token, saved.pos
        self.left[slot], self.cap[slot] = saved.left, saved.cap
        self.ids[slot, : len(saved.ids)] = saved.ids
        if saved.matcher is not None:
            self.matcher[slot] = saved.matcher  # ``add`` made a fresh one: this one goes on
            self.next_mask[slot] = saved.next_mask
            if saved.next_mask is None:
                self._submit_mask(slot)
        if saved.counts is not None and self.counts is not None and self.seen is not None:
            self.counts[slot] = saved.counts
            self.seen[slot] = saved.seen

    def decoding_slots(self) -> np.ndarray:
        """The decoding slots as an array (int64, ascending; made once per row set)."""
        if self._changed:
            self._rebuild()
        return self._slots_array

    def leave(self, slot: int) -> None:
        """``slot``'s row stops decoding but keeps its state (a preempted row: it joins again
        once its KV is recomputed, with the same last token, position and sampling state; a
        parked row too: its mask is kept, and waited for again when it joins)."""
        self.parked.discard(slot)
        if slot in self.decoding:
            self.decoding.remove(slot)
            self._changed = True

    def join(self, slots: list[int]) -> None:
        """Rows whose prompt is now in the cache join the decode set, and the row set is made
        now (after any ``remove``): the step that completed their prompts hands out these rows,
        and the next step decodes the same row set without rebuilding it."""
        if slots:
            self.decoding = sorted(self.decoding + slots)
            self._changed = True
        if self._changed:
            self._rebuild()

    def joined_rows(self, seqs: list[Sequence]) -> list[int]:
        """The positions in the row set of ``seqs`` (just joined), ascending."""
        if not seqs:
            return []
        slots = {s.slot for s in seqs}
        return [i for i, slot in enumerate(self.decoding) if slot in slots]

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
        if self._sampling is None:  # made when the row set first decodes (not at a join whose
            self._sampling = (  # rows leave again before the next step)
                np.array(self.decoding, np.int32),
                self.sampling[i].copy(),
            )
        slots, sampling = self._sampling
        processing = self.processing(self.decoding) if self._proc_rows else None
        return DecodeBatch(slots, self.token[i], self.pos[i], sampling, processing)

    def processing(self, slots: list[int]) -> Processing | None:
        """The logits processing of rows ``slots`` (in this order) for their next token, or None
        when none of them needs any. Fills each constrained row's grammar mask."""
        sl = np.array(slots, np.intp)
        if not self._processing or not self.processed[sl].any():
            return None
        from zerolayer.engine.sampling import Processing, SparseRows  # torch: only with such rows

        proc = Processing()
        if self.penalised[sl].any():
            assert self.counts is not None and self.seen is not None
            proc.presence, proc.frequency = self.presence[sl], self.frequency[sl]
            proc.repetition = self.repetition[sl]
            proc.counts, proc.seen = self.counts[sl], self.seen[sl]
        if slots is self.decoding and self._decode_bias is not None:
            proc.bias = self._decode_bias or None
        else:
            biases = [self.bias[s] for s in slots]
            bias = SparseRows.from_arrays(biases)
            if slots is self.decoding:
                self._decode_bias = bias
            proc.bias = bias or None
        below = self.min_tokens[sl] > self.cap[sl] - self.left[sl]
        if below.any():
            proc.banned = SparseRows.from_rows(
                [self._ends(s) if b else None for s, b in zip(slots, below.tolist(), strict=True)]
            )
        if (self.top_logprobs[sl] >= 0).any():
            proc.logprobs = self.top_logprobs[sl]
        matchers = [self.matcher[s] for s in slots]
        if any(m is not None for m in matchers):
            mask = np.zeros((len(slots), (self.vocab + 31) // 32), np.int32)
            for r, m in enumerate(matchers):
                if m is not None:
                    why = self._take_mask(slots[r], m, mask[r])
                    if why:  # the row ends, its token unproduced
                        self._grammar_failed(slots[r], why)
                        mask[r] = -1
                    self._every_eos(mask[r])
            proc.allowed = mask
            proc.constrained = np.array([m is not None for m in matchers], np.bool_)
        return proc

    def _take_mask(self, slot: int, m: RowMatcher, words: np.ndarray) -> str:
        """Copy ``slot``'s next mask (computed, ``prepare`` / ``mask_ready`` saw to that) into
        ``words``; why its grammar failed, "" when it did not."""
        future, self.next_mask[slot] = self.next_mask[slot], None
        assert future is not None and future.done(), "a constrained row sampled without its mask"
        try:
            words[:] = future.result()
        except Exception as exc:  # the matcher raised: its row alone fails
            text = str(exc).strip()
            return text.splitlines()[0][:200] if text else type(exc).__name__
        return m.error

    def _submit_mask(self, slot: int) -> None:
        """Start computing ``slot``'s next mask off the engine thread."""
        m = self.matcher[slot]
        assert m is not None
        if self._masks is None:
            from zerolayer.structured import MaskWorker

            self._masks = MaskWorker((self.vocab + 31) // 32, len(self.seq))
        self.next_mask[slot] = self._masks.submit(m, int(self.left[slot]))

    def prepare(self, budget_s: float) -> float:
        """Before the decode batch is made: wait at most ``budget_s`` for the decoding
        constrained rows' next masks and park the rows whose mask is late; parked rows whose
        mask is ready rejoin (a parked row is never waited for). Returns the deadline, for
        ``mask_ready``."""
        deadline = time.monotonic() + budget_s
        if not self._constrained:
            return deadline
        decoding = [s for s in self.decoding if self.matcher[s] is not None]
        for s in decoding:
            if self.next_mask[s] is None:  # defensive: never left without one
                self._submit_mask(s)
        futures = [self.next_mask[s] for s in decoding]
        if futures:
            concurrent.futures.wait(futures, timeout=budget_s)  # type: ignore[arg-type]
        late = {s for s in decoding if not self.next_mask[s].done()}  # type: ignore[union-attr]
        back = [s for s in self.parked if self.next_mask[s].done()]  # type: ignore[union-attr]
        if late or back:
            self.parked -= set(back)
            self.parked |= late
            self.decoding = sorted([s for s in self.decoding if s not in late] + back)
            self._changed = True
        return deadline

    def mask_ready(self, slot: int, deadline: float) -> bool:
        """``slot``'s first mask (its prompt's last chunk is next) is ready, waited for until
        ``deadline`` (monotonic) unless the row is already late (``held``): true for a row
        without a grammar."""
        future = self.next_mask[slot]
        if future is None:
            if self.matcher[slot] is None:
                return True
            self._submit_mask(slot)  # defensive: never left without one
            future = self.next_mask[slot]
            assert future is not None
        if slot not in self.held:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                future.exception(max(0.0, deadline - time.monotonic()))
        if future.done():
            self.held.discard(slot)
            return True
        self.held.add(slot)
        return False

    def wait_late(self) -> None:
        """A step with nothing to run while rows are parked or held: wait up to
        ``PARKED_WAIT_S`` for one of their masks, so that the engine loop does not spin (it
        looks at its inbox again after)."""
        futures = [self.next_mask[s] for s in self.parked | self.held]
        if futures:
            concurrent.futures.wait(
                futures,  # type: ignore[arg-type]
                timeout=PARKED_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    def close(self) -> None:
        """Stop the mask threads (at shutdown)."""
        if self._masks is not None:
            self._masks.close()

    def _ends(self, slot: int) -> list[int]:
        """The ids that would end ``slot``'s row: EOS and its stop ids (min_tokens bans them)."""
        ids = list(self.eos_ids)
        if self.stop_ids.shape[1]:
            ids += [int(t) for t in self.stop_ids[slot] if t != -1]
        return ids

    def _every_eos(self, words: np.ndarray) -> None:
        """A grammar that may end allows its one EOS id: allow every end-of-generation id the
        tokenizer has (each ends the row, zerolayer.engine.rows.advance)."""
        bits = words.view(np.uint32)
        eos = [e for e in self.eos_ids if e < self.vocab]
        if any(bits[e >> 5] >> np.uint32(e & 31) & np.uint32(1) for e in eos):
            for e in eos:
                bits[e >> 5] |= np.uint32(1 << (e & 31))

    def _rebuild(self) -> None:
        self._changed = False
        slots = self.decoding
        held = [self.seq[s] for s in slots]
        assert None not in held, "a decoding slot holds no sequence"
        seqs: list[Sequence] = held  # type: ignore[assignment]  # no None: checked above
        self.decoding_seqs = seqs
        self.owners = [s.owner for s in seqs]
        self.text_rows = [(i, s) for i, s in enumerate(seqs) if s.detok is not None]
        if slots and slots[-1] - slots[0] == len(slots) - 1:
            self.index = slice(slots[0], slots[-1] + 1)
        else:
            self.index = np.array(slots, np.intp)
        self._slots_array = np.array(slots, np.intp)
        self._last_id = self._slots_array * self.max_context - 1
        self._proc_rows = (
            [(r, s) for r, s in enumerate(slots) if self.processed[s]] if self._processing else []
        )
        self._sampling = None  # the batch's arrays: made by ``batch`` when this row set decodes
        self._decode_bias = None  # made by ``processing`` when this row set first needs it

    def advance(self, sampled: np.ndarray) -> np.ndarray:
        """Every row of the decode set sampled ``sampled`` (slot order): feed it back as the
        row's next input, count and record it, and note in ``fired`` the finish rules it fires
        (EOS unless the row ignores it, a stop id, the row's last allowed token); the processed
        rows take it in (``_take_in``). Returns each row's count of tokens produced, this one
        included: whether it ends its row, and whether it is produced, is decided after the text
        (zerolayer.engine.finish), and ``unproduce`` takes back the ones that are not."""
        index = self.index
        self.token[index] = sampled
        self.pos[index] += 1
        self.left[index] -= 1
        left = self.left[index]
        counts = self.cap[index] - left
        self._ids.put(self._last_id + counts, sampled)
        rules = self._eos_bit.take(sampled)
        if self._ignoring:
            rules[self.ignore_eos[index]] = 0
        if self._stopping:
            hit = (self.stop_ids[index] == sampled[:, None]).any(axis=1)
            np.bitwise_or(rules, STOP_ID, out=rules, where=hit)
        np.bitwise_or(rules, LENGTH, out=rules, where=left <= 0)
        if np.count_nonzero(rules):  # count_nonzero: no ufunc reduction set-up per step
            self.fired[index] |= rules
        if self._proc_rows:
            self._take_in(sampled)
        return counts

    def unproduce(self, rows: list[int]) -> None:
        """The tokens these decode rows (positions in the row set) sampled in this step ended
        them without being produced (zerolayer.engine.finish.UNPRODUCED): they are not counted."""
        self.left[[self.decoding[i] for i in rows]] += 1

    def step_counts(self) -> np.ndarray:
        """Each decoding row's count of tokens produced (int32 [rows], slot order)."""
        index = self.index
        counts: np.ndarray = self.cap[index] - self.left[index]
        return counts

    def _take_in(self, sampled: np.ndarray) -> None:
        """The processed rows take their sampled token in: the penalties' counts, and the
        grammar, unless the token is not produced (EOS, a stop id, a cancel), which notes in
        ``fired`` its completion (GRAMMAR), its limits exceeded (GRAMMAR_LIMIT) or its refusal
        of the token (FAILED)."""
        tokens = sampled.tolist()
        counts, seen = self.counts, self.seen
        fired = self.fired
        for i, slot in self._proc_rows:
            token = tokens[i]
            if self.penalised[slot] and counts is not None and seen is not None:
                counts[slot, token] += 1
                seen[slot, token] = True
            m = self.matcher[slot]
            if m is not None and not fired[slot] & UNPRODUCED:
                if m.accept(token):
                    if m.budget_closed:  # steered to its end as its tokens ran out
                        fired[slot] |= LENGTH
                    elif m.finished:
                        fired[slot] |= GRAMMAR
                    elif not fired[slot]:  # the row goes on: its next mask, off this thread
                        self._submit_mask(slot)
                elif m.error:
                    self._grammar_failed(slot, m.error)
                else:
                    fired[slot] |= FAILED

    def _grammar_failed(self, slot: int, why: str) -> None:
        """``slot``'s grammar exceeded its limits: the row ends (GRAMMAR_LIMIT), ``why`` kept
        on its sequence for the request path's answer."""
        self.fired[slot] |= GRAMMAR_LIMIT
        seq = self.seq[slot]
        if seq is not None:
            seq.grammar_error = why
