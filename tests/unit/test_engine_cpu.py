"""The engine on the real CPU backend (built-in model): batch-independent seeded sampling,
greedy determinism, and slots freed by cancel and by client disconnect."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.kv import reserve
from zerolayer.config.settings import BUILTIN_MODEL, EngineConfig, ModelConfig
from zerolayer.engine.backends.cpu import create_cpu_backend
from zerolayer.engine.engine import NO_TOKEN, NOT_FINISHED, Engine, Sequence
from zerolayer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("builtin"))
    cfg = EngineConfig(  # float32 KV: the parity mode these tests compare against
        max_batch_size=32,
        max_context=256,
        prefill_chunk=64,
        max_step_tokens=256,
        kv_dtype="float32",
    )
    backend, tokenizer = create_cpu_backend(ModelConfig(path=BUILTIN_MODEL, data_dir=data_dir), cfg)
    return backend, tokenizer, data_dir


def run(backend, tokenizer, seqs: list[Sequence]) -> dict[object, list[int]]:
    engine = Engine(
        backend, tokenizer, lambda o: None, max_queue=64, max_step_tokens=256, prefill_chunk=64
    )
    for s in seqs:
        engine.submit(s)
    got: dict[object, list[int]] = {s.owner: [] for s in seqs}
    for _ in range(500):
        for owner, token, _text, _finish in engine.step().outputs():
            if token != NO_TOKEN:
                got[owner].append(token)
        if engine.running == 0 and engine.waiting == 0:
            break
    assert engine.slots_used == 0
    return got


def seq(owner, prompt: str, tokenizer, n=24, **sampling) -> Sequence:
    return Sequence(owner, tokenizer.encode_prompt(prompt), n, SamplingParams(**sampling))


def test_seeded_request_same_alone_and_among_31_others(cpu):
    backend, tokenizer, _ = cpu
    target = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = run(backend, tokenizer, [seq("t", "The same seeded request", tokenizer, **target)])
    rng = np.random.default_rng(0)
    others = [
        seq(
            i,
            f"other prompt {i} " * int(rng.integers(1, 6)),
            tokenizer,
            n=int(rng.integers(5, 40)),
            temperature=float(rng.uniform(0, 1.5)),
        )
        for i in range(31)
    ]
    crowd = run(
        backend,
        tokenizer,
        others[:15] + [seq("t", "The same seeded request", tokenizer, **target)] + others[15:],
    )
    assert alone["t"] == crowd["t"]
    assert len(alone["t"]) == 24 or alone["t"]  # stops at EOS at most early
    other_seed = run(
        backend,
        tokenizer,
        [seq("t", "The same seeded request", tokenizer, **{**target, "seed": 99})],
    )
    assert other_seed["t"] != alone["t"], "the seed must matter"


def test_greedy_is_deterministic_and_batch_independent(cpu):
    backend, tokenizer, _ = cpu
    alone = run(backend, tokenizer, [seq("g", "greedy prompt", tokenizer)])
    crowd = run(
        backend,
        tokenizer,
        [seq(i, f"noise {i}", tokenizer) for i in range(8)]
        + [seq("g", "greedy prompt", tokenizer)],
    )
    assert alone["g"] == crowd["g"]


def test_cancel_frees_the_slot_at_the_next_step(cpu):
    backend, tokenizer, _ = cpu
    engine = Engine(
        backend, tokenizer, lambda o: None, max_queue=8, max_step_tokens=256, prefill_chunk=64
    )
    s = seq("c", "cancel me", tokenizer, n=200)
    engine.submit(s)
    engine.step()
    engine.step()
    assert engine.slots_used == 1
    engine.cancel(s)
    finishes = [f for _, _, _, f in engine.step().outputs() if f != NOT_FINISHED]
    assert finishes == [3]
    assert engine.slots_used == 0


@pytest.fixture(scope="module")
def cpu_bf16(cpu):
    cfg = EngineConfig(max_batch_size=8, max_context=256, prefill_chunk=64, max_step_tokens=256)
    backend, tokenizer = create_cpu_backend(
        ModelConfig(path=BUILTIN_MODEL, data_dir=cpu[2], dtype="bfloat16"), cfg
    )
    return backend, tokenizer


def test_bfloat16_engine_matches_the_model_stepped_by_hand(cpu_bf16):
    import torch

    backend, tokenizer = cpu_bf16
    assert backend.cache.k.dtype == torch.bfloat16
    assert backend.cache.native  # decode attention read in place by the kernel
    prompt = tokenizer.encode_prompt("bfloat16 greedy prompt")
    got = run(backend, tokenizer, [Sequence("b", prompt, 12, SamplingParams())])["b"]
    # The same request through the kernels directly, one row, argmax of each step's logits.
    model, cache, slot = backend.model, backend.cache, 0
    want: list[int] = []
    with torch.inference_mode():
        reserve(backend, slot, 0, len(prompt))
        logits = model.prefill(torch.from_numpy(prompt.astype(np.int64)), 0, slot, cache)
        for position in range(len(prompt), len(prompt) + 12):
            token = int(torch.argmax(logits))
            if token in tokenizer.eos_token_ids:
                break
            want.append(token)
            reserve(backend, slot, position, position + 1)
            logits = model.decode(
                torch.tensor([token]), torch.tensor([position]), torch.tensor([slot]), cache
            )[0]
    backend.kv_pages.release(slot)
    assert got == want and len(got) > 0


def test_bfloat16_engine_serves_a_full_batch(cpu_bf16):
    backend, tokenizer = cpu_bf16
    seqs = [seq(i, f"bf16 request {i} " * (1 + i % 3), tokenizer, n=16) for i in range(8)]
    got = run(backend, tokenizer, seqs)  # asserts every slot is free again
    assert all(0 < len(ids) <= 16 for ids in got.values())
    assert sum(len(ids) == 16 for ids in got.values()) >= 1


THREAD_WARNING = "torch ops are slower with two OpenMP teams"


def test_backend_warns_once_when_run_on_another_thread_than_it_was_loaded_on(cpu, caplog):
    import threading

    backend, tokenizer, _ = cpu  # loaded on this (the main) thread
    with caplog.at_level("WARNING", logger="zerolayer.engine"):
        run(backend, tokenizer, [seq("here", "same thread", tokenizer, n=2)])
        assert THREAD_WARNING not in caplog.text
        worker = threading.Thread(
            target=run, args=(backend, tokenizer, [seq("there", "other thread", tokenizer, n=2)])
        )
        worker.start()
        worker.join()
        run(backend, tokenizer, [seq("again", "other thread", tokenizer, n=2)])
    assert caplog.text.count(THREAD_WARNING) == 1


def test_logprobs_and_bias_on_the_cpu_backend_match_the_model_stepped_by_hand(cpu):
    """A greedy row asking for logprobs beside a biased row and a free one: the logprobs are
    torch's log_softmax of the model's own logits at each step (no processing, T = 1), the
    top 5 in order; the biased row takes its biased token."""
    import torch

    backend, tokenizer, _ = cpu
    prompt = tokenizer.encode_prompt("logprobs on the real kernels")
    engine = Engine(
        backend, tokenizer, lambda o: None, max_queue=8, max_step_tokens=256, prefill_chunk=64
    )
    engine.submit(Sequence("lp", prompt, 6, SamplingParams(logprobs=True, top_logprobs=5)))
    engine.submit(Sequence("bias", prompt, 6, SamplingParams(logit_bias={77: 100.0})))
    engine.submit(Sequence("free", prompt, 6, SamplingParams(temperature=0.8)))
    ids: dict[str, list[int]] = {"lp": [], "bias": [], "free": []}
    lps = []
    for _ in range(100):
        step = engine.step()
        for i, owner in enumerate(step.owners):
            if int(step.tokens[i]) != NO_TOKEN:
                ids[owner].append(int(step.tokens[i]))
                if owner == "lp":
                    lps.append(step.logprobs[i])
            else:
                assert i not in step.logprobs
        assert all(step.owners[i] == "lp" for i in step.logprobs)
        if engine.idle:
            break
    assert ids["bias"] == [77] * 6
    model, cache, slot = backend.model, backend.cache, 0
    with torch.inference_mode():
        reserve(backend, slot, 0, len(prompt) + len(lps))
        logits = model.prefill(torch.from_numpy(prompt.astype(np.int64)), 0, slot, cache)
        for position, (token, got) in enumerate(zip(ids["lp"], lps, strict=True), len(prompt)):
            ref = torch.log_softmax(logits.float(), dim=-1)
            assert token == int(torch.argmax(ref))
            assert abs(got.token - float(ref[token])) < 1e-4
            top = torch.topk(ref, 5)
            assert got.top_ids.tolist() == top.indices.tolist()
            np.testing.assert_allclose(got.top, top.values.numpy(), atol=1e-4)
            logits = model.decode(
                torch.tensor([token]), torch.tensor([position]), torch.tensor([slot]), cache
            )[0]
    backend.kv_pages.release(slot)
    assert len(lps) == len(ids["lp"]) > 0


def test_kv_is_bfloat16_by_default_and_its_size_is_logged(cpu, caplog) -> None:
    import logging

    import torch

    caplog.set_level(logging.INFO, logger="zerolayer.engine")
    cfg = EngineConfig(max_batch_size=2, max_context=64)
    backend, tokenizer = create_cpu_backend(ModelConfig(path=BUILTIN_MODEL, data_dir=cpu[2]), cfg)
    assert backend.cache.k.dtype == torch.bfloat16 and backend.cache.v.dtype == torch.bfloat16
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool")]
    pool = backend.kv_pages
    assert pool.num_pages == 2 * 4  # auto: every slot's whole context (64 positions)
    per_position = backend.kv_page_bytes // 16
    assert len(lines) == 1 and lines[0].endswith(
        f": 8 pages of 16 positions (128 positions, {per_position:,} bytes a position; "
        "engine.kv_cache_bytes=auto)"
    )
    # The float32 parity mode's cache (the module's fixture) is twice the bytes a position.
    assert cpu[0].cache.k.dtype == torch.float32
    got = run(backend, tokenizer, [seq("kv", "hello", tokenizer, n=4)])
    assert 1 <= len(got["kv"]) <= 4  # served on the bfloat16 cache (EOS may end it early)


def test_the_auto_kv_budget_is_the_smaller_of_every_context_and_half_the_free_memory(tmp_path):
    from zerolayer.engine.backends.cpu import kv_budget, mem_available

    per_position, page = 1000, 16_000  # bytes a position, a page (16 positions)
    row = 128  # pages of a 2,048-position context
    # plenty of memory: every slot's whole context
    assert kv_budget(0, 4, 2048, per_position, 10**6, 10**12) == 4 * row
    # half of 20 MB minus 2 MB of weights = 8 MB: 500 pages
    assert kv_budget(0, 4, 2048, per_position, 2 * 10**6, 20 * 10**6) == 8 * 10**6 // page
    # too little memory still leaves one whole context; unknown memory: every context
    assert kv_budget(0, 4, 2048, per_position, 10**9, 10**6) == row
    assert kv_budget(0, 4, 2048, per_position, 0, None) == 4 * row
    # a setting is the budget, whatever memory says; below one page it is refused by name
    assert kv_budget(5 * page + 1, 4, 2048, per_position, 0, 10**3) == 5
    with pytest.raises(ValueError, match="engine.kv_cache_bytes"):
        kv_budget(page - 1, 4, 2048, per_position, 0, None)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert mem_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal: 100 kB\n")
    assert mem_available(meminfo) is None
