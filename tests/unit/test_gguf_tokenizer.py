"""GGUF tokenizers (zerolayer.models.gguf_tokenizer) on real and built vocabularies, written as
GGUF files at test time: ids and text checked against llama.cpp's tokenization (the plain-Python
reference in tests/support/llama_cpp_vocab.py) and against transformers' tokenizer for the same
file, where transformers follows the same definition (the module docstring lists where not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import llama_cpp_vocab as ref
from zerolayer.models.gguf_errors import GGUFImportError
from zerolayer.models.gguf_import import _Fields, _open
from zerolayer.models.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer, check_tokenizer
from zerolayer.models.hf_tokenizer import HFTokenizer

# Shared by every vocabulary: digits, whitespace runs, newlines and tabs, leading spaces, CJK,
# emoji, accents, contractions, punctuation.
TRICKY = [
    "Hello world",
    "The year 2024 had 366 days; 1234567890 and 3.14159 and 1,000,000",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "line\nbreaks\n\n\nand\r\nCRLF\n",
    "def f(x):\n    if x:\n\t\treturn 1\n",
    "中文字符测试，标点。日本語のテキスト",
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧 ☃",
    "café naïve Ünïcödé façade ÉCOLEécole",
    "e\u0301 combining accent",
    "don't you'll WE'RE it's I'M",
    "a" * 40,
    "!!!???... x=1+2*3/4 -> y <= z",
    "zero\u200bwidth",
    "",
]
LEADING = ["  two leading spaces", " one", "\nnewline first", "   "]


def fields_of(path: Path) -> _Fields:
    return _Fields(_open(path), path)


class MemoryFields:
    """GGUF metadata held in a dict (as a file's would read), to vary one key without writing
    and re-reading a large vocabulary."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.values:
            raise GGUFImportError(f"metadata key {key!r} is missing")
        return self.values[key]


def build(path: Path) -> tuple[Any, dict[str, Any]]:
    return build_tokenizer(fields_of(path), path)


def encode(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def transformers_tokenizer(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- byte-level BPE: SmolLM2's real vocabulary under each family's pre-tokenizer ------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Path, ref.Vocab]:
    from zerolayer.models.bundled import BundledModelError, smollm2_gguf

    try:
        path = smollm2_gguf()
    except BundledModelError as exc:
        pytest.skip(str(exc))
    f = fields_of(path)
    vocab = ref.Vocab(
        tokens=list(f.require("tokenizer.ggml.tokens")),
        types=list(f.require("tokenizer.ggml.token_type")),
        merges=list(f.require("tokenizer.ggml.merges")),
    )
    return path, vocab


def smollm2_as(tmp: Path, vocab: ref.Vocab, pre: str, size: int = 8000, **keys: Any) -> Path:
    """SmolLM2's first ``size`` tokens and the merges among them (the file keeps them in merge
    order, so these are a complete smaller vocabulary) in a GGUF naming pre-tokenizer ``pre``.
    Smaller, so that transformers reads it in a few seconds."""
    tokens = vocab.tokens[:size]
    kept = set(tokens)
    merges = [
        m for m in vocab.merges if set(m.split(" ", 1)) <= kept and m.replace(" ", "") in kept
    ]
    vocab = ref.Vocab(tokens, vocab.types[:size], merges=merges)
    return ref.write_vocab_gguf(
        tmp / f"{pre}.gguf", vocab, model="gpt2", pre=pre, bos_token_id=1, eos_token_id=2, **keys
    )


def smollm2_in_memory(vocab: ref.Vocab, pre: str) -> tuple[Any, dict[str, Any]]:
    fields = MemoryFields(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": vocab.tokens,
            "tokenizer.ggml.token_type": vocab.types,
            "tokenizer.ggml.merges": vocab.merges,
        }
    )
    return build_tokenizer(fields, Path(f"{pre}.gguf"))


# Text with SmolLM2's control tokens in it.
SMOLLM2_SPECIAL = [
    "<|im_start|>user\nhi 12<|im_end|>\n<|endoftext|>",
    "<|im_start|><|im_start|> <|im_end|>",
    "a<|endoftext|>b",
]


# Each pre-tokenizer family of issue #26: expressions, ignore_merges.
FAMILIES = ["smollm", "llama-bpe", "qwen2", "tekken", "gpt-2", "default", "starcoder", "dbrx"]


@pytest.mark.parametrize("pre", FAMILIES)
def test_byte_level_ids_and_text_follow_llama_cpp(smollm2, tmp_path: Path, pre: str) -> None:
    _, vocab = smollm2
    tok, _ = smollm2_in_memory(vocab, pre)
    spec = PRE_TOKENIZERS[pre]
    # "a\n\n2": whitespace before a digit, where transformers' smollm differs (docs/models.md).
    for text in TRICKY + LEADING + SMOLLM2_SPECIAL + ["a\n\n2  3"]:
        ids = encode(tok, text)
        assert ids == ref.bpe_tokenize(vocab, text, spec.splits, spec.ignore_merges), text
        assert decode(tok, ids) == ref.detokenize(vocab, ids, byte_level=True), text
        if "<|" not in text:
            assert decode(tok, ids) == text  # byte-level BPE loses nothing


def test_pre_tokenizers_split_differently(smollm2, tmp_path: Path) -> None:
    """The families are not one expression under several names: each splits digits (one at a
    time, up to three, or whole runs) and letters after punctuation its own way."""
    _, vocab = smollm2
    text = " 1234567 x'Hello"
    seen = {}
    for pre in ("smollm", "llama-bpe", "qwen2", "gpt-2"):
        tok, _ = smollm2_in_memory(vocab, pre)
        pieces = tok.pre_tokenizer.pre_tokenize_str(text)
        seen[pre] = [p for p, _ in pieces]
    assert seen["smollm"][:4] == ["Ġ", "1", "2", "3"]
    assert seen["llama-bpe"][:3] == ["Ġ", "123", "456"]
    assert seen["qwen2"][:3] == ["Ġ", "1", "2"]
    assert seen["gpt-2"][0] == "Ġ1234567"


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "tekken"])
def test_byte_level_matches_transformers(smollm2, tmp_path: Path, pre: str) -> None:
    _, vocab = smollm2
    # SmolLM2's merges never join digits, so transformers' missing smollm digit split does not
    # show on this vocabulary (test_smollm_splits_every_digit... shows it).
    gguf_path = smollm2_as(tmp_path, vocab, pre)
    tok, _ = build(gguf_path)
    theirs = transformers_tokenizer(gguf_path)
    for text in TRICKY + LEADING + SMOLLM2_SPECIAL:
        ids = encode(tok, text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert decode(tok, ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_smollm_splits_every_digit_even_where_merges_would_join_them(tmp_path: Path) -> None:
    """llama.cpp's smollm/starcoder/refact/codeshell split digits before GPT-2's expression;
    transformers' GGUF conversion does not. With merges that join digits the ids differ."""
    alphabet = sorted(ref.gpt2_byte_chars().values())
    vocab = ref.Vocab(
        tokens=["<|endoftext|>", *alphabet, "12", "123", "Ġ1"],
        types=[ref.CONTROL] + [ref.NORMAL] * (len(alphabet) + 3),
        merges=["Ġ 1", "1 2", "12 3"],
    )
    ids = vocab.ids
    for pre, expected in (
        ("smollm", [ids["Ġ"], ids["1"], ids["2"], ids["3"]]),
        ("gpt-2", [ids["Ġ1"], ids["2"], ids["3"]]),
        ("llama-bpe", [ids["Ġ"], ids["123"]]),
    ):
        tok, _ = build(ref.write_vocab_gguf(tmp_path / f"{pre}.gguf", vocab, model="gpt2", pre=pre))
        spec = PRE_TOKENIZERS[pre]
        assert encode(tok, " 123") == expected, pre
        assert expected == ref.bpe_tokenize(vocab, " 123", spec.splits, spec.ignore_merges)


def test_ignore_merges_takes_a_whole_word_token(tmp_path: Path) -> None:
    """Llama 3 and Tekken (ignore_merges): a piece that is a token is that token, even when no
    merges reach it; other pre-tokenizers merge."""
    alphabet = sorted(ref.gpt2_byte_chars().values())
    vocab = ref.Vocab(
        tokens=[*alphabet, "ab", "abc"],
        types=[ref.NORMAL] * (len(alphabet) + 2),
        merges=["a b"],
    )
    for pre, expected in (("llama-bpe", ["abc"]), ("tekken", ["abc"]), ("qwen2", ["ab", "c"])):
        tok, _ = build(ref.write_vocab_gguf(tmp_path / f"{pre}.gguf", vocab, model="gpt2", pre=pre))
        assert encode(tok, "abc") == [vocab.ids[t] for t in expected], pre


# --- SentencePiece: a vocabulary trained at test time, and Gemma 3's real one ---------------

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "The year 2024 had 366 days and 12 months.",
    "café au lait, naïve façade, Ünïcödé",
    "def f(x):\n    return x + 1",
    "don't you'll we're it's",
    "hello world, hello there",
]
SPM_SPECIAL = [("<unk>", ref.UNKNOWN), ("<s>", ref.CONTROL), ("</s>", ref.CONTROL)]
SPM_SPECIAL += [("<|user|>", ref.CONTROL), ("<think>", ref.USER_DEFINED)]


def trained_spm_vocab() -> ref.Vocab:
    """A SentencePiece-style vocabulary: unknown and control tokens, a user-defined one, the 256
    byte tokens, then BPE pieces trained on CORPUS, scored best-first (as SentencePiece does)."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(CORPUS * 3, vocab_size=300, min_frequency=1, show_progress=False)
    pieces = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    pieces = [p for p in pieces if p not in ("<unk>",)]
    tokens = [t for t, _ in SPM_SPECIAL] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [k for _, k in SPM_SPECIAL] + [ref.BYTE] * 256 + [ref.NORMAL] * len(pieces)
    scores = [0.0] * (len(SPM_SPECIAL) + 256) + [-float(i) for i in range(len(pieces))]
    return ref.Vocab(tokens=tokens, types=types, scores=scores)


SPM_TEXT = [
    "<s>hello world</s>",
    "<|user|> the fox<think>jumps</think>",
    "unknown ☃ and 丽 fall back to bytes",
    "<|user|><|user|>",
]


@pytest.fixture(scope="module")
def spm_vocab() -> ref.Vocab:
    return trained_spm_vocab()


@pytest.mark.parametrize("prefix", [True, False])
def test_sentencepiece_ids_and_text_follow_llama_cpp(
    spm_vocab: ref.Vocab, tmp_path: Path, prefix: bool
) -> None:
    path = ref.write_vocab_gguf(
        tmp_path / "spm.gguf", spm_vocab, model="llama", add_space_prefix=prefix
    )
    tok, cfg = build(path)
    for text in TRICKY + LEADING + SPM_TEXT:
        ids = encode(tok, text)
        assert ids == ref.spm_tokenize(spm_vocab, text, prefix), text
        assert decode(tok, ids) == ref.detokenize(spm_vocab, ids, byte_level=False), text
        if not prefix and "<" not in text:
            assert decode(tok, ids) == text  # byte fallback loses nothing
    snowman = encode(tok, "☃")
    assert [spm_vocab.tokens[i] for i in snowman[-3:]] == ["<0xE2>", "<0x98>", "<0x83>"]
    # llama.cpp's SentencePiece defaults: <unk>=0, <s>=1, </s>=2, BOS added.
    assert (cfg["unk_token"], cfg["bos_token"], cfg["eos_token"]) == ("<unk>", "<s>", "</s>")
    assert cfg["add_bos_token"] is True and cfg["eog_token_ids"] == [2]


def test_sentencepiece_matches_transformers(spm_vocab: ref.Vocab, tmp_path: Path) -> None:
    """Where transformers' Metaspace agrees with llama.cpp: text that does not start with a
    space and has no special token before more text. Decoding: transformers strips the prefix
    space from the first token; we keep it (as llama.cpp streams pieces)."""
    path = ref.write_vocab_gguf(tmp_path / "spm.gguf", spm_vocab, model="llama")
    tok, _ = build(path)
    theirs = transformers_tokenizer(path)
    for text in TRICKY + ["unknown ☃ and 丽 fall back to bytes", "the fox<think>"]:
        ids = encode(tok, text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert decode(tok, ids).removeprefix(" ") == theirs.decode(ids), text
    # Where they differ, llama.cpp puts the prefix on text after a special token, too.
    after = encode(tok, "<|user|>the")
    assert after == ref.spm_tokenize(spm_vocab, "<|user|>the", True)
    assert spm_vocab.tokens[after[1]].startswith("\u2581")


def test_phi3_special_tokens_swallow_the_whitespace_after_them(
    spm_vocab: ref.Vocab, tmp_path: Path
) -> None:
    """llama.cpp, for a model named Phi-3: every special token but <unk>, <s> (and
    <|endoftext|>) strips the whitespace after it."""
    path = ref.write_vocab_gguf(
        tmp_path / "phi3.gguf", spm_vocab, model="llama", arch="phi3", name="Phi-3 Mini"
    )
    tok, _ = build(path)
    rstrip = ref.Vocab(
        spm_vocab.tokens,
        spm_vocab.types,
        spm_vocab.scores,
        rstrip=frozenset({"<|user|>", "</s>", "<think>"}),
    )
    for text in ("<|user|>  \n hi</s> x", "<s> hi <think> x", "<|user|>\nthe fox"):
        assert encode(tok, text) == ref.spm_tokenize(rstrip, text, True), text


@pytest.fixture(scope="module")
def gemma3(gemma3_file: Path) -> tuple[Path, ref.Vocab, Any, dict]:
    """Gemma 3 270M's GGUF (tests/conftest.py; skipped without `make install-gemma`), its
    vocabulary, our tokenizer of it and its config."""
    path = gemma3_file
    fields = fields_of(path)
    types = list(fields.require("tokenizer.ggml.token_type"))
    tokens = list(fields.require("tokenizer.ggml.tokens"))
    # llama.cpp makes its end-of-generation tokens control ("</s>" is user-defined in Gemma's).
    types[tokens.index("</s>")] = ref.CONTROL
    vocab = ref.Vocab(tokens, types, list(fields.require("tokenizer.ggml.scores")))
    tok, cfg = build_tokenizer(fields, path)
    return path, vocab, tok, cfg


# Reading Gemma's 262,144 tokens (our importer and transformers each) takes tens of seconds.
GEMMA_TIMEOUT_S = 900

GEMMA_TEXT = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>The capital of France is",
    "runs of\n\n\n\n\nnewlines and     spaces",
]


@pytest.mark.timeout(GEMMA_TIMEOUT_S)
def test_gemma3_vocabulary_follows_llama_cpp_and_transformers(
    gemma3, gemma3_transformers_tokenizer
) -> None:
    path, vocab, tok, cfg = gemma3
    unknown = next(chr(c) for c in range(0xF0000, 0xF0100) if chr(c) not in vocab.ids)
    theirs = gemma3_transformers_tokenizer
    fallback = f"private use {unknown} falls back to bytes"
    assert [vocab.types[i] for i in encode(tok, unknown)] == [ref.BYTE] * 4
    for text in TRICKY + LEADING + GEMMA_TEXT + [fallback]:
        ids = encode(tok, text)
        assert ids == ref.spm_tokenize(vocab, text, add_space_prefix=False), text
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert decode(tok, ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert decode(tok, ids) == ref.detokenize(vocab, ids, byte_level=False), text
    assert (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"]) == ("<bos>", "<eos>", True)
    assert vocab.ids["<end_of_turn>"] in cfg["eog_token_ids"]
    # The base model's file has no chat template, and none is made up.
    assert "chat_template" not in cfg and theirs.chat_template is None


@pytest.mark.timeout(GEMMA_TIMEOUT_S)
def test_gemma3_checkpoint_tokenizer_stops_on_end_of_turn(gemma3, tmp_path: Path) -> None:
    path, vocab, tok, cfg = gemma3
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = HFTokenizer(tmp_path)
    assert loaded.eos_token_id == vocab.ids["<eos>"]
    assert vocab.ids["<end_of_turn>"] in loaded.eos_token_ids and loaded.add_bos
    ids = loaded.encode_prompt("<bos>The capital of France is").tolist()
    assert ids.count(vocab.ids["<bos>"]) == 1 and ids[0] == vocab.ids["<bos>"]
    assert loaded.decode(loaded.encode_prompt("The capital").tolist()) == "The capital"


def test_the_chat_template_comes_from_the_file(smollm2, tmp_path: Path) -> None:
    """SmolLM2's own template, rendered by the checkpoint tokenizer as transformers renders it
    for the same GGUF file; its special tokens come from the file's ids."""
    real, vocab = smollm2
    template = fields_of(real).require("tokenizer.chat_template")
    path = smollm2_as(tmp_path, vocab, "smollm", chat_template=template)
    tok, cfg = build(path)
    assert cfg["chat_template"] == template
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = HFTokenizer(tmp_path)
    assert (loaded.bos_token, loaded.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert vocab.ids["<|endoftext|>"] in loaded.eos_token_ids
    theirs = transformers_tokenizer(path)
    for system in (None, "You are terse."):
        chat = [{"role": "user", "content": "Hi 123"}]
        full = ([{"role": "system", "content": system}] if system else []) + chat
        ours = loaded.render_chat(chat, system)
        rendered = theirs.apply_chat_template(
            full, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert ours == rendered
        assert loaded.encode(ours) == theirs.encode(ours, add_special_tokens=False)


# --- refusing from the header ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"model": "bert"}, "unsupported tokenizer model 'bert'; supported: gpt2"),
        ({"model": "gpt2", "pre": "deepseek-coder"}, "unsupported pre-tokenizer 'deepseek-coder'"),
        ({"model": "gpt2", "pre": "chatglm-bpe"}, "supported: default, llama3"),
    ],
)
def test_unsupported_tokenizers_are_refused_from_the_header(
    tmp_path: Path, keys: dict, message: str
) -> None:
    vocab = ref.Vocab(tokens=["a", "b", "ab"], types=[1, 1, 1], merges=["a b"])
    path = ref.write_vocab_gguf(tmp_path / "odd.gguf", vocab, **keys)
    fields = fields_of(path)
    with pytest.raises(GGUFImportError, match="odd.gguf") as info:
        check_tokenizer(fields, path)
    assert message in str(info.value)
    with pytest.raises(GGUFImportError, match="odd.gguf"):
        build_tokenizer(fields, path)


def test_merges_of_tokens_not_in_the_vocabulary_are_a_clear_error(tmp_path: Path) -> None:
    vocab = ref.Vocab(tokens=["a", "b"], types=[1, 1], merges=["a c"])
    path = ref.write_vocab_gguf(tmp_path / "broken.gguf", vocab, model="gpt2", pre="qwen2")
    with pytest.raises(GGUFImportError, match="broken.gguf: its vocabulary does not form a"):
        build(path)


def test_a_file_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFImportError, match="no tokenizer.*supported tokenizer models: gpt2"):
        check_tokenizer(fields_of(path), path)


def test_a_large_text_is_encoded_as_the_library_encodes_it(smollm2, tmp_path: Path) -> None:
    """Above 16 Ki characters HFTokenizer.encode goes through ``encode_batch`` (which releases
    the GIL, so the offload pool leaves the event loop running): the ids are unchanged."""
    real, vocab = smollm2
    path = smollm2_as(tmp_path, vocab, "smollm")
    tok, cfg = build(path)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    loaded = HFTokenizer(tmp_path)
    text = "The capital of France is Paris. <|im_start|> 123 " * 1000  # 50k characters
    assert loaded.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert loaded.encode(text[:100]) == tok.encode(text[:100], add_special_tokens=False).ids
