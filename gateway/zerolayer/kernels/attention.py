"""Decode attention over a paged KV cache (``kernels/attention.cpp``): the call, and its torch
reference.

``paged_decode_attention`` is one decode step's attention for a batch of rows whose keys and
values sit in pages of ``page_size`` positions, read in place through each row's page table
(a gather of the pages into a contiguous copy costs more than the attention itself: issue #38's
measurements). The native op is built into the block kernel's library (``qmatmul.build``, which
must have succeeded); ``reference`` is the same attention as a gather and torch's
``scaled_dot_product_attention``, the decoder's own math, which the tests compare it with.

Shapes: q [B, Hq, hd] float32 (the step's one query per row); k_cache, v_cache one layer's
[num_pages * page_size, Hkv, hd], bfloat16 or float32 (token-major: position t of a row is
token ``tables[b, t // page_size] * page_size + t % page_size``); tables [B, max_pages] int32
(-1 past a row's pages); seq_lens [B] int32 (positions 0 .. len - 1, the current token's K/V
already written; 0 gives a zero output); query head j reads kv head j // (Hq // Hkv); window > 0
keeps the last ``window`` positions (sliding layers); softcap > 0 applies cap * tanh(s / cap) to
the scaled scores (Gemma 2). Returns [B, Hq, hd] float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The native op (f32 arithmetic, online softmax, rows split over threads by length only,
    so the result is the same bits at any thread count)."""
    out: torch.Tensor = torch.ops.zerolayer.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, page_size, scale, window, softcap
    )
    return out


def gather_positions(
    tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int, window: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache tokens each row attends, padded to the longest: index [B, L] int64 (token 0
    where padded) and a mask [B, L] (True where attended)."""
    lens = seq_lens.long()
    starts = (lens - window).clamp(min=0) if window > 0 else torch.zeros_like(lens)
    width = int((lens - starts).max()) if lens.numel() else 0
    pos = starts[:, None] + torch.arange(width)[None, :]  # [B, L]
    mask = pos < lens[:, None]
    pos = torch.where(mask, pos, 0)
    pages = tables.long().gather(1, pos // page_size)
    index = torch.where(mask, pages * page_size + pos % page_size, 0)
    return index, mask


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The same attention as a gather of every row's positions into [B, Hkv, L, hd] in q's dtype
    (float32; float64 for a tighter reference) and
    the decoder's attention math (SDPA, or the scores written out when softcapped), grouped
    queries stacked per kv head as ``models.decoder.Attention`` stacks them."""
    B, Hq, hd = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    index, mask = gather_positions(tables, seq_lens, page_size, window)
    L = index.shape[1]
    if L == 0:
        return torch.zeros_like(q)
    keys = k_cache.index_select(0, index.reshape(-1)).view(B, L, Hkv, hd)
    values = v_cache.index_select(0, index.reshape(-1)).view(B, L, Hkv, hd)
    keys = keys.transpose(1, 2).to(q.dtype)  # [B, Hkv, L, hd]
    values = values.transpose(1, 2).to(q.dtype)
    queries = q.view(B, Hkv, group, hd)
    hidden = ~mask[:, None, None, :]
    additive = torch.zeros(B, 1, 1, L, dtype=q.dtype).masked_fill(hidden, float("-inf"))
    if softcap > 0:
        scores = queries @ keys.transpose(-1, -2) * scale
        scores = torch.tanh(scores / softcap) * softcap + additive
        out = scores.softmax(dim=-1) @ values
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=additive, scale=scale)
    empty = seq_lens == 0  # no position: SDPA's NaN, the op's zeros
    return out.reshape(B, Hq, hd).masked_fill(empty[:, None, None], 0.0)
