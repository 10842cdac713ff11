"""Drive a real Engine step by step to completion, for tests that compare outputs."""

from __future__ import annotations

from zerolayer.engine.backend import Backend
from zerolayer.engine.engine import NOT_FINISHED, Engine, Output, Sequence
from zerolayer.engine.prefix_store import PrefixStore
from zerolayer.tokenizer import Tokenizer


def scramble(backend: Backend) -> None:
    """Fill a CPU backend's KV cache with noise, so nothing a previous run left in a slot can
    stand in for KV the engine is supposed to compute or load. In pages: the pages nobody
    holds (those a prefix store holds are its KV)."""
    cache = getattr(backend, "cache", None)
    if cache is None:
        return
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(0)
    pool = backend.kv_pages
    if pool is None:
        for t in (cache.k, cache.v):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype))
        return
    free = np.flatnonzero(pool.refs == 0)
    rows = torch.from_numpy(free[:, None] * pool.page_tokens + np.arange(pool.page_tokens))
    rows = rows.flatten()
    for t in (cache.k, cache.v):
        shape = (t.shape[0], len(rows), *t.shape[2:])
        t[:, rows] = torch.randn(shape, generator=gen, dtype=torch.float32).to(t.dtype)


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
        backend, tok, lambda step: outputs.extend(step.outputs()), max_queue=16, max_step_tokens=64,
        prefill_chunk=prefill_chunk, prefix_store=store,
    )  # fmt: skip
    for s in seqs:
        engine.submit(s)
    got: dict[object, list] = {s.owner: [] for s in seqs}
    done: set = set()
    for _ in range(2000):
        outputs.extend(engine.step().outputs())
        for out in outputs:
            if out.token >= 0:
                got[out.owner].append(out.token)
            if out.finish != NOT_FINISHED:
                got[out.owner].append(("end", int(out.finish)))
                done.add(out.owner)
        outputs.clear()
        if len(done) == len(seqs):
            return got
    raise AssertionError("engine did not finish")
