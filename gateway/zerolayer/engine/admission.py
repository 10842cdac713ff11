"""Fair shares at admission: of the engine queue (``QueueShares``) and of the rows running
(``RowShares``), so that no client holds so much of either that another waits behind it.

A client is a sequence's fairness key (``Sequence.fair_key``: the principal, or the connection
when anonymous). With ``n`` other clients holding queued sequences, a client may hold at most
``max_queue // (n + 2)`` of them (at least 1): one client flooding alone holds at most half the
queue. A client that already holds sequences is also refused once the queue is within
``max_queue // 16`` (at least 1) of full: that reserve is for clients holding none, so however
many flood, the next client is admitted. Pure bookkeeping: the engine calls
``take`` at submit and ``give_back`` when a sequence leaves the queue, under its own lock. A
request with ``n`` choices counts as n sequences.

Rows running (issue #40): each principal with work (rows running or waiting) has a share of the
slots, ``slots * weight // total weight of the principals with work`` (at least 1; the weight
is the key's, from the keys file), or a fixed ``ceil(row_share * slots)`` when the
``engine.row_share`` setting is above 0. Each time a slot is free the engine asks ``pick`` whose
waiting head goes next: among the principals whose head fits in their share (a principal
holding no rows always fits), the one with the fewest rows per weight; when none fits, the
fewest rows per weight of all (work-conserving: a principal alone may use every slot). The
engine holds the free slots for the principal picked until its head's n rows are free. When
the principal picked is within its share (``entitled``) and no slot is free, the principals
over their share (``over``) give up their youngest rows: the engine preempts them (their KV
freed, recomputed when they are admitted again), so a principal alone on every slot does not
keep a newcomer waiting for its long rows to end. Pure bookkeeping on the engine thread:
``took`` at each slot given, ``gave_back`` at each slot freed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["QueueShares", "RowShares"]


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

    def take(self, key: object, count: int = 1) -> bool:
        """Count ``count`` more queued sequences (a request's n choices) for ``key``; False
        (nothing counted) when they would pass its share."""
        held = self._held.get(key, 0)
        if held + count > self.share(key) or (
            held and self.total + count > self.max_queue - self.reserve
        ):
            return False
        self._held[key] = held + count
        self.total += count
        return True

    def put_back(self, key: object, count: int = 1) -> None:
        """Count ``count`` sequences queued again (preempted rows: they were admitted once, so
        no share refuses them)."""
        self._held[key] = self._held.get(key, 0) + count
        self.total += count

    def give_back(self, key: object, count: int = 1) -> None:
        """``count`` of ``key``'s queued sequences left the queue (admitted or cancelled)."""
        if key not in self._held:
            return
        self.total -= count
        held = self._held[key] - count
        if held > 0:
            self._held[key] = held
        else:
            self._held.pop(key, None)


class RowShares:
    """Rows running per principal, and which waiting principal a free slot goes to."""

    def __init__(self, slots: int, row_share: float = 0.0) -> None:
        self.slots = slots
        # 0: an equal (weighted) share among the principals with work; else a fixed cap
        self.fixed = max(1, math.ceil(row_share * slots)) if row_share > 0 else 0
        self.running: dict[Hashable, int] = {}
        self._weight: dict[Hashable, int] = {}  # of the principals with rows running

    def took(self, key: Hashable, weight: int) -> None:
        """One more slot given to ``key``."""
        self.running[key] = self.running.get(key, 0) + 1
        self._weight[key] = weight

    def gave_back(self, key: Hashable) -> None:
        """One of ``key``'s slots freed."""
        held = self.running.get(key, 0) - 1
        if held > 0:
            self.running[key] = held
        else:
            self.running.pop(key, None)
            self._weight.pop(key, None)

    def share(self, weight: int, total_weight: int) -> int:
        """The rows a principal of ``weight`` may hold while others wait."""
        if self.fixed:
            return self.fixed
        return max(1, self.slots * weight // max(1, total_weight))

    def _total(self, heads: Sequence[tuple[Hashable, int, int]]) -> int:
        """The weight of the principals with work: running, or with a head in ``heads``."""
        total = sum(self._weight.values())
        return total + sum(w for key, _, w in heads if key not in self._weight)

    def entitled(
        self, head: tuple[Hashable, int, int], heads: Sequence[tuple[Hashable, int, int]]
    ) -> bool:
        """Whether ``head``'s principal stays within its share with its head's rows."""
        key, need, weight = head
        return self.running.get(key, 0) + need <= self.share(weight, self._total(heads))

    def over(self, heads: Sequence[tuple[Hashable, int, int]]) -> list[Hashable]:
        """The principals running more rows than their share while ``heads`` wait, the most
        over (rows per weight) first: whose youngest rows a waiting principal within its share
        may take (preemption, zerolayer.engine.engine)."""
        total = self._total(heads)
        over = [
            key for key, held in self.running.items() if held > self.share(self._weight[key], total)
        ]
        return sorted(over, key=lambda k: -self.running[k] / self._weight[k])

    def pick(self, heads: Sequence[tuple[Hashable, int, int]]) -> int:
        """The index in ``heads`` — (principal, rows its head needs, weight), one per waiting
        principal, in round-robin order — of the one admitted next."""
        total = self._total(heads)
        best = fallback = -1
        best_ratio = fallback_ratio = math.inf
        for i, (key, need, weight) in enumerate(heads):
            held = self.running.get(key, 0)
            ratio = held / weight
            if ratio < fallback_ratio:
                fallback, fallback_ratio = i, ratio
            if ratio < best_ratio and (not held or held + need <= self.share(weight, total)):
                best, best_ratio = i, ratio
        return best if best >= 0 else fallback
