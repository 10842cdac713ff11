"""The tests' reference for GGUF tokenizers: llama.cpp's tokenization (src/llama-vocab.cpp) written
out plainly in Python, one step per step of llama.cpp, slow and independent of the ``tokenizers``
library that ``zerolayer.models.gguf_tokenizer`` builds on. And a writer of tokenizer-only GGUF
files (no tensors) for the tests' vocabularies."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import regex

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's spelling of the 256 bytes as printable characters (llama.cpp's
    unicode_byte_to_utf8)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


@dataclass
class Vocab:
    """A vocabulary as llama.cpp holds it after loading (types already adjusted)."""

    tokens: list[str]
    types: list[int]
    scores: list[float] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    rstrip: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(self.merges)}

    def partition(self, text: str) -> list[str | int]:
        """tokenizer_st_partition with parse_special: control, user-defined and unknown tokens,
        longest first, cut out of the text (ids) between runs of raw text (str)."""
        special = [i for i, k in enumerate(self.types) if k in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: -len(self.tokens[i]))
        pieces: list[str | int] = [text] if text else []
        for tid in special:
            tok = self.tokens[tid]
            out: list[str | int] = []
            for piece in pieces:
                while isinstance(piece, str) and (at := piece.find(tok)) >= 0:
                    if at:
                        out.append(piece[:at])
                    out.append(tid)
                    piece = piece[at + len(tok) :]
                    if tok in self.rstrip:
                        piece = piece.lstrip(" \t\n\v\f\r")
                if not isinstance(piece, str) or piece:
                    out.append(piece)
            pieces = out
        return pieces


def regex_split(text: str, expressions: tuple[str, ...]) -> list[str]:
    """unicode_regex_split: each expression splits the pieces of the one before; a match and
    the text between matches are pieces."""
    pieces = [text]
    for expression in expressions:
        out = []
        for piece in pieces:
            start = 0
            for m in regex.finditer(expression, piece):
                if m.start() > start:
                    out.append(piece[start : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                start = m.end()
            if start < len(piece):
                out.append(piece[start:])
        pieces = out
    return pieces


def bpe_tokenize(
    vocab: Vocab, text: str, expressions: tuple[str, ...], ignore_merges: bool
) -> list[int]:
    """llama_vocab::tokenize for a byte-level BPE vocabulary (add_special false)."""
    spell = gpt2_byte_chars()
    out: list[int] = []
    for piece in vocab.partition(text):
        if isinstance(piece, int):
            out.append(piece)
            continue
        for word in regex_split(piece, expressions):
            word = "".join(spell[b] for b in word.encode("utf-8"))
            if ignore_merges and word in vocab.ids:
                out.append(vocab.ids[word])
                continue
            symbols = list(word)
            while True:  # merge the lowest-ranked adjacent pair, leftmost first
                best = None
                for i in range(len(symbols) - 1):
                    rank = vocab.ranks.get((symbols[i], symbols[i + 1]))
                    if rank is not None and (best is None or rank < best[0]):
                        best = (rank, i)
                if best is None:
                    break
                i = best[1]
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            out += [vocab.ids[s] for s in symbols]
    return out


def spm_tokenize(vocab: Vocab, text: str, add_space_prefix: bool) -> list[int]:
    """llama_vocab::tokenize for a SentencePiece vocabulary (add_special false)."""
    out: list[int] = []
    for piece in vocab.partition(text):
        if isinstance(piece, int):
            out.append(piece)
            continue
        # Every run of raw text follows a special token or the start: it gets the prefix.
        symbols = list((" " + piece if add_space_prefix else piece).replace(" ", "\u2581"))
        while True:  # merge the adjacent pair that makes the best-scoring token, leftmost first
            best = None
            for i in range(len(symbols) - 1):
                tid = vocab.ids.get(symbols[i] + symbols[i + 1])
                if tid is not None and (best is None or vocab.scores[tid] > best[0]):
                    best = (vocab.scores[tid], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            if s in vocab.ids:
                out.append(vocab.ids[s])
            else:  # byte fallback
                out += [vocab.ids[f"<0x{b:02X}>"] for b in s.encode("utf-8")]
    return out


def detokenize(vocab: Vocab, ids: list[int], byte_level: bool) -> str:
    """The concatenated token_to_piece of each id (special = false, lstrip = 0): what llama.cpp's
    server streams."""
    unspell = {c: b for b, c in gpt2_byte_chars().items()}
    data = b""
    for i in ids:
        kind, text = vocab.types[i], vocab.tokens[i]
        if kind in (CONTROL, UNKNOWN):
            continue
        if kind == USER_DEFINED:
            data += text.encode("utf-8")
        elif kind == BYTE:
            data += bytes([int(text[3:5], 16)])
        elif byte_level:
            data += bytes(unspell[c] for c in text)
        else:
            data += text.replace("\u2581", " ").encode("utf-8")
    return data.decode("utf-8", errors="replace")


def write_vocab_gguf(
    path: Path,
    vocab: Vocab,
    *,
    model: str,
    pre: str | None = None,
    arch: str = "llama",
    name: str | None = None,
    **keys: object,
) -> Path:
    """A GGUF holding only tokenizer metadata; ``keys`` are tokenizer.ggml.<key> values
    (bool, int or str) such as bos_token_id=1 or add_space_prefix=False."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores:
        w.add_token_scores([float(s) for s in vocab.scores])
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    for key, value in keys.items():
        full = f"tokenizer.ggml.{key}"
        if key == "chat_template":
            w.add_chat_template(str(value))
        elif isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        else:
            w.add_string(full, str(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
