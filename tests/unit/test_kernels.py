"""Kernel and CPU-backend behaviour: tracing, slot isolation, slot reuse, prefixes, buckets,
batched prefill."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.kv import reserve, reserving, slot_kv
from zerolayer.engine.backends.cpu import ATTENTION_BUDGET, CpuBackend, plan_prefill_groups
from zerolayer.engine.types import DecodeBatch, PrefillChunk
from zerolayer.models.architectures import DecoderConfig
from zerolayer.models.decoder import (
    Decoder,
    DecodeStep,
    KVCache,
    PrefillStep,
    RMSNorm,
    apply_rope,
    attention_bucket,
)
from zerolayer.models.loader import LoadedModel
from zerolayer.sampling_params import SamplingParams, sampling_rows
from zerolayer.tokenizer import ByteTokenizer

CFG = DecoderConfig(
    vocab_size=ByteTokenizer.BASE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
# Gemma 3's pieces all at once: sliding layers with their own rope, QK-norm, sandwich norms,
# +1 norms, scaled embeddings, tanh-GELU, softcaps.
GEMMA_CFG = replace(
    CFG,
    model_type="gemma3_text",
    hidden_act="gelu_pytorch_tanh",
    sliding_window=8,
    layer_types=("sliding_attention", "full_attention"),
    rope_local_theta=10000.0,
    rope_theta=1e6,
    query_pre_attn_scalar=24.0,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=30.0,
)
CONTEXT = 128


def make_model(dtype: torch.dtype = torch.float32, cfg: DecoderConfig = CFG) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(cfg, CONTEXT, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def make_backend(num_slots: int = 4, sampler_seed: int | None = 0) -> CpuBackend:
    loaded = LoadedModel(
        name="tiny",
        path=Path("."),
        config=CFG,
        model=make_model(),
        tokenizer=ByteTokenizer(),
        dtype=torch.float32,
        max_context=CONTEXT,
    )
    return reserving(
        CpuBackend(loaded, num_slots=num_slots, max_context=CONTEXT, sampler_seed=sampler_seed)
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def greedy_chunk(slot: int, ids: np.ndarray, start: int = 0, last: bool = True) -> PrefillChunk:
    return PrefillChunk(
        slot=slot, tokens=ids.astype(np.int32), start=start, last=last, sampling=SamplingParams()
    )


def decode_batch(slots: list[int], toks: list[int], positions: list[int], **kw) -> DecodeBatch:
    b = len(slots)
    return DecodeBatch(
        slots=np.array(slots, np.int32),
        tokens=np.array(toks, np.int32),
        positions=np.array(positions, np.int32),
        sampling=sampling_rows(
            SamplingParams(temperature=kw.get("temperature", 0.0), seed=seed)
            for seed in kw.get("seeds", [None] * b)
        ),
    )


def test_config_reads_both_rope_field_styles() -> None:
    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
    }
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    v4 = DecoderConfig.from_hf(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    v5 = DecoderConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    )
    old = DecoderConfig.from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert v4 == v5
    assert (v4.rope_type, v4.rope_theta, v4.rope_factor) == ("llama3", 500000.0, 8.0)
    assert (v4.num_key_value_heads, v4.head_dim) == (4, 16)
    assert (old.rope_type, old.rope_factor) == ("linear", 2.0)
    plain = DecoderConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    )
    assert plain.rope_type == "default"


def test_attention_bucket() -> None:
    assert attention_bucket(1, 2048) == 16
    assert attention_bucket(16, 2048) == 16
    assert attention_bucket(17, 2048) == 32
    assert attention_bucket(1025, 2048) == 2048
    assert attention_bucket(1500, 1500) == 1500
    with pytest.raises(ValueError):
        attention_bucket(2049, 2048)


# torch.jit.trace is deprecated upstream but is the CPU stand-in for torch_neuronx.trace.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", [CFG, GEMMA_CFG], ids=["llama", "gemma3"])
@torch.inference_mode()
def test_decode_step_traces_and_matches_eager(cfg: DecoderConfig) -> None:
    model = make_model(cfg=cfg)
    cache = KVCache.allocate(cfg, 4, CONTEXT, torch.float32)
    for slot in range(4):
        model.prefill(tokens(20 + slot, slot), 0, slot, cache)
    step = DecodeStep(model, attn_len=32)
    example = (torch.tensor([1, 2, 3]), torch.tensor([20, 22, 21]), torch.tensor([0, 2, 1]))
    traced = torch.jit.trace(step, (*example, cache.k.clone(), cache.v.clone()), check_trace=False)
    # Different values, same shapes: the graph must not have baked in the example's data.
    args = (torch.tensor([7, 8, 9]), torch.tensor([23, 25, 24]), torch.tensor([3, 1, 2]))
    k1, v1, k2, v2 = cache.k.clone(), cache.v.clone(), cache.k.clone(), cache.v.clone()
    eager = step(*args, k1, v1)
    out = traced(*args, k2, v2)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=0)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)  # the traced graph updates the cache too
    assert not torch.equal(k1, cache.k)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", [CFG, GEMMA_CFG], ids=["llama", "gemma3"])
@torch.inference_mode()
def test_prefill_step_traces_and_matches_eager(cfg: DecoderConfig) -> None:
    model = make_model(cfg=cfg)
    cache = KVCache.allocate(cfg, 2, CONTEXT, torch.float32)
    model.prefill(tokens(40, 1), 0, 0, cache)
    model.prefill(tokens(40, 2), 0, 1, cache)
    step = PrefillStep(model, attn_len=64)
    positions = torch.arange(16, 32)
    example = (tokens(16, 3), positions, torch.tensor([0]), cache.k.clone(), cache.v.clone())
    traced = torch.jit.trace(step, example, check_trace=False)
    args = (tokens(16, 4), positions + 8, torch.tensor([1]))
    k1, v1, k2, v2 = cache.k.clone(), cache.v.clone(), cache.k.clone(), cache.v.clone()
    torch.testing.assert_close(traced(*args, k2, v2), step(*args, k1, v1), atol=1e-5, rtol=0)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@torch.inference_mode()
def test_decoding_one_slot_leaves_others_alone() -> None:
    model = make_model()
    cache = KVCache.allocate(CFG, 3, CONTEXT, torch.float32)
    model.prefill(tokens(10, 1), 0, 0, cache)
    model.prefill(tokens(12, 2), 0, 1, cache)
    before = cache.k[:, 0].clone()
    reference = model.decode(
        torch.tensor([5]),
        torch.tensor([10]),
        torch.tensor([0]),
        KVCache(cache.k.clone(), cache.v.clone()),
    )
    for pos in range(12, 30):  # slot 1 runs on, past slot 0's length and bucket
        model.decode(torch.tensor([pos]), torch.tensor([pos]), torch.tensor([1]), cache)
    assert torch.equal(cache.k[:, 0], before)
    after = model.decode(torch.tensor([5]), torch.tensor([10]), torch.tensor([0]), cache)
    torch.testing.assert_close(after, reference, atol=1e-5, rtol=0)
    # Batched with slot 1, slot 0's row is still the same.
    both = model.decode(torch.tensor([5, 6]), torch.tensor([10, 30]), torch.tensor([0, 1]), cache)
    torch.testing.assert_close(both[0], reference[0], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_freed_slot_reused_without_stale_state() -> None:
    backend = make_backend()
    fresh = make_backend()
    short = tokens(7, 9).numpy()
    backend.prefill([greedy_chunk(0, tokens(60, 8).numpy())])
    backend.free(0)
    reserve(backend, 0, 0, len(short))
    reserve(fresh, 0, 0, len(short))
    got = backend.model.prefill(torch.from_numpy(short).long(), 0, 0, backend.cache)
    expected = fresh.model.prefill(torch.from_numpy(short).long(), 0, 0, fresh.cache)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    step = decode_batch([0], [65], [len(short)])  # the position after the prompt
    assert backend.decode(step).tolist() == fresh.decode(step).tolist()


def test_backend_prefill_chunks_and_decode() -> None:
    backend = make_backend()
    ids = tokens(50, 3).numpy()
    whole = backend.prefill([greedy_chunk(0, ids)])
    parts = backend.prefill(
        [greedy_chunk(1, ids[:30], last=False), greedy_chunk(2, ids[:5], last=False)]
    )
    assert parts.tolist() == [-1, -1] and parts.dtype == np.int32
    rest = backend.prefill([greedy_chunk(1, ids[30:], start=30), greedy_chunk(2, ids[5:], start=5)])
    assert rest.tolist() == [whole[0], whole[0]]
    out = backend.decode(decode_batch([0, 1, 2], [int(whole[0])] * 3, [50, 50, 50]))
    assert out.dtype == np.int32 and out.shape == (3,)
    assert len(set(out.tolist())) == 1


def test_backend_seeded_decode_independent_of_batch() -> None:
    backend = make_backend(sampler_seed=None)
    for slot in range(4):
        backend.prefill([greedy_chunk(slot, tokens(9 + slot, slot).numpy())])
    kw = {"temperature": 1.5}
    alone = backend.decode(decode_batch([2], [70], [11], seeds=[99], **kw))
    for others in range(3):
        backend2 = make_backend(sampler_seed=None)
        for slot in range(4):
            backend2.prefill([greedy_chunk(slot, tokens(9 + slot, slot).numpy())])
        slots = [0, 1, 3][:others] + [2]
        batch = decode_batch(
            slots,
            [70] * len(slots),
            [9 + s for s in slots],
            seeds=[None] * others + [99],
            **kw,
        )
        assert backend2.decode(batch)[-1] == alone[0]


def test_kv_range_save_load_equals_reprefill() -> None:
    backend = make_backend()
    system = tokens(24, 5).numpy()
    user = tokens(9, 6).numpy()
    full = np.concatenate([system, user])
    expected = backend.prefill([greedy_chunk(0, full)])
    backend.prefill([greedy_chunk(1, system, last=False)])
    # Saved as two ranges, as the prefix store keeps blocks.
    head, tail = backend.save_kv(1, 0, 16), backend.save_kv(1, 16, 24)
    assert (
        backend.kv_nbytes(tail)
        == 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * 16 * CFG.head_dim * 4
    )  # 8 positions, held as their whole page
    backend.prefill([greedy_chunk(3, tokens(40, 7).numpy())])  # slot 3 held something else
    backend.free(3)
    backend.load_kv(head, 3, 0)
    backend.load_kv(tail, 3, 16)
    got = backend.prefill([greedy_chunk(3, user, start=len(system))])
    assert got.tolist() == expected.tolist()
    torch.testing.assert_close(
        slot_kv(backend, 3, 0, 33)[0], slot_kv(backend, 0, 0, 33)[0], atol=1e-5, rtol=0
    )
    # Later decode steps agree too.
    out = backend.decode(decode_batch([0, 3], [int(expected[0])] * 2, [33, 33]))
    assert out[0] == out[1]


def test_backend_rejects_bad_input() -> None:
    backend = make_backend(num_slots=2)
    with pytest.raises(ValueError, match="slot"):
        backend.prefill([greedy_chunk(2, tokens(3, 0).numpy())])
    with pytest.raises(ValueError, match="context"):
        backend.prefill([greedy_chunk(0, tokens(3, 0).numpy(), start=CONTEXT - 2)])
    with pytest.raises(ValueError, match="token id"):
        backend.prefill([greedy_chunk(0, np.array([1, 300]))])


@torch.inference_mode()
def test_bfloat16_runs_close_to_float32() -> None:
    f32 = make_model()
    bf16 = make_model().to(torch.bfloat16)
    ids = tokens(20, 1)
    a = f32.prefill(ids, 0, 0, KVCache.allocate(CFG, 1, CONTEXT, torch.float32))
    b = bf16.prefill(ids, 0, 0, KVCache.allocate(CFG, 1, CONTEXT, torch.bfloat16))
    assert b.dtype == torch.float32
    assert torch.isfinite(b).all()
    assert torch.corrcoef(torch.stack([a, b]))[0, 1] > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rope_are_bit_identical_to_the_written_out_formulas(dtype) -> None:
    """The fused forms the kernels use give exactly the reference implementation's numbers."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    for shape, scale in [((1, 1, 96), 1e-2), ((3, 1, 96), 1.0), ((2, 17, 96), 30.0)]:
        x = (torch.randn(shape, generator=gen) * scale).to(dtype)
        xf = x.float()
        expected = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(
            dtype
        )
        assert torch.equal(norm(x), expected)
        heads = (torch.randn(*shape[:-1], 6, 16, generator=gen) * scale).to(dtype)
        cos, sin = torch.randn(2, *shape[:-1], 1, 16, generator=gen).to(dtype)
        first, second = heads.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)  # transformers' rotate_half
        signed = torch.cat((-sin[..., :8], sin[..., 8:]), dim=-1)
        assert torch.equal(apply_rope(heads, cos, signed), heads * cos + rotated * sin)


@torch.inference_mode()
def test_decode_in_place_and_gather_paths_agree() -> None:
    """Consecutive slots are read in place, others gathered; rows come back in input order."""
    model = make_model()
    prompts = [tokens(9, 11), tokens(14, 12), tokens(6, 13)]
    results = []
    for slots in ([0, 1, 2], [2, 1, 0], [0, 3, 1], [3, 0, 2]):  # in place, reversed, gaps
        cache = KVCache.allocate(CFG, 4, CONTEXT, torch.float32)
        for slot, prompt in zip(slots, prompts, strict=True):
            model.prefill(prompt, 0, slot, cache)
        logits = model.decode(
            torch.tensor([7, 8, 9]),
            torch.tensor([len(p) for p in prompts]),
            torch.tensor(slots),
            cache,
        )
        results.append(logits)
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-5, rtol=0)
    # And each row equals that sequence decoded alone.
    cache = KVCache.allocate(CFG, 4, CONTEXT, torch.float32)
    model.prefill(prompts[1], 0, 2, cache)
    alone = model.decode(torch.tensor([8]), torch.tensor([14]), torch.tensor([2]), cache)
    torch.testing.assert_close(alone[0], results[0][1], atol=1e-5, rtol=0)


def noisy_cache(num_slots: int) -> KVCache:
    """A cache full of stale values, as slots hold after earlier sequences."""
    cache = KVCache.allocate(CFG, num_slots, CONTEXT, torch.float32)
    gen = torch.Generator().manual_seed(42)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    return cache


# (start, length) per row: mixed lengths; continuing chunks (start > 0, their earlier chunks
# written first); the last row ends exactly at the context end, although its start plus the
# longest chunk (30) would run past it.
BATCH_ROWS = [(0, 30), (17, 5), (40, 23), (0, 1), (CONTEXT - 9, 9)]


@pytest.mark.parametrize("slots", [[3, 1, 0, 2, 4], [6, 0, 3, 1, 7]], ids=["in-place", "gather"])
@torch.inference_mode()
def test_prefill_batch_equals_sequential(slots: list[int]) -> None:
    """One batched forward gives each row the logits and KV cache of its own prefill call, for
    consecutive slots (read in place) and scattered ones (gathered), given in any order."""
    model = make_model()
    chunks = [tokens(n, 100 + i) for i, (_, n) in enumerate(BATCH_ROWS)]
    starts = [start for start, _ in BATCH_ROWS]
    runs = []
    for batched in (False, True):
        cache = noisy_cache(8)
        for i, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            if start:  # the earlier chunks of a continuing row
                model.prefill(tokens(start, 200 + i), 0, slot, cache)
        if batched:
            logits = model.prefill_batch(chunks, starts, slots, cache)
        else:
            rows = zip(chunks, starts, slots, strict=True)
            logits = torch.stack([model.prefill(c, start, slot, cache) for c, start, slot in rows])
        runs.append((cache, logits))
    (seq_cache, seq_logits), (batch_cache, batch_logits) = runs
    assert batch_logits.shape == (len(BATCH_ROWS), CFG.vocab_size)
    torch.testing.assert_close(batch_logits, seq_logits, atol=1e-5, rtol=0)
    assert torch.equal(batch_logits.argmax(-1), seq_logits.argmax(-1))
    # Real positions hold the same K/V in both caches, and padding wrote nothing: every position
    # after a row's chunk still holds its stale value.
    torch.testing.assert_close(batch_cache.k, seq_cache.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch_cache.v, seq_cache.v, atol=1e-5, rtol=0)
    stale = noisy_cache(8)
    for slot, (start, n) in zip(slots, BATCH_ROWS, strict=True):
        for new, old in ((batch_cache.k, stale.k), (batch_cache.v, stale.v)):
            assert torch.equal(new[:, slot, :, start + n :], old[:, slot, :, start + n :])
            assert not torch.equal(
                new[:, slot, :, start : start + n], old[:, slot, :, start : start + n]
            )


@torch.inference_mode()
def test_prefill_batch_consecutive_rows_read_in_place() -> None:
    """Consecutive slots in any order take the in-place path and agree with the gather path."""
    model = make_model()
    chunks = [tokens(12, 1), tokens(20, 2), tokens(7, 3)]
    results = []
    for slots in ([2, 1, 3], [0, 2, 3]):  # consecutive (out of order), then with a gap
        cache = noisy_cache(4)
        results.append(model.prefill_batch(chunks, [0, 0, 0], slots, cache))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_forward_last_index_rejects_all_logits() -> None:
    model = make_model()
    cache = KVCache.allocate(CFG, 1, CONTEXT, torch.float32)
    with pytest.raises(ValueError, match="all_logits"):
        model(
            tokens(4, 0)[None],
            torch.arange(4)[None],
            torch.tensor([0]),
            cache.k,
            cache.v,
            64,
            all_logits=True,
            last_index=torch.tensor([2]),
        )


def test_plan_prefill_groups_bounds_padding() -> None:
    lengths = [40, 1, 64, 33, 50, 2, 60]
    starts = [0] * len(lengths)
    groups = plan_prefill_groups(lengths, starts, 2048)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    # The 32..64-token chunks share one forward; the 1- and 2-token ones are not padded to 64.
    assert sorted([3, 0, 4, 6, 2]) in [sorted(g) for g in groups]
    assert all(not ({1, 5} & set(g) and {0, 2, 3, 4, 6} & set(g)) for g in groups)
    # A chunk far into its context does not drag short-context chunks to its attention length.
    far = plan_prefill_groups([40, 40, 40], [0, 0, 1500], 2048)
    assert sorted(map(sorted, far)) == [[0, 1], [2]]
    # Long chunks at long contexts stay under the attention budget, alone if need be.
    long = plan_prefill_groups([256] * 4, [1700, 1700, 1700, 1700], 2048)
    assert all(len(g) * 256 * 2048 <= ATTENTION_BUDGET or len(g) == 1 for g in long)
    assert len(long) > 1


def test_backend_batched_prefill_equals_one_chunk_per_call() -> None:
    """CpuBackend.prefill over many chunks (mixed lengths and starts, scattered slots) samples
    the same tokens and leaves the same cache as one call per chunk."""
    specs = [(6, 0, 37, True), (2, 0, 45, True), (0, 20, 30, True), (7, 0, 9, False)]
    specs += [(3, 0, 60, True), (5, CONTEXT - 40, 40, True), (1, 0, 52, True)]
    lengths = [n for _, _, n, _ in specs]
    starts = [start for _, start, _, _ in specs]
    assert max(len(g) for g in plan_prefill_groups(lengths, starts, CONTEXT)) >= 4
    results = []
    for one_per_call in (True, False):
        backend = make_backend(num_slots=8)
        for slot, start, _, _ in specs:
            if start:
                backend.prefill([greedy_chunk(slot, tokens(start, 50 + slot).numpy(), last=False)])
        chunks = [
            greedy_chunk(slot, tokens(n, slot).numpy(), start=start, last=last)
            for slot, start, n, last in specs
        ]
        if one_per_call:
            out = np.concatenate([backend.prefill([c]) for c in chunks])
        else:
            out = backend.prefill(chunks)
        results.append((out, backend.cache))
    (seq_out, seq_cache), (batch_out, batch_cache) = results
    assert batch_out.tolist() == seq_out.tolist()
    assert batch_out[3] == -1 and (batch_out[[0, 1, 2, 4, 5, 6]] >= 0).all()
    torch.testing.assert_close(batch_cache.k, seq_cache.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(batch_cache.v, seq_cache.v, atol=1e-5, rtol=0)


def test_backend_prefill_two_chunks_of_one_slot_in_one_call() -> None:
    """Chunks of the same slot in one call run in order: the second continues the first."""
    backend = make_backend()
    ids = tokens(50, 3).numpy()
    whole = backend.prefill([greedy_chunk(0, ids)])
    split = backend.prefill(
        [
            greedy_chunk(1, ids[:20], last=False),
            greedy_chunk(2, ids[:33]),
            greedy_chunk(1, ids[20:], start=20),
        ]
    )
    assert split[0] == -1 and split[2] == whole[0]


@torch.inference_mode()
def test_softcapped_attention_is_the_fused_attention_when_the_cap_is_far() -> None:
    # transformers' Gemma 3 never applies attn_logit_softcapping, so it cannot be the reference:
    # the written-out path (scores, cap, mask, softmax) must equal torch's fused attention when
    # the cap changes nothing, and a near cap must change the result.
    ids = tokens(30, 5)
    uncapped = replace(GEMMA_CFG, attn_logit_softcapping=None)
    results = {}
    for name, cfg in {
        "fused": uncapped,
        "far": replace(GEMMA_CFG, attn_logit_softcapping=1e7),
        "near": GEMMA_CFG,
    }.items():
        model = make_model(cfg=cfg)
        cache = KVCache.allocate(cfg, 1, CONTEXT, torch.float32)
        results[name] = model.prefill(ids, 0, 0, cache, all_logits=True)
    torch.testing.assert_close(results["far"], results["fused"], atol=1e-4, rtol=0)
    assert (results["near"] - results["fused"]).abs().max() > 1e-2
    assert results["near"].abs().max() <= 30.0  # the final softcap bounds every logit


def test_config_of_each_family_says_what_differs() -> None:
    base = {
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 8,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
    }
    qwen2 = DecoderConfig.from_hf({**base, "model_type": "qwen2"})
    assert qwen2.attention_bias and not qwen2.o_bias and not qwen2.layer_types
    gemma4x = DecoderConfig.from_hf(  # transformers 4.x keys
        {**base, "model_type": "gemma3_text", "sliding_window": 512, "rope_theta": 1e6}
    )
    assert [gemma4x.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert (gemma4x.rope_theta, gemma4x.rope_local_theta) == (1e6, 10000.0)
    assert gemma4x.hidden_act == "gelu_pytorch_tanh" and gemma4x.arch.norm_offset == 1.0
    mistral = DecoderConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 16})
    assert all(mistral.is_sliding(i) for i in range(6)) and mistral.sliding_window == 16
    no_window = DecoderConfig.from_hf({**base, "model_type": "mistral", "sliding_window": None})
    assert not no_window.layer_types and no_window.sliding_window is None
    phi3 = DecoderConfig.from_hf({**base, "architectures": ["Phi3ForCausalLM"]})
    assert phi3.arch.fused and phi3.model_type == "phi3"
    with pytest.raises(ValueError, match="partial rotary embeddings"):
        DecoderConfig.from_hf({**base, "model_type": "phi3", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="unsupported architecture MixtralForCausalLM"):
        DecoderConfig.from_hf({**base, "architectures": ["MixtralForCausalLM"]})


def cfg_backend(cfg: DecoderConfig, kv_dtype: torch.dtype, native: bool) -> CpuBackend:
    loaded = LoadedModel(
        name="tiny",
        path=Path("."),
        config=cfg,
        model=make_model(cfg=cfg),
        tokenizer=ByteTokenizer(),
        dtype=torch.float32,
        max_context=CONTEXT,
    )
    backend = CpuBackend(
        loaded, num_slots=3, max_context=CONTEXT, kv_dtype=kv_dtype, native_attention=native
    )
    return reserving(backend)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CFG, GEMMA_CFG], ids=["llama", "gemma3"])
def test_native_paged_decode_matches_the_gathered_attention(
    kernel_cache: Path, cfg: DecoderConfig, kv_dtype: torch.dtype
) -> None:
    """The backend's decode through the native kernel (pages read in place) against the same
    pages gathered for torch's attention (the parity mode's path): the same logits within
    float32 rounding, rows of other lengths beside each other, past a sliding window and across
    pages; and the parity mode is what a float32 backend picks by itself."""
    from zerolayer.kernels import qmatmul

    assert qmatmul.build(kernel_cache) is None
    native, gathered = cfg_backend(cfg, kv_dtype, True), cfg_backend(cfg, kv_dtype, False)
    assert native.cache.native and not gathered.cache.native
    if kv_dtype == torch.float32:
        assert not CpuBackend(native_loaded(cfg), 1, CONTEXT).cache.native  # the parity mode
    else:
        assert CpuBackend(native_loaded(cfg), 1, CONTEXT, kv_dtype=kv_dtype).cache.native
    lengths = [5, 17, 30]
    for backend in (native, gathered):
        for slot, n in enumerate(lengths):
            backend.prefill([greedy_chunk(slot, tokens(n, 40 + slot).numpy())])
    for step in range(20):
        positions = [n + step for n in lengths]
        batch = decode_batch([0, 1, 2], [(7 * step + s) % 256 for s in range(3)], positions)
        for backend in (native, gathered):
            for slot, position in enumerate(positions):
                reserve(backend, slot, position, position + 1)
        a, b = native.decode_logits(batch), gathered.decode_logits(batch)
        # float32 sums in another order and the kernel's own exp (about 2 ulp), grown through
        # two layers of random weights: up to 1.1e-3 seen on the Gemma shape with bfloat16
        # pages (logits of size ~1), under 1e-4 on the others
        torch.testing.assert_close(a, b, atol=5e-3, rtol=1e-3)
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def native_loaded(cfg: DecoderConfig) -> LoadedModel:
    return LoadedModel(
        "tiny", Path("."), cfg, make_model(cfg=cfg), ByteTokenizer(), torch.float32, CONTEXT
    )
