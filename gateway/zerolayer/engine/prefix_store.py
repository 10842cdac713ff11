"""The prefix store: KV of prompt prefixes, kept in fixed-size token blocks and reused by any
request that starts with the same ids. Owned by the engine thread (not thread-safe).

A block holds the KV of ``BLOCK_TOKENS`` consecutive prompt positions. Its key is a chained hash:
blake2b(key of the block before it + its own ids), so a key names the block's ids and everything
before them, and a block is only reused after the same history. A lookup walks a prompt's blocks
from the start and stops at the first one missing; every block found is also checked against the
ids and parent it was stored with, so even a hash collision cannot hand out the wrong KV.

- ``load`` (at admission): loads the longest run of a prompt's leading blocks found into the
  sequence's slot, always leaving at least one prompt token to prefill (its logits give the first
  output token), and returns how many tokens it covered.
- ``offer`` (when a prompt's prefill completes, while its slot is still held): saves the prompt's
  full blocks the store does not have yet. Blocks holding decoded tokens are never offered.
- ``pin`` (start-up, registered prompts): the same blocks, never evicted, plus a pinned *tail*:
  the prompt's last, partial block, so a registered prompt is reused up to its last token
  instead of to its last block boundary. Only pinned entries may be partial.

On a paged backend (zerolayer.engine.kv_pages) an entry holds the KV pages themselves, by
reference: loading maps them into the slot's page table (no copy; the first write into a shared
partial page copies it), an evicted entry drops its references, and when the pages run out the
engine asks the store to ``reclaim`` the pages only it holds before a sequence waits or is
preempted.

Unpinned blocks live in an LRU under ``capacity_bytes``. Whenever a block is used or added, the
blocks before it are marked used after it, so a parent is never evicted before its children
(a child without its parent could never be reached again).

Block size: 16 tokens. Small enough that a chat template's ~30-token default system prompt shares
a block and a conversation re-prefills less than 16 tokens of its history per turn; large enough
that a 1,000-token prefix is ~60 lookups and ~60 copies per request (microseconds each, against
milliseconds of prefill per block). vLLM uses the same default.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from zerolayer.engine.backend import Backend, PrefixKV

log = logging.getLogger("zerolayer.engine")

BLOCK_TOKENS = 16
_ROOT = b""  # the parent key of a prompt's first block


class PrefixMetrics(Protocol):
    def prefix_lookup(self, queried: int, hit: int) -> None: ...

    def prefix_bytes(self, pinned: int, cached: int) -> None: ...


@dataclass(slots=True)
class _Entry:
    """A saved run of positions: a full block, or a pinned tail (then ``pinned`` is true)."""

    key: bytes  # chain_key(parent, ids)
    parent: bytes  # the key of the block before it (_ROOT for a prompt's first block)
    ids: bytes  # its int32 ids, to check a match exactly
    start: int  # its first position
    tokens: int
    handle: object  # the backend's copy of its KV
    nbytes: int
    pinned: bool


def chain_key(parent: bytes, ids: bytes) -> bytes:
    return hashlib.blake2b(parent + ids, digest_size=16).digest()


class PrefixStore:
    """Prompt-prefix KV blocks for one backend: pinned ones and an LRU of ``capacity_bytes``."""

    def __init__(
        self,
        backend: Backend,
        capacity_bytes: int,
        metrics: PrefixMetrics | None = None,
        block_tokens: int = BLOCK_TOKENS,
    ) -> None:
        if not isinstance(backend, PrefixKV):  # what ``supports_prefix`` says, as a type
            raise ValueError(f"{type(backend).__name__} cannot save and load KV")
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.backend = backend
        # The same object, typed as what saves and loads KV; its handles are opaque here and
        # go back only to it.
        self._kv: PrefixKV[object] = backend
        self.capacity_bytes = capacity_bytes
        self.block_tokens = block_tokens
        self._metrics = metrics
        self._blocks: dict[bytes, _Entry] = {}  # every full block, pinned or not
        self._lru: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # unpinned
        self._tails: dict[bytes, list[_Entry]] = {}  # pinned partial blocks, by parent key
        self.pinned_bytes = 0
        self.cached_bytes = 0
        self.queried_tokens = 0  # what load() was asked for, in prompt tokens
        self.hit_tokens = 0  # ... and what it copied from the store
        self.evicted_blocks = 0

    # ---- queries -----------------------------------------------------------------------

    @property
    def blocks(self) -> int:
        """Full blocks held (pinned and cached)."""
        return len(self._blocks)

    def _block_ids(self, ids: np.ndarray, n_blocks: int) -> list[bytes]:
        b = self.block_tokens
        data = np.ascontiguousarray(ids[: n_blocks * b], dtype=np.int32).tobytes()
        step = 4 * b
        return [data[i : i + step] for i in range(0, len(data), step)]

    def match(self, ids: np.ndarray, limit: int) -> list[_Entry]:
        """The entries covering the longest run of ``ids``' leading positions found, at most
        ``limit`` positions: full blocks, then possibly one pinned tail."""
        found: list[_Entry] = []
        parent = _ROOT
        for chunk in self._block_ids(ids, limit // self.block_tokens):
            key = chain_key(parent, chunk)
            entry = self._blocks.get(key)
            if entry is None or entry.parent != parent or entry.ids != chunk:
                break
            found.append(entry)
            parent = key
        tails = self._tails.get(parent)
        if tails:
            start = len(found) * self.block_tokens
            rest = np.ascontiguousarray(ids[start:limit], dtype=np.int32).tobytes()
            fits = [t for t in tails if rest.startswith(t.ids)]
            if fits:
                found.append(max(fits, key=lambda t: t.tokens))
        return found

    # ---- engine thread: admission and prefill completion ---------------------------------

    def load(self, ids: np.ndarray, slot: int) -> int:
        """Copy the KV of ``ids``' longest known prefix (leaving at least one id) into ``slot``;
        returns the number of positions loaded (0: prefill everything)."""
        found = self.match(ids, len(ids) - 1)
        for entry in found:
            self._kv.load_kv(entry.handle, slot, entry.start)
        self._touch(found)
        hit = sum(e.tokens for e in found)
        self.queried_tokens += len(ids)
        self.hit_tokens += hit
        if self._metrics is not None:
            self._metrics.prefix_lookup(len(ids), hit)
        return hit

    def offer(self, ids: np.ndarray, slot: int) -> int:
        """``ids`` were prefilled into ``slot`` (every position of them written): save the full
        blocks the store lacks, within the capacity. Returns the number of blocks added."""
        if self.capacity_bytes <= 0:
            return 0
        n_blocks = len(ids) // self.block_tokens
        keys, parent = [], _ROOT
        for chunk in self._block_ids(ids, n_blocks):
            keys.append((chain_key(parent, chunk), parent, chunk))
            parent = keys[-1][0]
        chain = {key for key, _, _ in keys}
        self._touch([self._blocks[k] for k, _, _ in keys if k in self._blocks])
        added = 0
        for i, (key, parent, chunk) in enumerate(keys):
            if key in self._blocks:
                continue
            if parent != _ROOT and parent not in self._blocks:
                break  # its parent could not be kept: it would never be reached
            start = i * self.block_tokens
            handle = self._kv.save_kv(slot, start, start + self.block_tokens)
            nbytes = int(self._kv.kv_nbytes(handle))
            if not self._make_room(nbytes, chain):
                self._kv.drop_kv(handle)
                break
            entry = _Entry(key, parent, chunk, start, self.block_tokens, handle, nbytes, False)
            self._blocks[key] = self._lru[key] = entry
            self.cached_bytes += nbytes
            added += 1
        # Parents after children in LRU order, so eviction takes the deepest blocks first.
        self._touch([self._blocks[k] for k, _, _ in keys if k in self._blocks])
        if added:
            self._report_bytes()
        return added

    def _make_room(self, nbytes: int, keep: set[bytes]) -> bool:
        """Evict least recently used blocks not in ``keep`` until ``nbytes`` more fit."""
        while self.cached_bytes + nbytes > self.capacity_bytes:
            if not self._lru:
                return False
            key, entry = next(iter(self._lru.items()))
            if key in keep:  # only the chain being offered is left
                return False
            self._evict(entry)
        return True

    def _evict(self, entry: _Entry) -> None:
        del self._lru[entry.key]
        del self._blocks[entry.key]
        self._kv.drop_kv(entry.handle)
        self.cached_bytes -= entry.nbytes
        self.evicted_blocks += 1

    def reclaim(self, enough: Callable[[], bool]) -> bool:
        """Evict least recently used blocks that give memory back (KV pages no sequence
        shares) until ``enough()``; returns ``enough()``. The engine calls it when the KV pages
        run out, before it makes a sequence wait or preempts one."""
        evicted = False
        for entry in list(self._lru.values()):
            if enough():
                break
            if self._kv.kv_reclaimable(entry.handle):
                self._evict(entry)
                evicted = True
        if evicted:
            self._report_bytes()
        return enough()

    def _touch(self, entries: list[_Entry]) -> None:
        """Mark ``entries`` (a chain, first block first) used, the first one last."""
        lru = self._lru
        for entry in reversed(entries):
            if not entry.pinned:
                lru.move_to_end(entry.key)

    # ---- start-up: registered prompts ----------------------------------------------------

    def pin(self, ids: np.ndarray, slot: int) -> tuple[int, int]:
        """``ids`` were prefilled into ``slot``: keep their KV for good, as full blocks and a
        tail. Returns (KV bytes of the prompt's entries, bytes newly pinned); a block another
        pinned prompt already holds is shared."""
        b = self.block_tokens
        n_blocks = len(ids) // b
        total = new = 0
        parent = _ROOT
        for i, chunk in enumerate(self._block_ids(ids, n_blocks)):
            key = chain_key(parent, chunk)
            entry = self._blocks.get(key)
            if entry is None:
                handle = self._kv.save_kv(slot, i * b, (i + 1) * b)
                nbytes = int(self._kv.kv_nbytes(handle))
                entry = _Entry(key, parent, chunk, i * b, b, handle, nbytes, True)
                self._blocks[key] = entry
                new += entry.nbytes
            elif not entry.pinned:  # cached before: pinned from now on
                del self._lru[key]
                self.cached_bytes -= entry.nbytes
                entry.pinned = True
                new += entry.nbytes
            total += entry.nbytes
            parent = key
        start = n_blocks * b
        if start < len(ids):
            tail_ids = np.ascontiguousarray(ids[start:], dtype=np.int32).tobytes()
            tails = self._tails.setdefault(parent, [])
            tail = next((t for t in tails if t.ids == tail_ids), None)
            if tail is None:
                handle = self._kv.save_kv(slot, start, len(ids))
                nbytes = int(self._kv.kv_nbytes(handle))
                tail = _Entry(
                    chain_key(parent, tail_ids), parent, tail_ids, start, len(ids) - start,
                    handle, nbytes, True,
                )  # fmt: skip
                tails.append(tail)
                new += nbytes
            total += tail.nbytes
        self.pinned_bytes += new
        self._report_bytes()
        return total, new

    def _report_bytes(self) -> None:
        if self._metrics is not None:
            self._metrics.prefix_bytes(self.pinned_bytes, self.cached_bytes)
