"""The output processor: the only place that loops over engine outputs.

It runs on the event loop with each batch of engine steps (gateway.engine.outbox) and routes every
output to its stream's door: tokens and text deltas to ``Door.write_token``, the last output of a
sequence to ``RequestPath.finished`` (which ends the stream). Outputs of a stream that already
ended (cancelled, disconnected) are dropped by looking at the stream, not by a counter.

A columnar step (TokenColumn: one token for each plain decode row) is written through a
``ColumnPlan`` built once per row set (``TokenColumn.version``). Its rows are streams that take
ids without text, which only the frame door serves, so the plan holds their TOKEN frames in one
array, grouped by door: a step fills in the ids (one numpy call) and hands each door its span of
bytes (``Door.write_frames``). The rows' streams are not touched per step: ``settle`` brings
their token counts and response-cache recordings up to date, and the request path calls
``stream_ended`` (which settles, and drops the plan when the stream is one of its rows) before
it reads a stream's counts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from gateway import protocol as p
from gateway.engine.engine import NO_TOKEN, NOT_FINISHED, Output, TokenColumn
from gateway.engine.outbox import Step
from gateway.ops.metrics import Metrics

if TYPE_CHECKING:
    from gateway.lifecycle import Door, RequestPath, Stream

_perf = time.perf_counter
_FRAME, _ID = p.TOKEN1_FRAME_SIZE, p.TOKEN1_ID  # a one-id TOKEN frame: its bytes, its id's word


class ColumnPlan:
    """The TOKEN frames of one engine row set's columnar steps, grouped by door; valid while
    that set is."""

    __slots__ = ("version", "perm", "frames", "spans", "streams", "members", "recording",
                 "held", "steps")  # fmt: skip

    def __init__(self, version: int, owners: list[Stream]) -> None:
        self.version = version
        rows_by_door: dict[Door, list[int]] = {}
        self.recording: list[tuple[int, Stream]] = []
        # A row's stream has its t_first already: its first token came from its prefill, as an
        # Output (tests/e2e/test_protocol.py checks a columnar stream's TTFT).
        for i, st in enumerate(owners):
            if st.ended:
                continue
            rows = rows_by_door.get(st.door)
            if rows is None:
                rows_by_door[st.door] = rows = []
            rows.append(i)
            if st.rec_ids is not None:
                self.recording.append((i, st))
        # The live rows grouped by door: row j of ``frames`` is the frame of ``owners[perm[j]]``.
        order = [i for rows in rows_by_door.values() for i in rows]
        self.streams = [owners[i] for i in order]
        self.members = set(self.streams)  # streams hash by identity: no Python call per row
        n = len(order)
        self.perm = None if order == list(range(len(owners))) else np.fromiter(order, np.intp, n)
        # fromiter: a list of ints into an array without numpy's shape discovery per element
        self.frames = p.token1_frames(np.fromiter([st.key for st in self.streams], np.int64, n))
        view = memoryview(self.frames.reshape(-1).view(np.uint8))
        self.spans: list[tuple[Door, memoryview]] = []
        start = 0
        for door, rows in rows_by_door.items():
            end = start + len(rows) * _FRAME
            self.spans.append((door, view[start:end]))
            start = end
        self.held: list[np.ndarray] = []  # the steps' ids since the last settle, when recording
        self.steps = 0  # steps written since the last settle

    def write(self, tokens: np.ndarray, dirty: list[Door]) -> int:
        """Write one step's ids; returns the tokens written."""
        self.frames[:, _ID] = tokens if self.perm is None else tokens[self.perm]
        for door, frames in self.spans:
            door.write_frames(frames)
            if not door.dirty:
                door.dirty = True
                dirty.append(door)
        self.steps += 1
        if self.recording:
            self.held.append(tokens)
        return len(self.streams)

    def settle(self) -> None:
        """Bring the streams' token counts and response-cache recordings up to date."""
        k = self.steps
        if not k:
            return
        self.steps = 0
        for st in self.streams:
            st.n_ids += k
        if self.recording:
            held, self.held = self.held, []
            if k == 1:  # the common case while rows come and go: a settle after every step
                ids = held[0].tolist()
                for i, st in self.recording:
                    st.rec_ids.append(ids[i])  # type: ignore[union-attr]
            else:  # the steps as one block of bytes, then a slice per stream
                data = np.stack(held, axis=1).astype(np.int32, copy=False).tobytes()  # [rows][k]
                size = 4 * k
                for i, st in self.recording:
                    st.rec_ids.frombytes(data[i * size : (i + 1) * size])  # type: ignore[union-attr]


class OutputProcessor:
    """Writes engine steps' outputs to the doors, in order; one flush per door per batch."""

    def __init__(self, path: RequestPath, metrics: Metrics) -> None:
        self.path = path
        self._plan: ColumnPlan | None = None
        self._m_tokens_out = metrics.frames_out_token

    def deliver(self, steps: list[Step]) -> None:
        dirty: list[Door] = []
        n_frames = 0
        for outputs, column in steps:
            if outputs:
                n_frames += self._outputs(outputs, dirty)
            if column is not None:
                n_frames += self._column(column, dirty)
        for door in dirty:
            door.flush()
        if n_frames:
            self._m_tokens_out.inc(n_frames)

    def settle(self) -> None:
        """Make every stream's n_ids and rec_ids complete (columnar steps count lazily)."""
        if self._plan is not None:
            self._plan.settle()

    def stream_ended(self, st: Stream) -> None:
        """Called by the request path as ``st`` ends: its counts are settled, and a plan that
        writes to it is dropped (the next columnar step builds one without it)."""
        plan = self._plan
        if plan is not None:
            if plan.steps:
                plan.settle()
            if st in plan.members:
                self._plan = None

    def _column(self, column: TokenColumn, dirty: list[Door]) -> int:
        plan = self._plan
        if plan is None or plan.version != column.version:
            if plan is not None:
                plan.settle()
            self._plan = plan = ColumnPlan(column.version, column.owners)  # type: ignore[arg-type]
        return plan.write(column.tokens, dirty)

    def _outputs(self, outputs: list[Output], dirty: list[Door]) -> int:
        """One step's Outputs; returns the TOKEN frames written."""
        if self._plan is not None:
            self._plan.settle()  # earlier columnar ids go first in recordings; DONE counts them
        finished = self.path.finished
        n_frames = 0
        for st, token, text, finish, t_admit in outputs:
            if st.ended:  # type: ignore[attr-defined]
                continue
            door = st.door  # type: ignore[attr-defined]
            if st.rec_ids is not None:  # type: ignore[attr-defined]
                if token != NO_TOKEN:
                    st.rec_ids.append(token)  # type: ignore[attr-defined]
                if st.rec_text is not None:  # type: ignore[attr-defined]
                    st.rec_text.append(text)  # type: ignore[attr-defined]
            if token != NO_TOKEN:
                st.n_ids += 1  # type: ignore[attr-defined]
                if not st.t_first:  # type: ignore[attr-defined]
                    st.t_first = _perf()  # type: ignore[attr-defined]
                n_frames += door.write_token(st, token, text)
            elif text:
                n_frames += door.write_token(st, token, text)
            if finish != NOT_FINISHED:
                finished(st, finish, t_admit)  # type: ignore[arg-type]
            if not door.dirty:
                door.dirty = True
                dirty.append(door)
        return n_frames
