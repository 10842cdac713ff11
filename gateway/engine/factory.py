"""Builds the configured backend and its tokenizer. Heavy imports happen only for the chosen one."""

from __future__ import annotations

from gateway.config import Settings
from gateway.engine.backend import Backend
from gateway.tokenizer import ByteTokenizer, Tokenizer


def build_backend(settings: Settings) -> tuple[Backend, Tokenizer]:
    engine = settings.engine
    if engine.backend == "synthetic":
        from gateway.engine.synthetic import SyntheticBackend

        backend = SyntheticBackend(
            num_slots=engine.max_batch_size,
            vocab_size=engine.synthetic_vocab_size,
            max_context=engine.max_context,
            step_ms=engine.synthetic_step_ms,
            prefill_us_per_token=engine.synthetic_prefill_us_per_token,
        )
        return backend, ByteTokenizer(engine.synthetic_vocab_size)
    if engine.backend == "cpu":
        from gateway.engine.cpu_backend import create_cpu_backend

        return create_cpu_backend(settings.model, engine)
    from gateway.engine.neuron_backend import create_neuron_backend

    return create_neuron_backend(settings.model, engine)
