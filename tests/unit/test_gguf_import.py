"""GGUF import on tiny files written at test time: conversion matches transformers' own GGUF
loader, the cache is reused and written atomically, and files it does not convert are refused
with a message naming what they hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.gguf_files import HEADS, llama_cpp_permute, write_gguf
from zerolayer.config.settings import ModelConfig
from zerolayer.kernels.qmatmul import QStack
from zerolayer.models import gguf_import
from zerolayer.models.decoder import KVCache
from zerolayer.models.gguf_errors import GGUFImportError
from zerolayer.models.gguf_import import ensure_converted, unpermute_rows
from zerolayer.models.loader import ModelLoadError, load_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = np.arange(HEADS * 16 * 3, dtype=np.float32).reshape(HEADS * 16, 3)
    permuted = llama_cpp_permute(w, HEADS)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, HEADS), w)


def test_converted_model_matches_transformers_gguf_loader(tiny, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path, source = tiny
    loaded = load_model(ModelConfig(path=str(path), data_dir=str(tmp_path), dtype="float32"), 256)
    assert loaded.name == "tiny"
    assert loaded.config.tie_word_embeddings and loaded.config.rope_theta == 50000.0
    assert loaded.config.num_key_value_heads == 2 and loaded.max_context == 256
    # Q4_1 is lossy, but close: the un-permuted q rows match the original layout.
    # q's rows stay the file's (mapped blocks); the outputs are put back in transformers' order.
    attn = loaded.model.layers[0].self_attn
    assert isinstance(attn.qkv_blocks, QStack) and attn.qkv_order is not None
    rows = attn.qkv_blocks.parts[0].dense(torch.float32)
    q = rows[attn.qkv_order[: rows.shape[0]]].numpy()
    assert np.abs(q - source["model.layers.0.self_attn.q_proj.weight"]).max() < 0.05
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = loaded.tokenizer.encode("the cat 123 sat <|im_start|> there")
    cache = KVCache.allocate(loaded.config, 1, 256, torch.float32)
    with torch.inference_mode():
        ours = loaded.model.prefill(torch.tensor(ids), 0, 0, cache, all_logits=True)
        theirs = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_special_tokens_and_template_come_from_the_file(tiny, tmp_path: Path) -> None:
    tok = load_tokenizer(ModelConfig(path=str(tiny[0]), data_dir=str(tmp_path)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (1, 2, False)
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4
    assert tok.decode(ids) == "hi"  # control tokens are special: skipped when decoding
    chat = tok.render_chat([{"role": "user", "content": "yo"}], None)
    assert chat == "<|im_start|>yo<|im_end|>"


def test_second_start_reuses_the_cache_and_leaves_no_temp_dirs(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = ensure_converted(tiny[0], str(tmp_path))
    assert sorted(p.name for p in first.iterdir()) == [
        "blocks.safetensors",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "source.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]

    def must_not_run(path: Path, directory: Path) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_import, "convert", must_not_run)
    assert ensure_converted(tiny[0], str(tmp_path)) == first
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [first.name]


def test_the_conversions_daemons_served_from_are_removed_and_nothing_else(
    tiny, tmp_path: Path
) -> None:
    gguf_dir = gguf_import.cache_dir_for(tiny[0], str(tmp_path)).parent
    served = [f"tiny-0123456789abcdef-v{v}" for v in range(1, gguf_import.LAST_SERVED_VERSION + 1)]
    kept = [
        f"tiny-0123456789abcdef-v{gguf_import.CONVERTER_VERSION}",  # a tool's
        "tiny-0123456789abcdef-d1",  # a GGUF's description, which daemons read
        "notes-v2",  # not a conversion's name
    ]
    for name in served + kept:
        (gguf_dir / name).mkdir(parents=True)
        (gguf_dir / name / "model.safetensors").write_bytes(b"old")
    (gguf_dir / "link-0123456789abcdef-v4").symlink_to(gguf_dir / kept[0])  # not followed
    removed = gguf_import.remove_served(str(tmp_path))
    assert sorted(p.name for p in removed) == served
    assert sorted(p.name for p in gguf_dir.iterdir()) == sorted([*kept, "link-0123456789abcdef-v4"])
    assert gguf_import.remove_served(str(tmp_path / "none")) == []


def test_an_earlier_converter_versions_directory_is_removed(tiny, tmp_path: Path) -> None:
    current = gguf_import.cache_dir_for(tiny[0], str(tmp_path))
    keyed = current.name.rsplit("-v", 1)[0]
    stale = current.with_name(f"{keyed}-v{gguf_import.CONVERTER_VERSION - 1}")
    other_file = current.with_name(f"other-0123456789abcdef-v{gguf_import.CONVERTER_VERSION - 1}")
    for d in (stale, other_file):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"old")
    assert ensure_converted(tiny[0], str(tmp_path)) == current
    left = sorted(p.name for p in current.parent.iterdir())
    assert left == sorted([current.name, other_file.name])  # another file's cache stays


def test_failed_conversion_leaves_nothing_behind(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object) -> None:
        raise GGUFImportError("a tensor could not be read")

    monkeypatch.setattr(gguf_import, "read_tensors", fail)
    path = tiny[0]
    with pytest.raises(GGUFImportError):
        ensure_converted(path, str(tmp_path / "cache"))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"arch": "falcon"},
            "unsupported architecture 'falcon'; supported: llama, qwen2, qwen3, gemma3, phi3",
        ),
        ({"tokenizer_model": "bert"}, "unsupported tokenizer model 'bert'"),
        ({"pre": "deepseek-coder"}, "unsupported pre-tokenizer 'deepseek-coder'"),
        ({"matrix_type": "I8"}, "unsupported tensor type I8 (e.g. blk.0.attn_q.weight)"),
        ({"extra_tensor": "rope_factors_long.weight"}, "holds rope_factors_long.weight"),
        (
            {"extra_tensor": "blk.0.attn_q_norm.weight"},
            "unexpected tensor 'blk.0.attn_q_norm.weight' for the llama architecture",
        ),
    ],
)
def test_unsupported_files_are_refused_with_what_they_hold(
    tmp_path: Path, options: dict, message: str
) -> None:
    path = tmp_path / "bad.gguf"
    write_gguf(path, **options)
    with pytest.raises(ModelLoadError, match="bad.gguf") as info:
        load_model(ModelConfig(path=str(path), data_dir=str(tmp_path)), 64)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"arch": "falcon"}, "unsupported architecture 'falcon'"),
        ({"matrix_type": "I8"}, "unsupported tensor type I8"),
        ({"tokenizer_model": "bert"}, "unsupported tokenizer model 'bert'"),
    ],
)
def test_refused_from_the_header_before_any_tensor_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict, message: str
) -> None:
    import gguf

    path = tmp_path / "bad.gguf"
    write_gguf(path, **options)

    def must_not_run(*args: object) -> None:
        raise AssertionError("tensor data or the whole file was read before refusing")

    # Dequantizing a tensor and hashing the file (the cache key) are what takes long.
    monkeypatch.setattr(gguf.quants, "dequantize", must_not_run)
    monkeypatch.setattr(gguf_import, "file_digest", must_not_run)
    # gguf's reader builds a view per vocabulary entry (seconds on a 262k vocabulary): the
    # header check reads the header itself.
    monkeypatch.setattr(gguf, "GGUFReader", must_not_run)
    with pytest.raises(GGUFImportError, match=message) as info:
        ensure_converted(path, str(tmp_path))
    assert "supported:" in str(info.value) or "dequantizes" in str(info.value)
    assert not (tmp_path / "gguf").exists()


def test_missing_or_broken_files_are_clear_errors(tmp_path: Path) -> None:
    cfg = ModelConfig(path=str(tmp_path / "none.gguf"), data_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="none.gguf does not exist"):
        load_model(cfg, 64)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all, just text" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf is not a readable GGUF file"):
        load_model(ModelConfig(path=str(junk), data_dir=str(tmp_path)), 64)


def test_a_gguf_without_the_suffix_is_found_by_its_magic(tiny, tmp_path: Path) -> None:
    blob = tmp_path / "sha256-0123abcd"  # how Ollama names a model blob
    blob.symlink_to(tiny[0])
    loaded = load_model(ModelConfig(path=str(blob), data_dir=str(tmp_path)), 64)
    assert loaded.config.hidden_size == 64 and loaded.name == "sha256-0123abcd"
    other = tmp_path / "weights.bin"
    other.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelLoadError, match="weights.bin is a file but not a GGUF file"):
        load_model(ModelConfig(path=str(other), data_dir=str(tmp_path)), 64)


def test_named_models_and_empty_path(tmp_path: Path) -> None:
    named = "unknown named model .@nope.*@smollm2, @gemma3-270m, @builtin"
    with pytest.raises(ModelLoadError, match=named):
        load_model(ModelConfig(path="@nope", data_dir=str(tmp_path)), 64)
    with pytest.raises(ModelLoadError, match="model.path is empty"):
        load_model(ModelConfig(path="", data_dir=str(tmp_path)), 64)


def test_read_header_agrees_with_the_gguf_packages_reader(tiny, monkeypatch) -> None:
    import gguf

    monkeypatch.setattr(gguf_import, "SMALL_ARRAY", 8)  # the merges list is kept, tokens skipped
    header = gguf_import.read_header(tiny[0])
    reader = gguf.GGUFReader(str(tiny[0]))
    assert header.tensors == [(t.name, t.tensor_type.name) for t in reader.tensors]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ours, theirs = header.get(key), field.contents()
        if isinstance(ours, gguf_import.ArrayInfo):
            assert len(ours) == len(theirs) > 8, key
        elif isinstance(theirs, float):
            assert ours == pytest.approx(theirs), key
        else:
            assert ours == theirs, key
    junk = tiny[0].with_name("short.gguf")
    junk.write_bytes(tiny[0].read_bytes()[:200])  # cut off inside the metadata
    with pytest.raises(GGUFImportError, match="short.gguf is not a readable GGUF file"):
        gguf_import.read_header(junk)
