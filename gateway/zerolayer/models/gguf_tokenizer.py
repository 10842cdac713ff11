"""A GGUF file's vocabulary as a tokenizer: the ``tokenizers.Tokenizer`` (tokenizer.json) and
tokenizer_config.json that llama.cpp's reading of the same metadata (src/llama-vocab.cpp) implies.

Two tokenizer models are rebuilt (``tokenizer.ggml.model``):

- ``gpt2``, byte-level BPE (Llama 3, Qwen2/2.5/3, Mistral Nemo, SmolLM, ...): the text is split by
  the regular expressions of the file's pre-tokenizer (``tokenizer.ggml.pre``, one of
  ``PRE_TOKENIZERS``; each expression splits the pieces of the one before, a match and the text
  between matches each becoming a piece), every piece is spelled in GPT-2's byte alphabet and
  merged by the ranks of ``tokenizer.ggml.merges``. Pre-tokenizers with llama.cpp's
  ``ignore_merges`` (Llama 3, Tekken) take a piece that is a whole token as that token.
- ``llama``, SentencePiece BPE (Gemma, Llama 2, Mistral 7B, Phi-3): spaces become ``▁``, a ``▁``
  goes in front of each run of text when ``tokenizer.ggml.add_space_prefix`` is set (llama.cpp's
  default), and adjacent pieces merge best-score-first whenever together they are a token
  (``tokenizer.ggml.scores``); a character that never becomes a token is spelled as its UTF-8
  byte tokens ``<0xNN>``. This is expressed as BPE merges recovered from the scores.

Tokens typed control, user-defined or unknown (``tokenizer.ggml.token_type``) are matched whole in
the text before anything else; control and unknown ones are special (skipped when decoding).
The end-of-generation tokens are the file's EOS/EOT/EOM ids plus the tokens llama.cpp recognises
by their text (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``, ``<|end|>``, ...).

Where transformers' own GGUF conversion differs from llama.cpp we follow llama.cpp:
``smollm``/``starcoder``/``refact``/``codeshell`` split every digit on its own (transformers drops
that split); a SentencePiece vocabulary gets the ``▁`` prefix on every run of text after a
special token and on text already starting with a space (transformers' Metaspace adds it once,
and not before a space, except for Phi-3); decoding keeps the prefix space of the first token
(llama.cpp's per-token pieces, as its server streams them) and does not apply llama.cpp's
``clean_spaces`` clean-up of spaces before punctuation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from zerolayer.models.gguf_errors import GGUFImportError

log = logging.getLogger("zerolayer.models")

# llama.cpp's llama_token_type.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6
# Matched whole in text before the model runs; the special ones are skipped when decoding.
_MATCHED_WHOLE = (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
_SPECIAL = (TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL)

BYTE_LEVEL_BPE = "gpt2"
SENTENCEPIECE = "llama"
SUPPORTED_TOKENIZER_MODELS = (BYTE_LEVEL_BPE, SENTENCEPIECE)
SPACE = "\u2581"  # SentencePiece's ▁


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's byte-level BPE pre-tokenizers."""

    splits: tuple[str, ...]  # regexes, each splitting the pieces of the one before
    ignore_merges: bool = False  # a piece that is a whole token is that token
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


# The expressions as llama.cpp writes them (its regex engine has no (?i:) or \p{Lu}, so Llama 3's
# and Tekken's are spelled out; the tokenizers library runs them unchanged).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


def _named(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre -> pre-tokenizer, as src/llama-vocab.cpp maps the names (only names whose
# llama.cpp settings are all expressed here). "gpt2" is not a llama.cpp name; earlier versions of
# this importer accepted it for GPT-2's expression, so it stays.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **_named(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    **_named("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **_named("qwen2 deepseek-r1-qwen megrez stablelm2", PreTokenizer((_QWEN2,))),
    **_named(
        "smollm starcoder refact codeshell command-r exaone minerva-7b",
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    **_named("gpt2 gpt-2 phi-2 mpt olmo jais exaone4", PreTokenizer((_GPT2,))),
}

# Tokens llama.cpp takes as ending generation by their text (besides the EOS/EOT/EOM ids).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        # fill-in-the-middle pad, repository and file separators
        "<|fim_pad|>",
        "<fim-pad>",
        "<fim_pad>",
        "<PAD>",
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
        "<|file_sep|>",
    }
)


class Fields(Protocol):
    """A GGUF file's key/value metadata (``gguf_import._Fields``)."""

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...


def _pre_name(fields: Fields) -> str:
    return str(fields.get("tokenizer.ggml.pre") or "default")


def check_tokenizer(fields: Fields, path: Path) -> None:
    """Refuse, from the header alone, a tokenizer that ``build_tokenizer`` does not rebuild:
    a ``GGUFImportError`` naming the file's tokenizer model or pre-tokenizer and what is
    supported."""
    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise GGUFImportError(
            f"{path}: no tokenizer (metadata key 'tokenizer.ggml.model' is missing); supported "
            f"tokenizer models: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
        )
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise GGUFImportError(
            f"{path}: unsupported tokenizer model {model!r}; supported: "
            f"{BYTE_LEVEL_BPE} (byte-level BPE), {SENTENCEPIECE} (SentencePiece)"
        )
    if model == BYTE_LEVEL_BPE:
        pre = _pre_name(fields)
        if pre not in PRE_TOKENIZERS:
            raise GGUFImportError(
                f"{path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre) for the gpt2 "
                f"tokenizer model; supported: {', '.join(PRE_TOKENIZERS)}"
            )
        fields.require("tokenizer.ggml.merges")
    fields.require("tokenizer.ggml.tokens")


@dataclass
class _Vocab:
    """The file's vocabulary as llama.cpp reads it."""

    tokens: list[str]
    types: list[int]
    scores: list[float]
    ids: dict[str, int]

    @classmethod
    def read(cls, fields: Fields, path: Path) -> _Vocab:
        tokens = [str(t) for t in fields.require("tokenizer.ggml.tokens")]
        n = len(tokens)
        types = list(fields.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * n)
        scores = [float(s) for s in fields.get("tokenizer.ggml.scores") or [0.0] * n]
        if len(types) < n or len(scores) < n:
            raise GGUFImportError(
                f"{path}: {n} tokens but {len(types)} token types and {len(scores)} scores"
            )
        ids: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if token in ids:
                raise GGUFImportError(
                    f"{path}: duplicate token {token!r} in the vocabulary (ids {ids[token]}, {i})"
                )
            ids[token] = i
        return cls(tokens, [int(t) for t in types[:n]], scores[:n], ids)

    def token(self, fields: Fields, key: str, default: int | None) -> int | None:
        """The id stored under tokenizer.ggml.<key>, or llama.cpp's default, if in range."""
        value = fields.get(f"tokenizer.ggml.{key}")
        idx = default if value is None else int(value)
        return idx if idx is not None and 0 <= idx < len(self.tokens) else None


def _end_of_generation(vocab: _Vocab, fields: Fields, eos: int | None) -> list[int]:
    found = {eos} if eos is not None else set()
    for key in ("eot_token_id", "eom_token_id"):
        idx = vocab.token(fields, key, None)
        if idx is not None:
            found.add(idx)
    found |= {vocab.ids[t] for t in _EOG_TEXTS if t in vocab.ids}
    return sorted(found)


def _byte_level_model(vocab: _Vocab, fields: Fields, pre: PreTokenizer) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = []
    for merge in fields.require("tokenizer.ggml.merges"):
        # llama.cpp splits at the first space after the first character (a merge of " " exists).
        cut = str(merge).find(" ", 1)
        if cut > 0:
            merges.append((merge[:cut], merge[cut + 1 :]))
    tok = Tokenizer(
        models.BPE(vocab=vocab.ids, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(vocab: _Vocab) -> list[tuple[str, str]]:
    """BPE merges that reproduce llama.cpp's SentencePiece merging: every split of a token into
    two tokens, best (highest-scoring) result first, ties by id then by the split's position."""
    ranked = []
    for i, token in enumerate(vocab.tokens):
        if vocab.types[i] in (TOKEN_TYPE_BYTE, *_MATCHED_WHOLE):
            continue  # never formed by merging: byte tokens stand for bytes, others match whole
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab.ids and right in vocab.ids:
                ranked.append((-vocab.scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_model(vocab: _Vocab, unk: int | None, add_space_prefix: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    tok = Tokenizer(
        models.BPE(
            vocab=vocab.ids,
            merges=sentencepiece_merges(vocab),
            unk_token=None if unk is None else vocab.tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def build_tokenizer(fields: Fields, path: Path) -> tuple[Any, dict[str, Any]]:
    """The file's tokenizer as llama.cpp defines it, and its tokenizer_config.json (special
    tokens, add_bos/add_eos, the chat template, and ``eog_token_ids``: the ids that end
    generation)."""
    from tokenizers import AddedToken

    check_tokenizer(fields, path)
    vocab = _Vocab.read(fields, path)
    spm = fields.require("tokenizer.ggml.model") == SENTENCEPIECE
    # llama.cpp's SentencePiece defaults: <unk>=0, <s>=1, </s>=2 (byte-level BPE has none here).
    defaults = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0} if spm else {}
    bos, eos, unk = (
        vocab.token(fields, key, defaults.get(key))
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id")
    )
    try:
        if spm:
            add_bos_default = True
            add_space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
            tok = _sentencepiece_model(vocab, unk, add_space_prefix)
        else:
            if fields.get("tokenizer.ggml.pre") is None:
                log.warning("%s: no tokenizer.ggml.pre; llama.cpp's 'default' pre-tokenizer", path)
            pre = PRE_TOKENIZERS[_pre_name(fields)]
            add_bos_default = pre.add_bos
            tok = _byte_level_model(vocab, fields, pre)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise GGUFImportError(f"{path}: its vocabulary does not form a tokenizer: {exc}") from exc
    eog = _end_of_generation(vocab, fields, eos)
    eog_set = set(eog)

    # llama.cpp strips the whitespace after Phi-3's special tokens (by the model's name).
    name = str(fields.get("general.name", "")).lower()
    rstrip_special = "phi-3" in name or "phi3" in name
    added = []
    for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if i in eog_set:
            kind = TOKEN_TYPE_CONTROL  # llama.cpp makes every end-of-generation token control
        if kind in _MATCHED_WHOLE:
            rstrip = rstrip_special and text not in ("<unk>", "<s>", "<|endoftext|>")
            special = kind in _SPECIAL
            added.append(AddedToken(text, special=special, normalized=False, rstrip=rstrip))
    tok.add_tokens(added)

    def text_of(idx: int | None) -> str | None:
        return None if idx is None else vocab.tokens[idx]

    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    tok_cfg: dict[str, Any] = {
        "bos_token": text_of(bos),
        "eos_token": text_of(eos),
        "unk_token": text_of(unk),
        "pad_token": text_of(vocab.token(fields, "padding_token_id", None)),
        "add_bos_token": add_bos_default if add_bos is None else bool(add_bos),
        "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        "eog_token_ids": eog,
    }
    template = fields.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_cfg["chat_template"] = template
    return tok, tok_cfg
