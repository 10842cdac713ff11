"""The engine: a continuous-batching scheduler running a Backend in its own thread.

A step is schedule → execute → update (``step_columns``):
- **schedule** takes in new sequences and cancellations, admits waiting sequences into free KV
  slots (loading the longest prompt prefix the prefix store knows, so prefill starts after it),
  and returns a ``StepPlan``: prompt chunks for sequences still in prefill (within
  ``max_step_tokens``) and the decode batch of every decoding sequence. A plain dataclass that
  tests can inspect.
- **execute** runs the backend on the plan (nothing else); a failing batched call is retried row
  by row so that a failure ends only the sequence that caused it.
- **update** turns sampled ids into outputs (stop checks, UTF-8-safe text, stop sequences),
  offers the blocks of prompts whose prefill just completed to the prefix store, and frees the
  slots of finished sequences; the caller hands the step's outputs on in ONE call.
The waiting queue is bounded: ``submit`` refuses when it is full.

Steady-state decode steps take a columnar path: while the decode rows are unchanged, the "plain"
rows (no text, no stop ids) hand over their sampled ids as one ``TokenColumn`` per step instead
of one Output tuple per token, as long as none of them samples EOS or can reach max_tokens or
max_context; the other rows of the batch go token by token. Plain rows then all advance by
exactly one token per step, so their counters are brought up to date only when the path is left
(``_Columnar.sync``). The decode rows are a tuple that only ``_set_decoding`` replaces, bumping
``_rows_version``: every cache keyed on the rows (the decode batch, the columnar path, the
consumer's frame plan) compares versions, never object identity.
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
from dataclasses import dataclass

import numpy as np

from gateway.codes import FinishReason
from gateway.engine.admission import QueueShares
from gateway.engine.backend import Backend
from gateway.engine.compute import ComputeThread
from gateway.engine.prefix_store import PrefixStore
from gateway.engine.types import DecodeBatch, PrefillChunk, SamplingRow
from gateway.tokenizer import Detokenizer, Tokenizer

log = logging.getLogger("zerolayer.engine")

# Output.finish for a sequence that ended in an engine failure (the door answers INTERNAL).
FINISH_ERROR = FinishReason.ERROR
_MAX_TOKENS = FinishReason.MAX_TOKENS  # a global: read per request, cheaper than the enum's
NOT_FINISHED = -2
INT32_MAX = 2**31 - 1
POSITION_BLOCK = 64  # decode steps whose positions are computed at once


class EngineOverloaded(Exception):
    """The waiting queue is full; ``retry_after_ms`` estimates when a slot frees up."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"engine queue full, retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class EngineStopped(Exception):
    """The engine no longer accepts work (shutting down)."""


class Sequence:
    """One generation request as the engine sees it. ``owner`` is opaque (the server's stream)."""

    __slots__ = (
        "owner",
        "prompt",
        "max_tokens",
        "sampling",
        "stop_ids",
        "stop_sequences",
        "detok",
        "reused",
        "slot",
        "prefilled",
        "generated",
        "position",
        "last_token",
        "held",
        "cancelled",
        "t_admit",
        "ignore_eos",
        "fair_key",
        "matched_stop",
        "_max_stop",
    )

    def __init__(
        self,
        owner: object,
        prompt: np.ndarray,
        max_tokens: int,
        sampling: SamplingRow,
        stop_ids: frozenset[int] = frozenset(),
        stop_sequences: tuple[str, ...] = (),
        detokenizer: Detokenizer | None = None,
        ignore_eos: bool = False,
        fair_key: object = None,
    ) -> None:
        self.owner = owner
        self.prompt = prompt  # int32 [n]: the whole prompt
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.stop_sequences = stop_sequences
        self.detok = detokenizer  # None = no text wanted and no stop sequences
        self.reused = 0  # leading prompt positions whose KV came from the prefix store
        self.slot = -1
        self.prefilled = 0  # prompt ids in the cache so far (the reused ones included)
        self.generated = 0
        self.position = len(prompt)  # where the next sampled token will be written
        self.last_token = -1
        self.held = ""  # text withheld because it may start a stop sequence
        self.cancelled = False
        self.t_admit = 0.0
        self.ignore_eos = ignore_eos  # generate past EOS (vLLM's extension, HTTP only)
        self.fair_key = fair_key  # sequences sharing a key share one turn at admission
        self.matched_stop: str | None = None  # the stop sequence that ended it (finish STOP)
        self._max_stop = max(map(len, stop_sequences)) if stop_sequences else 0


# What one step produced for one sequence, as a plain tuple (one is made per token, so no class):
#   (owner, token, text, finish, t_admit)
# token: the new token id, or NO_TOKEN (the token that ends a stream is never sent);
# text: its UTF-8-safe text delta ("" when none or not wanted);
# finish: NOT_FINISHED, a FinishReason, or FINISH_ERROR; t_admit: perf_counter at slot admission.
Output = tuple[object, int, str, int, float]
NO_TOKEN = -1
OWNER, TOKEN, TEXT, FINISH, T_ADMIT = range(5)


@dataclass(slots=True)
class TokenColumn:
    """One columnar decode step: ``owners[i]`` got token ``tokens[i]`` and goes on (no text, not
    finished). ``version`` names the row set: it is the same for every step while the rows stay
    the same and changes whenever they change, so a consumer may cache per-row work under it.
    Both arrays are read-only: the engine feeds ``tokens`` back as the next step's input."""

    version: int
    owners: list[object]
    tokens: np.ndarray  # int32 [len(owners)]


# Called from the engine thread once per step that produced anything.
Deliver = Callable[[list[Output], TokenColumn | None], None]


@dataclass(slots=True)
class StepPlan:
    """What one step runs: prompt chunks (``chunk_seqs[i]`` owns ``chunks[i]``), then one decode
    row per sequence of ``decode`` (rows version ``version``) as ``batch``."""

    chunks: list[PrefillChunk]
    chunk_seqs: list[Sequence]
    decode: tuple[Sequence, ...]
    version: int
    batch: DecodeBatch | None


class _Columnar:
    """The columnar path's state for one decode row set (see the module docstring): its plain
    rows, their owners and indices in the batch (None: every row is plain), the other rows and
    their indices, how many columnar steps the plain rows can take before one of them may
    finish, how many they took since their counters were last written, and the last of those
    steps' tokens."""

    __slots__ = ("rows_version", "version", "seqs", "owners", "index", "others", "others_index",
                 "limit", "steps", "last")  # fmt: skip

    def __init__(self, rows: tuple[Sequence, ...], rows_version: int, max_context: int) -> None:
        self.rows_version = rows_version
        self.version = -1  # TokenColumn.version: set by the engine right after
        self.steps = 0
        self.last = np.empty(0, np.int32)
        plain = [i for i, seq in enumerate(rows) if seq.detok is None and not seq.stop_ids]
        if len(plain) == len(rows):
            self.seqs, self.index = list(rows), None
            self.others, self.others_index = [], None
        else:
            self.seqs = [rows[i] for i in plain]
            self.index = np.array(plain, np.intp)
            other = sorted(set(range(len(rows))) - set(plain))
            self.others = [rows[i] for i in other]
            self.others_index = np.array(other, np.intp)
        self.owners = [seq.owner for seq in self.seqs]
        # A row ends on the token that brings it to max_tokens or max_context: every step
        # before that one may go columnar. (Two list minima: no Python call per row.)
        seqs = self.seqs
        self.limit = (
            min(
                min([s.max_tokens - s.generated for s in seqs]),
                max_context - max([s.position for s in seqs]),
            )
            - 1
            if seqs
            else 0
        )

    def sync(self) -> None:
        """Write the columnar steps taken so far into the rows' counters."""
        k = self.steps
        if not k:
            return
        self.steps = 0
        self.limit -= k
        for seq, token in zip(self.seqs, self.last.tolist(), strict=True):
            seq.generated += k
            seq.position += k
            seq.last_token = token


class Engine:
    """Owns the scheduler thread. ``submit`` and ``cancel`` are safe from any thread.

    ``deliver(outputs, column)`` is called on the engine thread once per step that produced
    anything (the daemon passes its ``Outbox.put``)."""

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
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self._deliver = deliver
        self._max_queue = max_queue
        self._max_step_tokens = max_step_tokens
        self._prefill_chunk = prefill_chunk
        self._on_step = on_step
        self._store = prefix_store  # consulted at admission, fed at prefill completion
        self._inbox: collections.deque[Sequence] = collections.deque()
        # Waiting sequences by fairness key (Sequence.fair_key), in round-robin order: admission
        # takes the head of the first key's queue and moves that key to the end, so a client
        # with many queued sequences cannot starve one with a single request.
        self._waiting: dict[object, collections.deque[Sequence]] = {}
        self._running: list[Sequence] = []  # every sequence holding a slot
        self._prefilling: list[Sequence] = []  # ... whose prompt is not all in the cache yet
        self._decoding: tuple[Sequence, ...] = ()  # ... and those decoding (_set_decoding)
        self._rows_version = 0
        self._versions = 0  # source of new row and column versions
        self._cancel_pending = False
        n = backend.num_slots
        self._free_slots = list(range(n))  # a min-heap: the lowest free slot goes first
        self._max_context = backend.info.max_context
        self._temperature = np.zeros(n, np.float32)
        self._top_p = np.ones(n, np.float32)
        self._top_k = np.zeros(n, np.int32)
        self._seeds = np.zeros(n, np.uint64)
        self._seeded = np.zeros(n, np.bool_)
        self._last_batch: DecodeBatch | None = None
        self._last_batch_version = -1
        self._positions: list[np.ndarray] = []  # the coming steps' positions (_next_positions)
        self._last_sampled = np.empty(0, np.int32)
        self._eos = tokenizer.eos_token_ids
        self._eos_ids = tuple(sorted(self._eos))  # for the columnar path's vector check
        # The one EOS id as a decode step's int32 bytes (_any_eos); the backend contract's dtype.
        self._eos_bytes = np.array(self._eos_ids[:1], np.int32).tobytes()
        self._col: _Columnar | None = None
        # (version, rows) of the column a split step went on with (_split_column)
        self._handoff: tuple[int, list[Sequence]] | None = None
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
            if self._queued >= self._max_queue or not self._shares.take(seq.fair_key):
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
        """Stop ``seq`` at the next step; it then ends with finish CANCELLED."""
        seq.cancelled = True
        self._cancel_pending = True
        self._wake.set()

    def retry_after_ms(self) -> int:
        per_slot = self._avg_seq_s / max(1, self.backend.num_slots)
        estimate = per_slot * (self._queued + 1) * 1000.0
        return int(min(max(estimate, 50.0), 30_000.0))

    def start(self, compute: ComputeThread | None = None) -> None:
        """Run the engine loop on ``compute`` (the thread that loaded the model, so that torch
        keeps one OpenMP team; see gateway.engine.compute), or on a thread of its own."""
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
            return
        with contextlib.suppress(RuntimeError):  # RuntimeError: the thread is already gone
            self._compute.submit(self.backend.close)  # runs after _run has returned
        self._compute.close(timeout)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while not self._stop:
            self.last_beat = time.monotonic()
            if self.idle:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                outputs, column = self.step_columns()
            except Exception:  # a bug in the scheduler itself: nothing can be trusted
                log.exception("engine step failed; failing the sequences in flight")
                outputs, column = self._fail_all(), None
            if outputs or column is not None:
                self._deliver(outputs, column)

    def step(self) -> list[Output]:
        """One scheduling step with every token as its own Output (a TokenColumn expanded).
        Public so tests can drive the engine without the thread."""
        outputs, column = self.step_columns()
        if column is not None:
            col, handoff = self._col, self._handoff
            if col is not None and col.version == column.version:
                rows = col.seqs
            else:  # a split step's column (_split_column)
                assert handoff is not None and handoff[0] == column.version
                rows = handoff[1]
            for seq, token in zip(rows, column.tokens.tolist(), strict=True):
                outputs.append((seq.owner, token, "", NOT_FINISHED, seq.t_admit))
        return outputs

    def step_columns(self) -> tuple[list[Output], TokenColumn | None]:
        """One step: its Outputs, and the decode rows' tokens as one TokenColumn when the step
        took the columnar path (no Output then comes from those rows)."""
        outputs: list[Output] = []
        plan = self.schedule(outputs)
        if plan is None:
            return outputs, None
        prefilled, decoded, failed = self.execute(plan)
        column = self._update(plan, prefilled, decoded, failed, outputs)
        self.steps += 1
        return outputs, column

    # ---- schedule ----------------------------------------------------------------------------

    def schedule(self, outputs: list[Output]) -> StepPlan | None:
        """Take in new sequences and cancellations (their endings go to ``outputs``) and plan
        the step; None when nothing runs."""
        while self._inbox:
            seq = self._inbox.popleft()
            queue = self._waiting.get(seq.fair_key)
            if queue is None:
                self._waiting[seq.fair_key] = queue = collections.deque()
            queue.append(seq)
        self._admit(outputs)
        self._drop_cancelled(outputs)
        if not self._running:
            return None
        plan = StepPlan([], [], self._decoding, self._rows_version, None)
        budget = self._max_step_tokens - len(plan.decode)
        for seq in self._prefilling:
            if budget <= 0:
                break
            start = seq.prefilled
            n = min(len(seq.prompt) - start, self._prefill_chunk, budget)
            budget -= n
            plan.chunks.append(
                PrefillChunk(
                    slot=seq.slot,
                    tokens=seq.prompt[start : start + n],
                    start=start,
                    last=start + n == len(seq.prompt),
                    sampling=seq.sampling,
                )
            )
            plan.chunk_seqs.append(seq)
        if plan.decode:
            col = self._col
            if col is not None and col.rows_version != plan.version:
                col.sync()  # the rows changed: bring the old rows' counters up to date first
                self._col = None
            plan.batch = self._decode_batch(plan.decode, plan.version)
        return plan

    def _admit(self, outputs: list[Output]) -> None:
        waiting = self._waiting
        while waiting and self._free_slots:
            key = next(iter(waiting))
            queue = waiting.pop(key)
            seq = queue.popleft()
            if queue:
                waiting[key] = queue  # to the end of the round
            with self._lock:
                self._queued -= 1
                self._shares.give_back(seq.fair_key)
            seq.t_admit = time.perf_counter()
            if seq.cancelled:
                outputs.append(self._end(seq, NO_TOKEN, FinishReason.CANCELLED))
                continue
            # Lowest slot first keeps the active slots consecutive, which lets the CPU kernels
            # read the KV cache in place instead of gathering it.
            seq.slot = slot = heapq.heappop(self._free_slots)
            try:
                sp = seq.sampling
                self._temperature[slot] = sp.temperature
                self._top_p[slot] = sp.top_p
                self._top_k[slot] = sp.top_k
                self._seeds[slot] = sp.seed
                self._seeded[slot] = sp.seeded
                if self._store is not None:
                    # The longest known prefix's KV into the slot; prefill starts after it.
                    seq.prefilled = seq.reused = self._store.load(seq.prompt, slot)
            except Exception:  # this sequence alone cannot run: it ends, the others go on
                log.exception("admitting a sequence failed; ending it")
                outputs.append(self._end(seq, NO_TOKEN, FINISH_ERROR))
                self.backend.free(slot)
                heapq.heappush(self._free_slots, slot)
                seq.slot = -1
                continue
            self._running.append(seq)
            self._prefilling.append(seq)

    def _drop_cancelled(self, outputs: list[Output]) -> None:
        if not self._cancel_pending:  # no scan per step unless cancel() was called
            return
        self._cancel_pending = False
        # Waiting sequences that were cancelled leave the queue now, not when a slot frees.
        for key, queue in list(self._waiting.items()):
            if not any(s.cancelled for s in queue):
                continue
            keep = collections.deque()
            for seq in queue:
                if seq.cancelled:
                    with self._lock:
                        self._queued -= 1
                        self._shares.give_back(seq.fair_key)
                    outputs.append(self._end(seq, NO_TOKEN, FinishReason.CANCELLED))
                else:
                    keep.append(seq)
            if keep:
                self._waiting[key] = keep
            else:
                del self._waiting[key]
        cancelled = [s for s in self._running if s.cancelled]
        for seq in cancelled:
            outputs.append(self._end(seq, NO_TOKEN, FinishReason.CANCELLED))
        self._release(cancelled)

    def _decode_batch(self, rows: tuple[Sequence, ...], version: int) -> DecodeBatch:
        # Sampling parameters live in per-slot arrays written once at admission; per step only
        # the slot list, last tokens and positions are gathered. In the steady state (the same
        # rows as the previous step) even those are reused: only the tokens are new.
        last = self._last_batch
        if last is not None and version == self._last_batch_version:
            batch = DecodeBatch(
                slots=last.slots,
                tokens=self._last_sampled,  # each row feeds back what it sampled last step
                positions=self._next_positions(last.positions),
                temperature=last.temperature,
                top_p=last.top_p,
                top_k=last.top_k,
                seeds=last.seeds,
                seeded=last.seeded,
            )
        else:
            # fromiter: lists of ints into arrays without numpy's shape discovery per element
            n = len(rows)
            slots = np.fromiter([s.slot for s in rows], np.int32, n)
            batch = DecodeBatch(
                slots=slots,
                tokens=np.fromiter([s.last_token for s in rows], np.int32, n),
                positions=np.fromiter([s.position - 1 for s in rows], np.int32, n),
                temperature=self._temperature[slots],
                top_p=self._top_p[slots],
                top_k=self._top_k[slots],
                seeds=self._seeds[slots],
                seeded=self._seeded[slots],
            )
        self._last_batch, self._last_batch_version = batch, version
        return batch

    def _next_positions(self, positions: np.ndarray) -> np.ndarray:
        """``positions + 1``, taken from a block computed for the next POSITION_BLOCK steps at
        once: a numpy call costs tens of µs on a thread that just woke from a long backend call
        (cold caches; docs/benchmarks.md, paced serving), a list pop almost nothing."""
        if self._positions:
            following = self._positions.pop()
            if following.base is positions.base:  # the block this row came from: still valid
                return following
        steps = np.arange(POSITION_BLOCK, 0, -1, dtype=positions.dtype)[:, None]
        block = positions[None, :] + steps  # row i: positions + POSITION_BLOCK - i
        block.flags.writeable = False
        self._positions = list(block)
        return self._positions.pop()

    # ---- execute -----------------------------------------------------------------------------

    def execute(
        self, plan: StepPlan
    ) -> tuple[np.ndarray | None, np.ndarray | None, set[int] | None]:
        """Run the backend on ``plan``: (sampled per chunk, sampled per decode row, the ids of
        sequences whose rows failed even when run alone, or None when nothing failed)."""
        failed: set[int] | None = None
        prefilled = decoded = None
        backend = self.backend
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
    def _retry_rows(call, work, seqs, one, failed: set[int]) -> np.ndarray:  # noqa: ANN001
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
        outputs: list[Output],
    ) -> TokenColumn | None:
        finished: list[Sequence] = []
        if prefilled is not None:
            completed: list[Sequence] = []
            first: list[int] = []  # the first token of each completed prompt
            tokens = prefilled.tolist()
            for seq, chunk, token in zip(plan.chunk_seqs, plan.chunks, tokens, strict=True):
                if failed and id(seq) in failed:
                    self._fail(seq, outputs, finished)
                    continue
                seq.prefilled += len(chunk.tokens)
                if chunk.last:
                    completed.append(seq)
                    first.append(token)
            if completed:  # they decode from the next step on
                self._accept_decoded(completed, first, outputs, finished)
                if self._store is not None:
                    self._offer(completed)
                self._prefilling = [s for s in self._prefilling if s.prefilled < len(s.prompt)]
                self._set_decoding((*self._decoding, *completed))
        column = None
        if decoded is not None:
            self._last_sampled = decoded
            if failed:
                self._update_rows(plan.decode, decoded, failed, outputs, finished)
            else:
                column = self._update_decode(plan, decoded, outputs, finished)
        if finished:
            self._release(finished)
        return column

    def _update_decode(
        self,
        plan: StepPlan,
        sampled: np.ndarray,
        outputs: list[Output],
        finished: list[Sequence],
    ) -> TokenColumn | None:
        col = self._col
        if col is None:
            self._col = col = _Columnar(plan.decode, plan.version, self._max_context)
            handoff, self._handoff = self._handoff, None
            if handoff is not None and handoff[1] == col.seqs:
                col.version = handoff[0]  # the rows the last column went on with: same plan
            else:
                self._versions += 1
                col.version = self._versions
        if not col.seqs:
            self._accept_decoded(plan.decode, sampled, outputs, finished)
            return None
        index = col.index
        plain = sampled if index is None else sampled[index]
        if index is not None:
            others = col.others_index
            assert others is not None
            self._accept_decoded(col.others, sampled[others], outputs, finished)
        if col.steps < col.limit and not self._any_eos(plain):
            col.steps += 1
            col.last = plain
            return TokenColumn(col.version, col.owners, plain)
        return self._split_column(col, plain, outputs, finished)

    def _split_column(
        self, col: _Columnar, plain: np.ndarray, outputs: list[Output], finished: list[Sequence]
    ) -> TokenColumn | None:
        """A plain row may end at this token (EOS, max_tokens, max_context): the rows that do
        go token by token; the others still make one column, whose version the next step's
        columnar set-up keeps when its rows are exactly these (so the consumer's plan is built
        once, not for this step and again for the next)."""
        col.sync()
        self._col = None
        eos, max_context = self._eos, self._max_context
        ending: list[Sequence] = []
        ending_tokens: list[int] = []
        going: list[Sequence] = []
        going_tokens: list[int] = []
        for seq, token in zip(col.seqs, plain.tolist(), strict=True):
            ends = seq.generated + 1 >= seq.max_tokens or seq.position + 1 >= max_context
            if ends or token in eos:
                ending.append(seq)
                ending_tokens.append(token)
            else:
                seq.generated += 1
                seq.position += 1
                seq.last_token = token
                going.append(seq)
                going_tokens.append(token)
        self._accept_decoded(ending, ending_tokens, outputs, finished)
        if not going:
            return None
        self._versions += 1
        self._handoff = (self._versions, going)
        owners = [seq.owner for seq in going]
        return TokenColumn(self._versions, owners, np.array(going_tokens, np.int32))

    def _update_rows(
        self,
        rows: tuple[Sequence, ...],
        sampled: np.ndarray,
        failed: set[int],
        outputs: list[Output],
        finished: list[Sequence],
    ) -> None:
        """A decode step in which some rows failed: every row token by token."""
        self._leave_columns()
        for seq, token in zip(rows, sampled.tolist(), strict=True):
            if id(seq) in failed:
                self._fail(seq, outputs, finished)
            else:
                self._accept_token(seq, token, outputs, finished)

    def _leave_columns(self) -> None:
        if self._col is not None:
            self._col.sync()
            self._col = None

    def _accept_decoded(
        self,
        rows: tuple[Sequence, ...] | list[Sequence],
        sampled: np.ndarray | list[int],
        outputs: list[Output],
        finished: list[Sequence],
    ) -> None:
        """Sampled tokens (a decode step's, or the first of prompts just prefilled), row by row."""
        eos, max_context, append = self._eos, self._max_context, outputs.append
        tokens = sampled.tolist() if isinstance(sampled, np.ndarray) else sampled
        for seq, token in zip(rows, tokens, strict=True):
            if seq.detok is None and not seq.stop_ids and token not in eos:
                # The common case inlined (one per token): no text, no stop ids, not EOS.
                seq.generated += 1
                seq.position += 1
                seq.last_token = token
                if seq.generated < seq.max_tokens and seq.position < max_context:
                    append((seq.owner, token, "", NOT_FINISHED, seq.t_admit))
                    continue
                append(self._end(seq, token, _MAX_TOKENS))
                finished.append(seq)
            else:
                self._accept_token(seq, token, outputs, finished)

    def _any_eos(self, sampled: np.ndarray) -> bool:
        eos = self._eos_ids
        if len(eos) == 1:  # the usual case: a byte search, no numpy ufunc and no Python int
            # per row (after a long backend call a ufunc costs tens of µs; docs/benchmarks.md)
            data, pattern = sampled.tobytes(), self._eos_bytes
            at = data.find(pattern)
            while at >= 0:
                if at % 4 == 0:  # at an element, not across two
                    return True
                at = data.find(pattern, at + 1)
            return False
        return bool(len(eos) and np.isin(sampled, eos).any())

    def _accept_token(
        self, seq: Sequence, token: int, outputs: list[Output], finished: list[Sequence]
    ) -> None:
        try:
            out = self._next_output(seq, token)
        except Exception:  # e.g. a detokenizer failure: this sequence ends, the others go on
            log.exception("processing a sampled token failed; ending its sequence")
            self._fail(seq, outputs, finished)
            return
        outputs.append(out)
        if out[FINISH] != NOT_FINISHED:
            finished.append(seq)

    def _next_output(self, seq: Sequence, token: int) -> Output:
        if token in self._eos and not seq.ignore_eos:
            return self._end(seq, NO_TOKEN, FinishReason.EOS)
        if token in seq.stop_ids:
            return self._end(seq, NO_TOKEN, FinishReason.STOP)
        seq.generated += 1
        seq.position += 1
        seq.last_token = token
        text = ""
        if seq.detok is not None:
            text = seq.detok.push(token)
            if seq.stop_sequences:
                text, hit = self._scan_stops(seq, text)
                if hit:
                    return self._end(seq, token, FinishReason.STOP, text, flush=False)
        if seq.generated >= seq.max_tokens or seq.position >= self._max_context:
            return self._end(seq, token, FinishReason.MAX_TOKENS, text)
        return (seq.owner, token, text, NOT_FINISHED, seq.t_admit)

    @staticmethod
    def _scan_stops(seq: Sequence, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop sequence matched). Text that could be the
        start of a stop sequence is held back until the next token decides."""
        candidate = seq.held + text
        cut = -1
        for stop in seq.stop_sequences:
            i = candidate.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
                seq.matched_stop = stop  # the earliest match; at a tie, the first listed
        if cut != -1:
            seq.held = ""
            return candidate[:cut], True
        keep = 0
        for k in range(min(len(candidate), seq._max_stop - 1), 0, -1):
            tail = candidate[-k:]
            if any(stop.startswith(tail) for stop in seq.stop_sequences):
                keep = k
                break
        seq.held = candidate[len(candidate) - keep :] if keep else ""
        return candidate[: len(candidate) - keep], False

    def _end(
        self, seq: Sequence, token: int, finish: int, text: str = "", flush: bool = True
    ) -> Output:
        if flush and seq.detok is not None and finish != FINISH_ERROR:
            rest = seq.detok.flush()
            if seq.stop_sequences:
                rest, hit = self._scan_stops(seq, rest)
                text += rest + ("" if hit else seq.held)
                if hit:
                    finish = FinishReason.STOP
            else:
                text += rest
            seq.held = ""
        if seq.t_admit:
            elapsed = time.perf_counter() - seq.t_admit
            self._avg_seq_s += 0.05 * (elapsed - self._avg_seq_s)
        return (seq.owner, token, text, finish, seq.t_admit)

    def _fail(self, seq: Sequence, outputs: list[Output], finished: list[Sequence]) -> None:
        outputs.append((seq.owner, NO_TOKEN, "", FINISH_ERROR, seq.t_admit))
        finished.append(seq)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _set_decoding(self, rows: tuple[Sequence, ...]) -> None:
        """The only place the decode rows change: a new tuple and a new version."""
        self._decoding = rows
        self._versions += 1
        self._rows_version = self._versions

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

    def _release(self, seqs: list[Sequence]) -> None:
        """Free the slots of ended sequences; the decode rows are rebuilt once for all of them."""
        decoding = False
        for seq in seqs:
            if seq.slot >= 0:
                self.backend.free(seq.slot)
                heapq.heappush(self._free_slots, seq.slot)
                seq.slot = -1
            self._running.remove(seq)
            if seq.prefilled < len(seq.prompt):
                self._prefilling.remove(seq)
            else:
                decoding = True
        if decoding:  # a released sequence has slot -1; every decoding one holds a slot
            self._set_decoding(tuple([s for s in self._decoding if s.slot >= 0]))

    def _fail_all(self) -> list[Output]:
        self._leave_columns()
        outputs: list[Output] = []
        running = list(self._running)
        for seq in running:
            outputs.append((seq.owner, NO_TOKEN, "", FINISH_ERROR, seq.t_admit))
        self._release(running)
        return outputs


def _one_chunk(chunks: list[PrefillChunk], i: int) -> list[PrefillChunk]:
    return [chunks[i]]


def _one_row(batch: DecodeBatch, i: int) -> DecodeBatch:
    s = slice(i, i + 1)
    return DecodeBatch(
        slots=batch.slots[s],
        tokens=batch.tokens[s],
        positions=batch.positions[s],
        temperature=batch.temperature[s],
        top_p=batch.top_p[s],
        top_k=batch.top_k[s],
        seeds=batch.seeds[s],
        seeded=batch.seeded[s],
    )
