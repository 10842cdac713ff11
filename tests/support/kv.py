"""Paged KV for tests that drive a model backend directly: its pages reserved before each call
as the engine reserves them (``reserving``), and a slot's KV read back in the static cache's
layout (``slot_kv``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zerolayer.engine.types import DecodeBatch, PrefillChunk


def reserve(backend: Any, slot: int, start: int, end: int) -> None:
    """Make ``slot``'s positions [start, end) writable, copying shared pages first."""
    copies = backend.kv_pages.prepare_write(slot, start, end)
    assert copies is not None, "the test's KV pool is full"
    if copies:
        backend.copy_pages(copies)


def reserving(backend: Any) -> Any:
    """``backend`` (returned) whose ``prefill`` and ``decode`` first reserve every position
    they write and whose ``free`` releases the slot's pages, as the engine does; everything
    else is the backend's own. A call outside the slots or the context reserves nothing, so
    the backend's own check refuses it."""
    prefill, decode, free = backend.prefill, backend.decode, backend.free
    pool = backend.kv_pages

    def within(slot: int, end: int) -> bool:
        return 0 <= slot < backend.num_slots and end <= backend.info.max_context

    def paged_prefill(chunks: list[PrefillChunk]) -> np.ndarray:
        for c in chunks:
            end = c.start + len(c.tokens)
            if within(c.slot, end) and c.start >= 0:
                reserve(backend, c.slot, c.start, end)
        return prefill(chunks)

    def paged_decode(batch: DecodeBatch) -> np.ndarray:
        for slot, position in zip(batch.slots.tolist(), batch.positions.tolist(), strict=True):
            if within(slot, position + 1) and position >= 0:
                reserve(backend, slot, position, position + 1)
        return decode(batch)

    def paged_free(slot: int) -> None:
        pool.release(slot)
        free(slot)

    backend.prefill, backend.decode, backend.free = paged_prefill, paged_decode, paged_free
    return backend


def slot_kv(backend: Any, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``slot``'s K and V at positions [start, end) through its page table, each
    [layers, kv_heads, end - start, head_dim] (the static cache's layout)."""
    cache = backend.cache
    pt = cache.page_tokens
    positions = torch.arange(start, end)
    table = torch.from_numpy(backend.kv_pages.tables[slot].astype(np.int64))
    pages = table[positions // pt]
    assert bool((pages >= 0).all()), f"slot {slot} has no page for some of {start}..{end - 1}"
    rows = pages * pt + positions % pt
    return cache.k[:, rows].transpose(1, 2), cache.v[:, rows].transpose(1, 2)
