"""The CPU backend: ``zerolayer.models.decoder`` run eagerly by torch on KV in pages.

One ``CpuBackend`` owns the loaded model and the KV pages' bytes (a ``PagedKVCache`` of
``PagePool.num_pages`` pages, allocated once; ``num_slots`` = ``engine.max_batch_size`` page
tables of up to ``max_context`` positions); the engine owns the pages (``kv_pages``: it reserves
every page a call writes and hands copies on write to ``copy_pages``), and the prefix store and n
choices share them by reference (``PagedKV``). It returns logits, which the engine's one sampler
turns into tokens (``LogitsBackend``). The prefill chunks of one call run as a few batched
forwards (``plan_prefill_groups`` decides which chunks share one); decode runs all active slots
in one step, its attention read in place through the page tables by the native kernel
(``zerolayer.kernels.attention``) unless this is the parity mode (float32 KV and float32 model:
gathered, then the static cache's attention call, bit for bit) or the kernel could not be built.
A chunk that asks for prompt outputs (an embedding, prompt logprobs) runs as a forward of its own
that keeps every position's final-norm state (``_prompt_outputs``). ``free`` has nothing to clear:
every attention masks positions past the sequence's own.

The pool's size (``kv_budget``): ``engine.kv_cache_bytes``, or with 0 the smaller of every slot's
whole context and half of MemAvailable minus the weights, at least one whole context.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import torch

from zerolayer.cachedir import data_root
from zerolayer.config.settings import EngineConfig, ModelConfig
from zerolayer.engine.backend import LogitsBackend, ModelInfo, PagedKV, log_pool
from zerolayer.engine.kv_pages import PAGE_TOKENS, PagePool, pages_for
from zerolayer.engine.types import DecodeBatch, PrefillChunk, PromptLogprobs
from zerolayer.kernels import qmatmul
from zerolayer.models.architectures import DecoderConfig
from zerolayer.models.decoder import Decoder, PagedKVCache, eager_attention_len
from zerolayer.models.loader import LoadedModel, load_model
from zerolayer.ops import openmp
from zerolayer.tokenizer import Tokenizer

log = logging.getLogger("zerolayer.engine")


# Batched prefill pads every row to the group's longest chunk and attends over the group's
# longest context. The kernels skip padding everywhere but in attention, so what padding wastes
# is attention area: query places x attended positions. A group may have at most PADDING_LIMIT x
# the area of its chunks run one by one, and at most ATTENTION_BUDGET per query head (which
# bounds the attention mask and working set of one forward); a lone chunk may exceed it.
PADDING_LIMIT = 1.5
ATTENTION_BUDGET = 1 << 20
# Prompt logprobs apply the head to this many positions at a time: the logits of a long prompt
# at once would be [n, vocab] float32 (400 MB for 2048 positions of a 49k vocabulary).
SCORE_SLICE = 64


def plan_prefill_groups(lengths: list[int], starts: list[int], max_context: int) -> list[list[int]]:
    """Split chunks (their lengths and start positions) into groups to run as one forward each.

    Chunks are taken in order of attention length, then length, and a group grows until the
    next chunk would break a bound above; a chunk that breaks one on its own runs alone. Returns
    lists of chunk indices that together cover every chunk once.
    """
    attn = [eager_attention_len(s + n, max_context) for s, n in zip(starts, lengths, strict=True)]
    groups: list[list[int]] = []
    group: list[int] = []
    area = longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: (attn[i], lengths[i])):
        n, own = lengths[i], lengths[i] * attn[i]
        # attn[i] is the group's largest attention length so far, as the chunks are sorted.
        padded = (len(group) + 1) * max(longest, n) * attn[i]
        if group and (padded > PADDING_LIMIT * (area + own) or padded > ATTENTION_BUDGET):
            groups.append(group)
            group, area, longest = [], 0, 0
        group.append(i)
        area += own
        longest = max(longest, n)
    if group:
        groups.append(group)
    return groups


def parity_mode(kv_dtype: torch.dtype, model_dtype: torch.dtype, int8: bool) -> bool:
    """Whether decode attention gathers the pages for the static cache's math (bit-exact with
    it): float32 KV of a float32 model on float products; else the native kernel reads them."""
    return kv_dtype == torch.float32 and model_dtype == torch.float32 and not int8


def position_bytes(cfg: DecoderConfig, dtype: torch.dtype) -> int:
    """One position's K and V over every layer, stored as ``dtype``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in bytes, or None where the file does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weight_bytes(model: Decoder) -> int:
    """The model's weights: its parameters and block copies (each tensor once, by storage)."""
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = [p for p in model.parameters() if not p.is_meta]
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, qmatmul.QWeight):
                tensors.append(value.blocks)
            elif isinstance(value, qmatmul.QStack):
                tensors.extend(part.blocks for part in value.parts)
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def kv_budget(
    setting: int,
    num_slots: int,
    context: int,
    per_position: int,
    weights: int,
    available: int | None,
) -> int:
    """The KV pool's pages: ``setting`` bytes (engine.kv_cache_bytes) when set, else the smaller
    of every slot's whole context and half of ``available`` (MemAvailable) minus ``weights``,
    never less than one whole context. A setting below one page is the user's mistake."""
    page = per_position * PAGE_TOKENS
    row = pages_for(context)
    if setting:
        if setting < page:
            raise ValueError(
                f"engine.kv_cache_bytes {setting} holds no KV page ({page:,} bytes each)"
            )
        return setting // page
    pages = num_slots * row
    if available is not None:
        pages = min(pages, max(0, available // 2 - weights) // page)
    return max(pages, row)


class CpuBackend(LogitsBackend, PagedKV):
    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        max_context: int,
        sampler_seed: int | None = None,
        kv_dtype: torch.dtype | None = None,
        num_pages: int = 0,
        native_attention: bool | None = None,
    ) -> None:
        """``kv_dtype``: how K and V are stored; None = the model's dtype. ``num_pages``: the
        KV pool (0: every slot's whole context). ``native_attention``: decode attention through
        the native kernel; None = unless the parity mode (float32 KV of a float32 model), when
        the kernel is loaded."""
        super().__init__(sampler_seed)
        self.model = loaded.model
        self.num_slots = num_slots
        context = min(max_context, loaded.max_context)
        dtype = kv_dtype or loaded.dtype
        row_pages = pages_for(context)
        pool = PagePool(num_pages or num_slots * row_pages, num_slots, row_pages)
        self.kv_pages: PagePool = pool
        if native_attention is None:
            parity = parity_mode(dtype, loaded.dtype, int8=False)
            native_attention = not parity and qmatmul.loaded_build() is not None
        self.cache = PagedKVCache.allocate(
            loaded.config,
            pool.num_pages,
            torch.from_numpy(pool.tables),  # the pool's tables, shared: read at every forward
            dtype,
            PAGE_TOKENS,
            native_attention,
        )
        self.kv_page_bytes = self.cache.page_nbytes
        self.info = ModelInfo(
            name=loaded.name,
            vocab_size=loaded.config.vocab_size,
            eos_token_id=loaded.tokenizer.eos_token_id,
            max_context=context,
            hidden_size=loaded.config.hidden_size,
            kv_positions=pool.positions,
        )
        log.info(
            "KV %s, up to %d positions a slot; decode attention %s",
            str(dtype).removeprefix("torch."),
            context,
            "in place (native kernel)" if native_attention else "gathered (torch SDPA)",
        )
        self._thread = threading.get_ident()  # the thread that loaded the model
        self._thread_warned = False

    def _check_thread(self) -> None:
        """Warn once when the model runs on another thread than the one that loaded it: each
        thread then has its own OpenMP team and small ops get several times slower (see
        zerolayer.engine.compute)."""
        if threading.get_ident() != self._thread and not self._thread_warned:
            self._thread_warned = True
            log.warning(
                "CPU backend runs on thread %s but was loaded on thread %s: torch ops are "
                "slower with two OpenMP teams; load and run it on one thread",
                threading.current_thread().name,
                self._thread,
            )

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    @torch.inference_mode()
    def prefill_logits(self, chunks: list[PrefillChunk]) -> torch.Tensor | None:
        self._check_thread()
        inputs = [self._chunk_tokens(chunk) for chunk in chunks]
        lengths = [int(t.shape[0]) for t in inputs]
        starts = [chunk.start for chunk in chunks]
        slots = [chunk.slot for chunk in chunks]
        outputs = [chunk.pool or chunk.score >= 0 for chunk in chunks]
        if len(set(slots)) == len(slots) and not any(outputs):
            groups = plan_prefill_groups(lengths, starts, self.info.max_context)
        else:  # two chunks of one slot: the later continues the earlier, so keep them in order
            groups = [[i] for i in range(len(chunks))]
        logits: dict[int, torch.Tensor] = {}
        for group in groups:
            if len(group) == 1 and outputs[group[0]]:
                (i,) = group
                states = self.model.prefill_hidden(inputs[i], starts[i], slots[i], self.cache)
                row_logits = self._prompt_outputs(chunks[i], states)
            elif len(group) == 1:
                (i,) = group
                row_logits = self.model.prefill(inputs[i], starts[i], slots[i], self.cache)[None]
            else:
                row_logits = self.model.prefill_batch(
                    [inputs[i] for i in group],
                    [starts[i] for i in group],
                    [slots[i] for i in group],
                    self.cache,
                )
            logits.update((i, row_logits[r]) for r, i in enumerate(group) if chunks[i].last)
        last = [logits[i] for i, chunk in enumerate(chunks) if chunk.last]
        return torch.stack(last) if last else None

    def _prompt_outputs(self, chunk: PrefillChunk, states: torch.Tensor) -> torch.Tensor:
        """Write ``chunk``'s prompt outputs from its final-norm states [n, hidden]: the sum of
        the states (``pool``), the logprobs of its ``targets`` (``score``; the raw logits'
        log_softmax, SCORE_SLICE positions at a time). Returns the logits at its last position
        [1, vocab]."""
        if chunk.pool:
            chunk.pooled = states.float().sum(0).numpy()
        if chunk.score >= 0:
            assert chunk.targets is not None
            targets = torch.from_numpy(np.asarray(chunk.targets, dtype=np.int64))
            m, k = int(targets.shape[0]), chunk.score
            token = torch.empty(m)
            top_ids = torch.empty(m, k, dtype=torch.int32)
            top = torch.empty(m, k)
            for a in range(0, m, SCORE_SLICE):
                b = min(a + SCORE_SLICE, m)
                lp = torch.log_softmax(self.model.head(states[a:b]), -1)
                token[a:b] = lp.gather(1, targets[a:b, None])[:, 0]
                if k:
                    values, ids = lp.topk(k, -1)
                    top[a:b], top_ids[a:b] = values, ids.int()
            chunk.scored = PromptLogprobs(token.numpy(), top_ids.numpy(), top.numpy())
        return self.model.head(states[-1:])

    def _chunk_tokens(self, chunk: PrefillChunk) -> torch.Tensor:
        """The chunk's ids as int64, after checking its slot, positions and ids."""
        self._check_slot(chunk.slot)
        n = int(chunk.tokens.shape[0])
        if n == 0:
            raise ValueError("empty prefill chunk")
        if chunk.start < 0 or chunk.start + n > self.info.max_context:
            raise ValueError(
                f"chunk positions {chunk.start}..{chunk.start + n - 1} outside the context "
                f"of {self.info.max_context}"
            )
        tokens = torch.from_numpy(np.asarray(chunk.tokens, dtype=np.int64))
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.info.vocab_size:
            raise ValueError(f"prompt token id outside [0, {self.info.vocab_size})")
        return tokens

    @torch.inference_mode()
    def decode_logits(self, batch: DecodeBatch) -> torch.Tensor:
        self._check_thread()
        positions = np.asarray(batch.positions, dtype=np.int64)
        if positions.min() < 0 or positions.max() >= self.info.max_context:
            raise ValueError(f"decode position outside the context of {self.info.max_context}")
        return self.model.decode(
            torch.from_numpy(np.asarray(batch.tokens, dtype=np.int64)),
            torch.from_numpy(positions),
            torch.from_numpy(np.asarray(batch.slots, dtype=np.int64)),
            self.cache,
        )

    def free(self, slot: int) -> None:
        self._check_slot(slot)

    @torch.inference_mode()
    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.cache.copy_pages(copies)

    def close(self) -> None:
        self.cache = PagedKVCache(
            torch.empty(0), torch.empty(0), self.cache.tables, self.cache.page_tokens
        )


def create_cpu_backend(
    model_cfg: ModelConfig, engine_cfg: EngineConfig
) -> tuple[CpuBackend, Tokenizer]:
    """Load the configured model and build a backend with ``engine.max_batch_size`` slots."""
    # 0 keeps torch's default, one thread per core. Measured on a 2-core machine
    # (docs/benchmarks.md), every core for torch beat leaving one to the event loop at 1, 8 and 32
    # streams: the loop's work per step is small next to a model's forward.
    if engine_cfg.threads:
        torch.set_num_threads(engine_cfg.threads)
    log.info("torch threads: %d; %s", torch.get_num_threads(), openmp.describe())
    loaded = load_model(model_cfg, engine_cfg.max_context)
    kv_dtype: torch.dtype = getattr(torch, engine_cfg.kv_dtype)
    int8 = qmatmul.uses_int8(model_cfg.kernel, parity=model_cfg.dtype == "float32")
    parity = parity_mode(kv_dtype, loaded.dtype, int8)
    native = False
    if not parity:  # the paged decode attention lives in the block kernel's library
        reason = qmatmul.build(data_root(model_cfg.data_dir) / "kernels")
        native = reason is None
        if reason is not None:
            log.warning("paged attention kernel unavailable, gathering KV instead: %s", reason)
    context = min(engine_cfg.max_context, loaded.max_context)
    num_pages = kv_budget(
        engine_cfg.kv_cache_bytes,
        engine_cfg.max_batch_size,
        context,
        position_bytes(loaded.config, kv_dtype),
        weight_bytes(loaded.model),
        mem_available(),
    )
    backend = CpuBackend(
        loaded,
        engine_cfg.max_batch_size,
        engine_cfg.max_context,
        kv_dtype=kv_dtype,
        num_pages=num_pages,
        native_attention=native,
    )
    log_pool(backend, engine_cfg.kv_cache_bytes)
    return backend, loaded.tokenizer
