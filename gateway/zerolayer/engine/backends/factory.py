"""Builds the configured backend and its tokenizer (heavy imports happen only for the chosen
one), and the engine's prefix store for it."""

from __future__ import annotations

import logging

from zerolayer.config.settings import Settings
from zerolayer.engine.backend import Backend, log_pool
from zerolayer.engine.prefix_store import PrefixMetrics, PrefixStore
from zerolayer.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("zerolayer.engine")


def build_backend(settings: Settings) -> tuple[Backend, Tokenizer]:
    engine = settings.engine
    if engine.backend == "synthetic":
        from zerolayer.engine.backends.synthetic import PAGE_BYTES as SYNTHETIC_PAGE_BYTES
        from zerolayer.engine.backends.synthetic import SyntheticBackend

        num_pages = engine.kv_cache_bytes // SYNTHETIC_PAGE_BYTES
        if engine.kv_cache_bytes and not num_pages:
            raise ValueError(
                f"engine.kv_cache_bytes {engine.kv_cache_bytes} holds no KV page "
                f"({SYNTHETIC_PAGE_BYTES} bytes each)"
            )
        backend = SyntheticBackend(
            num_slots=engine.max_batch_size,
            vocab_size=engine.synthetic_vocab_size,
            max_context=engine.max_context,
            step_ms=engine.synthetic_step_ms,
            prefill_us_per_token=engine.synthetic_prefill_us_per_token,
            num_pages=num_pages,
        )
        log_pool(backend, engine.kv_cache_bytes)
        return backend, ByteTokenizer(engine.synthetic_vocab_size)
    if engine.backend == "cpu":
        from zerolayer.engine.backends.cpu import create_cpu_backend

        return create_cpu_backend(settings.model, engine)
    from zerolayer.engine.backends.neuron import create_neuron_backend

    return create_neuron_backend(settings.model, engine)


def build_prefix_store(
    settings: Settings, backend: Backend, metrics: PrefixMetrics | None, registered: int
) -> PrefixStore | None:
    """The engine's prefix store, or None when nothing would be reused: the backend cannot save
    and load KV (said once at start-up), or ``engine.prefix_cache`` is off and no prompt is
    registered. With the cache off, registered prompts still get their pinned blocks."""
    cfg = settings.engine
    if not backend.supports_prefix:
        if cfg.prefix_cache:
            log.info("prefix cache off: the %s backend cannot load KV into a slot", cfg.backend)
        return None
    if not cfg.prefix_cache and not registered:
        return None
    capacity = cfg.prefix_cache_bytes if cfg.prefix_cache else 0
    return PrefixStore(backend, capacity, metrics)
