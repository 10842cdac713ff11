"""Our Llama kernels against transformers' LlamaForCausalLM on tiny random checkpoints.

Each case saves a random transformers model (safetensors) plus a tiny tokenizer.json into a
temporary directory, loads it through our loader, and compares logits (float32, atol 1e-4) for
full prefill, two-chunk prefill and batched decode with a second slot active, and 20-token greedy
generations against ``generate(do_sample=False)``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.engine.cpu_backend import CpuBackend
from gateway.engine.types import DecodeBatch, PrefillChunk, SamplingRow
from gateway.models import load_checkpoint
from kernels.decoder import KVCache

transformers = pytest.importorskip("transformers")

VOCAB = 300
ATOL = 1e-4
BASE = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
CASES = {
    "mha": {"num_key_value_heads": 4},
    "gqa": {"num_key_value_heads": 2, "rope_theta": 500000.0},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "llama3-rope": {
        "num_key_value_heads": 2,
        "head_dim": 32,  # head_dim * heads != hidden_size
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "linear-rope": {"num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 4}},
    "biases": {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True},
}


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(hash(request.param) % 1000)
    cfg = transformers.LlamaConfig(**BASE, **CASES[request.param])
    ref = transformers.LlamaForCausalLM(cfg).eval()
    # Default init leaves logits nearly flat; wider weights make greedy choices decisive, so
    # the token-for-token comparison tests the math rather than tie-breaking.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "proj.bias" in name:
                p.normal_(0.0, 0.1)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    directory = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    ours = load_checkpoint(directory, max_context=256)
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


@torch.inference_mode()
def test_greedy_generation_identical(pair) -> None:
    ref, ours = pair
    prompts = [_prompt(9, 4), _prompt(23, 5)]
    backend = CpuBackend(ours, num_slots=3, max_context=256)
    greedy = SamplingRow()
    first = backend.prefill(
        [
            PrefillChunk(
                slot=2 - i, tokens=p.numpy().astype(np.int32), start=0, last=True, sampling=greedy
            )
            for i, p in enumerate(prompts)
        ]
    )
    generated = [[int(t)] for t in first]
    positions = np.array([len(p) for p in prompts], np.int32)
    for _ in range(19):
        batch = DecodeBatch(
            slots=np.array([2, 1], np.int32),
            tokens=np.array([g[-1] for g in generated], np.int32),
            positions=positions,
            temperature=np.zeros(2, np.float32),
            top_p=np.ones(2, np.float32),
            top_k=np.zeros(2, np.int32),
            seeds=np.zeros(2, np.uint64),
            seeded=np.zeros(2, bool),
        )
        for g, t in zip(generated, backend.decode(batch), strict=True):
            g.append(int(t))
        positions = positions + 1
    for p, g in zip(prompts, generated, strict=True):
        expected = ref.generate(p[None], max_new_tokens=20, do_sample=False)[0, len(p) :]
        assert g == expected.tolist()
