"""One decoder for the Llama-shaped families, in plain torch, on a static slot KV cache or KV
in pages.

Owns the model math: RMSNorm (optionally scaling by 1 + weight), rotary embeddings (plain,
"linear" and "llama3" scaling; a second table for sliding layers with their own base),
grouped-query attention (optional q/k biases, per-head QK-norm, causal or sliding-window masks,
logit softcapping), the gated MLP (SiLU or tanh-GELU) and optional norms after attention and MLP.
What each family switches on is ``zerolayer.models.architectures`` (an ``Architecture`` and the
checkpoint's ``DecoderConfig``), not a copy of the model. One ``Decoder.forward`` serves both
phases:

* prefill: one slot, ``n`` prompt tokens at positions ``start .. start+n-1`` (a chunk; earlier
  chunks of the same prompt are already in the cache), or chunks of several slots at once
  (``prefill_batch``: rows right-padded to the longest, the padding skipped outside attention),
* decode: ``b`` slots, one token each.

The KV cache is allocated once (``KVCache.allocate``) and passed in as two tensors that
``forward`` updates in place, so the same code runs eagerly on CPU and traces to a fixed graph
(``DecodeStep`` / ``PrefillStep``) for ahead-of-time compilers such as torch_neuronx. Attention
reads only the first ``attn_len`` cache positions; callers pick ``attn_len`` from a small set
of buckets (``attention_bucket``) so cost follows the real length while shapes stay fixed;
sliding-window layers keep every position too and mask the ones outside their window.
KV in pages (``PagedKVCache``, the engine's page tables: zerolayer.engine.kv_pages) is the same
math: writes go to each position's row of the token-major page storage, and attention gathers
each row's pages into the static cache's layout before the same attention call, so the float32
parity mode gives the static cache's logits bit for bit. A cache made ``native`` runs decode
steps' attention through ``zerolayer.kernels.attention.paged_decode_attention`` instead, which
reads the pages in place (float32 arithmetic; not bit-exact with SDPA).
Parameter names match the Hugging Face ``*ForCausalLM`` with the ``model.`` prefix removed
(Phi-3's fused matrices are split by the loader). A model loaded from a GGUF file holds its
matrices as the file's own blocks (``Decoder.use_blocks``, ``zerolayer.kernels.qmatmul``: the same
weights, fewer bytes, views of the mapped file) and computes every forward on them, the embedding
looked up from its blocks; a checkpoint directory converted from a GGUF keeps its dense weights
for forwards of many tokens.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerolayer.kernels import qmatmul
from zerolayer.kernels.attention import paged_decode_attention
from zerolayer.kernels.qmatmul import QStack, QWeight
from zerolayer.models.architectures import DecoderConfig

MIN_ATTENTION_BUCKET = 16


def attention_bucket(length: int, max_context: int) -> int:
    """Smallest power of two >= ``length`` (at least MIN_ATTENTION_BUCKET), capped at
    ``max_context``: the attention lengths a compiled backend needs graphs for."""
    if length > max_context:
        raise ValueError(f"length {length} exceeds max_context {max_context}")
    bucket = MIN_ATTENTION_BUCKET
    while bucket < length:
        bucket *= 2
    return min(bucket, max_context)


def eager_attention_len(length: int, max_context: int) -> int:
    """Attention length for eager CPU calls: ``length`` rounded up to a multiple of 64. Eager
    torch needs no fixed set of shapes, so this avoids the up-to-2x masked work of power-of-two
    buckets; traced modules (DecodeStep, PrefillStep) take ``attention_bucket`` sizes."""
    if length > max_context:
        raise ValueError(f"length {length} exceeds max_context {max_context}")
    return min(-(-length // 64) * 64, max_context)


def rope_inv_freq(cfg: DecoderConfig, local: bool = False) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float32, after rope scaling; with
    ``local``, the sliding layers' own unscaled ones (``rope_local_theta``)."""
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    if local:
        assert cfg.rope_local_theta is not None
        return 1.0 / (cfg.rope_local_theta**exponents)
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_type == "linear":
        # Positions are divided by the factor; the same as dividing every frequency.
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        # Llama 3.1: long wavelengths (low frequencies) are slowed by `factor`, short ones are
        # kept, and the band in between is interpolated smoothly between the two.
        old_len = cfg.rope_original_max_position
        low_wavelen = old_len / cfg.rope_low_freq_factor
        high_wavelen = old_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
        smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, smoothed, scaled)
    if cfg.rope_freq_factors is not None:
        # ggml's rope: theta_i = pos * base^(-2i/d) / factor_i.
        if len(cfg.rope_freq_factors) != inv_freq.shape[0]:
            raise ValueError(
                f"{len(cfg.rope_freq_factors)} rope_freq_factors for {inv_freq.shape[0]} pairs"
            )
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = (-second half, first half): the
    halves are swapped in one copy and the sign is in ``sin_signed`` = (-sin, sin) instead,
    which gives bit for bit the same products. x [..., heads, head_dim]; cos, sin_signed
    [..., 1, head_dim]."""
    swapped = x.reshape(*x.shape[:-1], 2, -1).flip(-2).flatten(-2)
    out: torch.Tensor = x * cos + swapped * sin_signed
    return out


class RMSNorm(nn.Module):
    """x / rms(x) * weight, or * (offset + weight) with an ``offset`` (Gemma's norms store the
    difference from 1). Checkpoints keep the weight as their family stores it."""

    def __init__(
        self, dim: int, eps: float, offset: float = 0.0, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype, as the reference implementations do:
        # x * rsqrt(mean(x^2) + eps), which torch's rms_norm computes bit for bit the same in
        # half the ops (checked against the written-out formula in the tests). Llama scales in
        # the model dtype, Gemma in float32 before the cast: so do we.
        xf = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap): logits squashed into (-cap, cap); x itself without a cap."""
    return x if cap is None else torch.tanh(x / cap) * cap


@dataclass(frozen=True)
class Rows:
    """Where one forward's tokens live, built once per forward and shared by every layer.

    The batch has ``B`` rows (one per slot) of ``n`` token places. Normally every place holds a
    real token and the model runs on ``[B, n, hidden]``. With right padding, ``packed`` lists the
    real places (flat indices into ``B * n``) and the model's per-token work (projections, MLP,
    norms, cache writes) runs on just those ``T`` tokens, ``[T, hidden]``; only attention uses
    the padded layout, with zero queries for padding whose outputs are dropped.
    """

    slots: torch.Tensor  # [B] int64, the slot each row reads
    write_slots: torch.Tensor  # slot of each computed token: [B, 1] (broadcasts) or [T]
    write_positions: torch.Tensor  # cache position of each computed token: [B, n] or [T]
    # [B, 1, group * n, attn_len] in the model dtype, added to the scores: 0 where a query may
    # attend, -inf where not (see Attention). Made once per forward: a bool mask would be
    # converted to this by every layer's attention call. ``sliding_mask`` also hides keys at or
    # beyond the sliding window behind each query (None when no layer slides).
    mask: torch.Tensor
    sliding_mask: torch.Tensor | None
    packed: torch.Tensor | None  # [T] int64 or None (no padding)
    slot_start: int | None  # rows are slots slot_start, slot_start + 1, ...: read in place
    blocks: bool = False  # few enough tokens for the GGUF block weights (Decoder.use_blocks)
    # KV in pages (PagedKVCache): where each computed token's K/V goes in the layer's
    # [pages * page_tokens, kv_heads, head_dim] storage ([B, n] or [T]) and where each row's
    # first attn_len positions are read from ([B, attn_len]); None on the static cache.
    write_index: torch.Tensor | None = None
    read_index: torch.Tensor | None = None
    # A paged decode step read in place by the native kernel (PagedKVCache.native): each row's
    # page table [B, max_pages] int32 and length [B] int32 (its position + 1); read_index unset.
    row_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    page_tokens: int = 0


def _bias(parts: list[nn.Linear]) -> torch.Tensor | None:
    """The biases of matrices stacked into one block matmul, stacked the same way."""
    if parts[0].bias is None:
        return None
    return torch.cat([p.bias.detach() for p in parts])


class Attention(nn.Module):
    def __init__(
        self, cfg: DecoderConfig, sliding: bool, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        self.sliding = sliding
        self.softcap = cfg.attn_logit_softcapping
        self.window = (cfg.sliding_window or 0) if sliding else 0  # keys a query sees; 0 = all
        hd, bias = cfg.head_dim, cfg.attention_bias
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=bias, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=bias, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=bias, **kw)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.arch.qk_norm:
            offset = cfg.arch.norm_offset
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, offset, device, dtype)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, offset, device, dtype)
        # GGUF block copies (Decoder.use_blocks): q, k and v stacked into one matmul, and o,
        # with their biases stacked alike.
        self.qkv_blocks: QWeight | QStack | None = None
        self.qkv_bias: torch.Tensor | None = None
        # Output columns of qkv_blocks in the checkpoint's order, when the blocks keep the rows
        # in another (llama.cpp's rope permutation of q/k): each output is the same row's dot
        # product, so picking columns gives the un-permuted weights' results bit for bit.
        self.qkv_order: torch.Tensor | None = None
        self.o_blocks: QWeight | QStack | None = None

    def forward(
        self,
        x: torch.Tensor,  # [*tokens, hidden]: [B, n, hidden], or [T, hidden] when packed
        cos: torch.Tensor,  # [*tokens, 1, head_dim]
        sin: torch.Tensor,  # [*tokens, 1, head_dim], signed (apply_rope)
        rows: Rows,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, max_context, head_dim], this layer's
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        mask = rows.sliding_mask if self.sliding else rows.mask
        assert mask is not None
        B, _, group_n, attn_len = mask.shape
        group = self.n_heads // self.n_kv
        n = group_n // group
        if rows.blocks and self.qkv_blocks is not None:
            qkv: torch.Tensor = self.qkv_blocks(x)  # one matmul for q, k and v
            if self.qkv_order is not None:
                qkv = qkv.index_select(-1, self.qkv_order)
            if self.qkv_bias is not None:
                qkv = qkv + self.qkv_bias
            qkv = qkv.reshape(*qkv.shape[:-1], self.n_heads + 2 * self.n_kv, self.head_dim)
            q, k, v = torch.split(qkv, [self.n_heads, self.n_kv, self.n_kv], dim=-2)
        else:
            q = self.q_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
            k = self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
            v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        # Write the new keys/values, then attend over the slot's first attn_len positions; the
        # mask hides positions after each query (later chunk tokens, stale data of old sequences)
        # and, in a sliding layer, those outside the window.
        # Indexing [write_slots, :, write_positions] selects [*tokens, kv_heads, head_dim].
        if rows.seq_lens is not None and rows.write_index is not None:  # paged decode, native
            assert rows.row_tables is not None
            k_cache[rows.write_index] = k.to(k_cache.dtype)
            v_cache[rows.write_index] = v.to(v_cache.dtype)
            attended = paged_decode_attention(
                q.reshape(B, self.n_heads, self.head_dim).float().contiguous(),
                k_cache, v_cache, rows.row_tables, rows.seq_lens, rows.page_tokens,
                float(self.scale), self.window, float(self.softcap or 0.0),
            )  # fmt: skip
            return self._project(attended.to(x.dtype).reshape(B, 1, -1), rows)
        if rows.write_index is not None and rows.read_index is not None:  # KV in pages
            k_cache[rows.write_index] = k.to(k_cache.dtype)
            v_cache[rows.write_index] = v.to(v_cache.dtype)
            # each row's pages gathered into the static cache's layout [B, kv, attn_len, hd]
            keys = k_cache[rows.read_index].transpose(1, 2).contiguous()
            values = v_cache[rows.read_index].transpose(1, 2).contiguous()
        else:
            k_cache[rows.write_slots, :, rows.write_positions] = k.to(k_cache.dtype)
            v_cache[rows.write_slots, :, rows.write_positions] = v.to(v_cache.dtype)
            if rows.slot_start is None:  # any slots: a gather (a copy of each row's first attn_len)
                keys = k_cache[rows.slots, :, :attn_len]  # [B, kv_heads, attn_len, head_dim]
                values = v_cache[rows.slots, :, :attn_len]
            else:  # consecutive slots: a view of the cache, no copy per layer and step
                keys = k_cache.narrow(0, rows.slot_start, B).narrow(2, 0, attn_len)
                values = v_cache.narrow(0, rows.slot_start, B).narrow(2, 0, attn_len)
        if keys.dtype != q.dtype:  # a bfloat16 cache of a float32 model: computed in float32
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if rows.packed is not None:  # queries back into the padded [B, n] layout; padding = 0
            q = q.new_zeros(B * n, self.n_heads, self.head_dim).index_copy_(0, rows.packed, q)
        q = q.view(B, n, self.n_heads, self.head_dim)

        # Grouped-query attention without repeating K/V: query heads h = kv * group + j share kv
        # head `kv`, so stack each group's queries into one [group * n] block per kv head and
        # attend as if there were kv_heads heads (the mask is laid out the same way). torch's
        # fused attention works through the keys in blocks and never holds the whole
        # [B, kv, group * n, attn_len] score tensor, which for a batch of prefill rows outgrows
        # the CPU caches. Softcapped scores need the scores themselves: written out.
        q = q.transpose(1, 2).reshape(B, self.n_kv, group * n, self.head_dim)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        else:
            scores = softcap(q @ keys.transpose(-1, -2) * self.scale, self.softcap) + mask
            out = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype) @ values
        out = out.view(B, self.n_heads, n, self.head_dim).transpose(1, 2).reshape(B, n, -1)
        if rows.packed is not None:
            out = out.view(B * n, -1).index_select(0, rows.packed)  # [T, heads * head_dim]
        return self._project(out, rows)

    def _project(self, out: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The output projection of the heads' outputs [*tokens, heads * head_dim]."""
        if rows.blocks and self.o_blocks is not None:
            out = self.o_blocks(out)
            return out if self.o_proj.bias is None else out + self.o_proj.bias
        projected: torch.Tensor = self.o_proj(out)
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw = {"bias": cfg.mlp_bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # else SiLU
        # GGUF block copies (Decoder.use_blocks): gate and up stacked into one matmul, and down.
        self.gate_up_blocks: QWeight | QStack | None = None
        self.gate_up_bias: torch.Tensor | None = None
        self.down_blocks: QWeight | QStack | None = None

    def forward(self, x: torch.Tensor, use_blocks: bool = False) -> torch.Tensor:
        if use_blocks and self.gate_up_blocks is not None:
            gate_up = self.gate_up_blocks(x)
            if self.gate_up_bias is not None:
                gate_up = gate_up + self.gate_up_bias
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        if use_blocks and self.down_blocks is not None:
            out = self.down_blocks(h)
            return out if self.down_proj.bias is None else out + self.down_proj.bias
        down: torch.Tensor = self.down_proj(h)
        return down


class Block(nn.Module):
    """One layer. Llama-style: x + attn(norm(x)), then x + mlp(norm(x)), where the second norm
    is Hugging Face's ``post_attention_layernorm``. With ``sandwich_norms`` (Gemma) the
    attention and MLP outputs are normed too before their residual add, and the names shift:
    ``post_attention_layernorm`` norms the attention output, ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` surround the MLP."""

    self_attn: Attention
    mlp: MLP

    def __init__(
        self, cfg: DecoderConfig, layer: int, device: Any = None, dtype: Any = None
    ) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.arch.norm_offset
        self.sliding = cfg.is_sliding(layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset, device, dtype)
        self.self_attn = Attention(cfg, self.sliding, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset, device, dtype)
        self.mlp = MLP(cfg, device, dtype)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if cfg.arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset, device, dtype)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: Rows,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, rows, k_cache, v_cache)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + h
            out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x), rows.blocks)
            return out
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), rows.blocks)
        out = x + self.post_feedforward_layernorm(h)
        return out


@dataclass
class KVCache:
    """The static cache: k and v are [layers, num_slots, kv_heads, max_context, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor
    tables: None = None  # not paged (PagedKVCache)
    page_tokens: int = 0

    @classmethod
    def allocate(
        cls, cfg: DecoderConfig, num_slots: int, max_context: int, dtype: torch.dtype
    ) -> KVCache:
        shape = (
            cfg.num_hidden_layers,
            num_slots,
            cfg.num_key_value_heads,
            max_context,
            cfg.head_dim,
        )
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def max_context(self) -> int:
        return self.k.shape[3]


@dataclass
class PagedKVCache:
    """KV in pages (zerolayer.engine.kv_pages): k and v are [layers, num_pages * page_tokens,
    kv_heads, head_dim], token-major, so one token's K or V of a layer is one row; position p
    of slot s is row ``tables[s, p // page_tokens] * page_tokens + p % page_tokens``. ``tables``
    [num_slots, max_pages_per_row] (-1 = no page) is the engine's page table, shared, read at
    every forward. Zeroed at allocation: attention masks positions a row has not written, but a
    masked value still enters the weighted sum (times 0), so it must never be NaN."""

    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    page_tokens: int
    # Decode steps attend through the native kernel (zerolayer.kernels.attention), reading the
    # pages in place; False: gathered into the static layout (the float32 parity mode's math).
    native: bool = False

    @classmethod
    def allocate(
        cls,
        cfg: DecoderConfig,
        num_pages: int,
        tables: torch.Tensor,
        dtype: torch.dtype,
        page_tokens: int = 16,
        native: bool = False,
    ) -> PagedKVCache:
        shape = (
            cfg.num_hidden_layers,
            num_pages * page_tokens,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        return cls(k, v, tables, page_tokens, native)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def page_nbytes(self) -> int:
        """One page's K and V over every layer."""
        return self.nbytes // (self.k.shape[1] // self.page_tokens)

    @property
    def max_context(self) -> int:
        return int(self.tables.shape[1]) * self.page_tokens

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) page's rows, every layer."""
        pt = self.page_tokens
        lanes = torch.arange(pt)
        pairs = torch.tensor(copies, dtype=torch.int64).reshape(-1, 2) * pt
        src = (pairs[:, :1] + lanes).flatten()
        dst = (pairs[:, 1:] + lanes).flatten()
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))


class Decoder(nn.Module):
    """Weights plus rope tables for ``max_context`` positions. Build with ``device="meta"`` to
    skip weight initialisation when a checkpoint is loaded next (``load_state_dict(assign=True)``).
    """

    # Buffers (register_buffer), typed for the checker: nn.Module types attributes it holds as
    # Tensor | Module.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor | None
    rope_local_sin: torch.Tensor | None

    def __init__(
        self,
        cfg: DecoderConfig,
        max_context: int,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_context = max_context
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            Block(cfg, i, device, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.arch.norm_offset, device, dtype)
        # Gemma scales embeddings by sqrt(hidden), rounded to the model dtype as transformers does.
        self.embed_scale = (
            float(torch.tensor(cfg.hidden_size**0.5).to(dtype)) if cfg.arch.embed_scale else None
        )
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        )
        # Rope tables [max_context, head_dim], computed in float32 then stored in the model dtype;
        # always real CPU tensors (never meta) and not part of the checkpoint. The sine table
        # carries rotate_half's sign (apply_rope). Sliding layers with their own rope base
        # (Gemma 3) get a second pair.
        cos, sin = self._rope_tables(rope_inv_freq(cfg), max_context, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.local_rope = cfg.rope_local_theta is not None
        local: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if self.local_rope:
            local = self._rope_tables(rope_inv_freq(cfg, local=True), max_context, dtype)
        self.register_buffer("rope_local_cos", local[0], persistent=False)
        self.register_buffer("rope_local_sin", local[1], persistent=False)
        # Forwards of at most this many tokens use the GGUF block weights; 0 until use_blocks.
        self.blocks_max_rows = 0
        self.head_blocks: QWeight | QStack | None = None
        self.embed_blocks: QWeight | None = None  # the embedding looked up from its blocks

    def blocks(self) -> list[Block]:
        """The layers, typed (``nn.ModuleList`` holds them as modules)."""
        return [layer for layer in self.layers if isinstance(layer, Block)]

    @staticmethod
    def _rope_tables(
        inv_freq: torch.Tensor, max_context: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(max_context, dtype=torch.float32)[:, None] * inv_freq[None, :]
        sin = angles.sin()
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def use_blocks(
        self,
        weights: dict[str, QWeight],
        every_forward: bool = False,
        qk_orders: dict[str, torch.Tensor] | None = None,
    ) -> int:
        """Give the matrices found in ``weights`` (GGUF blocks under this model's parameter
        names) block copies, which forwards of at most ``qmatmul.MAX_ROWS[dtype]`` tokens use
        (q/k/v and gate/up each stacked into one call when all of them are there, a
        ``QStack`` of views, their biases stacked alike); the dense weights stay for longer
        forwards. With ``every_forward`` there are no dense weights for these matrices (a
        GGUF file's blocks, mapped): every forward uses the blocks, the embedding too.
        ``qk_orders`` (by q_proj / k_proj weight name): the checkpoint's row order of blocks
        kept in the file's (``unpermute_rows`` of an arange).
        Needs the kernel built (``qmatmul.build``). Returns how many matrices got a copy."""
        orders = qk_orders or {}

        def stacked(prefix: str, names: tuple[str, ...]) -> QWeight | QStack | None:
            keys = [f"{prefix}{name}.weight" for name in names]
            if not all(key in weights for key in keys):
                return None
            for key in keys:
                shape, w = self.get_parameter(key).shape, weights[key]
                if (w.out_features, w.in_features) != tuple(shape):
                    raise ValueError(
                        f"{key}: blocks of {w.out_features}x{w.in_features}, "
                        f"weight of {shape[0]}x{shape[1]}"
                    )
            return QWeight.stack([weights[key] for key in keys])

        used = 0
        for i, layer in enumerate(self.blocks()):
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_blocks = stacked(f"layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj"))
            attn.qkv_bias = _bias([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.qkv_order = self._qkv_order(i, orders) if attn.qkv_blocks is not None else None
            attn.o_blocks = stacked(f"layers.{i}.self_attn.", ("o_proj",))
            mlp.gate_up_blocks = stacked(f"layers.{i}.mlp.", ("gate_proj", "up_proj"))
            mlp.gate_up_bias = _bias([mlp.gate_proj, mlp.up_proj])
            mlp.down_blocks = stacked(f"layers.{i}.mlp.", ("down_proj",))
            counts = (3, 1, 2, 1)
            parts = (attn.qkv_blocks, attn.o_blocks, mlp.gate_up_blocks, mlp.down_blocks)
            used += sum(c for c, w in zip(counts, parts, strict=True) if w is not None)
        self.head_blocks = stacked("", ("embed_tokens" if self.lm_head is None else "lm_head",))
        used += self.head_blocks is not None
        self.blocks_max_rows = qmatmul.MAX_ROWS[self.rope_cos.dtype] if used else 0
        if every_forward:
            self.blocks_max_rows = sys.maxsize
            self.embed_blocks = weights.get("embed_tokens.weight")
        return used

    def _qkv_order(self, layer: int, orders: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Columns of layer ``layer``'s stacked q|k|v output in the checkpoint's order."""
        prefix = f"layers.{layer}.self_attn."
        q, k = orders.get(f"{prefix}q_proj.weight"), orders.get(f"{prefix}k_proj.weight")
        if q is None and k is None:
            return None
        cfg = self.cfg
        nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        q = torch.arange(nq) if q is None else q
        k = torch.arange(nkv) if k is None else k
        return torch.cat((q, nq + k, torch.arange(nq + nkv, nq + 2 * nkv)))

    def use_int8_activations(self, int8: bool) -> None:
        """Products on the blocks with 8-bit activations (``QWeight.int8``) or float ones."""

        def switched(w: QWeight | QStack | None) -> QWeight | QStack | None:
            return None if w is None else w.with_int8(int8)

        for layer in self.blocks():
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_blocks, attn.o_blocks = switched(attn.qkv_blocks), switched(attn.o_blocks)
            mlp.gate_up_blocks = switched(mlp.gate_up_blocks)
            mlp.down_blocks = switched(mlp.down_blocks)
        self.head_blocks = switched(self.head_blocks)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, n] int64
        positions: torch.Tensor,  # [B, n] int64, where each token is written
        slots: torch.Tensor,  # [B] int64, distinct
        k_cache: torch.Tensor,  # [layers, num_slots, kv_heads, max_context, head_dim]
        v_cache: torch.Tensor,
        attn_len: int,  # > every position; usually attention_bucket(max position + 1)
        all_logits: bool = False,
        slot_start: int | None = None,  # set when slots == slot_start, slot_start + 1, ...
        last_index: torch.Tensor | None = None,  # [B] int64 in [0, n): last real token per row
        hidden: bool = False,
        tables: torch.Tensor | None = None,  # a PagedKVCache's tables: k/v are its pages
        page_tokens: int = 16,
        native: bool = False,  # a paged decode step (n = 1) through the native kernel
    ) -> torch.Tensor:
        """Run the tokens through the model, writing their K/V into the cache.

        Returns float32 logits: [B, n, vocab] with ``all_logits``, else [B, vocab] for the last
        token of each row. With ``last_index``, the places after ``last_index[i]`` in row ``i``
        are right padding: they are neither computed nor written to the cache (their positions
        only shape their own, discarded, mask rows), and each row's logits are taken at its
        ``last_index``; it excludes ``all_logits``. With ``hidden`` (and ``all_logits``), the
        last layer's states after the final norm instead, [B, n, hidden] in the model's dtype:
        what the head reads (``head``), for embeddings and prompt logprobs.
        """
        key_pos = torch.arange(attn_len, device=tokens.device)
        B, n = tokens.shape
        group = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        causal = key_pos[None, None, :] <= positions[:, :, None]  # [B, n, attn_len]

        def additive(allowed: torch.Tensor) -> torch.Tensor:  # [B, 1, group * n, attn_len]
            allowed = allowed[:, None].expand(B, group, n, attn_len)
            allowed = allowed.reshape(B, 1, group * n, attn_len)
            mask = torch.zeros(allowed.shape, dtype=self.rope_cos.dtype, device=tokens.device)
            return mask.masked_fill_(~allowed, float("-inf"))

        mask = additive(causal)
        sliding_mask = None
        if self.cfg.sliding_window is not None:
            # A query at q sees keys k with q - window < k <= q, as transformers' masks do.
            inside = key_pos[None, None, :] > positions[:, :, None] - self.cfg.sliding_window
            sliding_mask = additive(causal & inside)
        # A plain bool (no tensor op) for models without block weights, so that tracing
        # (DecodeStep, PrefillStep) sees a constant rather than a data-dependent branch.
        use_blocks = self.blocks_max_rows > 0 and tokens.numel() <= self.blocks_max_rows
        if last_index is None:
            rows = Rows(
                slots, slots[:, None], positions, mask, sliding_mask, None, slot_start, use_blocks
            )
        else:
            if all_logits:
                raise ValueError("all_logits cannot be combined with last_index")
            lengths = last_index + 1
            real = torch.arange(n, device=tokens.device)[None, :] < lengths[:, None]  # [B, n]
            packed = real.flatten().nonzero().squeeze(1)  # [T], row-major: row 0's tokens first
            tokens, positions = tokens.flatten()[packed], positions.flatten()[packed]
            rows = Rows(
                slots,
                slots.repeat_interleave(lengths),
                positions,
                mask,
                sliding_mask,
                packed,
                slot_start,
                self.blocks_max_rows > 0 and int(lengths.sum()) <= self.blocks_max_rows,
            )
        if tables is not None:  # KV in pages: rows of the token-major storage (PagedKVCache)
            table = tables.to(torch.int64)
            pages = table[rows.write_slots, rows.write_positions // page_tokens]
            if bool((pages < 0).any()):
                raise ValueError(
                    "a position is written without a KV page (the engine reserves them)"
                )
            write_index = pages * page_tokens + rows.write_positions % page_tokens
            if native and n == 1 and last_index is None:  # the kernel reads the pages in place
                rows = dataclasses.replace(
                    rows,
                    write_index=write_index,
                    row_tables=tables.index_select(0, slots).to(torch.int32),
                    seq_lens=(positions[:, 0] + 1).to(torch.int32),
                    page_tokens=page_tokens,
                )
            else:
                read = table[slots][:, key_pos // page_tokens] * page_tokens
                rows = dataclasses.replace(
                    rows,
                    write_index=write_index,
                    read_index=(read + key_pos % page_tokens).clamp_(min=0),  # no page: masked
                )
        # [B, n, hidden], or [T, hidden] when packed
        if self.embed_blocks is not None:
            x = self.embed_blocks.rows(tokens, self.rope_cos.dtype)
        else:
            x = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        # [..., 1, head_dim]: broadcast over heads
        cos, sin = self.rope_cos[positions].unsqueeze(-2), self.rope_sin[positions].unsqueeze(-2)
        local = (cos, sin)
        if self.rope_local_cos is not None and self.rope_local_sin is not None:
            local = (
                self.rope_local_cos[positions].unsqueeze(-2),
                self.rope_local_sin[positions].unsqueeze(-2),
            )
        for i, layer in enumerate(self.blocks()):
            layer_cos, layer_sin = local if layer.sliding else (cos, sin)
            x = layer(x, layer_cos, layer_sin, rows, k_cache[i], v_cache[i])
        if last_index is not None:
            x = x[torch.cumsum(lengths, 0) - 1]  # [B, hidden]: each row's last packed token
        elif not all_logits:
            x = x[:, -1]
        x = self.norm(x)
        if hidden:
            states: torch.Tensor = x
            return states
        return self.head(x, rows.blocks)

    def head(self, x: torch.Tensor, use_blocks: bool | None = None) -> torch.Tensor:
        """float32 logits [..., vocab] of final-norm states ``x`` [..., hidden]: the LM head and
        the logit softcap. ``use_blocks`` None: the file's blocks when ``x`` has few enough
        rows for them."""
        if use_blocks is None:
            use_blocks = 0 < x[..., 0].numel() <= self.blocks_max_rows
        if use_blocks and self.head_blocks is not None:
            logits = self.head_blocks(x)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(x, weight)
        return softcap(logits, self.cfg.final_logit_softcapping).float()

    def prefill(
        self,
        tokens: torch.Tensor,  # [n] int64
        start: int,
        slot: int,
        cache: KVCache | PagedKVCache,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Write one prompt chunk at positions start..start+n-1 of ``slot``. Returns [vocab]
        logits of the last token, or [n, vocab] with ``all_logits``."""
        n = int(tokens.shape[0])
        end = start + n
        positions = torch.arange(start, end, dtype=torch.int64)[None]
        slots = torch.tensor([slot], dtype=torch.int64)
        attn_len = eager_attention_len(end, cache.max_context)
        logits: torch.Tensor = self(
            tokens[None], positions, slots, cache.k, cache.v, attn_len, all_logits, slot,
            tables=cache.tables, page_tokens=cache.page_tokens,
        )  # fmt: skip
        return logits[0]

    def prefill_hidden(
        self, tokens: torch.Tensor, start: int, slot: int, cache: KVCache | PagedKVCache
    ) -> torch.Tensor:
        """``prefill`` that returns the chunk's final-norm states [n, hidden] (``forward``'s
        ``hidden``) instead of logits; ``head`` turns any of them into logits."""
        n = int(tokens.shape[0])
        positions = torch.arange(start, start + n, dtype=torch.int64)[None]
        slots = torch.tensor([slot], dtype=torch.int64)
        attn_len = eager_attention_len(start + n, cache.max_context)
        states: torch.Tensor = self(
            tokens[None], positions, slots, cache.k, cache.v, attn_len, True, slot, hidden=True,
            tables=cache.tables, page_tokens=cache.page_tokens,
        )  # fmt: skip
        return states[0]

    def prefill_batch(
        self,
        chunks: list[torch.Tensor],  # B chunks, [n_i] int64 each
        starts: list[int],
        slots: list[int],  # distinct
        cache: KVCache | PagedKVCache,
    ) -> torch.Tensor:
        """Write B prompt chunks in ONE forward, chunk i at positions starts[i] .. of slots[i].
        Returns [B, vocab] logits of each chunk's last token, rows in the order given: the same
        as B ``prefill`` calls, with one pass over the weights instead of B.

        Rows are right-padded to the longest chunk; the padding costs attention work only (see
        ``Rows``). Rows run in slot order, so consecutive slots are read in place.
        """
        order = sorted(range(len(chunks)), key=slots.__getitem__)
        lengths = torch.tensor([int(chunks[i].shape[0]) for i in order], dtype=torch.int64)
        row_starts = torch.tensor([starts[i] for i in order], dtype=torch.int64)
        tokens = torch.nn.utils.rnn.pad_sequence([chunks[i] for i in order], batch_first=True)
        # A padding place takes its row's last real position: never written, it only needs a
        # mask row that is not empty, and it stays inside the context however long the row.
        offsets = torch.arange(tokens.shape[1], dtype=torch.int64)[None, :]
        positions = row_starts[:, None] + torch.minimum(offsets, lengths[:, None] - 1)
        sorted_slots = torch.tensor([slots[i] for i in order], dtype=torch.int64)
        first, b = int(sorted_slots[0]), len(order)
        consecutive = int(sorted_slots[-1]) - first == b - 1
        attn_len = eager_attention_len(int((row_starts + lengths).max()), cache.max_context)
        logits: torch.Tensor = self(
            tokens,
            positions,
            sorted_slots,
            cache.k,
            cache.v,
            attn_len,
            slot_start=first if consecutive else None,
            # Equal lengths need no padding, and so no packing either.
            last_index=None if bool((lengths == lengths[0]).all()) else lengths - 1,
            tables=cache.tables,
            page_tokens=cache.page_tokens,
        )
        if order == sorted(order):  # given in slot order already: no reordering copy
            return logits
        inverse = torch.tensor(order, dtype=torch.int64)
        return torch.empty_like(logits).index_copy_(0, inverse, logits)

    def decode(
        self,
        tokens: torch.Tensor,  # [b] int64
        positions: torch.Tensor,  # [b] int64
        slots: torch.Tensor,  # [b] int64
        cache: KVCache | PagedKVCache,
    ) -> torch.Tensor:
        """One batched decode step. Returns [b, vocab] logits, rows in the order given.

        Rows are processed in slot order; when the slots are then consecutive (the usual case
        once the engine has filled its lowest free slots) attention reads the cache in place.
        """
        attn_len = eager_attention_len(int(positions.max()) + 1, cache.max_context)
        in_order = bool((slots[1:] > slots[:-1]).all())  # the usual case: no reordering
        order = None if in_order else torch.argsort(slots)
        sorted_slots = slots if order is None else slots[order]
        first, b = int(sorted_slots[0]), int(slots.shape[0])
        consecutive = int(sorted_slots[-1]) - first == b - 1
        logits: torch.Tensor = self(
            (tokens if order is None else tokens[order])[:, None],
            (positions if order is None else positions[order])[:, None],
            sorted_slots,
            cache.k,
            cache.v,
            attn_len,
            slot_start=first if consecutive else None,
            tables=cache.tables,
            page_tokens=cache.page_tokens,
            native=isinstance(cache, PagedKVCache) and cache.native,
        )
        if order is None:
            return logits
        return torch.empty_like(logits).index_copy_(0, order, logits)


class DecodeStep(nn.Module):
    """A decode step at a fixed attention bucket, in the form a tracer wants: tensors in,
    logits out, cache updated in place. Inputs: tokens/positions/slots [b] int64, k/v cache."""

    def __init__(self, model: Decoder, attn_len: int) -> None:
        super().__init__()
        self.model = model
        self.attn_len = attn_len

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        logits: torch.Tensor = self.model(
            tokens[:, None], positions[:, None], slots, k_cache, v_cache, self.attn_len
        )
        return logits


class PrefillStep(nn.Module):
    """A prefill chunk of fixed length at a fixed attention bucket, for tracing.
    Inputs: tokens/positions [n] int64, slot [1] int64, k/v cache. Returns [vocab] logits."""

    def __init__(self, model: Decoder, attn_len: int) -> None:
        super().__init__()
        self.model = model
        self.attn_len = attn_len

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slot: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        logits: torch.Tensor = self.model(
            tokens[None], positions[None], slot, k_cache, v_cache, self.attn_len
        )
        return logits[0]
