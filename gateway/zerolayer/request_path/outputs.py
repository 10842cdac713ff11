"""The output processor: the only place that reads engine steps, and where a stream's counts live.

It runs on the event loop with each batch of engine steps (zerolayer.engine.outbox). A step's rows
go to their doors through each kind of door's encoder (``Door.encoder``, e.g. the frame door's
batched TOKEN frames for all its connections), made once per engine row set: a ``Fanout``
groups the rows by encoder and is rebuilt only when the step's ``owners`` list is a new one
(the engine keeps it while the rows stay the same) or one of its streams ended. ``write``
returns the sequences the engine finished; the request path ends their streams (the processor
never calls it).

A stream's counts change only here. Its token count is set once, when it ends (``ended``):
the engine's count from its ending, or, when something else ends it, the count of the last
step delivered to its door (the engine counts tokens by row: no counter per token, nothing to
settle). The text recorded for the response cache and the time of the first token are written
per step (the ids come whole with the engine's ending).
"""

from __future__ import annotations

import time

import numpy as np

from zerolayer.engine.step import Finished, StepOutput
from zerolayer.ops.metrics import Metrics
from zerolayer.request_path.stream import Door, Encoder, Stream

_perf = time.perf_counter


class Fanout:
    """One engine row set's rows by door kind, each kind's writer, the doors written to, the
    rows whose text is recorded for the response cache, and the streams (live when it was
    built)."""

    __slots__ = ("owners", "writers", "doors", "row_of", "recording", "stale")

    def __init__(self, owners: list[Stream]) -> None:
        self.owners = owners
        self.stale = False  # one of its streams ended: the next step builds a new one
        by_encoder: dict[Encoder, tuple[list[Stream], list[int]]] = {}
        self.row_of: dict[Stream, int] = {}
        self.recording: list[tuple[int, list[str]]] = []  # (row, its stream's rec_text)
        for i, st in enumerate(owners):
            if st.ended:
                continue
            self.row_of[st] = i
            encoder = st.door.encoder
            group = by_encoder.get(encoder)
            if group is None:
                by_encoder[encoder] = group = ([], [])
            group[0].append(st)
            group[1].append(i)
            if st.rec_text is not None:  # set before the engine, never replaced after
                self.recording.append((i, st.rec_text))
        self.writers = [encoder(streams, rows) for encoder, (streams, rows) in by_encoder.items()]
        self.doors = list(dict.fromkeys(door for w in self.writers for door in w.doors))


class OutputProcessor:
    """Writes engine steps to the doors, in order; returns the finished sequences."""

    def __init__(self, metrics: Metrics) -> None:
        self._fanout: Fanout | None = None
        self._counts = np.empty(0, np.int32)  # the last delivered step's counts, by row
        self._m_tokens_out = metrics.frames_out_token

    def write(self, steps: list[StepOutput], dirty: list[Door]) -> list[Finished]:
        """Write ``steps`` to the doors (each door written to is appended to ``dirty`` once,
        for the caller to flush); returns the sequences that finished, in order."""
        finished: list[Finished] = []
        n_frames = 0
        for step in steps:
            if step.owners:
                n_frames += self._write_rows(step, dirty)
            if step.finished:
                finished += step.finished
        if n_frames:
            self._m_tokens_out.inc(n_frames)
        return finished

    def _write_rows(self, step: StepOutput, dirty: list[Door]) -> int:
        fan = self._fanout
        if fan is None or fan.stale or fan.owners is not step.owners:
            # The engine's owners are this path's Streams (RequestPath submits them).
            self._fanout = fan = Fanout(step.owners)  # type: ignore[arg-type]
        self._counts = step.counts
        n_frames = 0
        for writer in fan.writers:
            n_frames += writer.write(step)
        for door in fan.doors:
            if not door.dirty:
                door.dirty = True
                dirty.append(door)
        if step.joined:
            now = _perf()
            owners = fan.owners  # step.owners, as Streams
            for i in step.joined:
                st = owners[i]
                if not st.t_first:
                    st.t_first = now
        if fan.recording:
            text = step.text
            for i, rec_text in fan.recording:
                rec_text.append(text.get(i, ""))
        return n_frames

    def ended(self, st: Stream, count: int | None) -> None:
        """``st`` ends: its token count becomes final (``count`` from the engine's ending, or
        None: the tokens its door was given so far), and no later step writes to it."""
        fan = self._fanout
        row = fan.row_of.get(st) if fan is not None else None
        if fan is not None and row is not None:
            fan.stale = True
        if st.from_cache:  # counted by replay
            return
        if count is None:
            count = 0 if row is None else int(self._counts[row])
        st.n_ids = count

    def replay(self, st: Stream, ids: list[int], text: str) -> None:
        """A whole answer from the response cache, written to ``st``'s door and counted."""
        self._m_tokens_out.inc(st.door.write_cached(st, ids, text))
        st.n_ids = len(ids)
        st.t_first = _perf()
