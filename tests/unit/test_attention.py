"""The paged decode attention (kernels/attention.cpp): the decoder's attention (gather + SDPA,
``zerolayer.kernels.attention.reference``) read in place through page tables, within float32
rounding, for bfloat16 and float32 pages, grouped queries, sliding windows and softcaps; the same
bits at any thread count; only a row's own pages and positions read.

Every test's name says "paged": test_qmatmul.py's other builds (the portable C++ here) run them
too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from zerolayer.kernels import qmatmul
from zerolayer.kernels.attention import paged_decode_attention, reference

# Float32 sums in another order than SDPA's: relative 1e-5, and absolute 1e-5 for outputs near 0
# (averages of values of size 1, whose terms cancel).
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module", autouse=True)
def kernel(kernel_cache: Path) -> Iterator[None]:
    """The session's build, required here; two threads, so rows and their partitions are
    really split between threads (the suite runs on one, tests/conftest.py)."""
    reason = qmatmul.build(kernel_cache)
    assert reason is None, reason
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def paged(
    lens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_pages: int = 3,
) -> tuple[torch.Tensor, ...]:
    """A random batch: q [B, Hq, hd], K and V pages [pages * page_size, Hkv, hd] of ``dtype``,
    each row's pages drawn from a shuffled pool (never in order, some pages nobody's) and its
    table padded with -1, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // page_size) for n in lens]
    width = max(needed) + 1
    num_pages = sum(needed) + spare_pages
    ids = torch.randperm(num_pages, generator=gen).to(torch.int32)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[taken : taken + n]
        taken += n
    shape = (num_pages * page_size, kv_heads, head_dim)
    k = (torch.randn(shape, generator=gen) * 2).to(dtype)  # sharper softmaxes than N(0, 1)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def lengths(batch: int, page_size: int, seed: int) -> list[int]:
    """1, the page boundaries (a full page, one past it), a partition boundary (512, 513), then
    random lengths up to 1,200."""
    edges = [1, page_size, page_size + 1, 2 * page_size, 512, 513]
    gen = torch.Generator().manual_seed(seed)
    rest = torch.randint(1, 1200, (max(0, batch - len(edges)),), generator=gen).tolist()
    return (edges + rest)[:batch]


SHAPES = [  # batch, kv heads, group, head_dim, page_size
    (1, 1, 1, 64, 16),
    (33, 8, 4, 128, 16),  # Llama-3-8B's heads
    (7, 2, 7, 64, 16),  # Qwen2.5-0.5B's
    (5, 3, 3, 64, 32),  # SmolLM2's
    (4, 1, 4, 256, 16),  # Gemma 3 270M's
    (6, 2, 3, 80, 5),  # head_dim 80, pages of 5
    (3, 2, 2, 20, 16),  # head_dim 20: the plain C++ loop in every build
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "kv_heads", "group", "head_dim", "page_size"), SHAPES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (300, 0.0), (0, 50.0), (100, 30.0)])
def test_paged_attention_is_the_reference_within_float32_rounding(
    dtype, batch, kv_heads, group, head_dim, page_size, window, softcap
) -> None:
    lens = lengths(batch, page_size, seed=batch + head_dim)
    q, k, v, tables, seq_lens = paged(lens, kv_heads, group, head_dim, page_size, dtype, seed=7)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k, v, tables, seq_lens, page_size, scale, window, softcap)
    assert out.shape == q.shape and out.dtype == torch.float32
    want = reference(q, k, v, tables, seq_lens, page_size, scale, window, softcap)
    torch.testing.assert_close(out, want, **CLOSE)
    # And against the same math in float64 (bfloat16 pages widen exactly: the same bound).
    exact = reference(q.double(), k, v, tables, seq_lens, page_size, scale, window, softcap)
    torch.testing.assert_close(out.double(), exact, **CLOSE)


def test_paged_attention_windows_and_caps_change_the_answer() -> None:
    """The cases above are not the same attention four times: a window drops positions, a cap
    squashes scores."""
    q, k, v, tables, seq_lens = paged([700, 40], 2, 2, 64, 16, torch.float32, seed=3)
    plain = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 0, 0.0)
    windowed = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 300, 0.0)
    capped = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 0, 5.0)
    assert not torch.allclose(plain[0], windowed[0], atol=1e-3)
    assert torch.equal(plain[1], windowed[1])  # 40 positions: all inside the window
    assert not torch.allclose(plain, capped, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_is_the_same_bits_at_any_thread_count(dtype) -> None:
    """Long rows are split into partitions by their length alone and merged in order."""
    lens = [2000, 1, 513, 1100, 40, 1500]
    q, k, v, tables, seq_lens = paged(lens, 4, 2, 128, 16, dtype, seed=11)
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        outs.append(paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.09, 0, 0.0))
    torch.set_num_threads(2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # A row's answer does not depend on the batch around it either.
    alone = paged_decode_attention(q[3:4], k, v, tables[3:4], seq_lens[3:4], 16, 0.09, 0, 0.0)
    assert torch.equal(alone[0], outs[0][3])


def test_paged_attention_reads_only_the_rows_pages_and_positions() -> None:
    """NaN in every page no row owns and past each row's length in its last page: the output is
    untouched, so the kernel reads exactly the positions its tables and lengths name."""
    lens = [37, 16, 1, 600]
    q, k, v, tables, seq_lens = paged(lens, 2, 3, 64, 16, torch.bfloat16, seed=5, spare_pages=4)
    clean = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 0, 0.0)
    owned = torch.zeros(k.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens):
        for pos in range(n):
            owned[int(tables[b, pos // 16]) * 16 + pos % 16] = True
    k[~owned] = float("nan")
    v[~owned] = float("nan")
    out = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 0, 0.0)
    assert torch.equal(out, clean)
    windowed = paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 20, 0.0)
    assert torch.isfinite(windowed).all()


def test_paged_attention_takes_a_token_stride_and_zero_lengths() -> None:
    """K and V as views of one [tokens, 2, Hkv, hd] tensor (a token stride of 2 * Hkv * hd); a
    row of length 0 (a padded batch row) gives zeros."""
    q, k, v, tables, seq_lens = paged([50, 0, 9], 2, 2, 64, 16, torch.float32, seed=9)
    both = torch.stack([k, v], dim=1)
    out = paged_decode_attention(q, both[:, 0], both[:, 1], tables, seq_lens, 16, 0.125, 0, 0.0)
    assert torch.equal(out, paged_decode_attention(q, k, v, tables, seq_lens, 16, 0.125, 0, 0.0))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, reference(q, k, v, tables, seq_lens, 16, 0.125), **CLOSE)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": "bf16"}, "q \\[B, Hq, hd\\] float32"),
        ({"k": "f32"}, "both float32 or both bfloat16"),
        ({"page": 99}, "row 0's page 1 is 99, not one of the cache's"),
        ({"page": -1}, "row 0's page 1 is -1"),
        ({"len": 10_000}, "row 0's length 10000 is outside its table"),
        ({"heads": 3}, "3 query heads are not groups of 2 kv heads"),
        ({"tables": "int64"}, "tables \\[B, max_pages\\] int32"),
        ({"page_size": 7}, "not whole pages of 7"),
    ],
)
def test_paged_attention_refuses_what_it_cannot_read(change, message) -> None:
    q, k, v, tables, seq_lens = paged([20, 5], 2, 2, 64, 16, torch.bfloat16, seed=1)
    page_size = change.get("page_size", 16)
    if "q" in change:
        q = q.bfloat16()
    if "k" in change:
        k = k.float()
    if "page" in change:
        tables[0, 1] = change["page"]
    if "len" in change:
        seq_lens[0] = change["len"]
    if "heads" in change:
        q = q[:, :3]
    if "tables" in change:
        tables = tables.long()
    with pytest.raises(RuntimeError, match=message):
        paged_decode_attention(q, k, v, tables, seq_lens, page_size, 0.125, 0, 0.0)
