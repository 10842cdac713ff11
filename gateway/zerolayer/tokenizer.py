"""Tokenizers and incremental detokenization.

``Tokenizer`` is what the engine needs: encode text, decode ids, apply a chat template.
``ByteTokenizer`` is the built-in byte-level tokenizer (ids 0..255 are bytes, then BOS, EOS, PAD),
used by the built-in model and the synthetic backend. Checkpoint tokenizers (tokenizer.json) live
in ``zerolayer.models``. ``Detokenizer`` turns a growing id sequence into UTF-8-safe text deltas.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPLACEMENT = "\ufffd"


class TemplateRefused(ValueError):
    """A chat template refused a conversation (its ``raise_exception``, e.g. "roles must
    alternate" or "system role not supported"); the message is the template's."""


class Tokenizer(ABC):
    vocab_size: int
    bos_token_id: int  # -1 when none
    eos_token_id: int  # -1 when none; the one WELCOME reports
    eos_token_ids: frozenset[
        int
    ]  # every id that ends generation (generation_config may list several)
    add_bos: bool  # prepend BOS to prompts that do not start with it
    renders_tools = False  # the chat template renders tool definitions and calls itself
    # The checkpoint's tokenizer.json, which structured output's grammar engine reads (None: the
    # tokenizer has none, and constrained requests are refused).
    json_path: Path | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; incomplete UTF-8 comes back as U+FFFD."""

    @abstractmethod
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        system: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for a chat, ending where the assistant's turn begins. ``tools`` and
        the messages' tool fields are given only when ``renders_tools``
        (zerolayer.request_path.inputs renders them as text otherwise). ``messages`` may hold
        ``system`` messages after the first turn. Raises TemplateRefused when the template
        rejects the conversation."""

    def render_system(self, system: str) -> str:
        """The text a chat with only this system prompt starts with (for precompiled prompts)."""
        return self.render_chat([], system)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character for some): what the APIs'
        logprobs report per token. By default its decoded text."""
        return self.decode([token_id]).encode("utf-8")

    def encode_prompt(self, text: str) -> np.ndarray:
        """Prompt ids as int32, with BOS when the model expects one and the text (e.g. a rendered
        chat template) does not already start with it."""
        ids = self.encode(text)
        if self.add_bos and self.bos_token_id >= 0 and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return np.asarray(ids, dtype=np.int32)


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer: one id per UTF-8 byte, plus BOS (256), EOS (257), PAD (258)."""

    BOS, EOS, PAD = 256, 257, 258
    BASE_VOCAB = 259

    def __init__(self, vocab_size: int = BASE_VOCAB, add_bos: bool = True) -> None:
        if vocab_size < self.BASE_VOCAB:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {self.BASE_VOCAB}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_id = self.EOS
        self.eos_token_ids = frozenset({self.EOS})
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes((token_id,)) if 0 <= token_id < 256 else b""

    def decode(self, ids: Sequence[int]) -> str:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()  # bytes(array) would be its raw buffer
        try:
            data = bytes(ids)  # the common case: every id is a byte, none special
        except ValueError:
            data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        system: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        parts = []
        if system:
            parts.append(f"<|system|>\n{system}\n")
        for m in messages:
            parts.append(f"<|{m['role']}|>\n{m['content']}\n")
        if messages:
            parts.append("<|assistant|>\n")
        return "".join(parts)


class Detokenizer:
    """Incremental, UTF-8-safe detokenization of one stream (the prefix/read-offset method).

    Each ``push`` decodes only a short window of recent ids and returns the new complete text;
    bytes of an unfinished UTF-8 sequence (decoded as a trailing U+FFFD) wait for the next token.
    ``flush`` returns what is left, with U+FFFD for anything still incomplete.
    """

    __slots__ = ("_tok", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this have had their text emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            self._prefix = self._read
            self._read = len(self._ids)
            return full_text[len(prefix_text) :]
        if len(self._ids) - self._read > 8:
            # Give up waiting: these bytes will never form a character.
            return self.flush()
        return ""

    def flush(self) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]
