"""KV pages: which fixed-size pages of the KV budget each slot's positions live in, and who holds
each page. Bookkeeping only, owned by the engine thread (not thread-safe); the backend holds the
bytes and reads ``tables`` in place.

A page holds the KV of ``PAGE_TOKENS`` consecutive positions of one sequence (every layer, K and
V). A slot's table lists its pages in position order: position p of the slot is at offset
``p % PAGE_TOKENS`` of page ``tables[slot, p // PAGE_TOKENS]`` (-1: none yet). A row's pages are
always a prefix of its table (``mapped``): writes go on from where the row is, loads map a
prompt's leading pages.

Pages are reference-counted: a row's table holds one reference per page, and so does each prefix
store entry that keeps it (zerolayer.engine.prefix_store) or each other row sharing it (n choices
share their prompt's pages). A page whose count falls to 0 is free again. A shared page is never
written: ``prepare_write`` gives the row its own copy first (copy on write) and returns the
``(source, destination)`` pairs the backend copies before the step's writes.

Allocation is all or nothing (``alloc``, ``prepare_write``): a request for pages either gets all
of them or changes nothing, so the scheduler can wait or preempt instead of undoing half a step.
Like vLLM's block pool, with the scheduler owning the pages and the backend owning the bytes.
"""

from __future__ import annotations

import numpy as np

PAGE_TOKENS = 16  # positions a page holds (= the prefix store's block, vLLM's default block)


def pages_for(positions: int, page_tokens: int = PAGE_TOKENS) -> int:
    """Pages that hold ``positions`` positions from 0."""
    return -(-positions // page_tokens)


class PagePool:
    """``num_pages`` ref-counted pages and the page table of each of ``num_slots`` slots (each
    at most ``max_pages_per_row`` pages)."""

    def __init__(
        self,
        num_pages: int,
        num_slots: int,
        max_pages_per_row: int,
        page_tokens: int = PAGE_TOKENS,
    ) -> None:
        if num_pages < 1 or num_slots < 1 or max_pages_per_row < 1 or page_tokens < 1:
            raise ValueError("a page pool needs at least one page, slot and page per row")
        self.num_pages = num_pages
        self.page_tokens = page_tokens
        self.max_pages_per_row = max_pages_per_row
        self.refs = np.zeros(num_pages, np.int32)
        # The free pages as a stack: _free[:_nfree], the lowest ids on top at first.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._nfree = num_pages
        self.tables = np.full((num_slots, max_pages_per_row), -1, np.int32)
        self.mapped = np.zeros(num_slots, np.int32)  # pages in each slot's table (a prefix)

    # ---- queries -----------------------------------------------------------------------

    @property
    def available(self) -> int:
        """Free pages."""
        return self._nfree

    @property
    def used(self) -> int:
        return self.num_pages - self._nfree

    @property
    def positions(self) -> int:
        """Positions the whole pool holds (the longest sequence that can ever run)."""
        return self.num_pages * self.page_tokens

    def pages_of(self, slot: int) -> np.ndarray:
        """``slot``'s pages in position order (a view: do not keep it across changes)."""
        return self.tables[slot, : self.mapped[slot]]

    def pages_needed(self, slot: int, start: int, end: int) -> int:
        """Pages ``prepare_write(slot, start, end)`` would take from the free pages: the ones
        the row lacks up to ``end`` and a copy of each shared page it writes into."""
        have = int(self.mapped[slot])
        need_to = pages_for(end, self.page_tokens)
        first = start // self.page_tokens
        shared = self.tables[slot, first : min(need_to, have)]
        return max(0, need_to - have) + int(np.count_nonzero(self.refs[shared] > 1))

    # ---- changes -----------------------------------------------------------------------

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` free pages, each with one reference, or None (and nothing taken) when fewer
        than ``n`` are free."""
        if n > self._nfree:
            return None
        self._nfree -= n
        pages: np.ndarray = self._free[self._nfree : self._nfree + n][::-1].copy()
        self.refs[pages] = 1
        return pages

    def incref(self, pages: np.ndarray) -> None:
        np.add.at(self.refs, pages, 1)

    def decref(self, pages: np.ndarray) -> None:
        """Drop one reference to each of ``pages``; those left with none are free again."""
        refs = self.refs
        np.add.at(refs, pages, -1)
        if (refs[pages] < 0).any():
            raise AssertionError("a page was released more often than it was held")
        gone = np.unique(pages[refs[pages] == 0])
        n = len(gone)
        self._free[self._nfree : self._nfree + n] = gone[::-1]
        self._nfree += n

    def prepare_write(self, slot: int, start: int, end: int) -> list[tuple[int, int]] | None:
        """Make positions ``start .. end - 1`` of ``slot`` writable: map new pages up to
        ``end`` and replace each shared page in the range by a private copy. Returns the
        ``(source, destination)`` page copies the backend must make before writing, or None
        when the free pages do not suffice (then nothing changed)."""
        pt = self.page_tokens
        have = int(self.mapped[slot])
        if start > have * pt:
            raise ValueError(f"slot {slot} writes at {start} but holds {have * pt} positions")
        need_to = pages_for(end, pt)
        if need_to > self.max_pages_per_row:
            raise ValueError(f"slot {slot} cannot hold {end} positions")
        first = start // pt
        row = self.tables[slot]
        shared = [i for i in range(first, min(need_to, have)) if self.refs[row[i]] > 1]
        fresh = max(0, need_to - have)
        pages = self.alloc(fresh + len(shared))
        if pages is None:
            return None
        copies = []
        for i, dst in zip(shared, pages[fresh:].tolist(), strict=True):
            src = int(row[i])
            copies.append((src, dst))
            row[i] = dst
            self.refs[src] -= 1  # still held by another (it was shared): never freed here
        if fresh:
            row[have:need_to] = pages[:fresh]
            self.mapped[slot] = need_to
        return copies

    def append(self, slots: np.ndarray) -> bool:
        """One more page at the end of each of ``slots``' tables (distinct slots: decode rows
        crossing into a new page), all or nothing; False when the free pages do not suffice."""
        pages = self.alloc(len(slots))
        if pages is None:
            return False
        ends = self.mapped[slots]
        if (ends >= self.max_pages_per_row).any():
            self.decref(pages)
            raise ValueError("a slot cannot hold another page")
        self.tables[slots, ends] = pages
        self.mapped[slots] = ends + 1
        return True

    def map(self, slot: int, first: int, pages: np.ndarray) -> None:
        """Put ``pages`` (held elsewhere: each gains a reference) into ``slot``'s table from
        page index ``first`` on, which must be where the row's pages end."""
        if first != self.mapped[slot]:
            raise ValueError(f"slot {slot} holds {self.mapped[slot]} pages, not {first}")
        end = first + len(pages)
        if end > self.max_pages_per_row:
            raise ValueError(f"slot {slot} cannot hold {end} pages")
        self.tables[slot, first:end] = pages
        self.mapped[slot] = end
        self.incref(pages)

    def share(self, src: int, dst: int, positions: int) -> None:
        """``dst`` (holding no pages) starts from ``src``'s first ``positions`` positions: the
        same pages, shared (a write into one goes through ``prepare_write``'s copy)."""
        pages = self.tables[src, : pages_for(positions, self.page_tokens)].copy()
        self.map(dst, 0, pages)

    def release(self, slot: int) -> int:
        """``slot`` holds no pages any more; returns how many it held."""
        n = int(self.mapped[slot])
        if n:
            pages = self.tables[slot, :n].copy()
            self.tables[slot, :n] = -1
            self.mapped[slot] = 0
            self.decref(pages)
        return n
