"""The backend interface: what the scheduler needs from a model runtime, and nothing more.

A backend owns ``num_slots`` KV-cache slots of ``max_context`` positions each. The scheduler
assigns slots, feeds prompt chunks (``prefill``) and runs batched ``decode`` steps, and calls
``free`` when a sequence ends. Implementations: ``synthetic`` (no model), ``cpu``
(our decoder, zerolayer.models.decoder, on torch), ``neuron`` (transformers-neuronx on NeuronCores).

KV ranges (the prefix store, gateway/zerolayer/engine/prefix_store.py) are optional: a backend that
can copy the KV of a range of a slot's positions out and back into a slot at the same positions also
inherits ``PrefixKV`` (``save_kv``, ``load_kv``, ``kv_nbytes``); ``supports_prefix`` is derived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from zerolayer.engine.types import DecodeBatch, PrefillChunk


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts a client learns in WELCOME and the engine needs for validation."""

    name: str
    vocab_size: int
    eos_token_id: int  # -1 when the model has none
    max_context: int


class Backend(ABC):
    """A model runtime with a fixed number of KV slots. Called from the engine thread only."""

    info: ModelInfo
    num_slots: int

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
