"""Kernel and CPU-backend behaviour: tracing, slot isolation, slot reuse, prefixes, buckets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.engine.cpu_backend import CpuBackend
from gateway.engine.types import DecodeBatch, PrefillChunk, SamplingRow
from gateway.models.loader import LoadedModel
from gateway.tokenizer import ByteTokenizer
from kernels.llama import DecodeStep, KVCache, Llama, LlamaConfig, PrefillStep, attention_bucket

CFG = LlamaConfig(
    vocab_size=ByteTokenizer.BASE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
CONTEXT = 128


def make_model(dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG, CONTEXT, dtype=dtype).eval()
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
    return CpuBackend(loaded, num_slots=num_slots, max_context=CONTEXT, sampler_seed=sampler_seed)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def greedy_chunk(slot: int, ids: np.ndarray, start: int = 0, last: bool = True) -> PrefillChunk:
    return PrefillChunk(
        slot=slot, tokens=ids.astype(np.int32), start=start, last=last, sampling=SamplingRow()
    )


def decode_batch(slots: list[int], toks: list[int], positions: list[int], **kw) -> DecodeBatch:
    b = len(slots)
    return DecodeBatch(
        slots=np.array(slots, np.int32),
        tokens=np.array(toks, np.int32),
        positions=np.array(positions, np.int32),
        temperature=np.full(b, kw.get("temperature", 0.0), np.float32),
        top_p=np.ones(b, np.float32),
        top_k=np.zeros(b, np.int32),
        seeds=np.array(kw.get("seeds", [0] * b), np.uint64),
        seeded=np.array(kw.get("seeded", [False] * b), bool),
    )


def test_config_reads_both_rope_field_styles() -> None:
    base = {
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
    v4 = LlamaConfig.from_hf(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    v5 = LlamaConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    )
    old = LlamaConfig.from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert v4 == v5
    assert (v4.rope_type, v4.rope_theta, v4.rope_factor) == ("llama3", 500000.0, 8.0)
    assert (v4.num_key_value_heads, v4.head_dim) == (4, 16)
    assert (old.rope_type, old.rope_factor) == ("linear", 2.0)
    plain = LlamaConfig.from_hf(
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
@torch.inference_mode()
def test_decode_step_traces_and_matches_eager() -> None:
    model = make_model()
    cache = KVCache.allocate(CFG, 4, CONTEXT, torch.float32)
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
@torch.inference_mode()
def test_prefill_step_traces_and_matches_eager() -> None:
    model = make_model()
    cache = KVCache.allocate(CFG, 2, CONTEXT, torch.float32)
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
    got = backend.model.prefill(torch.from_numpy(short).long(), 0, 0, backend.cache)
    expected = fresh.model.prefill(torch.from_numpy(short).long(), 0, 0, fresh.cache)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    step = decode_batch([0], [65], [7])
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
    alone = backend.decode(decode_batch([2], [70], [11], seeded=[True], seeds=[99], **kw))
    for others in range(3):
        backend2 = make_backend(sampler_seed=None)
        for slot in range(4):
            backend2.prefill([greedy_chunk(slot, tokens(9 + slot, slot).numpy())])
        slots = [0, 1, 3][:others] + [2]
        batch = decode_batch(
            slots,
            [70] * len(slots),
            [9 + s for s in slots],
            seeded=[False] * others + [True],
            seeds=[0] * others + [99],
            **kw,
        )
        assert backend2.decode(batch)[-1] == alone[0]


def test_prefix_save_load_equals_reprefill() -> None:
    backend = make_backend()
    system = tokens(24, 5).numpy()
    user = tokens(9, 6).numpy()
    full = np.concatenate([system, user])
    expected = backend.prefill([greedy_chunk(0, full)])
    backend.prefill([greedy_chunk(1, system, last=False)])
    prefix = backend.save_prefix(1, len(system))
    assert (
        backend.prefix_nbytes(prefix)
        == 2 * CFG.num_hidden_layers * CFG.num_key_value_heads * 24 * CFG.head_dim * 4
    )
    backend.prefill([greedy_chunk(3, tokens(40, 7).numpy())])  # slot 3 holds something else
    backend.load_prefix(prefix, 3)
    got = backend.prefill([greedy_chunk(3, user, start=len(system))])
    assert got.tolist() == expected.tolist()
    torch.testing.assert_close(
        backend.cache.k[:, 3, :, :33], backend.cache.k[:, 0, :, :33], atol=1e-5, rtol=0
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
