"""The fair share of the engine queue: no client holds so much of it that a newcomer is refused.

A client is a sequence's fairness key (``Sequence.fair_key``: the principal, or the connection
when anonymous). With ``n`` other clients holding queued sequences, a client may hold at most
``max_queue // (n + 2)`` of them (at least 1): one client flooding alone holds at most half the
queue. A client that already holds sequences is also refused once the queue is within
``max_queue // 16`` (at least 1) of full: that reserve is for clients holding none, so however
many flood, the next client is admitted. Pure bookkeeping: the engine calls
``take`` at submit and ``give_back`` when a sequence leaves the queue, under its own lock.
"""

from __future__ import annotations

__all__ = ["QueueShares"]


class QueueShares:
    """Queued sequences per client and the check against each client's share."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.reserve = max(1, max_queue // 16)  # kept for clients that hold nothing queued
        self.total = 0
        self._held: dict[object, int] = {}

    def share(self, key: object) -> int:
        """The most ``key`` may hold now."""
        others = len(self._held) - (key in self._held)
        return max(1, self.max_queue // (others + 2))

    def take(self, key: object) -> bool:
        """Count one more queued sequence for ``key``; False (nothing counted) over its share."""
        held = self._held.get(key, 0)
        if held >= self.share(key) or (held and self.total >= self.max_queue - self.reserve):
            return False
        self._held[key] = held + 1
        self.total += 1
        return True

    def give_back(self, key: object) -> None:
        """One of ``key``'s queued sequences left the queue (admitted or cancelled)."""
        if key not in self._held:
            return
        self.total -= 1
        held = self._held[key] - 1
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)
