"""The backend interface: what the scheduler needs from a model runtime, and nothing more.

A backend owns ``num_slots`` KV-cache slots of ``max_context`` positions each. The scheduler
assigns slots, feeds prompt chunks (``prefill``) and runs batched ``decode`` steps, and calls
``free`` when a sequence ends. Implementations: ``synthetic`` (no model), and the model backends
``cpu`` (zerolayer.models.decoder on torch) and ``neuron`` (transformers-neuronx on
NeuronCores), which are ``LogitsBackend``s: they return logits, and the one sampler takes it from
there.

KV ranges (the prefix store, gateway/zerolayer/engine/prefix_store.py) are optional: a backend that
can copy the KV of a range of a slot's positions out and back into a slot at the same positions also
inherits ``PrefixKV`` (``save_kv``, ``load_kv``, ``kv_nbytes``); ``supports_prefix`` is derived.

KV in pages (zerolayer.engine.kv_pages) is optional too: a paged backend sets ``kv_pages``, the
pool whose page tables it reads in place, and implements ``copy_pages``. The engine then owns the
pages: it reserves every page a call writes before the call (``PagePool.prepare_write``), hands
the step's copies on write to ``copy_pages`` first, and shares pages by reference for the prefix
store and n choices (``PagedKV``: a saved range is its page ids). A backend without pages (the
Neuron backend's static cache) keeps one slot's whole context per slot.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from zerolayer.engine.kv_pages import PagePool, pages_for
from zerolayer.engine.types import DecodeBatch, PrefillChunk

log = logging.getLogger("zerolayer.engine")

if TYPE_CHECKING:  # torch only where a model runs (this module is the synthetic backend's too)
    import torch


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts a client learns in WELCOME and the engine needs for validation."""

    name: str
    vocab_size: int
    eos_token_id: int  # -1 when the model has none
    max_context: int
    hidden_size: int = 0  # the length of an embedding (0: the backend has no prompt outputs)
    # Positions the paged KV holds in all (0: not paged): the longest sequence that can run,
    # so a longer prompt + max_tokens is refused, never left waiting for pages.
    kv_positions: int = 0


class Backend(ABC):
    """A model runtime with a fixed number of KV slots. Called from the engine thread only.

    A backend whose ``info.hidden_size`` is set fills a prefill chunk's ``pooled`` / ``scored``
    when the chunk asks (zerolayer.engine.types.PrefillChunk); one without never gets such a
    chunk (the input processor refuses the request)."""

    info: ModelInfo
    num_slots: int
    kv_pages: PagePool | None = None  # set by a paged backend (module docstring)
    # Whether chunks without ``last`` write their KV (and sample nothing): the engine's
    # preemption recomputes a row's KV that way; without it rows are never preempted.
    recomputes: bool = True

    @property
    def supports_prefix(self) -> bool:
        """Whether KV ranges can be saved and loaded (the backend is also a PrefixKV)."""
        return isinstance(self, PrefixKV)

    @abstractmethod
    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        """Write each chunk into its slot's cache. Returns int32 [len(chunks)]: the sampled next
        token for chunks with ``last`` set, -1 for the others."""

    @abstractmethod
    def decode(self, batch: DecodeBatch) -> np.ndarray:
        """Run one decode step. Returns the sampled next token per row, int32 [batch.size], a
        new array the caller owns (the engine feeds it back as the next step's tokens)."""

    def free(self, slot: int) -> None:  # noqa: B027 - optional for stateless backends
        """Forget the slot's sequence; the slot may be reused by the next prefill."""

    def close(self) -> None:  # noqa: B027
        """Release devices and threads at shutdown."""


class LogitsBackend(Backend):
    """A backend whose model gives logits: ``prefill`` and ``decode`` run its forward passes
    (``prefill_logits``, ``decode_logits``), then the engine's one sampler
    (zerolayer.engine.sampling) turns the logits into tokens with each row's own parameters: a
    prompt's last chunk's ``SamplingParams``, a decode batch's ``SAMPLING_ROW`` records, and the
    rows' logits processing. A model backend implements the two forward passes and nothing of
    sampling."""

    def __init__(self, sampler_seed: int | None = None) -> None:
        from zerolayer.engine.sampling import Sampler  # torch: imported when a model is built

        self.sampler = Sampler(sampler_seed)  # the RNG of unseeded rows

    @abstractmethod
    def prefill_logits(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """Write each chunk into its slot's cache. Returns the logits [r, vocab] at the final
        position of the r chunks with ``last`` set, in the chunks' order (None when r = 0)."""

    @abstractmethod
    def decode_logits(self, batch: DecodeBatch) -> torch.Tensor:
        """Run one decode step (``batch.size`` >= 1). Returns logits [batch.size, vocab], row i
        for ``batch.slots[i]``."""

    def prefill(self, chunks: list[PrefillChunk]) -> np.ndarray:
        out = np.full(len(chunks), -1, np.int32)
        logits = self.prefill_logits(chunks)
        if logits is not None:
            last = [i for i, chunk in enumerate(chunks) if chunk.last]
            done = [chunks[i] for i in last]
            out[last] = self.sampler.sample_prompts(
                logits,
                [c.sampling for c in done],
                np.array([c.start + len(c.tokens) for c in done], np.int64),  # after the chunk
                [c.processing for c in done],
            )
        return out

    def decode(self, batch: DecodeBatch) -> np.ndarray:
        if batch.size == 0:
            return np.empty(0, np.int32)
        # each row's token is sampled for the position after its input
        positions = batch.positions.astype(np.int64) + 1
        logits = self.decode_logits(batch)
        return self.sampler.sample(logits, batch.sampling, positions, batch.processing).ids


# A backend's copy of a KV range: opaque to everyone else, who only hands it back.
KVHandle = TypeVar("KVHandle")


class PrefixKV(ABC, Generic[KVHandle]):
    """The optional capability of a backend that can save ranges of a slot's KV and load them
    into another slot (the prefix store's needs). A backend has it by inheriting it, naming its
    handle type: ``PrefixKV[KVRange]``."""

    @abstractmethod
    def save_kv(self, slot: int, start: int, end: int) -> KVHandle:
        """A copy of the KV of positions ``start .. end - 1`` of ``slot`` (an opaque handle that
        stays valid after the slot is reused)."""

    @abstractmethod
    def load_kv(self, handle: KVHandle, slot: int, start: int) -> None:
        """Copy a saved range into ``slot`` from position ``start`` on (the positions it was
        saved from: KV holds position information)."""

    @abstractmethod
    def kv_nbytes(self, handle: KVHandle) -> int:
        """Memory held by a saved range."""

    def drop_kv(self, handle: KVHandle) -> None:  # noqa: B027 - a copy needs no release
        """The store no longer keeps a saved range."""

    def kv_reclaimable(self, handle: KVHandle) -> bool:
        """Whether dropping the range gives memory back (a shared page does not)."""
        return True


class PagedKV(PrefixKV[np.ndarray]):
    """KV ranges of a paged backend, by reference: a saved range is the page ids holding it
    (each gains a reference), loading maps them into the slot's table, and the first write into
    a shared page copies it (zerolayer.engine.kv_pages). A range starts on a page boundary; it
    may end inside a page (a pinned prompt's tail)."""

    kv_pages: PagePool | None

    @abstractmethod
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy each ``(source, destination)`` page's KV (before the step's writes, which may
        go into a destination)."""

    kv_page_bytes: int  # one page's KV, every layer

    def _pool(self) -> PagePool:
        pool = self.kv_pages
        assert pool is not None, "a PagedKV backend sets kv_pages"
        return pool

    def save_kv(self, slot: int, start: int, end: int) -> np.ndarray:
        pool = self._pool()
        pt = pool.page_tokens
        if start % pt:
            raise ValueError(f"a saved KV range starts on a page boundary, not at {start}")
        pages: np.ndarray = pool.tables[slot, start // pt : pages_for(end, pt)].copy()
        if (pages < 0).any():
            raise ValueError(f"slot {slot} holds no KV for positions {start} .. {end - 1}")
        pool.incref(pages)
        return pages

    def load_kv(self, handle: np.ndarray, slot: int, start: int) -> None:
        pool = self._pool()
        pool.map(slot, start // pool.page_tokens, handle)

    def kv_nbytes(self, handle: np.ndarray) -> int:
        return len(handle) * self.kv_page_bytes

    def drop_kv(self, handle: np.ndarray) -> None:
        self._pool().decref(handle)

    def kv_reclaimable(self, handle: np.ndarray) -> bool:
        return bool((self._pool().refs[handle] == 1).all())


def log_pool(backend: Backend, setting: int) -> None:
    """The KV pages, said once at start-up."""
    pool = backend.kv_pages
    if pool is None:
        return
    page_bytes = getattr(backend, "kv_page_bytes", 0)
    total = pool.num_pages * page_bytes
    unit = next(u for u in (3, 2) if total >= 2 ** (10 * u)) if total >= 2**20 else 1
    size = f"{total / 2 ** (10 * unit):.{2 if unit == 3 else 1}f} {('KiB', 'MiB', 'GiB')[unit - 1]}"
    log.info(
        "KV pool %s: %s pages of %d positions (%s positions, %s bytes a position; "
        "engine.kv_cache_bytes=%s)",
        size, f"{pool.num_pages:,}", pool.page_tokens, f"{pool.positions:,}",
        f"{page_bytes // pool.page_tokens:,}", setting or "auto",
    )  # fmt: skip
