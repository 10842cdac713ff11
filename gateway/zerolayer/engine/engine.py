"""The engine: a continuous-batching scheduler running a Backend in its own thread.

A step is schedule → execute → update (``step``):
- **schedule** takes in new sequences and cancellations, admits waiting sequences into free KV
  slots (``_admit``: fair by client — each principal's share of the rows, zerolayer.engine.admission
  —, then the longest prompt prefix the prefix store knows is
  loaded, so prefill starts after it), and returns a ``StepPlan``: prompt chunks for sequences
  still in prefill (within ``max_step_tokens``) and the decode batch of every decoding row.
- **execute** runs the backend on the plan (nothing else); a failing batched call is retried row
  by row so that a failure ends only the sequence that caused it.
- **update** advances every row that sampled a token in one vectorized call on the rows
  (zerolayer.engine.rows: counters, limits and stop ids by slot), adds the text of rows that
  detokenize (zerolayer.engine.sequence), decides which rows end and why, once for the step
  (zerolayer.engine.finish: the rules, a cancel included, noted by slot first), offers the
  blocks of prompts whose prefill just completed to the prefix store, frees the slots of ended
  sequences and returns ONE ``StepOutput`` (zerolayer.engine.step), which the engine thread
  hands to ``deliver``.
The waiting queue is bounded: ``submit`` refuses when it is full.

KV pages (a paged backend: ``backend.kv_pages``, zerolayer.engine.kv_pages): admission needs a
free row and the pages of the head's first chunk; when the pool is out of them (after the prefix
store gave back the pages only it holds) the head waits, fair order kept (``kv_admission_waits``,
one log line per 10 s at most). Every page a step writes is reserved in ``schedule``, oldest
sequence first (decode rows, then prompt chunks); a reservation that cannot be met preempts the
most recently admitted sequence holding pages (vLLM's recompute preemption): it keeps its slot and
its row's state (sampling state, penalties' counts, grammar, produced ids) but leaves the decode
set, gives its pages back, and prefills again its prompt and the ids it produced but the last
(``Sequence.recompute``), sampling nothing; it then rejoins the decode set with the last token it
had (``kv_preemptions``, a WARNING). No admission in a step that preempted. The input processor
refuses a prompt + max_tokens beyond the whole pool, so the oldest sequence always fits and no
request fails because another holds pages. A backend without pages keeps slot-only admission.

Rows (issue #40): when the principal whose head is picked is within its share of the rows and no
slot is free, the principals over their share give up their youngest rows (``_take_rows``): each
such row's state is saved (zerolayer.engine.rows.SavedRow), its slot freed, and it waits at the
head of its key's queue; admitted again, it recomputes its KV the same way and rejoins without
resampling (``class_preempted``, by principal class). Not on a backend that cannot write KV
without sampling (``Backend.recomputes``: the Neuron backend encodes prompts whole).

Prompt outputs (an embedding, prompt logprobs: ``Sequence.pool`` / ``score``): the sequence's
chunks ask the backend for them, ``_update`` hands each prefilled chunk's to its sequence, and
such a sequence's prompt is computed whole (the prefix store's KV has no states or logits, so it
is not loaded; the blocks are still offered). A sequence with ``max_tokens`` 0 (embeddings,
echo without a completion) never joins the rows: it ends MAX_TOKENS in the step that completes
its prompt, with its choices (they read choice 0's outputs).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from zerolayer.codes import FinishReason
from zerolayer.engine.admission import QueueShares, RowShares
from zerolayer.engine.backend import Backend, PagedKV, PrefixKV
from zerolayer.engine.compute import ComputeThread
from zerolayer.engine.finish import CANCEL, FAILED, NOT_FINISHED, STOP_STRING, UNPRODUCED, decide
from zerolayer.engine.kv_pages import pages_for
from zerolayer.engine.prefix_store import PrefixStore
from zerolayer.engine.rows import Rows, SavedRow
from zerolayer.engine.sequence import Sequence
from zerolayer.engine.step import FINISH_ERROR, NO_TOKEN, Finished, Logprobs, Output, StepOutput
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.structured import MASK_BUDGET_S
from zerolayer.tokenizer import Tokenizer

__all__ = [
    "FINISH_ERROR", "NO_TOKEN", "NOT_FINISHED", "Engine", "EngineOverloaded", "EngineStopped",
    "Finished", "Output", "Sequence", "StepOutput", "StepPlan",
]  # fmt: skip

log = logging.getLogger("zerolayer.engine")

# Called from the engine thread once per step that produced anything.
Deliver = Callable[[StepOutput], None]

# What a batched backend call takes: the step's prompt chunks or its decode batch.
_Work = TypeVar("_Work")


class EngineOverloaded(Exception):
    """The waiting queue is full; ``retry_after_ms`` estimates when a slot frees up."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"engine queue full, retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class EngineStopped(Exception):
    """The engine no longer accepts work (shutting down)."""


@dataclass(slots=True)
class StepPlan:
    """What one step runs: KV page copies (a paged backend's copies on write, first), prompt
    chunks (``chunk_seqs[i]`` owns ``chunks[i]``), then the decode batch of the decoding rows
    (``decode[i]`` owns row i)."""

    chunks: list[PrefillChunk]
    chunk_seqs: list[Sequence]
    decode: list[Sequence]
    batch: DecodeBatch | None
    copies: list[tuple[int, int]] = field(default_factory=list)


class Engine:
    """Owns the scheduler thread. ``submit`` and ``cancel`` are safe from any thread.

    ``deliver(step)`` is called on the engine thread once per step that produced anything (the
    daemon passes its ``Outbox.put``)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        deliver: Deliver,
        *,
        max_queue: int,
        max_step_tokens: int,
        prefill_chunk: int,
        on_step: Callable[[str, float, int], None] | None = None,
        prefix_store: PrefixStore | None = None,
        row_share: float = 0.0,
        mask_budget_s: float = MASK_BUDGET_S,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self._deliver = deliver
        self._max_queue = max_queue
        self._max_step_tokens = max_step_tokens
        self._prefill_chunk = prefill_chunk
        self._on_step = on_step
        self._store = prefix_store  # consulted at admission, fed at prefill completion
        # How long a step waits for constrained rows' masks before parking the late ones
        # (zerolayer.engine.rows, engine.grammar_mask_budget_ms).
        self._mask_budget_s = mask_budget_s
        self._inbox: collections.deque[Sequence] = collections.deque()
        # Waiting sequences by fairness key (Sequence.fair_key), in round-robin order: admission
        # takes the head of the key ``RowShares.pick`` names (under its share of the rows; ties
        # in this order) and moves that key to the end, so a client with many queued or
        # running sequences cannot starve one with a single request.
        self._waiting: dict[object, collections.deque[Sequence]] = {}
        self._running: list[Sequence] = []  # every sequence holding a slot
        self._prefilling: list[Sequence] = []  # ... whose prompt is not all in the cache yet
        # cancel() was called: the waiting queue (schedule) and the running rows (update) are
        # scanned for cancelled sequences, each only then.
        self._cancel_queued = self._cancel_running = False
        self._extra: list[Finished] = []  # endings of choices without a row, for the step
        n = backend.num_slots
        self._free_slots = list(range(n))  # a min-heap: the lowest free slot goes first
        self._row_shares = RowShares(n, row_share)  # rows running per fairness key
        # Rows [running, waiting] per principal class, for the metrics (no key names), and a
        # counter bumped at every change so that a reader sets its gauges only then.
        self.class_rows: dict[str, list[int]] = {}
        self.class_preempted: dict[str, int] = {}  # rows preempted for another principal
        self._saved: dict[Sequence, SavedRow] = {}  # their rows' state while they wait
        self.class_version = 0
        self._pool = backend.kv_pages  # None: slot-only admission (module docstring)
        self._rejoin: list[Sequence] = []  # recomputed after a preemption: decode next step
        self.kv_admission_waits = 0  # sequences that waited for pages at admission (once each)
        self.kv_preemptions = 0
        self._full_logged = -1e9  # when "KV pool full" was last logged (monotonic)
        info = backend.info
        self._rows = Rows(n, info.max_context, info.vocab_size, tokenizer.eos_token_ids)
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self._compute: ComputeThread | None = None
        self._running_loop: Future[None] | None = None  # _run on the compute thread
        self._queued = 0  # inbox + waiting, maintained under _lock
        self._shares = QueueShares(max_queue)  # each client's part of _queued (admission.py)
        self._lock = threading.Lock()
        self.last_beat = time.monotonic()  # the thread's heartbeat, for health checks
        self._avg_seq_s = 1.0  # moving average of admitted→finished, for retry hints
        self.steps = 0

    # ------------------------------------------------------------------ any thread

    @property
    def waiting(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def slots_used(self) -> int:
        return self.backend.num_slots - len(self._free_slots)

    @property
    def kv_pages_used(self) -> float:
        """Fraction of the KV pages in use (0 without pages)."""
        pool = self._pool
        return pool.used / pool.num_pages if pool is not None else 0.0

    @property
    def alive(self) -> bool:
        loop = self._running_loop
        return loop is not None and not loop.done()

    @property
    def idle(self) -> bool:
        """Nothing queued, waiting or running (for tests and shutdown)."""
        return not (self._inbox or self._waiting or self._running)

    def submit(self, seq: Sequence) -> None:
        if not len(seq.prompt):  # the input processor never sends one
            raise ValueError("a sequence needs at least one prompt token to prefill")
        with self._lock:
            if not self._accepting:
                raise EngineStopped("engine is shutting down")
            rows = 1 + len(seq.choices)  # n choices count as n
            if self._queued >= self._max_queue or not self._shares.take(seq.fair_key, rows):
                raise EngineOverloaded(self.retry_after_ms())
            self._queued += 1
            self._inbox.append(seq)
        self._nudge()

    def _nudge(self) -> None:
        """Wake the engine thread if it waits. The event stays set while the engine is busy (it
        clears it only after a wait, then looks at its inbox), so setting it again is skipped:
        ``Event.set`` takes a lock and notifies, several Python calls per request."""
        if not self._wake.is_set():
            self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq``: it ends with finish CANCELLED at the engine's next step. A waiting
        sequence leaves the queue; a running one's row ends by the CANCEL rule
        (zerolayer.engine.finish), and a token it sampled in that step is not produced."""
        seq.cancelled = True
        self._cancel_queued = self._cancel_running = True
        self._wake.set()

    def retry_after_ms(self) -> int:
        per_slot = self._avg_seq_s / max(1, self.backend.num_slots)
        estimate = per_slot * (self._queued + 1) * 1000.0
        return int(min(max(estimate, 50.0), 30_000.0))

    def start(self, compute: ComputeThread | None = None) -> None:
        """Run the engine loop on ``compute`` (the thread that loaded the model, so that torch
        keeps one OpenMP team; see zerolayer.engine.compute), or on a thread of its own."""
        self._compute = compute if compute is not None else ComputeThread()
        self._running_loop = self._compute.submit(self._run)

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, then close the backend on the engine thread (torch stays on one
        thread). Blocks up to ``timeout``: call it off the event loop. The deliver callback must
        not block by then (the daemon closes its Outbox first)."""
        self.stop_accepting()
        self._stop = True
        self._wake.set()
        if self._compute is None:
            self.backend.close()
            self._rows.close()
            return
        with contextlib.suppress(RuntimeError):  # RuntimeError: the thread is already gone
            self._compute.submit(self.backend.close)  # runs after _run has returned
        self._compute.close(timeout)
        self._rows.close()  # the mask threads, once the loop no longer submits

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop:
            self.last_beat = time.monotonic()
            if self.idle:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                out = self.step()
            except Exception:  # a bug in the scheduler itself: nothing can be trusted
                log.exception("engine step failed; failing the sequences in flight")
                out = StepOutput(finished=self._fail_all())
            if out:
                self._deliver(out)

    def step(self) -> StepOutput:
        """One step (schedule → execute → update). Public so tests can drive the engine
        without its thread."""
        finished: list[Finished] = []
        plan = self.schedule(finished)
        if plan is None:
            out = StepOutput(finished=finished)
        else:
            prefilled, decoded, failed = self.execute(plan)
            out = self._update(plan, prefilled, decoded, failed, finished)
            self.steps += 1
        if self._extra:  # choices that ended without a row of their own
            out.finished += self._extra
            self._extra = []
        return out

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self, finished: list[Finished]) -> StepPlan | None:
        """Take in new sequences and cancellations (their endings go to ``finished``) and plan
        the step; None when nothing runs."""
        while self._inbox:
            seq = self._inbox.popleft()
            queue = self._waiting.get(seq.fair_key)
            if queue is None:
                self._waiting[seq.fair_key] = queue = collections.deque()
            queue.append(seq)
            self._count_class(seq, 1, 1 + len(seq.choices))
        pool = self._pool
        copies: list[tuple[int, int]] = []
        preempted = False
        if self._rejoin:  # their KV is recomputed: they decode again from this step
            self._rows.join([seq.slot for seq in self._rejoin if seq.slot >= 0])
            self._rejoin = []
        # masks first: a parked row that rejoins now reserves its page below like the others
        deadline = self._rows.prepare(self._mask_budget_s)
        if pool is not None:
            before = self.kv_preemptions
            self._grow(copies)
            preempted = self.kv_preemptions != before
        promised = 0  # pages the first chunks of this step's admissions will take
        while self._waiting and not preempted:
            key = self._pick()
            head = self._waiting[key][0]
            if 1 + len(head.choices) > len(self._free_slots) and not self._take_rows(key):
                break  # held for that head: n choices are admitted together, when n are free
            if pool is not None:
                need = self._pages_to_admit(head, promised)
                if need < 0:
                    break  # held for that head too, until pages free up
                promised += need
            self._admit(self._next_waiting(key), finished)
        self._drop_cancelled_waiting(finished)
        if not self._running:
            return None
        rows = self._rows
        plan = StepPlan([], [], [], None, copies)
        budget = self._max_step_tokens - len(rows.decoding)
        for seq in list(self._prefilling):  # a copy: a preemption puts a sequence back in
            if budget <= 0:
                break
            if seq.cancelled:  # its row ends in this step's update: no more of its prompt runs
                continue
            ids = seq.kv_ids
            start = seq.prefilled
            n = min(len(ids) - start, self._prefill_chunk, budget)
            prompt = seq.recompute is None  # a recomputed row samples nothing, outputs nothing
            last = prompt and start + n == len(ids)
            if last and not rows.mask_ready(seq.slot, deadline):
                continue  # its first mask is late: the last chunk runs at a later step
            if pool is not None and not self._reserve(seq, start, start + n, copies):
                continue  # it waits for pages (or was itself preempted)
            budget -= n
            plan.chunks.append(
                PrefillChunk(
                    slot=seq.slot,
                    tokens=ids[start : start + n],
                    start=start,
                    last=last,
                    sampling=seq.sampling,
                    processing=rows.processing([seq.slot]) if last else None,
                    pool=seq.pool and prompt,
                    score=seq.score if prompt else -1,
                    targets=ids[start + 1 : start + n + 1] if prompt and seq.score >= 0 else None,
                )
            )
            plan.chunk_seqs.append(seq)
        plan.batch = rows.batch()  # after the reservations: a preempted row left the set
        if plan.batch is not None:
            plan.decode = rows.decoding_seqs
        elif not plan.chunks:
            rows.wait_late()  # only rows waiting for their masks: no spin
        return plan

    # ---- KV pages (a paged backend) ----------------------------------------------------------

    def _grow(self, copies: list[tuple[int, int]]) -> None:
        """The decode rows whose write this step needs a page (a new one, or a copy of a
        shared one) reserve it: all new pages at once when the pool has them (the usual case,
        a few numpy calls per step), else row by row, oldest first (``_reserve``: it may
        preempt)."""
        pool, rows = self._pool, self._rows
        assert pool is not None
        if not rows.decoding:
            return
        slots = rows.decoding_slots()
        pos = rows.pos[slots]
        index = pos // pool.page_tokens
        have = pool.mapped[slots] > index
        pages = pool.tables[slots, np.minimum(index, pool.max_pages_per_row - 1)]
        shared = have & (pool.refs[np.maximum(pages, 0)] > 1)
        fresh = ~have
        needy = fresh | shared
        if not np.count_nonzero(needy):  # the usual step: no page to take
            return
        if not np.count_nonzero(shared) and pool.append(slots[fresh]):
            return
        order = {id(seq): i for i, seq in enumerate(self._running)}
        held = [rows.seq[slot] for slot in slots[needy].tolist()]
        for seq in sorted((s for s in held if s is not None), key=lambda s: order[id(s)]):
            slot = seq.slot
            if slot < 0 or slot not in rows.decoding:  # preempted meanwhile
                continue
            p = int(rows.pos[slot])
            self._reserve(seq, p, p + 1, copies)

    def _reserve(self, seq: Sequence, start: int, end: int, copies: list[tuple[int, int]]) -> bool:
        """Make positions ``start .. end - 1`` of ``seq``'s slot writable (its page copies go to
        ``copies``). When the pool is short: the prefix store gives back pages only it holds,
        else the most recently admitted sequence after ``seq`` that holds pages is preempted;
        when there is none, ``seq`` itself is (when it holds pages) and False is returned."""
        pool = self._pool
        assert pool is not None
        slot = seq.slot
        while True:
            got = pool.prepare_write(slot, start, end)
            if got is not None:
                copies += got
                return True
            if self._reclaim(pool.pages_needed(slot, start, end)):
                continue
            victim = self._victim(seq)
            if victim is None:
                if pool.mapped[slot]:
                    self._preempt(seq)
                return False
            self._preempt(victim)

    def _reclaim(self, need: int) -> bool:
        """Whether ``need`` pages are free once the prefix store gave back what it alone
        holds."""
        pool = self._pool
        assert pool is not None
        return self._store is not None and self._store.reclaim(lambda: pool.available >= need)

    def _victim(self, seq: Sequence) -> Sequence | None:
        """The most recently admitted sequence after ``seq`` that holds pages."""
        pool = self._pool
        assert pool is not None
        running = self._running
        first = running.index(seq) + 1
        for victim in reversed(running[first:]):
            if pool.mapped[victim.slot]:
                return victim
        return None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption (module docstring): ``seq`` gives its pages back and prefills
        its KV again later; its row keeps its state."""
        pool, rows = self._pool, self._rows
        assert pool is not None
        slot = seq.slot
        pages = pool.release(slot)
        if seq.recompute is None and seq.prefilled >= len(seq.prompt):  # a decoding row
            positions = int(rows.pos[slot])  # its KV: every position before its next input
            produced = rows.ids[slot, : positions - len(seq.prompt)]
            seq.recompute = np.concatenate([seq.prompt, produced])
            rows.leave(slot)
        elif seq.recompute is None:  # its prompt was not in yet: it starts again
            positions = seq.prefilled
            seq.restart_prompt()
        else:
            positions = seq.prefilled
        seq.prefilled = 0
        if seq not in self._prefilling:  # back in, in admission order
            members = {id(s) for s in self._prefilling} | {id(seq)}
            self._prefilling = [s for s in self._running if id(s) in members]
        self.kv_preemptions += 1
        log.warning(
            "preempted sequence (client %s, %d positions) to free %d KV pages; it recomputes",
            seq.fair_key, positions, pages,
        )  # fmt: skip

    def _pages_to_admit(self, seq: Sequence, promised: int) -> int:
        """The pages of ``seq``'s first chunk when the pool has them beside the ``promised``
        ones (after the prefix store gave back what it alone holds), else -1: ``seq`` waits,
        counted once, logged at most every 10 s."""
        pool = self._pool
        assert pool is not None
        need = pages_for(min(len(seq.kv_ids), self._prefill_chunk), pool.page_tokens)
        if pool.available >= need + promised or self._reclaim(need + promised):
            return need
        if not seq.waited:
            seq.waited = True
            self.kv_admission_waits += 1
        now = time.monotonic()
        if now - self._full_logged >= 10.0:
            self._full_logged = now
            log.info(
                "KV pool full (%d/%d pages, %d sequences): %d requests wait",
                pool.used, pool.num_pages, len(self._running), self._queued,
            )  # fmt: skip
        return -1

    def _heads(self) -> list[tuple[object, int, int]]:
        """(fairness key, rows its head needs, weight) of each waiting key, in round order."""
        return [(key, 1 + len(q[0].choices), q[0].weight) for key, q in self._waiting.items()]

    def _pick(self) -> object:
        """The fairness key whose head is admitted next (zerolayer.engine.admission)."""
        heads = self._heads()
        return heads[self._row_shares.pick(heads)][0]

    def _take_rows(self, key: object) -> bool:
        """``key``'s head needs more rows than are free: when ``key`` is within its share and
        other principals run over theirs, their youngest rows are preempted (each gives its
        slot back and waits again, at the head of its queue, to recompute its KV when admitted)
        until the head's rows are free. Whether they are."""
        if not self.backend.recomputes:
            return False
        heads = self._heads()
        head = next(h for h in heads if h[0] == key)
        if not self._row_shares.entitled(head, heads):
            return False
        while 1 + len(self._waiting[key][0].choices) > len(self._free_slots):
            over = self._row_shares.over(heads)
            victim = next(
                (s for o in over for s in reversed(self._running) if s.fair_key == o
                 and not s.choices and not s.cancelled and not s.prompt_outputs),
                None,
            )  # fmt: skip
            if victim is None:
                return False
            self._requeue(victim)
        return True

    def _requeue(self, seq: Sequence) -> None:
        """``seq`` gives its slot to another principal: its row's state is saved, its pages
        released, and it waits at the head of its key's queue; when admitted again it
        recomputes its KV (prompt and produced ids but the last) and goes on without
        resampling, like a sequence preempted for pages."""
        rows = self._rows
        slot = seq.slot
        if seq.recompute is None and seq.prefilled >= len(seq.prompt):  # a decoding row
            positions = int(rows.pos[slot])
            seq.recompute = np.concatenate(
                [seq.prompt, rows.ids[slot, : positions - len(seq.prompt)]]
            )
            self._saved[seq] = rows.save(slot)
        elif seq.recompute is not None:  # recomputing already
            self._saved[seq] = rows.save(slot)
        else:  # its prompt was not in yet: it starts again
            seq.restart_prompt()
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        if seq in self._rejoin:
            self._rejoin.remove(seq)
        self._running.remove(seq)
        self._free(seq)
        seq.prefilled = 0
        with self._lock:
            self._queued += 1
            self._shares.put_back(seq.fair_key)
        queue = self._waiting.get(seq.fair_key)
        if queue is None:
            self._waiting[seq.fair_key] = queue = collections.deque()
        queue.appendleft(seq)
        self._count_class(seq, 1, 1)
        self.class_preempted[seq.principal_class] = (
            self.class_preempted.get(seq.principal_class, 0) + 1
        )
        log.info(
            "preempted a row of client %s (over its share of the rows) for a waiting one",
            seq.fair_key,
        )

    def _next_waiting(self, key: object) -> Sequence:
        """Admission order, in one place: the head of ``key``'s queue, and ``key`` goes to the
        end of the round."""
        waiting = self._waiting
        queue = waiting.pop(key)
        seq = queue.popleft()
        if queue:
            waiting[key] = queue
        self._dequeued(seq)
        return seq

    def _dequeued(self, seq: Sequence) -> None:
        """``seq`` left the queue (admitted or cancelled): the one place both the queue's count
        and its client's share go down."""
        rows = 1 + len(seq.choices)
        with self._lock:
            self._queued -= 1
            self._shares.give_back(seq.fair_key, rows)
        self._count_class(seq, 1, -rows)

    def _count_class(self, seq: Sequence, which: int, rows: int) -> None:
        """``rows`` more rows running (``which`` 0) or waiting (1) for ``seq``'s class."""
        counts = self.class_rows.get(seq.principal_class)
        if counts is None:
            self.class_rows[seq.principal_class] = counts = [0, 0]
        counts[which] += rows
        self.class_version += 1

    def _take_slot(self, seq: Sequence) -> None:
        """Give ``seq`` the lowest free slot, counted in its principal's rows. Lowest slot first
        keeps the active slots consecutive, which lets the CPU kernels read the KV cache in
        place instead of gathering it (and the rows give views)."""
        seq.slot = heapq.heappop(self._free_slots)
        self._row_shares.took(seq.fair_key, seq.weight)
        self._count_class(seq, 0, 1)

    def _admit(self, seq: Sequence, finished: list[Finished]) -> None:
        """Give ``seq`` the lowest free slot and its row, and load its known prefix."""
        if not seq.t_admit:  # a preempted sequence keeps its first admission's
            seq.t_admit = time.perf_counter()
        if seq.cancelled:
            finished.append(self._end(seq, FinishReason.CANCELLED))
            return
        self._take_slot(seq)
        slot = seq.slot
        try:
            saved = self._saved.pop(seq, None)
            if saved is not None:  # preempted for another principal: back as it was
                self._rows.restore(slot, seq, saved)
            else:
                self._rows.add(slot, seq)
            if seq.recompute is not None:
                if self._store is not None:  # its prompt's known blocks, by reference
                    seq.prefilled = self._store.load(seq.recompute, slot)
            elif self._store is not None and not seq.prompt_outputs:
                # The longest known prefix's KV into the slot; prefill starts after it.
                seq.prefilled = seq.reused = self._store.load(seq.prompt, slot)
        except Exception:  # this sequence alone cannot run: it ends, the others go on
            log.exception("admitting a sequence failed; ending it")
            finished.append(self._end(seq, FINISH_ERROR))
            self._free(seq)
            return
        for choice in seq.choices:  # reserved now; their rows start when the prompt is in
            self._take_slot(choice)
            choice.t_admit = seq.t_admit
        self._running.append(seq)
        self._prefilling.append(seq)

    def _fork(self, seq: Sequence) -> None:
        """``seq``'s prompt is in its slot: its other choices start from its KV (all but the
        prompt's last position, copied into their reserved slots), so each prefills one token
        and samples its first from its own seed stream. A backend without KV ranges prefills
        each choice's whole prompt."""
        choices, seq.choices = seq.choices, []
        n = len(seq.prompt)
        backend = self.backend
        handle = None
        if isinstance(backend, PrefixKV) and n > 1:
            try:
                handle = backend.save_kv(seq.slot, 0, n - 1)
            except Exception:
                log.exception("copying a prompt's KV for its choices failed; they prefill it")
        for choice in choices:
            if choice.cancelled:
                self._extra.append(self._end(choice, FinishReason.CANCELLED))
                self._free(choice)
                continue
            try:
                self._rows.add(choice.slot, choice)
                if handle is not None:
                    assert isinstance(backend, PrefixKV)
                    backend.load_kv(handle, choice.slot, 0)
                    choice.prefilled = n - 1
                    choice.reused = seq.reused
            except Exception:  # this choice alone cannot run
                log.exception("starting a choice from its prompt's KV failed; ending it")
                self._extra.append(self._end(choice, FINISH_ERROR))
                self._free(choice)
                continue
            self._running.append(choice)
            self._prefilling.append(choice)
        if handle is not None:  # a paged backend's handle holds the pages: the choices do now
            assert isinstance(backend, PrefixKV)
            backend.drop_kv(handle)

    def _end_prompt_only(
        self, completed: list[Sequence], finished: list[Finished]
    ) -> list[Sequence]:
        """The sequences of ``completed`` (their prompts just prefilled) that generate nothing
        (``max_tokens`` 0) end now, MAX_TOKENS, with their choices; returns the others."""
        done = [seq for seq in completed if seq.max_tokens == 0]
        for seq in done:
            choices, seq.choices = seq.choices, []
            for choice in choices:
                self._extra.append(self._end(choice, FinishReason.MAX_TOKENS))
                self._free(choice)
            finished.append(self._end(seq, FinishReason.MAX_TOKENS))
        self._release(done)
        return [seq for seq in completed if seq.max_tokens]

    def _drop_cancelled_waiting(self, finished: list[Finished]) -> None:
        """Cancelled sequences still waiting leave the queue now, not when a slot frees (those
        holding a slot end in ``_update``, by the CANCEL rule)."""
        if not self._cancel_queued:  # no scan per step unless cancel() was called
            return
        self._cancel_queued = False
        for key, queue in list(self._waiting.items()):
            if not any(s.cancelled for s in queue):
                continue
            keep: collections.deque[Sequence] = collections.deque()
            for seq in queue:
                if seq.cancelled:
                    self._dequeued(seq)
                    finished.append(self._end(seq, FinishReason.CANCELLED))
                else:
                    keep.append(seq)
            if keep:
                self._waiting[key] = keep
            else:
                del self._waiting[key]

    # ---- execute -----------------------------------------------------------------------------

    def execute(
        self, plan: StepPlan
    ) -> tuple[np.ndarray | None, np.ndarray | None, set[int] | None]:
        """Run the backend on ``plan``: (sampled per chunk, sampled per decode row, the ids of
        sequences whose rows failed even when run alone, or None when nothing failed)."""
        failed: set[int] | None = None
        prefilled = decoded = None
        backend = self.backend
        if plan.copies:  # before any write: a copy's destination may be written in this step
            assert isinstance(backend, PagedKV), "page copies come from a paged backend's pool"
            backend.copy_pages(plan.copies)
        if plan.chunks:
            t0 = time.perf_counter()
            try:
                prefilled = backend.prefill(plan.chunks)
            except Exception:
                failed = set()
                prefilled = self._retry_rows(
                    backend.prefill, plan.chunks, plan.chunk_seqs, _one_chunk, failed
                )
            self._report("prefill", time.perf_counter() - t0, len(plan.chunks))
        if plan.batch is not None:
            t0 = time.perf_counter()
            try:
                decoded = backend.decode(plan.batch)
            except Exception:
                failed = failed if failed is not None else set()
                decoded = self._retry_rows(
                    backend.decode, plan.batch, plan.decode, _one_row, failed
                )
            self._report("decode", time.perf_counter() - t0, plan.batch.size)
        return prefilled, decoded, failed

    @staticmethod
    def _retry_rows(
        call: Callable[[_Work], np.ndarray],
        work: _Work,
        seqs: list[Sequence],
        one: Callable[[_Work, int], _Work],
        failed: set[int],
    ) -> np.ndarray:
        """A batched ``call(work)`` raised: run each row alone so that only the rows that fail
        by themselves are lost (their sequences' ids go to ``failed``, their tokens are -1)."""
        log.exception("a batched backend call failed; retrying its %d rows one by one", len(seqs))
        sampled = np.full(len(seqs), -1, np.int32)
        for i, seq in enumerate(seqs):
            try:
                sampled[i] = call(one(work, i))[0]
            except Exception:
                log.exception("backend call failed for one sequence; ending it")
                failed.add(id(seq))
        return sampled

    def _report(self, phase: str, seconds: float, batch: int) -> None:
        if self._on_step is not None:
            self._on_step(phase, seconds, batch)

    # ---- update ------------------------------------------------------------------------------

    def _update(
        self,
        plan: StepPlan,
        prefilled: np.ndarray | None,
        decoded: np.ndarray | None,
        failed: set[int] | None,
        finished: list[Finished],
    ) -> StepOutput:
        """The step's rows are the rows' decode set after this step's joins and failures, in
        slot order: a prompt that completed joins the rows now (``Rows.join``), so the row set
        (owners, index, text rows) is built once per change and the next step reuses it."""
        ended: list[Sequence] = []
        rows = self._rows
        sampled = decoded
        completed: list[Sequence] = []
        recomputed: list[Sequence] = []
        first: list[int] = []
        if prefilled is not None:
            for seq, chunk, token in zip(plan.chunk_seqs, plan.chunks, prefilled.tolist(),
                                         strict=True):  # fmt: skip
                if failed and id(seq) in failed:
                    continue
                seq.prefilled += len(chunk.tokens)
                if seq.prompt_outputs:
                    seq.take_prompt_outputs(chunk)
                if chunk.last:
                    completed.append(seq)
                    first.append(token)
                elif seq.recompute is not None and seq.prefilled == len(seq.recompute):
                    recomputed.append(seq)
            for seq in recomputed:  # its KV is back: it decodes from the next step on
                seq.recompute = None
                seq.prefilled = len(seq.prompt)
                self._rejoin.append(seq)
            if completed or recomputed:
                self._prefilling = [s for s in self._prefilling if s.prefilled < len(s.kv_ids)]
            if completed:
                if self._store is not None:
                    self._offer(completed)
                if any(seq.max_tokens == 0 for seq in completed):
                    first = [t for s, t in zip(completed, first, strict=True) if s.max_tokens]
                    completed = self._end_prompt_only(completed, finished)
                for seq in completed:
                    if seq.choices:
                        self._fork(seq)
        if failed:  # rows that failed even when run alone end; the others go on
            for seq in plan.decode + plan.chunk_seqs:
                if id(seq) in failed and seq not in ended:
                    finished.append(self._end(seq, FINISH_ERROR))
                    ended.append(seq)
            self._release(ended)  # out of the decode set before the step's rows are taken
        if completed or failed:  # the row set changed: each token to its slot, then in order
            joined = [s.slot for s in completed]
            rows.join(joined)
            if rows.decoding:
                by_slot = rows.scratch
                if decoded is not None and plan.batch is not None:
                    by_slot[plan.batch.slots] = decoded
                by_slot[joined] = first
                sampled = by_slot[rows.index].copy()  # a slice is a view of the scratch
            else:
                sampled = None
        if self._cancel_running:  # noted before the rows take their tokens in (not produced)
            self._cancel_running = False
            for seq in self._running:
                if seq.cancelled:
                    rows.fired[seq.slot] |= CANCEL
        if sampled is not None:
            counts, text = self._advance(sampled)
        # The one place a running row's end is decided, once per step.
        ends = decide(rows.fired, None if sampled is None else rows.index)
        out = StepOutput()
        if sampled is not None:
            out = self._step_rows(sampled, counts, text, rows.joined_rows(completed), ends.quiet)
            if rows.logprob_rows:
                out.logprobs = self._logprobs(plan, ends.quiet)
        if ends.slots:
            mine: list[Sequence] = []
            for slot, finish in zip(ends.slots, ends.finishes, strict=True):
                ending = rows.seq[slot]
                assert ending is not None, "a row with a finish rule holds no sequence"
                finished.append(self._end(ending, finish))
                mine.append(ending)
            self._release(mine)
        out.finished = finished
        return out

    def _advance(self, sampled: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
        """Every row of the step (the rows' decode set, in slot order) sampled a token: the rows
        take them in at once, noting the finish rules they fire, then the rows that detokenize
        add their text, noting a stop string or a failure (zerolayer.engine.finish). Returns
        each row's count of tokens and the text by row."""
        rows = self._rows
        counts = rows.advance(sampled)
        text: dict[int, str] = {}
        if rows.text_rows:
            tokens = sampled.tolist()
            fired = rows.fired
            rules = fired[rows.index].tolist()
            for i, seq in rows.text_rows:
                r = rules[i]
                try:
                    # A token not produced has no text; a row that ends anyway flushes its text.
                    text[i], stop = seq.text(None if r & UNPRODUCED else tokens[i], r != 0)
                except Exception:  # e.g. a detokenizer failure: this sequence ends alone
                    log.exception("processing a sampled token failed; ending its sequence")
                    text[i] = ""
                    fired[seq.slot] |= FAILED
                    continue
                if stop:
                    fired[seq.slot] |= STOP_STRING
        return counts, text

    def _step_rows(
        self,
        sampled: np.ndarray,
        counts: np.ndarray,
        text: dict[int, str],
        joined: list[int],
        quiet: list[int],
    ) -> StepOutput:
        """The step's rows as handed out, once its endings are decided: the tokens that ended
        their rows without being produced (``quiet``) are taken back: not counted, and NO_TOKEN
        in place of the id."""
        rows = self._rows
        if quiet:
            rows.unproduce(quiet)
            counts = rows.step_counts()
            sampled = sampled.copy()
            sampled[quiet] = NO_TOKEN
        sampled.flags.writeable = False
        return StepOutput(rows.owners, sampled, counts, joined, text, quiet)

    def _logprobs(self, plan: StepPlan, quiet: list[int]) -> dict[int, Logprobs]:
        """The logprobs of the step's rows that asked (the samplers wrote them into the
        batch's and the chunks' Processing), by row; none for a row that produced no token, nor
        for one retried alone after its batch failed (the retry samples a copy)."""
        rows = self._rows
        by_slot: dict[int, Logprobs] = {}
        sources = [(c.processing, [c.slot]) for c in plan.chunks if c.processing is not None]
        if plan.batch is not None and plan.batch.processing is not None:
            sources.append((plan.batch.processing, plan.batch.slots.tolist()))
        for proc, slots in sources:
            got = proc.sampled
            if got is None or got.logprob is None or proc.logprobs is None:
                continue
            assert got.top_ids is not None and got.top_logprobs is not None
            for r, slot in enumerate(slots):
                k = int(proc.logprobs[r])
                if k >= 0:
                    by_slot[slot] = Logprobs(
                        float(got.logprob[r]),
                        got.top_ids[r, :k].copy(),
                        got.top_logprobs[r, :k].copy(),
                    )
        skip = set(quiet)
        return {
            i: by_slot[slot]
            for i, slot in enumerate(rows.decoding)
            if slot in by_slot and i not in skip
        }

    # ---- bookkeeping -------------------------------------------------------------------------

    def _end(self, seq: Sequence, finish: int) -> Finished:
        """``seq`` ended with ``finish``: its record (the slot is freed by ``_release``). Its
        choices still waiting for its prompt end with it (cancelled with it, else failed)."""
        if seq.choices:
            choices, seq.choices = seq.choices, []
            for choice in choices:
                cancelled = finish == FinishReason.CANCELLED or choice.cancelled
                self._extra.append(
                    self._end(choice, FinishReason.CANCELLED if cancelled else FINISH_ERROR)
                )
                self._free(choice)
        if seq.t_admit:
            elapsed = time.perf_counter() - seq.t_admit
            self._avg_seq_s += 0.05 * (elapsed - self._avg_seq_s)
        if seq.slot < 0:
            saved = self._saved.pop(seq, None)  # preempted and waiting: what it produced
            if saved is not None and len(saved.ids):
                ids = saved.ids.copy()
                ids.flags.writeable = False
                return Finished(seq.owner, finish, seq.t_admit, len(ids), ids)
            return Finished(seq.owner, finish, seq.t_admit, 0, None)
        ids = self._rows.produced_ids(seq.slot)
        return Finished(seq.owner, finish, seq.t_admit, len(ids), ids)

    def _offer(self, completed: list[Sequence]) -> None:
        """Prompts just prefilled: their full blocks go to the prefix store, copied out now,
        while the slots still hold them. A failure here costs reuse, never a sequence."""
        assert self._store is not None
        for seq in completed:
            if seq.slot < 0:
                continue
            try:
                self._store.offer(seq.prompt, seq.slot)
            except Exception:
                log.exception("saving a prompt's KV blocks failed; they will be recomputed")

    def _free(self, seq: Sequence) -> None:
        """Give ``seq``'s slot back (its row is cleared)."""
        slot = seq.slot
        if slot >= 0:
            self._rows.remove(slot)
            if self._pool is not None:
                self._pool.release(slot)
            self.backend.free(slot)
            heapq.heappush(self._free_slots, slot)
            seq.slot = -1
            self._row_shares.gave_back(seq.fair_key)
            self._count_class(seq, 0, -1)

    def _release(self, seqs: list[Sequence]) -> None:
        """Ended sequences leave: their slots and rows are freed."""
        for seq in seqs:
            self._free(seq)
            self._running.remove(seq)
            if seq.prefilled < len(seq.kv_ids):
                self._prefilling.remove(seq)
            if seq in self._rejoin:
                self._rejoin.remove(seq)

    def _fail_all(self) -> list[Finished]:
        running = list(self._running)
        finished = [self._end(seq, FINISH_ERROR) for seq in running]
        self._release(running)
        finished += self._extra
        self._extra = []
        return finished


def _one_chunk(chunks: list[PrefillChunk], i: int) -> list[PrefillChunk]:
    return [chunks[i]]


def _one_row(batch: DecodeBatch, i: int) -> DecodeBatch:
    s = slice(i, i + 1)
    return DecodeBatch(
        slots=batch.slots[s],
        tokens=batch.tokens[s],
        positions=batch.positions[s],
        sampling=batch.sampling[s],
        processing=None if batch.processing is None else batch.processing.select(i),
    )
