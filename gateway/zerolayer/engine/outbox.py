"""The engine's outbox: steps handed from the engine thread to the event loop, with a hard bound.

The engine thread ``put``s each StepOutput; the first step of a batch schedules one wake-up of
the loop, and steps that finish while that wake-up waits join it, so the loop is woken at most
once per batch however fast the engine runs. At most ``max_pending`` steps wait: beyond that the
engine thread blocks until the loop takes them (it is slowed to the loop's pace instead of
queueing outputs without bound). ``close`` releases a blocked engine thread for shutdown; steps
put after it are dropped (nobody is left to deliver them to).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from zerolayer.engine.step import StepOutput

Consumer = Callable[[list[StepOutput]], None]

MAX_PENDING_STEPS = 16  # steps the engine may run ahead of the loop before it waits


class Outbox:
    """Engine thread → event loop hand-off. ``put`` is the engine's deliver callback."""

    def __init__(self, max_pending: int = MAX_PENDING_STEPS) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()  # taken directly on the hot path (a C call)
        self._cond = threading.Condition(self._lock)  # for waiting when full
        self._pending: list[StepOutput] = []
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._consumer: Consumer | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, consumer: Consumer) -> None:
        """``consumer(steps)`` runs on ``loop`` with every batch of steps, in order."""
        self._loop, self._consumer = loop, consumer

    def put(self, step: StepOutput) -> None:
        """On the engine thread: queue one step; blocks while ``max_pending`` steps wait."""
        with self._lock:
            while len(self._pending) >= self.max_pending and not self._closed:
                self._cond.wait()
            if self._closed:
                return
            self._pending.append(step)
            wake = len(self._pending) == 1
        if wake:
            assert self._loop is not None, "Outbox.attach was not called"
            try:
                self._loop.call_soon_threadsafe(self._hand_over)
            except RuntimeError:  # the loop is closed: shutting down, nobody to deliver to
                self.close()

    def close(self) -> None:
        """Release a blocked ``put`` and drop what waits and what comes later."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _hand_over(self) -> None:
        with self._lock:
            steps, self._pending = self._pending, []
            if len(steps) >= self.max_pending:  # only then can the engine thread be waiting
                self._cond.notify_all()
        if steps and self._consumer is not None:
            self._consumer(steps)
