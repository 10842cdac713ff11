"""The decoder on KV pages (zerolayer.models.decoder.PagedKVCache) against its static cache, in
float32: chunked and batched prefill, batched decode, pages in scrambled order and a page shared
then copied on write give the static cache's logits bit for bit (the parity mode's promise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.unit.test_kernels import CFG, CONTEXT, GEMMA_CFG, make_model
from zerolayer.engine.kv_pages import PagePool
from zerolayer.models.architectures import DecoderConfig
from zerolayer.models.decoder import KVCache, PagedKVCache


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(3, 250, n).astype(np.int64))


@pytest.mark.parametrize("cfg", [CFG, GEMMA_CFG], ids=["llama", "gemma3"])
@torch.inference_mode()
def test_paged_logits_equal_the_static_cache_bit_for_bit(cfg: DecoderConfig) -> None:
    model = make_model(cfg=cfg)
    static = KVCache.allocate(cfg, 4, CONTEXT, torch.float32)
    pool = PagePool(40, 4, CONTEXT // 16)
    scramble = pool.alloc(13)  # later pages are handed out in another order than ids
    assert scramble is not None
    pool.decref(scramble[::2].copy())
    paged = PagedKVCache.allocate(cfg, 40, torch.from_numpy(pool.tables), torch.float32)

    def pages(slot: int, start: int, end: int) -> None:
        copies = pool.prepare_write(slot, start, end)
        assert copies is not None
        if copies:
            paged.copy_pages(copies)

    # slot 0: a prompt in two chunks; slots 1 and 2: one batched prefill of unequal lengths
    a, b, c = ids(40, 1), ids(7, 2), ids(33, 3)
    pages(0, 0, 16)
    assert torch.equal(model.prefill(a[:16], 0, 0, paged), model.prefill(a[:16], 0, 0, static))
    pages(0, 16, 40)
    assert torch.equal(model.prefill(a[16:], 16, 0, paged), model.prefill(a[16:], 16, 0, static))
    pages(1, 0, 7)
    pages(2, 0, 33)
    got = model.prefill_batch([b, c], [0, 0], [1, 2], paged)
    assert torch.equal(got, model.prefill_batch([b, c], [0, 0], [1, 2], static))
    # slot 3 starts from slot 0's first 39 positions: shared pages, its write copies the last
    pool.share(0, 3, 39)
    static.k[:, 3, :, :39] = static.k[:, 0, :, :39]
    static.v[:, 3, :, :39] = static.v[:, 0, :, :39]
    pages(3, 39, 40)
    assert int(pool.pages_of(3)[2]) != int(pool.pages_of(0)[2])  # copied on write
    assert int(pool.pages_of(3)[0]) == int(pool.pages_of(0)[0])  # still shared
    one = a[39:40]
    assert torch.equal(model.prefill(one, 39, 3, paged), model.prefill(one, 39, 3, static))
    # batched decode across page boundaries, rows in any slot order
    tokens = torch.tensor([5, 6, 7, 8])
    positions = torch.tensor([40, 7, 33, 40])
    slots = torch.tensor([0, 1, 2, 3])
    for step in range(30):
        order = slots if step % 2 else slots.flip(0)
        pos = positions[order]
        for slot, p in zip(order.tolist(), pos.tolist(), strict=True):
            pages(slot, p, p + 1)
        want = model.decode(tokens[order], pos, order, static)
        got = model.decode(tokens[order], pos, order, paged)
        assert torch.equal(got, want), step
        tokens[order] = want.argmax(-1)
        positions += 1
    assert pool.used <= 40


@torch.inference_mode()
def test_a_write_without_a_page_is_refused() -> None:
    model = make_model()
    pool = PagePool(4, 2, CONTEXT // 16)
    paged = PagedKVCache.allocate(CFG, 4, torch.from_numpy(pool.tables), torch.float32)
    assert pool.prepare_write(0, 0, 16) == []
    with pytest.raises(ValueError, match="without a KV page"):
        model.prefill(ids(17, 4), 0, 0, paged)  # position 16 has no page
    assert paged.page_nbytes == 2 * CFG.num_hidden_layers * 16 * CFG.num_key_value_heads * 16 * 4
