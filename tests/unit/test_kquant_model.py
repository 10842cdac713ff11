"""A Q4_K_M-style GGUF end to end: a tiny random Llama written with the gguf package's writer,
its matrices Q4_K with Q6_K v_proj, embedding/head and first-layer down_proj (the reference
quantizer's blocks), and a Q5_0 matrix the block kernel does not compute on. Served through
the engine on the block kernel (q/k/v a mixed-kind stack), it gives transformers' greedy ids
on the file's dequantized weights in float32; the Q5_0 matrices load dense, said in one log
line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.support.arch_models import VOCAB, q4_k_m, reference_model, write_gguf
from tests.support.engine_run import run_engine
from zerolayer.config.settings import ModelConfig
from zerolayer.engine.backends.cpu import CpuBackend
from zerolayer.engine.engine import Sequence
from zerolayer.kernels.qmatmul import QStack, QWeight
from zerolayer.models.decoder import KVCache
from zerolayer.models.loader import load_model
from zerolayer.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

NAME = "llama-kquant"
NEW_TOKENS = 12
DENSE_LINE = "of the GGUF's matrices load as dense weights only"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("kquant")
    ref = reference_model(NAME, seed=26)
    path = directory / "tiny-q4_k_m.gguf"
    stored = write_gguf(ref, NAME, path, q4_k_m)
    ref.load_state_dict(stored, strict=True)  # the reference on the file's own weights
    cfg = ModelConfig(path=str(path), data_dir=str(directory / "cache"))
    return ref, cfg


@pytest.fixture(scope="module")
def ours(loaded):
    return load_model(loaded[1], 256, "float32")


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_layers_run_on_their_blocks_mixed_kinds_in_one_stack(ours) -> None:
    model = ours.model
    assert model.blocks_max_rows > 2**31  # mapped blocks only: every forward runs on them
    for i, layer in enumerate(model.layers):
        qkv = layer.self_attn.qkv_blocks
        assert isinstance(qkv, QStack), i  # Q4_K q, k beside Q6_K v: one call, not dense
        assert [p.kind for p in qkv.parts] == ["Q4_K", "Q4_K", "Q6_K"]
        gate_up, down = layer.mlp.gate_up_blocks, layer.mlp.down_blocks
        assert isinstance(gate_up, QStack)  # views of the file's blocks, never concatenated
        assert [p.kind for p in gate_up.parts] == ["Q4_K", "Q4_K"]
        assert isinstance(down, QWeight) and down.kind == ("Q6_K" if i == 0 else "Q4_K")
        o = layer.self_attn.o_blocks  # Q5_0 after the first layer: no kernel, dense
        assert (o is not None and o.kind == "Q4_K") if i == 0 else o is None
    assert isinstance(model.head_blocks, QWeight) and model.head_blocks.kind == "Q6_K"


def test_types_without_a_kernel_load_dense_in_one_log_line(loaded, caplog) -> None:
    caplog.set_level(logging.INFO)
    load_model(loaded[1], 256, "float32")  # converted by the fixture: this is a plain load
    lines = [r.getMessage() for r in caplog.records if DENSE_LINE in r.getMessage()]
    assert lines == [
        f"2 {DENSE_LINE} (types without a block kernel): "
        "2 Q5_0 (e.g. model.layers.1.self_attn.o_proj.weight)"
    ]


@torch.inference_mode()
def test_block_decode_matches_transformers(loaded, ours) -> None:
    ref = loaded[0]
    a, b = _prompt(11, 2), _prompt(29, 3)
    cache = KVCache.allocate(ours.config, 4, ours.max_context, torch.float32)
    ours.model.prefill(a, 0, 3, cache)
    ours.model.prefill(b, 0, 1, cache)
    seqs = [a, b]
    for step in range(4):
        feed = torch.tensor([_prompt(1, 100 + step)[0], _prompt(1, 200 + step)[0]])
        positions = torch.tensor([len(seqs[0]), len(seqs[1])])
        logits = ours.model.decode(feed, positions, torch.tensor([3, 1]), cache)
        seqs = [torch.cat([s, feed[i : i + 1]]) for i, s in enumerate(seqs)]
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref(s[None]).logits[0, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("streams", [1, 4])
@torch.inference_mode()
def test_greedy_ids_through_the_engine_identical(loaded, ours, streams: int) -> None:
    ref = loaded[0]
    prompts = [_prompt(n, 10 + n) for n in (9, 23, 5, 17)[:streams]]
    backend = CpuBackend(ours, num_slots=4, max_context=256)
    seqs = [
        Sequence(i, p.numpy().astype(np.int32), NEW_TOKENS, SamplingParams(), ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    got = run_engine(backend, ours.tokenizer, seqs)  # steps of at most 64 tokens: all blocks
    for i, p in enumerate(prompts):
        expected = ref.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :]
        assert got[i][:-1] == expected.tolist(), f"stream {i}"
        assert got[i][-1][0] == "end"
