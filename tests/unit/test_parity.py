"""Our decoder against transformers on tiny random models of every supported family
(tests/support/arch_models.py: Llama variants, Mistral with a sliding window, Qwen2, Qwen3,
Gemma 3 with and without softcaps, Phi-3).

Each case is loaded from a saved checkpoint, and — for the families with a GGUF form — from a
GGUF file written by the gguf package, in float32 and in Q8_0. The reference is transformers in
float32 on exactly the weights each source holds. Compared: logits (atol 1e-4) of a whole and
a two-chunk prefill and of batched decode steps with another slot active; and greedy ids
through the real engine and CPU backend, one stream alone and four streams at once, against
``generate(do_sample=False)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.arch_models import CASES, VOCAB, reference_model, write_checkpoint, write_gguf
from tests.support.engine_run import run_engine
from zerolayer.config.settings import ModelConfig
from zerolayer.engine.backends.cpu import CpuBackend
from zerolayer.engine.engine import Sequence
from zerolayer.models.decoder import KVCache
from zerolayer.models.loader import load_checkpoint, load_model
from zerolayer.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 12
SOURCES = [(name, "checkpoint") for name in CASES] + [
    (name, kind) for name, case in CASES.items() if case.gguf_arch for kind in ("F32", "Q8_0")
]


@pytest.fixture(scope="module", params=SOURCES, ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name, kind = request.param
    ref = reference_model(name, seed=sum(map(ord, name)) % 1000)
    directory = tmp_path_factory.mktemp(f"{name}-{kind}")
    if kind == "checkpoint":
        write_checkpoint(ref, directory)
        ours = load_checkpoint(directory, max_context=256)
    else:
        path = directory / f"{name}.gguf"
        stored = write_gguf(ref, name, path, kind)
        ref.load_state_dict(stored, strict=True)  # the reference on the file's own weights
        cfg = ModelConfig(path=str(path), data_dir=str(directory / "cache"))
        ours = load_model(cfg, 256, "float32")
        if kind != "F32":  # small forwards compute on the file's blocks (make test builds them)
            assert ours.model.blocks_max_rows > 0
            assert ours.model.layers[0].self_attn.qkv_blocks is not None
    assert ours.config.model_type == ref.config.model_type
    return ref, ours


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_prefill_logits_match(pair) -> None:
    ref, ours = pair
    ids = _prompt(37, 1)
    expected = ref(ids[None]).logits[0]
    cache = KVCache.allocate(ours.config, 2, ours.max_context, torch.float32)
    whole = ours.model.prefill(ids, 0, 0, cache, all_logits=True)
    torch.testing.assert_close(whole, expected, atol=ATOL, rtol=0)
    # The same prompt in two chunks, in the other slot.
    first = ours.model.prefill(ids[:20], 0, 1, cache, all_logits=True)
    second = ours.model.prefill(ids[20:], 20, 1, cache, all_logits=True)
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=ATOL, rtol=0)
    last = ours.model.prefill(ids[:20], 0, 1, cache)
    torch.testing.assert_close(last, expected[19], atol=ATOL, rtol=0)


@torch.inference_mode()
def test_batched_decode_matches(pair) -> None:
    ref, ours = pair
    a, b = _prompt(11, 2), _prompt(29, 3)
    cache = KVCache.allocate(ours.config, 4, ours.max_context, torch.float32)
    ours.model.prefill(a, 0, 3, cache)
    ours.model.prefill(b, 0, 1, cache)
    seqs = [a, b]
    for step in range(5):
        feed = torch.tensor([_prompt(1, 100 + step)[0], _prompt(1, 200 + step)[0]])
        positions = torch.tensor([len(seqs[0]), len(seqs[1])])
        logits = ours.model.decode(feed, positions, torch.tensor([3, 1]), cache)
        seqs = [torch.cat([s, feed[i : i + 1]]) for i, s in enumerate(seqs)]
        for i, s in enumerate(seqs):
            expected = ref(s[None]).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("streams", [1, 4])
@torch.inference_mode()
def test_greedy_ids_through_the_engine_identical(pair, streams: int) -> None:
    ref, ours = pair
    prompts = [_prompt(n, 10 + n) for n in (9, 23, 5, 17)[:streams]]
    backend = CpuBackend(ours, num_slots=4, max_context=256)
    seqs = [
        Sequence(i, p.numpy().astype(np.int32), NEW_TOKENS, SamplingParams(), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    got = run_engine(backend, ours.tokenizer, seqs)
    for i, p in enumerate(prompts):
        expected = ref.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :]
        assert got[i][:-1] == expected.tolist(), f"stream {i}"
        assert got[i][-1][0] == "end"


def test_cases_cover_every_architecture() -> None:
    from zerolayer.models.architectures import ARCHITECTURES

    covered = {getattr(transformers, c.config_class).model_type for c in CASES.values()}
    assert covered == set(ARCHITECTURES)
    assert {c.gguf_arch for c in CASES.values() if c.gguf_arch} == {
        a.gguf_arch for a in ARCHITECTURES.values() if a.gguf_arch
    }


def test_a_phi3_checkpoint_is_split_into_separate_matrices(tmp_path: Path) -> None:
    ref = reference_model("phi3")
    write_checkpoint(ref, tmp_path)
    ours = load_checkpoint(tmp_path, max_context=64)
    qkv = ref.model.layers[0].self_attn.qkv_proj.weight
    attn = ours.model.layers[0].self_attn
    stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(stacked, qkv)
