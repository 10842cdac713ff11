"""A stream: one request in flight, whatever its door, and what the request path needs from
that door (``Door``) and from the door kind's encoder (``Encoder``, ``TokenWriter``).

A stream's phase moves only through ``zerolayer.request_path.lifecycle.RequestPath``; its counts
only through ``zerolayer.request_path.outputs``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from zerolayer.codes import Cached, FinishReason, Refusal

if TYPE_CHECKING:
    from zerolayer.engine.engine import Sequence
    from zerolayer.engine.step import StepOutput
    from zerolayer.hooks import RequestContext

_perf = time.perf_counter


class Phase(enum.IntEnum):
    NEW = 0  # accepted by a door; not (yet) in the engine, no hook running
    HOOKS = 1  # async on_request hooks are running
    ENGINE = 2  # submitted to the engine (or being answered from the response cache)
    ENDED = 3
    PREPARING = (
        4  # a large input is templated and tokenized off the loop (zerolayer.request_path.offload)
    )


# The phases as module names: read on every request, and an IntEnum's class attribute lookup
# costs several times a global's.
NEW, HOOKS, ENGINE, ENDED, PREPARING = Phase
_ERROR = FinishReason.ERROR


class Door(Protocol):
    """What the request path needs from a door. All calls happen on the event loop."""

    dirty: bool  # has unwritten output; the output processor flushes it after a delivery
    label: str  # names the door in logs ("7" for frame connection 7)
    peer_ip: str  # the client's address: an anonymous client's fairness key

    # Read-only here (a door may derive them), so a door may name its own writer type.
    @property
    def open(self) -> bool:
        """False once the peer is gone: nothing more is written."""

    @property
    def encoder(self) -> Encoder:
        """The door kind's encoder, the same for every door of that kind: ``encoder(streams,
        rows)`` writes each engine step's ids and text for ``streams`` (rows ``rows`` of an
        engine row set, on any doors of this kind); see zerolayer.request_path.outputs."""

    def write_cached(self, st: Stream, ids: list[int], text: str) -> int:
        """A whole answer replayed from the response cache; returns TOKEN frames written."""

    def write_done(
        self, st: Stream, finish: FinishReason, timings: tuple[float, float, float]
    ) -> None:
        """The stream finished (st holds the counts); timings = (queue_s, ttft_s, total_s)."""

    def write_error(self, st: Stream, error: Refusal) -> None:
        """The stream ended in an error: its code, message (naming the field at fault), the
        field itself when there is one, and the retry hint."""

    def stream_ended(self, st: Stream) -> None:
        """After the ending was written: forget the stream (and close when draining)."""

    def flush(self) -> None:
        """Write what was buffered (one write per door per delivery)."""


class Stream:
    """One request in flight, whatever its door. Its phase moves only through RequestPath."""

    __slots__ = ("door", "key", "api", "phase", "seq", "ctx", "t_recv", "t_first", "n_ids",
                 "prompt_tokens", "cache_bits", "want_text", "record", "rec_ids", "rec_text",
                 "full_ids", "finish", "from_cache", "state", "ended", "choice",
                 "group")  # fmt: skip

    def __init__(self, door: Door, key: int, api: str, want_text: bool = False) -> None:
        self.door = door
        self.key = key  # the door's id for it (the frame stream id)
        self.api = api  # "frames", "openai", "anthropic": for metrics and logs
        self.phase = NEW
        self.ended = False  # phase is ENDED: a plain flag for the output loop (set by _end only)
        self.seq: Sequence | None = None
        self.ctx: RequestContext | None = None  # while on_done is still owed to the hooks
        self.t_recv = _perf()
        self.t_first = 0.0
        self.n_ids = 0  # tokens sent: final once ENDED (set by the output processor)
        self.prompt_tokens = 0
        self.cache_bits = Cached(0)
        self.want_text = want_text
        # Recorded for the response cache: the ids (the engine's, whole, when it ends the
        # sequence) and the text deltas as they come (None: decoded from the ids at the end).
        self.record = False
        self.rec_ids: np.ndarray | None = None
        self.rec_text: list[str] | None = None
        self.full_ids: np.ndarray | None = None  # the whole prompt, a registered one's ids included
        self.finish = _ERROR  # how it ended, once ENDED
        self.from_cache = False
        self.state: object = None  # the door's own per-stream data
        # n > 1 (docs/architecture.md, "n choices"): ``RequestPath.open`` makes n streams for
        # one request; each is one choice, ``group`` the tuple of all n (None when n == 1).
        self.choice = 0
        self.group: tuple[Stream, ...] | None = None


class TokenWriter(Protocol):
    """A door kind's encoder for one engine row set (``Door.encoder``)."""

    doors: list[Door]  # the doors it writes to (flushed after a delivery)

    def write(self, step: StepOutput) -> int:
        """Write this step's tokens and text for the writer's rows; returns TOKEN frames."""


# A door kind's encoder (``Door.encoder``): its streams in a row set and their rows → a writer.
Encoder = Callable[[list["Stream"], list[int]], TokenWriter]
