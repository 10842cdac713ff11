"""Drive a real Engine step by step to completion, for tests that compare outputs."""

from __future__ import annotations

from gateway.engine.backend import Backend
from gateway.engine.engine import FINISH, NOT_FINISHED, OWNER, TOKEN, Engine, Output, Sequence
from gateway.engine.prefix_store import PrefixStore
from gateway.tokenizer import Tokenizer


def scramble(backend: Backend) -> None:
    """Fill a CPU backend's KV cache with noise, so nothing a previous run left in a slot can
    stand in for KV the engine is supposed to compute or load."""
    cache = getattr(backend, "cache", None)
    if cache is not None:
        import torch

        gen = torch.Generator().manual_seed(0)
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))


def run_engine(
    backend: Backend,
    tok: Tokenizer,
    seqs: list[Sequence],
    store: PrefixStore | None = None,
    prefill_chunk: int = 16,
) -> dict[object, list]:
    """Every sequence's tokens, then ("end", finish), by owner. The KV cache is scrambled first."""
    scramble(backend)
    outputs: list[Output] = []
    engine = Engine(
        backend, tok, outputs.extend, max_queue=16, max_step_tokens=64,
        prefill_chunk=prefill_chunk, prefix_store=store,
    )  # fmt: skip
    for s in seqs:
        engine.submit(s)
    got: dict[object, list] = {s.owner: [] for s in seqs}
    done: set = set()
    for _ in range(2000):
        outputs.extend(engine.step())
        for out in outputs:
            if out[TOKEN] >= 0:
                got[out[OWNER]].append(out[TOKEN])
            if out[FINISH] != NOT_FINISHED:
                got[out[OWNER]].append(("end", int(out[FINISH])))
                done.add(out[OWNER])
        outputs.clear()
        if len(done) == len(seqs):
            return got
    raise AssertionError("engine did not finish")
