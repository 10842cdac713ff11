"""A GGUF file served mapped: its header's tensor table is gguf's, its matrices are views of the
map (no dense copy, no converted directory), the embedding and long prompts computed from the
blocks agree with the dense checkpoint, and Llama 3.1's rope factors are read."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.datadirs import share_kernels
from tests.support.gguf_files import HEAD_DIM, write_gguf
from zerolayer.config.settings import ModelConfig
from zerolayer.kernels import qmatmul
from zerolayer.models.decoder import KVCache, rope_inv_freq
from zerolayer.models.gguf_file import GGUFFile, tensor_nbytes
from zerolayer.models.gguf_import import ensure_converted
from zerolayer.models.loader import load_checkpoint, load_model


@pytest.fixture
def data_dir(tmp_path: Path, kernel_cache: Path) -> Path:
    return share_kernels(tmp_path, kernel_cache)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)  # Q4_1 matrices, a Q8_0 embedding
    return path


def test_tensor_table_is_the_gguf_readers(tiny: Path) -> None:
    import gguf

    ours = GGUFFile.open(tiny)
    reader = gguf.GGUFReader(str(tiny))
    assert [t.name for t in reader.tensors] == list(ours.header.layout)
    for t in reader.tensors:
        info = ours.info(t.name)
        assert info.kind == t.tensor_type.name
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        assert info.offset == t.data_offset
        assert tensor_nbytes(info) == t.n_bytes
        assert np.array_equal(
            ours.raw(t.name).numpy(), np.asarray(t.data).reshape(-1).view(np.uint8)
        )


def test_matrices_are_views_of_the_map_and_nothing_is_converted(tiny: Path, data_dir: Path) -> None:
    loaded = load_model(ModelConfig(path=str(tiny), data_dir=str(data_dir)), 256)
    model = loaded.model
    # The data directory holds the small description only: no weights written anywhere.
    written = sorted(p.name for p in (data_dir / "gguf").rglob("*") if p.is_file())
    assert not [n for n in written if n.endswith(".safetensors")]
    assert "tokenizer.json" in written and "config.json" in written
    mapped = GGUFFile.open(tiny).data  # another map of the same file: compare by contents
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_blocks, qmatmul.QStack)  # q|k|v: views, not concatenated
    size = mapped.numel()
    for part in attn.qkv_blocks.parts:
        assert part.blocks.untyped_storage().nbytes() == size  # the whole file's map
    assert model.embed_blocks is not None
    assert model.embed_blocks.blocks.untyped_storage().nbytes() == size
    assert attn.q_proj.weight.is_meta and model.embed_tokens.weight.is_meta  # no dense twin


def test_mapped_model_matches_the_dense_checkpoint(tiny: Path, data_dir: Path) -> None:
    """Decode-sized forwards bit for bit (the same block products; q/k outputs reordered instead
    of rows), a long prompt (dequantized tiles) and the embedding within float32 rounding."""
    mapped = load_model(ModelConfig(path=str(tiny), data_dir=str(data_dir), dtype="float32"), 256)
    converted = ensure_converted(tiny, str(data_dir))
    dense = load_checkpoint(converted, 256, kernel_cache=data_dir / "kernels")
    ids = torch.arange(3, 3 + 100) % mapped.config.vocab_size
    with torch.inference_mode():
        for n in (1, 7, 100):  # 100 > qmatmul.MAX_ROWS: the tiled path
            a = mapped.model.prefill(
                ids[:n], 0, 0, KVCache.allocate(mapped.config, 1, 256, torch.float32), True
            )
            b = dense.model.prefill(
                ids[:n], 0, 0, KVCache.allocate(dense.config, 1, 256, torch.float32), True
            )
            if n <= qmatmul.MAX_ROWS[torch.float32]:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        emb = mapped.model.embed_blocks
        assert emb is not None
        assert torch.equal(emb.rows(ids[:5], torch.float32), dense.model.embed_tokens(ids[:5]))


def test_tiled_product_equals_the_dense_weights(tiny: Path, kernel_cache: Path) -> None:
    f = GGUFFile.open(tiny)
    w = qmatmul.QWeight(f.blocks("blk.0.ffn_up.weight"), f.info("blk.0.ffn_up.weight").kind)
    x = torch.randn(80, w.in_features)
    ref = x @ w.dense(torch.float32).T
    torch.testing.assert_close(qmatmul.tiled(x, (w,)), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w(x), ref, rtol=1e-5, atol=1e-5)  # 80 rows: tiled


def test_llama31_rope_factors_are_read_and_divide_the_frequencies(data_dir: Path) -> None:
    path = data_dir / "l31.gguf"
    write_gguf(path, extra_tensor="rope_freqs.weight")  # ones: the frequencies unchanged
    loaded = load_model(ModelConfig(path=str(path), data_dir=str(data_dir)), 64)
    assert loaded.config.rope_freq_factors == (1.0,) * (HEAD_DIM // 2)
    plain = replace(loaded.config, rope_freq_factors=None)
    assert torch.equal(rope_inv_freq(loaded.config), rope_inv_freq(plain))
    twice = replace(loaded.config, rope_freq_factors=(2.0,) * (HEAD_DIM // 2))
    assert torch.equal(rope_inv_freq(twice), rope_inv_freq(plain) / 2)
